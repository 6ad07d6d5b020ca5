#include "daemon/sd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/posix_error.h"
#include "base/unique_fd.h"

namespace offload {

absl::Status NotifySystemd(absl::string_view state) {
  const char* path = std::getenv("NOTIFY_SOCKET");
  if (path == nullptr || path[0] == '\0') return absl::OkStatus();
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const size_t n = std::strlen(path);
  if (n >= sizeof(addr.sun_path) || (path[0] != '/' && path[0] != '@')) {
    return absl::InvalidArgumentError(absl::StrCat("NOTIFY_SOCKET '", path, "' is not a socket"));
  }
  std::memcpy(addr.sun_path, path, n);
  if (path[0] == '@') addr.sun_path[0] = '\0';  // the abstract namespace
  UniqueFd fd(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return PosixError("socket(AF_UNIX, SOCK_DGRAM)", errno);
  const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + n);
  if (sendto(fd.get(), state.data(), state.size(), MSG_NOSIGNAL,
             reinterpret_cast<const sockaddr*>(&addr), len) < 0) {
    return PosixError(absl::StrCat("notifying systemd at ", path), errno);
  }
  return absl::OkStatus();
}

}  // namespace offload
