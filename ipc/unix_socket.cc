#include "ipc/unix_socket.h"

#include <grp.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/posix_error.h"
#include "base/status_macros.h"

namespace offload {
namespace {

constexpr size_t kMaxPayload = 4096;

absl::StatusOr<sockaddr_un> UnixAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("Unix socket path must be 1 to ",
                                                   sizeof(addr.sun_path) - 1, " bytes, got ",
                                                   path.size(), ": '", path, "'"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

}  // namespace

absl::Status SendWithFd(int sock, absl::string_view payload, int fd) {
  if (payload.empty() || payload.size() > kMaxPayload) {
    return absl::InvalidArgumentError(
        absl::StrCat("fd message payload must be 1 to ", kMaxPayload, " bytes"));
  }
  iovec iov{const_cast<char*>(payload.data()), payload.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cm), &fd, sizeof(int));
  }
  for (;;) {
    ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n >= 0) {
      if (static_cast<size_t>(n) != payload.size()) {
        return absl::UnavailableError("short send on Unix socket");
      }
      return absl::OkStatus();
    }
    if (errno != EINTR) return PosixError("sendmsg with descriptor", errno);
  }
}

absl::StatusOr<ReceivedMessage> ReceiveWithFd(int sock) {
  ReceivedMessage out;
  out.payload.resize(kMaxPayload);
  iovec iov{out.payload.data(), out.payload.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  // Room for more descriptors than the one a message may carry, so that a
  // peer sending several gets them all received here and closed, none left
  // behind in this process (CMSG_SPACE of one int already holds two).
  constexpr int kMaxFds = 8;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return PosixError("recvmsg", errno);
  // Every descriptor received is owned here, so none can leak.
  std::vector<UniqueFd> fds;
  for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
    if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
      fds.emplace_back(fd);
    }
  }
  if (fds.size() > 1 || (msg.msg_flags & MSG_CTRUNC)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a message may carry at most one descriptor; this one carried ",
                     (msg.msg_flags & MSG_CTRUNC) ? "more than " : "", fds.size()));
  }
  if (!fds.empty()) out.fd = std::move(fds[0]);
  if (n == 0) return absl::UnavailableError("peer closed the Unix socket");
  out.payload.resize(static_cast<size_t>(n));
  return out;
}

absl::StatusOr<ucred> PeerCredentials(int sock) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return PosixError("getsockopt(SO_PEERCRED)", errno);
  }
  return cred;
}

absl::StatusOr<bool> PeerInGroup(int sock, const ucred& cred, gid_t group) {
  if (cred.gid == group) return true;
  std::vector<gid_t> groups(64);
  for (;;) {
    socklen_t len = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) == 0) {
      groups.resize(len / sizeof(gid_t));
      break;
    }
    if (errno != ERANGE) return PosixError("getsockopt(SO_PEERGROUPS)", errno);
    groups.resize(len / sizeof(gid_t) + 1);  // the kernel said how many
  }
  return std::find(groups.begin(), groups.end(), group) != groups.end();
}

absl::StatusOr<gid_t> GroupNamed(const std::string& name) {
  std::vector<char> buf(16384);
  group g{};
  group* found = nullptr;
  const int rc = getgrnam_r(name.c_str(), &g, buf.data(), buf.size(), &found);
  if (rc != 0) return PosixError(absl::StrCat("looking up group '", name, "'"), rc);
  if (found == nullptr) return absl::NotFoundError(absl::StrCat("no group named '", name, "'"));
  return found->gr_gid;
}

absl::Status ShareWithGroup(const std::string& path, gid_t group) {
  if (chown(path.c_str(), static_cast<uid_t>(-1), group) != 0) {
    return PosixError(absl::StrCat("giving ", path, " to group ", group), errno);
  }
  if (chmod(path.c_str(), 0660) != 0) return PosixError(absl::StrCat("chmod 0660 ", path), errno);
  return absl::OkStatus();
}

bool UnixSocketIsLive(const std::string& path) { return ConnectUnix(path).ok(); }

absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path) {
  auto addr = UnixAddress(path);
  if (!addr.ok()) return addr.status();
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return PosixError("socket(AF_UNIX)", errno);
  if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    return PosixError(absl::StrCat("connect ", path), errno);
  }
  return fd;
}

absl::Status ClaimSocketPath(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) == 0 && !S_ISSOCK(st.st_mode)) {
    // A file, directory or link someone named by mistake is not ours to
    // delete.
    return absl::FailedPreconditionError(absl::StrCat(
        path, " exists and is not a Unix socket; refusing to replace it (choose another path)"));
  }
  if (UnixSocketIsLive(path)) {
    return absl::AlreadyExistsError(absl::StrCat("another process is already serving on ", path));
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return PosixError(absl::StrCat("removing stale socket ", path), errno);
  }
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> ListenUnixOwnerOnly(const std::string& path, int backlog) {
  auto addr = UnixAddress(path);
  if (!addr.ok()) return addr.status();
  RETURN_IF_ERROR(ClaimSocketPath(path));
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return PosixError("socket(AF_UNIX)", errno);
  // The umask makes bind() create the file 0600: no window in which another
  // user could connect.
  mode_t old_mask = umask(0177);
  int rc = bind(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr));
  int bind_errno = errno;
  umask(old_mask);
  if (rc != 0) return PosixError(absl::StrCat("bind ", path), bind_errno);
  if (listen(fd.get(), backlog) != 0) return PosixError(absl::StrCat("listen ", path), errno);
  return fd;
}

}  // namespace offload
