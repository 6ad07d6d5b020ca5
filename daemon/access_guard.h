// Who may do what, by the listener a call came in on. The Unix socket is
// owner-only (mode 0600 in a directory only this user can write, and the
// arena channel checks SO_PEERCRED), so its callers may do everything. TCP
// is loopback-only but reachable by every user of the machine: over it,
// offloadd serves read-only status (stats, listing and reading tunables)
// unless the caller presents the token offloadd wrote to
// <data_dir>/tcp_token, readable by its own user only.
//
// Thread-safety: immutable after construction; safe from any thread.
#ifndef OFFLOADD_DAEMON_ACCESS_GUARD_H_
#define OFFLOADD_DAEMON_ACCESS_GUARD_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace offload {

class AccessGuard {
 public:
  // `token` empty: no TCP listener, nothing to guard.
  AccessGuard(std::string token, std::string token_path)
      : token_(std::move(token)), token_path_(std::move(token_path)) {}

  // OK for a caller on the Unix socket, or one presenting the token;
  // PERMISSION_DENIED naming `what` and where the token is otherwise.
  absl::Status CheckMayChange(const grpc::ServerContext& context, absl::string_view what) const;

 private:
  const std::string token_;
  const std::string token_path_;
};

}  // namespace offload

#endif  // OFFLOADD_DAEMON_ACCESS_GUARD_H_
