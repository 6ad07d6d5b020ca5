// Unix-socket helpers shared by the daemon and the client library: sending
// and receiving one file descriptor with a small payload (SCM_RIGHTS), and
// reading the peer's credentials (SO_PEERCRED), claiming a socket path,
// listening and connecting.
//
// All functions are blocking and thread-compatible; `sock` is borrowed.
#ifndef OFFLOADD_IPC_UNIX_SOCKET_H_
#define OFFLOADD_IPC_UNIX_SOCKET_H_

#include <sys/socket.h>
#include <sys/types.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/unique_fd.h"

namespace offload {

// Sends `payload` (at most 4 KiB) and, if `fd` >= 0, that descriptor.
absl::Status SendWithFd(int sock, absl::string_view payload, int fd);

struct ReceivedMessage {
  std::string payload;
  UniqueFd fd;  // invalid if none was attached
};

// Receives one message sent by SendWithFd.
absl::StatusOr<ReceivedMessage> ReceiveWithFd(int sock);

absl::StatusOr<ucred> PeerCredentials(int sock);

// Whether the peer of `sock` (credentials `cred`) is in group `group`: its
// group, or one of its supplementary groups (SO_PEERGROUPS).
absl::StatusOr<bool> PeerInGroup(int sock, const ucred& cred, gid_t group);

// The id of the group named `name`; NOT_FOUND if there is none.
absl::StatusOr<gid_t> GroupNamed(const std::string& name);

// Lets group `group` use the socket at `path`: its group and mode 0660.
absl::Status ShareWithGroup(const std::string& path, gid_t group);

// Makes `path` free for a new Unix socket: ALREADY_EXISTS if a live server
// answers there, FAILED_PRECONDITION if something other than a socket is
// there (never deleted), otherwise removes a stale socket file left by a
// crash.
absl::Status ClaimSocketPath(const std::string& path);

// Creates a listening Unix stream socket at `path` readable and writable by
// the owner only, after ClaimSocketPath; `backlog` connections may wait to
// be accepted.
absl::StatusOr<UniqueFd> ListenUnixOwnerOnly(const std::string& path, int backlog = 64);

// Connects to the Unix stream socket at `path`.
absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path);

// True if something accepts connections at `path`.
bool UnixSocketIsLive(const std::string& path);

}  // namespace offload

#endif  // OFFLOADD_IPC_UNIX_SOCKET_H_
