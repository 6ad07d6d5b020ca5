// SpanMaps: one process's mappings of the spans of one shared file (a
// session's arena), a mapping per window of the file instead of one per span.
//
// The kernel lets a process hold vm.max_map_count mappings in all (65,530 by
// default); with a mapping per partition, one session of about 32,500 small
// partitions (a mixture-of-experts rank's tensors) reached it. So the file is
// cut into windows of kWindowBytes at fixed offsets: a span of small pages of
// at most kSharedMaxBytes that lies inside one window is a view of that
// window's mapping, shared by every such span in it and unmapped with the last
// of them. The rest map on their own: larger spans, huge-page ones (their
// address must be congruent to their offset, HostMemory::MapShared), and a
// small span that crosses a window's end. Spans laid end to end then cost at
// most two mappings for every 16 small ones (a window holds at least 16; at
// most one span crosses its end); a window holds no more than one small span
// only where large spans fill the rest of it.
//
// A window maps past the file's end (MAP_NORESERVE: pages exist as the file
// grows and they are touched), so nothing is touched outside a span. The
// daemon (ShmArena) and the client library each keep one per session arena,
// in their own process. The daemon counts the mappings as they are made
// (`mapped`): its budget of mappings (SessionManager) holds them, not a
// guess of how many spans share a window.
//
// Thread-safety: Map may be called from any thread; a MappedSpan is a value
// that keeps its mapping alive.
#ifndef OFFLOADD_BASE_SPAN_MAPS_H_
#define OFFLOADD_BASE_SPAN_MAPS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/host_memory.h"

namespace offload {

// `size` bytes of a file, mapped (its own mapping or a window's).
class MappedSpan {
 public:
  MappedSpan() = default;
  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  bool empty() const { return data_ == nullptr; }
  // Whether it is a view of a window's mapping other spans share.
  bool shared() const { return shared_; }
  // The mapping it is in: holding it keeps the span's pages mapped.
  const std::shared_ptr<const HostMemory>& mapping() const { return mapping_; }

 private:
  friend class SpanMaps;
  MappedSpan(std::shared_ptr<const HostMemory> mapping, std::byte* data, uint64_t size, bool shared)
      : mapping_(std::move(mapping)), data_(data), size_(size), shared_(shared) {}

  std::shared_ptr<const HostMemory> mapping_;
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  bool shared_ = false;
};

class SpanMaps {
 public:
  static constexpr uint64_t kWindowBytes = uint64_t{64} << 20;
  static constexpr uint64_t kSharedMaxBytes = kWindowBytes / 16;

  // Makes a mapping of the file: `bytes` from `offset`, asking for `pages`
  // (HostMemory::MapShared, or an Env's).
  using MapFn =
      std::function<absl::StatusOr<HostMemory>(uint64_t offset, uint64_t bytes, Pages pages)>;
  // With `mapped`, every mapping made (its own or a window) adds one to
  // it while it lives.
  explicit SpanMaps(MapFn map, std::shared_ptr<std::atomic<int64_t>> mapped = nullptr)
      : map_(std::move(map)), mapped_(std::move(mapped)) {}
  SpanMaps(const SpanMaps&) = delete;
  SpanMaps& operator=(const SpanMaps&) = delete;

  // Whether a span of `bytes` from `offset` on `pages` shares its window's
  // mapping.
  static bool SharesWindow(uint64_t offset, uint64_t bytes, Pages pages) {
    return pages == Pages::kSmall && bytes > 0 && bytes <= kSharedMaxBytes &&
           offset / kWindowBytes == (offset + bytes - 1) / kWindowBytes;
  }

  // `bytes` of the file from `offset` (a multiple of the page size), mapped
  // for as long as the result (or a copy) lives. The map function's error
  // as it is.
  absl::StatusOr<MappedSpan> Map(uint64_t offset, uint64_t bytes, Pages pages)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Windows mapped now.
  int windows() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // A mapping of `bytes` from `offset`, counted in mapped_ while it lives.
  absl::StatusOr<std::shared_ptr<const HostMemory>> MapCounted(uint64_t offset, uint64_t bytes,
                                                               Pages pages);

  const MapFn map_;
  const std::shared_ptr<std::atomic<int64_t>> mapped_;
  mutable absl::Mutex mu_;
  // By window index; an expired entry's window went with its last span.
  absl::flat_hash_map<uint64_t, std::weak_ptr<const HostMemory>> windows_ ABSL_GUARDED_BY(mu_);
};

}  // namespace offload

#endif  // OFFLOADD_BASE_SPAN_MAPS_H_
