#include "daemon/access_guard.h"

#include <unistd.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/secret.h"
#include "ipc/paths.h"
#include "ipc/unix_socket.h"

namespace offload {
bool AccessGuard::HasToken(const grpc::ServerContext& context) const {
  if (token_.empty()) return false;
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kTokenMetadataKey);
  return it != metadata.end() &&
         SecretsEqual(absl::string_view(it->second.data(), it->second.size()), token_);
}

namespace {
// The unix socket's connections reach gRPC from offloadd's acceptor
// (daemon/unix_acceptor: grpc::AddInsecureChannelFromFd names them "fd:N");
// TCP's are gRPC's own ("ipv4:...").
bool OverUnixSocket(const grpc::ServerContext& context) {
  const std::string peer = context.peer();
  return absl::StartsWith(peer, "fd:") || absl::StartsWith(peer, "unix:");
}
}  // namespace

absl::Status AccessGuard::CheckMayChange(const grpc::ServerContext& context,
                                         absl::string_view what) const {
  if (OverUnixSocket(context) || HasToken(context)) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("over TCP offloadd serves read-only status; ", what,
                   " needs the Unix socket, or the token in ", token_path_,
                   " (readable by offloadd's user only) as OFFLOADD_TOKEN"));
}

absl::Status AccessGuard::CheckOperator(const grpc::ServerContext& context,
                                        absl::string_view what) const {
  if (!group_shared_) return CheckMayChange(context, what);
  if (HasToken(context)) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("the socket is shared with a group (server.socket_group): ", what,
                   " is the operator's, with the token in ", token_path_,
                   " (readable by offloadd's user only) as OFFLOADD_TOKEN"));
}

absl::StatusOr<std::optional<uid_t>> AccessGuard::OtherUser(
    const grpc::ServerContext& context) const {
  const std::string peer = context.peer();
  absl::string_view number(peer);
  if (!absl::ConsumePrefix(&number, "fd:")) {
    // TCP (the token holder's), or a Unix socket gRPC accepted itself
    // (tests' own servers): not another user's.
    return std::optional<uid_t>();
  }
  int fd = -1;
  absl::StatusOr<ucred> cred = absl::UnavailableError("");
  if (absl::SimpleAtoi(number, &fd) && fd >= 0) cred = PeerCredentials(fd);
  if (!cred.ok()) {
    return absl::UnavailableError(
        absl::StrCat("offloadd could not tell which user is calling on connection ", peer,
                     " (it closed meanwhile?): ", cred.status().message(), "; try again"));
  }
  if (cred->uid == geteuid() || cred->uid == 0) return std::optional<uid_t>();
  return std::optional<uid_t>(cred->uid);
}

}  // namespace offload
