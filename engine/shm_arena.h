// A session's shared-memory arena: one anonymous memfd that the daemon owns
// and hands to exactly one client session (see arena_channel.h), plus a bump
// allocator over it.
//
// Why a memfd: it has no name in any filesystem, so no other process or user
// can open it; a process gets it only by being sent the descriptor. The file
// is sealed against shrinking (F_SEAL_SHRINK), so a client cannot truncate it
// under the daemon and make daemon accesses fault. Its size grows with the
// allocations; the daemon maps `capacity` bytes of address space once, so
// pointers into it stay valid for the arena's lifetime.
//
// Thread-safety: Allocate() is internally synchronised; base()/fd() are
// immutable after Create().
#ifndef OFFLOADD_ENGINE_SHM_ARENA_H_
#define OFFLOADD_ENGINE_SHM_ARENA_H_

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
#include "base/unique_fd.h"

namespace offload {

class ShmArena {
 public:
  // Every allocation starts on this boundary (page size: keeps buffers
  // usable for O_DIRECT transfers and avoids false sharing).
  static constexpr uint64_t kAlignment = 4096;

  // `name` only labels the memfd in /proc/<pid>/fd (it is not a path).
  // `env` (borrowed, must outlive the arena) makes the memfd, the mapping
  // and the file growth.
  static absl::StatusOr<std::unique_ptr<ShmArena>> Create(absl::string_view name,
                                                          uint64_t capacity,
                                                          Env* env = Env::Default());
  ~ShmArena() = default;
  ShmArena(const ShmArena&) = delete;
  ShmArena& operator=(const ShmArena&) = delete;

  // Bytes of arena an allocation of `bytes` occupies (rounded up to
  // kAlignment).
  static constexpr uint64_t RoundedSize(uint64_t bytes) {
    return (bytes + kAlignment - 1) / kAlignment * kAlignment;
  }

  // Returns the offset of `bytes` fresh zeroed bytes. RESOURCE_EXHAUSTED if
  // the arena's capacity would be exceeded.
  absl::StatusOr<uint64_t> Allocate(uint64_t bytes);

  std::byte* base() const { return mapping_.data(); }
  int fd() const { return fd_.get(); }
  uint64_t capacity() const { return mapping_.size(); }
  uint64_t size() const;

 private:
  ShmArena(UniqueFd fd, HostMemory mapping, Env* env)
      : fd_(std::move(fd)), mapping_(std::move(mapping)), env_(env) {}

  // Constant after construction.
  const UniqueFd fd_;
  const HostMemory mapping_;
  Env* const env_;
  mutable absl::Mutex mu_;
  uint64_t size_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_SHM_ARENA_H_
