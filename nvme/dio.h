// Direct I/O helpers: the alignment a file needs (queried from the kernel,
// never assumed), opening with O_DIRECT where the filesystem supports it,
// (I/O buffers are base/host_memory.h's HostMemory, on huge pages).
#ifndef OFFLOADD_NVME_DIO_H_
#define OFFLOADD_NVME_DIO_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "base/host_memory.h"  // RoundUp
#include "base/unique_fd.h"

namespace offload {

struct DirectIoAlignment {
  uint32_t memory = 0;  // buffer address alignment
  uint32_t offset = 0;  // file offset and length alignment
  bool supported() const { return offset != 0; }
};

// statx(STATX_DIOALIGN) where the kernel reports it; otherwise the logical
// block size of the underlying block device from sysfs. Unsupported (0, 0)
// for filesystems without direct I/O, such as tmpfs.
DirectIoAlignment QueryDirectIoAlignment(int fd);

struct IoFile {
  UniqueFd fd;
  std::string path;
  bool direct = false;
  // Alignment I/O on this file must respect (at least 512 even when
  // buffered, so buffers stay interchangeable between files).
  uint32_t alignment = 4096;
};

// Opens (creating if `create`) `path` read-write, with O_DIRECT when
// `want_direct` and the filesystem supports it; otherwise buffered, with a
// logged warning naming the path.
absl::StatusOr<IoFile> OpenIoFile(const std::string& path, bool create, bool want_direct);

// OpenIoFile without the warning: whether the file is direct says it
// (offloadctl doctor reports it as its own finding).
absl::StatusOr<IoFile> OpenIoFileQuietly(const std::string& path, bool create, bool want_direct);

}  // namespace offload

#endif  // OFFLOADD_NVME_DIO_H_
