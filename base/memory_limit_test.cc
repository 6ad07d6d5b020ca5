#include "base/memory_limit.h"

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace offload {
namespace {

std::string Root(const std::string& name) {
  std::string root = std::string(getenv("TEST_TMPDIR")) + "/" + name;
  mkdir(root.c_str(), 0700);
  return root;
}

void Write(const std::string& path, const std::string& text) {
  std::string dir = path.substr(0, path.rfind('/'));
  std::string partial;
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i == dir.size() || dir[i] == '/') mkdir(dir.substr(0, i).c_str(), 0700);
  }
  std::ofstream(path) << text;
}

constexpr uint64_t kGiB = uint64_t{1} << 30;

TEST(MemoryLimit, CgroupV2LimitOfTheProcessPath) {
  const std::string root = Root("v2");
  Write(root + "/app.slice/offloadd.service/memory.max", "4294967296\n");
  MemoryLimit m = ReadMemoryLimitFrom("0::/app.slice/offloadd.service\n", root, 24 * kGiB);
  EXPECT_EQ(m.cgroup, 4 * kGiB);
  EXPECT_EQ(m.effective(), 4 * kGiB);
}

// A limit on a cgroup above the process's (a user's slice) binds it too;
// the smallest on the way up is the one that counts.
TEST(MemoryLimit, CgroupV2LimitOfAParent) {
  const std::string root = Root("v2parent");
  Write(root + "/user.slice/user-1000.slice/memory.max", "2147483648\n");
  Write(root + "/user.slice/user-1000.slice/session-3.scope/memory.max", "max\n");
  Write(root + "/user.slice/memory.max", "8589934592\n");
  MemoryLimit m =
      ReadMemoryLimitFrom("0::/user.slice/user-1000.slice/session-3.scope\n", root, 24 * kGiB);
  EXPECT_EQ(m.cgroup, 2 * kGiB);
  EXPECT_EQ(m.cgroup_file, root + "/user.slice/user-1000.slice/memory.max");
  Write(root + "/user.slice/user-1000.slice/session-3.scope/memory.max", "1073741824\n");
  EXPECT_EQ(ReadMemoryLimitFrom("0::/user.slice/user-1000.slice/session-3.scope\n", root, 24 * kGiB)
                .cgroup,
            kGiB);
}

TEST(MemoryLimit, CgroupV2MaxMeansNoLimit) {
  const std::string root = Root("v2max");
  Write(root + "/memory.max", "max\n");
  MemoryLimit m = ReadMemoryLimitFrom("0::/\n", root, 24 * kGiB);
  EXPECT_EQ(m.cgroup, 0u);
  EXPECT_EQ(m.effective(), 24 * kGiB);
}

TEST(MemoryLimit, CgroupV1AtItsPathOrAtTheContainersRoot) {
  const std::string root = Root("v1");
  // The process's own path has no limit (v1's "unlimited"); the container's
  // root has one.
  Write(root + "/memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n");
  Write(root + "/memory/memory.limit_in_bytes", "2147483648\n");
  MemoryLimit m =
      ReadMemoryLimitFrom("9:cpu,cpuacct:/\n4:memory:/docker/abc\n0::/\n", root, 24 * kGiB);
  EXPECT_EQ(m.cgroup, 2 * kGiB);
  EXPECT_EQ(m.cgroup_file, root + "/memory/memory.limit_in_bytes");
}

TEST(MemoryLimit, AboveThePhysicalMemoryOrUnreadableCountsPhysical) {
  const std::string root = Root("big");
  Write(root + "/memory.max", "107374182400\n");
  EXPECT_EQ(ReadMemoryLimitFrom("0::/\n", root, 24 * kGiB).effective(), 24 * kGiB);
  EXPECT_EQ(ReadMemoryLimitFrom("garbage", root + "/none", 24 * kGiB).effective(), 24 * kGiB);
  EXPECT_GT(ReadMemoryLimit().effective(), 0u);  // this machine
}

TEST(MemoryLimit, AMadeUpNodeGivesItsMemTotalAndCgroup) {
  const std::string root = Root("node");
  Write(root + "/proc/meminfo", "MemTotal:       16777216 kB\nMemFree:         1024 kB\n");
  Write(root + "/proc/self/cgroup", "0::/offloadd.service\n");
  Write(root + "/sys/fs/cgroup/offloadd.service/memory.max", "6442450944\n");
  MemoryLimit m = ReadMemoryLimitIn(root + "/proc", root + "/sys");
  EXPECT_EQ(m.physical, 16 * kGiB);
  EXPECT_EQ(m.cgroup, 6 * kGiB);
  EXPECT_EQ(m.cgroup_file, root + "/sys/fs/cgroup/offloadd.service/memory.max");
}

}  // namespace
}  // namespace offload
