#include "base/descriptors.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(Descriptors, CountsWhatThisProcessHasOpenAgainstItsLimit) {
  const DescriptorUse before = CountDescriptors();
  rlimit lim{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &lim), 0);
  EXPECT_EQ(before.limit, static_cast<int64_t>(lim.rlim_cur));
  EXPECT_GE(before.open, 3);
  std::vector<UniqueFd> more;
  for (int i = 0; i < 10; ++i) more.emplace_back(open("/dev/null", O_RDONLY | O_CLOEXEC));
  EXPECT_EQ(CountDescriptors().open, before.open + 10);
  more.clear();
  EXPECT_EQ(CountDescriptors().open, before.open);
}

TEST(Descriptors, AMadeUpDirectoryIsCountedAsItIs) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/fd";
  ASSERT_EQ(system(("mkdir -p " + dir).c_str()), 0);
  for (int i = 0; i < 5; ++i) std::ofstream(dir + "/" + std::to_string(i)) << "";
  EXPECT_EQ(CountDescriptors(dir).open, 5);
  // Unreadable (as at EMFILE): full.
  const DescriptorUse none = CountDescriptors(dir + "/missing");
  EXPECT_EQ(none.open, none.limit);
  EXPECT_EQ(none.free(), 0);
}

TEST(Descriptors, TheSpareLetsAListenerAtItsLimitTakeAConnection) {
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  SpareDescriptor spare;
  ASSERT_TRUE(spare.held());
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd a(pair[0]), b(pair[1]);
  // Fill the table up to a small limit.
  const DescriptorUse use = CountDescriptors();
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(use.open + 4);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<UniqueFd> fill;
  for (;;) {
    UniqueFd fd(open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) break;
    fill.push_back(std::move(fd));
  }
  EXPECT_EQ(errno, EMFILE);
  EXPECT_LT(dup(a.get()), 0);
  // With the spare given up, one more opens; the spare comes back after.
  const bool got = spare.WithSpare([&] {
    UniqueFd d(dup(a.get()));
    return d.valid();
  });
  EXPECT_TRUE(got);
  EXPECT_TRUE(spare.held());
  fill.clear();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
}

}  // namespace
}  // namespace offload
