#include "engine/shm_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "base/posix_error.h"

namespace offload {

absl::StatusOr<std::unique_ptr<ShmArena>> ShmArena::Create(absl::string_view name,
                                                           uint64_t capacity) {
  if (capacity == 0 || capacity % kAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "arena capacity must be a positive multiple of ", kAlignment, ", got ", capacity));
  }
  std::string label = absl::StrCat("offloadd-", name);
  UniqueFd fd(memfd_create(label.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return PosixError(absl::StrCat("memfd_create ", label), errno);
  if (fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
    return PosixError(absl::StrCat("sealing ", label), errno);
  }
  // Reserve address space for the whole capacity; pages exist only as the
  // file grows and is touched. MAP_NORESERVE: no swap accounting for space
  // we may never use.
  void* base = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE,
                    fd.get(), 0);
  if (base == MAP_FAILED) {
    return PosixError(absl::StrCat("mmap ", capacity, " bytes of ", label), errno);
  }
  return std::unique_ptr<ShmArena>(
      new ShmArena(std::move(fd), static_cast<std::byte*>(base), capacity));
}

ShmArena::~ShmArena() { munmap(base_, capacity_); }

uint64_t ShmArena::size() const {
  absl::MutexLock lock(&mu_);
  return size_;
}

absl::StatusOr<uint64_t> ShmArena::Allocate(uint64_t bytes) {
  const uint64_t rounded = RoundedSize(bytes);
  absl::MutexLock lock(&mu_);
  if (rounded == 0 || rounded > capacity_ - size_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("session arena full: ", bytes, " bytes requested, ", capacity_ - size_,
                     " of ", capacity_, " left (raise memory.session_arena_bytes)"));
  }
  const uint64_t offset = size_;
  if (ftruncate(fd_.get(), static_cast<off_t>(offset + rounded)) != 0) {
    return PosixError(absl::StrCat("growing session arena to ", offset + rounded, " bytes"),
                      errno);
  }
  size_ = offset + rounded;
  return offset;
}

}  // namespace offload
