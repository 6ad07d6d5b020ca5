#include "daemon/access_guard.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/secret.h"
#include "ipc/paths.h"

namespace offload {
absl::Status AccessGuard::CheckMayChange(const grpc::ServerContext& context,
                                         absl::string_view what) const {
  if (absl::StartsWith(context.peer(), "unix:")) return absl::OkStatus();
  if (!token_.empty()) {
    const auto& metadata = context.client_metadata();
    auto it = metadata.find(kTokenMetadataKey);
    if (it != metadata.end() &&
        SecretsEqual(absl::string_view(it->second.data(), it->second.size()), token_)) {
      return absl::OkStatus();
    }
  }
  return absl::PermissionDeniedError(
      absl::StrCat("over TCP offloadd serves read-only status; ", what,
                   " needs the Unix socket, or the token in ", token_path_,
                   " (readable by offloadd's user only) as OFFLOADD_TOKEN"));
}

}  // namespace offload
