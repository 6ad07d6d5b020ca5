#include "ipc/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace offload {
namespace {

// A directory under /tmp (TEST_TMPDIR can exceed the 107-byte sun_path
// limit; /tmp cannot), removed with what it holds when this goes.
class TempSocketDir {
 public:
  TempSocketDir() {
    char dir[] = "/tmp/offload_fd_test.XXXXXX";
    EXPECT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  ~TempSocketDir() {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  std::string Path(const char* name) const { return dir_ + "/" + name; }

 private:
  std::string dir_;
};

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

int OpenDescriptors() {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    (void)entry;
    ++n;
  }
  return n;
}

// Sends `count` descriptors (duplicates of stdin) in one message.
void SendDescriptors(int sock, int count) {
  std::vector<int> fds(static_cast<size_t>(count), STDIN_FILENO);
  char payload = 'p';
  iovec iov{&payload, 1};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  cmsghdr* cm = CMSG_FIRSTHDR(&msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
  std::memcpy(CMSG_DATA(cm), fds.data(), sizeof(int) * fds.size());
  ASSERT_EQ(sendmsg(sock, &msg, 0), 1);
}

// A peer sending several descriptors gets a clear error and leaves none
// behind in the receiver, however many it sends (each was a leaked fd).
TEST(FdPassing, ExtraDescriptorsAreRefusedAndClosed) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  const int before = OpenDescriptors();
  for (int count : {2, 3, 8, 20}) {
    SendDescriptors(a.get(), count);
    auto msg = ReceiveWithFd(b.get());
    EXPECT_EQ(msg.status().code(), absl::StatusCode::kInvalidArgument) << count;
    EXPECT_NE(msg.status().message().find("at most one descriptor"), std::string::npos);
    EXPECT_EQ(OpenDescriptors(), before) << count << " descriptors sent";
  }
  SendDescriptors(a.get(), 1);
  auto one = ReceiveWithFd(b.get());
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_TRUE(one->fd.valid());
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
  TempSocketDir dir;
  const std::string path = dir.Path("s.sock");
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
  EXPECT_EQ(ConnectUnix(std::string(200, 'a')).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace offload
