// What offloadd's NVMe tier would meet in one swap directory, found by
// trying it the way SwapSpace::Create and the I/O backend would: a scratch
// file is created there, opened for direct I/O (OpenIoFileQuietly, the
// rule the swap space uses), and one block is written and read back through
// the backend nvme.io.backend names (io_uring: the project's own backend,
// not a separate ring). The scratch file is removed before it returns;
// nothing else in the directory is changed (an existing swap file is only
// looked at, under a shared lock it drops at once).
//
// For `offloadctl doctor`: each field is a measurement, and judging it
// (what is slow, what would make offloadd fail) is the caller's.
// Thread-compatible; blocks for the I/O (milliseconds).
#ifndef OFFLOADD_NVME_SWAP_DIR_PROBE_H_
#define OFFLOADD_NVME_SWAP_DIR_PROBE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "nvme/nvme_options.h"

namespace offload {

struct SwapDirProbe {
  std::string dir;
  // OK once a file could be created in `dir`; otherwise the error (NOT_FOUND
  // for a missing directory, PERMISSION_DENIED, ...), and nothing below it
  // was measured.
  absl::Status usable;
  // The filesystem by statfs's magic: "ext4" (ext2/3/4 share it), "xfs",
  // "btrfs", "tmpfs", ... or its magic in hex where unknown.
  std::string filesystem;
  // Whether the filesystem lives in memory (tmpfs, ramfs): a swap file there
  // takes host memory, not NVMe.
  bool in_memory = false;
  // Bytes an unprivileged writer may still use (statvfs f_bavail).
  uint64_t free_bytes = 0;
  // Bytes on disk of an existing <dir>/offloadd.swap: offloadd truncates and
  // reuses it at start, so they count as free for it. 0 where none.
  uint64_t swap_file_bytes = 0;
  // Whether another process (a running offloadd) holds that file's lock:
  // a second offloadd on the same directory fails to start.
  bool swap_file_locked = false;
  // Opened with O_DIRECT and the filesystem reports its alignment.
  bool direct = false;
  uint32_t direct_alignment = 0;  // bytes; 0 without direct I/O
  // The backend the one-block write and read went through ("io_uring" or
  // "posix"), and their outcome: OK, the backend's setup error (io_uring
  // refused by the kernel: FAILED_PRECONDITION naming the errno), or the
  // I/O's error (DATA_LOSS where the block read back differs).
  std::string backend;
  absl::Status io;
  uint64_t io_bytes = 0;  // the block written and read
};

// Tries `dir` with `options` (direct_io and io.backend as offloadd would
// use them; io.backend "auto" tries io_uring and reports its failure
// rather than falling back, so that the caller can say what "auto" would
// lose).
SwapDirProbe ProbeSwapDir(const std::string& dir, const NvmeOptions& options);

// statfs's f_type as a name ("ext4", "xfs", "tmpfs", ...), or "0x<hex>".
std::string FilesystemName(int64_t magic);

}  // namespace offload

#endif  // OFFLOADD_NVME_SWAP_DIR_PROBE_H_
