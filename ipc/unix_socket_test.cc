#include "ipc/unix_socket.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace offload {
namespace {

std::string TempSocketPath(const char* name) {
  // TEST_TMPDIR can exceed the 107-byte sun_path limit; /tmp cannot.
  char dir[] = "/tmp/offload_fd_test.XXXXXX";
  EXPECT_NE(mkdtemp(dir), nullptr);
  return std::string(dir) + "/" + name;
}

TEST(FdPassing, SendsDescriptorAndPayload) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  UniqueFd rd(pipe_fds[0]), wr(pipe_fds[1]);
  ASSERT_TRUE(SendWithFd(a.get(), "here", wr.get()).ok());
  auto msg = ReceiveWithFd(b.get());
  ASSERT_TRUE(msg.ok()) << msg.status();
  EXPECT_EQ(msg->payload, "here");
  ASSERT_TRUE(msg->fd.valid());
  ASSERT_EQ(write(msg->fd.get(), "x", 1), 1);
  char c = 0;
  ASSERT_EQ(read(rd.get(), &c, 1), 1);
  EXPECT_EQ(c, 'x');
}

TEST(FdPassing, PeerCredentialsAreOurs) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  auto cred = PeerCredentials(a.get());
  ASSERT_TRUE(cred.ok());
  EXPECT_EQ(cred->uid, geteuid());
  EXPECT_EQ(cred->pid, getpid());
}

TEST(FdPassing, ListenerIsOwnerOnlyAndExclusive) {
  std::string path = TempSocketPath("s.sock");
  auto listener = ListenUnixOwnerOnly(path);
  ASSERT_TRUE(listener.ok()) << listener.status();
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_TRUE(UnixSocketIsLive(path));
  EXPECT_EQ(ListenUnixOwnerOnly(path).status().code(), absl::StatusCode::kAlreadyExists);
  listener->reset();
  // A stale socket file (nobody listening) is replaced.
  EXPECT_FALSE(UnixSocketIsLive(path));
  EXPECT_TRUE(ListenUnixOwnerOnly(path).ok());
}

TEST(FdPassing, ErrorsCarryContext) {
  auto missing = ConnectUnix("/tmp/offload_no_such_dir/x.sock");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/tmp/offload_no_such_dir/x.sock"), std::string::npos);
  EXPECT_NE(missing.status().message().find("ENOENT"), std::string::npos);
  EXPECT_EQ(ConnectUnix(std::string(200, 'a')).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace offload
