// Who may do what, by the listener a call came in on. The Unix socket is
// owner-only (mode 0600 in a directory only this user can write, and the
// arena channel checks SO_PEERCRED), so its callers may do everything. TCP
// is loopback-only but reachable by every user of the machine: over it,
// offloadd serves read-only status (stats, listing and reading tunables)
// unless the caller presents the token offloadd wrote to
// <data_dir>/tcp_token, readable by its own user only. With
// server.socket_group, the group's members reach the Unix socket too: they
// use sessions (each proves its own with its session token), but the
// operator's actions (node settings, other sessions by id) need the token.
//
// Thread-safety: immutable after construction; safe from any thread.
#ifndef OFFLOADD_DAEMON_ACCESS_GUARD_H_
#define OFFLOADD_DAEMON_ACCESS_GUARD_H_

#include <sys/types.h>

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace offload {

class AccessGuard {
 public:
  // `token` empty: no TCP listener and no group, nothing to guard.
  // `group_shared`: the Unix socket is a group's too (server.socket_group).
  AccessGuard(std::string token, std::string token_path, bool group_shared = false)
      : token_(std::move(token)), token_path_(std::move(token_path)), group_shared_(group_shared) {}

  // OK for a caller on the Unix socket, or one presenting the token;
  // PERMISSION_DENIED naming `what` and where the token is otherwise.
  absl::Status CheckMayChange(const grpc::ServerContext& context, absl::string_view what) const;
  // The operator's actions (changing node settings, acting on a session by
  // id without its token): OK on an owner-only Unix socket, or with the
  // token; PERMISSION_DENIED naming `what` otherwise.
  absl::Status CheckOperator(const grpc::ServerContext& context, absl::string_view what) const;
  // The caller's Unix user where it is neither offloadd's own nor root
  // (a member of server.socket_group: its sessions are bounded); unset
  // for those, and over TCP (the token holder's). Read from the call's
  // connection (SO_PEERCRED of the descriptor offloadd's acceptor handed to
  // gRPC) while the call runs. UNAVAILABLE where it cannot be read (the
  // connection closed meanwhile, its number now something else's): no
  // unbounded call for want of knowing who made it. (A number reused by
  // another connection meanwhile reads that one's user.)
  absl::StatusOr<std::optional<uid_t>> OtherUser(const grpc::ServerContext& context) const;
  // Whether the Unix socket is a group's too (others may call on it).
  bool group_shared() const { return group_shared_; }

 private:
  bool HasToken(const grpc::ServerContext& context) const;

  const std::string token_;
  const std::string token_path_;
  const bool group_shared_;
};

}  // namespace offload

#endif  // OFFLOADD_DAEMON_ACCESS_GUARD_H_
