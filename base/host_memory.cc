#include "base/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/posix_error.h"

namespace offload {
uint64_t PageSize() {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return page;
}

uint64_t RoundUpToPage(uint64_t bytes) {
  const uint64_t page = PageSize();
  return (bytes + page - 1) / page * page;
}

absl::Status DiscardSharedPages(std::byte* data, uint64_t bytes) {
  if (madvise(data, RoundUpToPage(bytes), MADV_REMOVE) != 0) {
    return PosixError(absl::StrCat("freeing ", bytes, " bytes of shared memory"), errno);
  }
  return absl::OkStatus();
}

absl::StatusOr<HostMemory> HostMemory::Allocate(uint64_t bytes, bool huge_pages) {
  if (bytes == 0) return HostMemory();
  const uint64_t mapped = RoundUpToPage(bytes);
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return PosixError(absl::StrCat("mmap ", bytes, " bytes"), errno);
  // Best effort (THP may be off); see the header.
  if (huge_pages) madvise(p, mapped, MADV_HUGEPAGE);
  return HostMemory(static_cast<std::byte*>(p), bytes, mapped);
}

absl::StatusOr<HostMemory> HostMemory::MapShared(int fd, uint64_t offset, uint64_t bytes) {
  if (bytes == 0) return HostMemory();
  const uint64_t mapped = RoundUpToPage(bytes);
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd,
                 static_cast<off_t>(offset));
  if (p == MAP_FAILED) {
    return PosixError(absl::StrCat("mmap ", bytes, " bytes at offset ", offset, " of descriptor ",
                                   fd, " shared"),
                      errno);
  }
  return HostMemory(static_cast<std::byte*>(p), bytes, mapped);
}

HostMemory::HostMemory(HostMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)) {}

HostMemory& HostMemory::operator=(HostMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
  }
  return *this;
}

HostMemory::~HostMemory() { Reset(); }

void HostMemory::Reset() {
  if (data_ != nullptr) munmap(data_, mapped_);
  data_ = nullptr;
  size_ = mapped_ = 0;
}

}  // namespace offload
