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
// block size of the underlying block device from sysfs (the disk's for a
// partition). Unsupported (0, 0) where neither knows: filesystems without
// direct I/O; tmpfs (which takes O_DIRECT from Linux 6.6 on, as a copy);
// and, before 6.1, filesystems on no block device of their own (btrfs,
// overlayfs, NFS), which then work through the page cache.
DirectIoAlignment QueryDirectIoAlignment(int fd);

// The logical block size of block device `major`:`minor` as
// `sys_dev_block` (/sys/dev/block) tells it: its queue's, or for a
// partition (which has none) its disk's; 0 if neither is there.
uint32_t LogicalBlockSize(const std::string& sys_dev_block, unsigned major, unsigned minor);

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
// `exclusive`: the file must not exist yet, nor be a link (O_EXCL, O_NOFOLLOW).
absl::StatusOr<IoFile> OpenIoFileQuietly(const std::string& path, bool create, bool want_direct,
                                         bool exclusive = false);

}  // namespace offload

#endif  // OFFLOADD_NVME_DIO_H_
