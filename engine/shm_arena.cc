#include "engine/shm_arena.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>

#include "absl/numeric/bits.h"
#include "absl/strings/str_cat.h"
#include "base/posix_error.h"
#include "base/status_macros.h"

namespace offload {

absl::StatusOr<std::unique_ptr<ShmArena>> ShmArena::Create(
    absl::string_view name, uint64_t capacity, Env* env,
    std::shared_ptr<std::atomic<int64_t>> span_mappings) {
  if (capacity == 0 || capacity % kAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("arena capacity must be a positive multiple of ",
                                                   kAlignment, ", got ", capacity));
  }
  const std::string label = absl::StrCat("offloadd-", name);
  ASSIGN_OR_RETURN(UniqueFd fd, env->CreateMemfd(label));
  if (fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
    return PosixError(absl::StrCat("sealing ", label), errno);
  }
  return std::unique_ptr<ShmArena>(
      new ShmArena(std::move(fd), capacity, env, std::move(span_mappings)));
}

absl::StatusOr<HostMemory> ShmArena::Map(uint64_t offset, uint64_t bytes, Pages pages) const {
  return env_->MapShared(fd_.get(), offset, bytes, pages);
}

absl::Status ShmArena::Discard(uint64_t offset, uint64_t bytes) const {
  if (bytes == 0) return absl::OkStatus();
  if (fallocate(fd_.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                static_cast<off_t>(bytes)) != 0) {
    return PosixError(absl::StrCat("freeing ", bytes, " bytes of the arena at ", offset), errno);
  }
  return absl::OkStatus();
}

uint64_t ShmArena::size() const {
  absl::MutexLock lock(&mu_);
  return size_;
}

absl::StatusOr<uint64_t> ShmArena::Allocate(uint64_t bytes, uint64_t alignment) {
  if (alignment < kAlignment || !absl::has_single_bit(alignment)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "arena alignment must be a power of two of at least ", kAlignment, ", got ", alignment));
  }
  const uint64_t capacity = capacity_;
  absl::MutexLock lock(&mu_);
  // Both rounded up without overflow: capacity is far below 2^64.
  const uint64_t offset = std::min(capacity, RoundUp(size_, alignment));
  const uint64_t rounded = bytes > capacity ? capacity + 1 : RoundUp(bytes, alignment);
  if (rounded == 0 || rounded > capacity - offset) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session arena full: ", bytes, " bytes requested (aligned to ", alignment, "), ",
        capacity - offset, " of ", capacity, " left (raise memory.session_arena_bytes)"));
  }
  // The file only grows (sealed against shrinking: a trainer's mapping of
  // it must never lose its pages); space given back is reused in place.
  if (offset + rounded > file_size_) {
    absl::Status grown = env_->ResizeFile(fd_.get(), offset + rounded);
    if (!grown.ok()) {
      return absl::Status(grown.code(), absl::StrCat("growing session arena: ", grown.message()));
    }
    file_size_ = offset + rounded;
  }
  size_ = offset + rounded;
  return offset;
}

bool ShmArena::GiveBack(uint64_t offset, uint64_t bytes, uint64_t alignment) {
  const uint64_t rounded = RoundUp(bytes, alignment);
  absl::MutexLock lock(&mu_);
  if (offset > size_ || size_ - offset != rounded) return false;
  // Its pages freed before anyone may allocate there (the next allocation
  // starts from zeros, as a fresh one does).
  (void)Discard(offset, rounded);
  size_ = offset;
  return true;
}

}  // namespace offload
