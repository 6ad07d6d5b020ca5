#include "nvme/swap_dir_probe.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "gtest/gtest.h"
#include "nvme/swap_space.h"
#include "nvme/uring_backend.h"

namespace offload {
namespace {

std::string Dir(const std::string& name) {
  std::string dir = std::string(getenv("TEST_TMPDIR")) + "/" + name;
  std::filesystem::create_directories(dir);
  return dir;
}

bool Empty(const std::string& dir) {
  return std::filesystem::directory_iterator(dir) == std::filesystem::directory_iterator();
}

TEST(SwapDirProbe, TriesTheDirectoryAndLeavesNothingBehind) {
  const std::string dir = Dir("probe");
  NvmeOptions options;
  const SwapDirProbe p = ProbeSwapDir(dir, options);
  ASSERT_TRUE(p.usable.ok()) << p.usable;
  EXPECT_FALSE(p.filesystem.empty());
  EXPECT_GT(p.free_bytes, 0u);
  EXPECT_EQ(p.swap_file_bytes, 0u);
  EXPECT_FALSE(p.swap_file_locked);
  // What this filesystem does, whichever it is: the ones the swap space is
  // for take O_DIRECT, the ones in memory do not.
  if (p.filesystem == "ext4" || p.filesystem == "xfs") {
    EXPECT_TRUE(p.direct) << p.filesystem;
  }
  if (p.in_memory) {
    EXPECT_FALSE(p.direct) << p.filesystem;
  }
  EXPECT_EQ(p.direct_alignment != 0, p.direct);
  EXPECT_EQ(p.backend, "io_uring");
  if (ProbeIoUring() == 0) {
    EXPECT_TRUE(p.io.ok()) << p.io;
    EXPECT_GE(p.io_bytes, 4096u);
  } else {
    EXPECT_EQ(p.io.code(), absl::StatusCode::kFailedPrecondition) << p.io;
  }
  EXPECT_TRUE(Empty(dir)) << "the scratch file stays";
}

TEST(SwapDirProbe, PosixBackendAndBufferedWhenAsked) {
  const std::string dir = Dir("posix");
  NvmeOptions options;
  options.io.backend = "posix";
  options.direct_io = false;
  const SwapDirProbe p = ProbeSwapDir(dir, options);
  ASSERT_TRUE(p.usable.ok()) << p.usable;
  EXPECT_FALSE(p.direct);
  EXPECT_EQ(p.backend, "posix");
  EXPECT_TRUE(p.io.ok()) << p.io;
  EXPECT_TRUE(Empty(dir));
}

TEST(SwapDirProbe, AMissingDirectoryIsNotFoundAndMeasuresNothing) {
  const SwapDirProbe p = ProbeSwapDir(Dir("parent") + "/missing", NvmeOptions());
  EXPECT_EQ(p.usable.code(), absl::StatusCode::kNotFound) << p.usable;
  EXPECT_NE(p.usable.message().find("/missing"), std::string::npos) << p.usable;
  EXPECT_EQ(p.free_bytes, 0u);
  EXPECT_TRUE(p.backend.empty());
}

TEST(SwapDirProbe, SeesAnExistingSwapFileAndItsLock) {
  const std::string dir = Dir("held");
  const std::string path = dir + "/" + SwapSpace::kFileName;
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(posix_fallocate(fd, 0, 1 << 20), 0);
  SwapDirProbe p = ProbeSwapDir(dir, NvmeOptions());
  EXPECT_GE(p.swap_file_bytes, 1u << 20);
  EXPECT_FALSE(p.swap_file_locked);
  ASSERT_EQ(flock(fd, LOCK_EX | LOCK_NB), 0);  // as a running offloadd holds it
  p = ProbeSwapDir(dir, NvmeOptions());
  EXPECT_TRUE(p.swap_file_locked);
  close(fd);
  EXPECT_TRUE(std::filesystem::exists(path)) << "the probe removed the swap file";
}

// What another user of a shared directory may plant there: a FIFO at the
// swap file's name is not waited on (a blocking open hung the probe), and a
// link at the scratch file's next name is not written through.
TEST(SwapDirProbe, APlantedFifoOrLinkIsNeitherWaitedOnNorWrittenThrough) {
  const std::string dir = Dir("planted");
  ASSERT_EQ(mkfifo((dir + "/" + SwapSpace::kFileName).c_str(), 0600), 0);
  const std::string victim = Dir("planted_victim") + "/precious";
  const int v = open(victim.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(v, 0);
  ASSERT_EQ(write(v, "keep", 4), 4);
  close(v);
  // The scratch files are named by pid and a counter: every next name of
  // the first few points at the victim.
  for (int serial = 0; serial < 64; ++serial) {
    (void)symlink(victim.c_str(), (dir + "/.offloadd-doctor." + std::to_string(getpid()) + "." +
                                   std::to_string(serial))
                                      .c_str());
  }
  SwapDirProbe p = ProbeSwapDir(dir, NvmeOptions());  // (returns: the FIFO did not block)
  EXPECT_EQ(p.swap_file_bytes, 0u);
  EXPECT_FALSE(p.usable.ok()) << "the probe used a file it did not make";
  EXPECT_EQ(std::filesystem::file_size(victim), 4u) << "written through a planted link";
}

TEST(SwapDirProbe, TmpfsIsInMemoryAndBuffered) {
  struct statfs fs;
  if (statfs("/dev/shm", &fs) != 0 || fs.f_type != 0x01021994) GTEST_SKIP() << "no tmpfs";
  const SwapDirProbe p = ProbeSwapDir("/dev/shm", NvmeOptions());
  ASSERT_TRUE(p.usable.ok()) << p.usable;
  EXPECT_EQ(p.filesystem, "tmpfs");
  EXPECT_TRUE(p.in_memory);
  EXPECT_FALSE(p.direct);
}

TEST(SwapDirProbe, FilesystemNames) {
  EXPECT_EQ(FilesystemName(0xEF53), "ext4");
  EXPECT_EQ(FilesystemName(0x58465342), "xfs");
  EXPECT_EQ(FilesystemName(0x12345678), "0x12345678");
}

}  // namespace
}  // namespace offload
