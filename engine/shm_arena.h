// A session's shared-memory arena: one anonymous memfd that the daemon owns
// and hands to exactly one client session (see arena_channel.h), plus a bump
// allocator over it.
//
// Why a memfd: it has no name in any filesystem, so no other process or user
// can open it; a process gets it only by being sent the descriptor. The file
// is sealed against shrinking (F_SEAL_SHRINK), so a client cannot truncate it
// under the daemon and make daemon accesses fault. Its size grows with the
// allocations, up to `capacity`. Nothing is mapped up front: whoever uses a
// region maps just that region (Map) or the window of the file it lies in
// (MapSpan: small partitions share one mapping per window, base/span_maps.h;
// the client does the same), so a session costs address space only for what
// it holds, and mappings for its windows rather than its partitions.
//
// Thread-safety: Allocate(), Map() and MapSpan() may be called from any thread; fd()
// and capacity() are immutable after Create().
#ifndef OFFLOADD_ENGINE_SHM_ARENA_H_
#define OFFLOADD_ENGINE_SHM_ARENA_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "base/env.h"
#include "base/host_memory.h"
#include "base/span_maps.h"
#include "base/unique_fd.h"

namespace offload {

class ShmArena {
 public:
  // Every allocation starts on this boundary (page size: keeps buffers
  // usable for O_DIRECT transfers and avoids false sharing).
  static constexpr uint64_t kAlignment = 4096;

  // `name` only labels the memfd in /proc/<pid>/fd (it is not a path).
  // `env` (borrowed, must outlive the arena) makes the memfd, the mappings
  // and the file growth. With `span_mappings`, each mapping MapSpan makes
  // counts one in it while it lives (SpanMaps).
  static absl::StatusOr<std::unique_ptr<ShmArena>> Create(
      absl::string_view name, uint64_t capacity, Env* env = Env::Default(),
      std::shared_ptr<std::atomic<int64_t>> span_mappings = nullptr);
  ~ShmArena() = default;
  ShmArena(const ShmArena&) = delete;
  ShmArena& operator=(const ShmArena&) = delete;

  // Bytes of arena an allocation of `bytes` occupies (rounded up to
  // kAlignment).
  static constexpr uint64_t RoundedSize(uint64_t bytes) {
    return (bytes + kAlignment - 1) / kAlignment * kAlignment;
  }

  // Returns the offset, a multiple of `alignment` (a power of two, at least
  // kAlignment), of `bytes` fresh zeroed bytes; the arena's end moves to the
  // next multiple of `alignment` after them, so that nothing allocated
  // later shares a page of that size with them. RESOURCE_EXHAUSTED if the
  // arena's capacity would be exceeded.
  absl::StatusOr<uint64_t> Allocate(uint64_t bytes, uint64_t alignment = kAlignment);
  // Gives back what Allocate(bytes, alignment) returned at `offset` if it
  // is still the arena's last allocation (a registration that failed: one
  // retried for room would otherwise take new space each time); true if
  // it did. The caller maps none of it any more.
  bool GiveBack(uint64_t offset, uint64_t bytes, uint64_t alignment = kAlignment);

  // Maps `bytes` from `offset` (an offset Allocate returned) for this
  // process, asking the kernel for `pages`; the mapping is the caller's and
  // may outlive nothing but the arena's descriptor, which the kernel keeps
  // alive for it.
  absl::StatusOr<HostMemory> Map(uint64_t offset, uint64_t bytes,
                                 Pages pages = Pages::kSystemDefault) const;

  // A partition's span: `bytes` from `offset`, in a window's mapping shared
  // with the other small spans in it where SpanMaps::SharesWindow, else
  // mapped on its own; mapped while the result lives.
  absl::StatusOr<MappedSpan> MapSpan(uint64_t offset, uint64_t bytes, Pages pages) {
    return spans_.Map(offset, bytes, pages);
  }

  // Frees the pages of [offset, offset + bytes) (the file keeps its size:
  // mappings read zeros there), whoever maps them: a session's teardown,
  // its partitions' spans after their blocks went.
  absl::Status Discard(uint64_t offset, uint64_t bytes) const;

  int fd() const { return fd_.get(); }
  uint64_t capacity() const { return capacity_; }
  uint64_t size() const;

 private:
  ShmArena(UniqueFd fd, uint64_t capacity, Env* env,
           std::shared_ptr<std::atomic<int64_t>> span_mappings)
      : fd_(std::move(fd)),
        capacity_(capacity),
        env_(env),
        spans_([this](uint64_t offset, uint64_t bytes,
                      Pages pages) { return Map(offset, bytes, pages); },
               std::move(span_mappings)) {}

  // Constant after construction.
  const UniqueFd fd_;
  const uint64_t capacity_;
  Env* const env_;
  SpanMaps spans_;  // after fd_ and env_, which it maps with
  mutable absl::Mutex mu_;
  uint64_t size_ ABSL_GUARDED_BY(mu_) = 0;       // where the next allocation goes
  uint64_t file_size_ ABSL_GUARDED_BY(mu_) = 0;  // the memfd's (never shrinks)
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_SHM_ARENA_H_
