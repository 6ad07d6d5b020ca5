#include "nvme/dio.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "base/host_memory.h"
#include "base/log.h"
#include "base/posix_error.h"

namespace offload {

DirectIoAlignment QueryDirectIoAlignment(int fd) {
  struct statx stx = {};
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN | STATX_TYPE, &stx) == 0 &&
      (stx.stx_mask & STATX_DIOALIGN)) {
    return {stx.stx_dio_mem_align, stx.stx_dio_offset_align};
  }
  // Older kernels: the device's logical block size.
  struct stat st;
  if (fstat(fd, &st) != 0) return {};
  const uint32_t block = LogicalBlockSize("/sys/dev/block", major(st.st_dev), minor(st.st_dev));
  if (block != 0) return {block, block};
  return {};
}

uint32_t LogicalBlockSize(const std::string& sys_dev_block, unsigned major, unsigned minor) {
  const std::string dev = absl::StrCat(sys_dev_block, "/", major, ":", minor);
  // A partition's directory (a link into its disk's) has no queue: its
  // parent, the disk's, does.
  for (const char* queue : {"/queue/logical_block_size", "/../queue/logical_block_size"}) {
    std::ifstream in(dev + queue);
    uint32_t block = 0;
    if (in >> block && block != 0 && (block & (block - 1)) == 0) return block;
  }
  return 0;
}

absl::StatusOr<IoFile> OpenIoFile(const std::string& path, bool create, bool want_direct) {
  absl::StatusOr<IoFile> file = OpenIoFileQuietly(path, create, want_direct);
  if (file.ok() && want_direct && !file->direct) {
    LogWarning("%s: filesystem does not support O_DIRECT; using buffered I/O (page cache)", path);
  }
  return file;
}

absl::StatusOr<IoFile> OpenIoFileQuietly(const std::string& path, bool create, bool want_direct,
                                         bool exclusive) {
  const int flags =
      O_RDWR | O_CLOEXEC | (create ? O_CREAT : 0) | (exclusive ? O_EXCL | O_NOFOLLOW : 0);
  IoFile file;
  file.path = path;
  if (want_direct) {
    file.fd.reset(open(path.c_str(), flags | O_DIRECT, 0600));
    if (!file.fd.valid() && errno != EINVAL) {
      return PosixError(absl::StrCat("opening ", path, " for direct I/O"), errno);
    }
  }
  if (file.fd.valid()) {
    DirectIoAlignment a = QueryDirectIoAlignment(file.fd.get());
    const uint64_t alignment = std::max({a.memory, a.offset, 512u});
    if (a.supported() && alignment <= PageSize()) {
      file.direct = true;
      file.alignment = alignment;
      return file;
    }
    if (a.supported()) {
      // Transfers are whole alignment units, and the buffers they land in
      // (the pool's leases, the arenas' spans) whole pages only: a larger
      // unit would read past them.
      LogWarning("%s: direct I/O needs %d-byte units, more than a page; using buffered I/O", path,
                 static_cast<int64_t>(alignment));
    }
    // Opened, but the filesystem reports no direct I/O support: reopen.
    file.fd.reset();
  }
  // (After a direct attempt, which may have made the file before the
  // filesystem refused O_DIRECT: the file is this call's, opened again
  // without O_EXCL, still never through a link.)
  file.fd.reset(open(path.c_str(), want_direct ? flags & ~O_EXCL : flags, 0600));
  if (!file.fd.valid()) return PosixError(absl::StrCat("opening ", path), errno);
  file.alignment = 4096;
  return file;
}

}  // namespace offload
