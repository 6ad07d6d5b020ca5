#include "nvme/swap_dir_probe.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/host_memory.h"
#include "base/posix_error.h"
#include "base/unique_fd.h"
#include "nvme/dio.h"
#include "nvme/io_backend.h"
#include "nvme/posix_backend.h"
#include "nvme/swap_space.h"
#include "nvme/uring_backend.h"

namespace offload {
namespace {

struct NamedMagic {
  int64_t magic;
  const char* name;
  bool in_memory;
};

constexpr NamedMagic kFilesystems[] = {
    {0xEF53, "ext4", false},       {0x58465342, "xfs", false},  {0x9123683E, "btrfs", false},
    {0xF2F52010, "f2fs", false},   {0x2FC12FC1, "zfs", false},  {0xCA451A4E, "bcachefs", false},
    {0x01021994, "tmpfs", true},   {0x858458F6, "ramfs", true}, {0x794C7630, "overlayfs", false},
    {0x6969, "nfs", false},        {0xFF534D42, "cifs", false}, {0xFE534D42, "smb2", false},
    {0x65735546, "fuse", false},   {0x01021997, "9p", false},   {0x00C36400, "ceph", false},
    {0x0BD00BD0, "lustre", false}, {0x47504653, "gpfs", false}, {0x73717368, "squashfs", false},
};

const NamedMagic* Find(int64_t magic) {
  for (const NamedMagic& m : kFilesystems) {
    if (m.magic == (magic & 0xFFFFFFFF)) return &m;
  }
  return nullptr;
}

// Looks at an existing swap file: its bytes on disk, and whether a process
// holds its lock (SwapSpace::Create takes LOCK_EX; a shared lock fails then).
void LookAtSwapFile(const std::string& dir, SwapDirProbe& probe) {
  const std::string path = absl::StrCat(dir, "/", SwapSpace::kFileName);
  // Not followed, not waited on (a FIFO or a link planted there by another
  // user of a shared directory): only a regular file is looked at; its
  // size also where this user cannot open it (another user's offloadd's).
  struct stat st;
  if (lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  probe.swap_file_bytes = static_cast<uint64_t>(st.st_blocks) * 512;
  UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW));
  struct stat opened;
  if (!fd.valid() || fstat(fd.get(), &opened) != 0 || opened.st_ino != st.st_ino) return;
  if (flock(fd.get(), LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
    probe.swap_file_locked = true;
  }
}

// One block written and read back through `backend` on `file`.
absl::Status WriteAndReadBack(IoBackend& backend, const IoFile& file, uint64_t bytes) {
  absl::StatusOr<int> index = backend.AddFile(file.fd.get(), file.path);
  if (!index.ok()) return index.status();
  absl::StatusOr<HostMemory> out = HostMemory::Allocate(bytes, Pages::kSystemDefault);
  if (!out.ok()) return out.status();
  absl::StatusOr<HostMemory> in = HostMemory::Allocate(bytes, Pages::kSystemDefault);
  if (!in.ok()) return in.status();
  for (uint64_t i = 0; i < bytes; ++i) out->data()[i] = static_cast<std::byte>(i * 131 + 7);
  if (absl::Status s = backend.Run({IoRequest{IoOp::kWrite, *index, 0, out->data(), bytes}});
      !s.ok()) {
    return s;
  }
  if (absl::Status s = backend.Run({IoRequest{IoOp::kRead, *index, 0, in->data(), bytes}});
      !s.ok()) {
    return s;
  }
  if (std::memcmp(out->data(), in->data(), bytes) != 0) {
    return absl::DataLossError(
        absl::StrCat(bytes, " bytes read back from ", file.path, " differ from those written"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string FilesystemName(int64_t magic) {
  const NamedMagic* m = Find(magic);
  return m != nullptr ? m->name : absl::StrFormat("0x%x", static_cast<uint32_t>(magic));
}

SwapDirProbe ProbeSwapDir(const std::string& dir, const NvmeOptions& options) {
  SwapDirProbe probe;
  probe.dir = dir;
  struct statfs fs;
  if (statfs(dir.c_str(), &fs) != 0) {
    probe.usable = PosixError(absl::StrCat("statfs ", dir), errno);
    return probe;
  }
  const NamedMagic* known = Find(static_cast<int64_t>(fs.f_type));
  probe.filesystem = FilesystemName(static_cast<int64_t>(fs.f_type));
  probe.in_memory = known != nullptr && known->in_memory;
  struct statvfs vfs;
  if (statvfs(dir.c_str(), &vfs) == 0) {
    probe.free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  }
  LookAtSwapFile(dir, probe);

  // A scratch file of this process's own, removed below.
  static std::atomic<int> serial{0};
  const std::string path =
      absl::StrCat(dir, "/.offloadd-doctor.", getpid(), ".", serial.fetch_add(1));
  // Made here, never an existing file or a link someone planted at this
  // name (the pid is guessable): O_EXCL | O_NOFOLLOW.
  absl::StatusOr<IoFile> file =
      OpenIoFileQuietly(path, /*create=*/true, options.direct_io, /*exclusive=*/true);
  if (!file.ok()) {
    probe.usable = file.status();
    return probe;
  }
  struct Unlink {
    std::string path;
    ~Unlink() { unlink(path.c_str()); }
  } unlink_at_exit{path};
  probe.direct = file->direct;
  probe.direct_alignment = file->direct ? file->alignment : 0;

  IoOptions io = options.io;
  io.rings = 1;
  io.sqpoll = false;
  absl::StatusOr<std::unique_ptr<IoBackend>> backend;
  if (io.backend == "posix") {
    probe.backend = "posix";
    backend = MakePosixBackend(io);
  } else {
    probe.backend = "io_uring";
    const int rc = ProbeIoUring();
    backend = rc == 0 ? MakeUringBackend(io)
                      : absl::StatusOr<std::unique_ptr<IoBackend>>(absl::FailedPreconditionError(
                            PosixError("io_uring_queue_init", -rc).message()));
  }
  if (!backend.ok()) {
    probe.io = backend.status();
    return probe;
  }
  probe.io_bytes = std::max<uint64_t>(file->alignment, 64 << 10);
  probe.io = WriteAndReadBack(**backend, *file, probe.io_bytes);
  return probe;
}

}  // namespace offload
