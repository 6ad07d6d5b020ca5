#include "base/posix_error.h"

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace offload {

absl::StatusCode ErrnoToStatusCode(int err) {
  switch (err) {
    case 0:
      return absl::StatusCode::kOk;
    case ENOENT:
    case ESRCH:
    case ENXIO:
      return absl::StatusCode::kNotFound;
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::StatusCode::kPermissionDenied;
    case ENOSPC:
    case ENOMEM:
    case EMFILE:
    case ENFILE:
    case EDQUOT:
    case EFBIG:
      return absl::StatusCode::kResourceExhausted;
    case EIO:
      return absl::StatusCode::kDataLoss;
    case EAGAIN:
    case EINTR:
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
    case ETIMEDOUT:
      return absl::StatusCode::kUnavailable;
    case EEXIST:
    case EADDRINUSE:
      return absl::StatusCode::kAlreadyExists;
    case EINVAL:
    case ENAMETOOLONG:
    case EBADF:
    case ENOTDIR:
    case EISDIR:
    case ELOOP:  // a path through a symlink loop, or one O_NOFOLLOW refused
      return absl::StatusCode::kInvalidArgument;
    case ENOSYS:
    case EOPNOTSUPP:
      return absl::StatusCode::kUnimplemented;
    default:
      return absl::StatusCode::kInternal;
  }
}

std::string ErrnoName(int err) {
  // strerrorname_np is glibc >= 2.32; bookworm has 2.36.
  const char* name = strerrorname_np(err);
  if (name != nullptr) return name;
  return absl::StrCat("errno ", err);
}

absl::Status PosixError(absl::string_view context, int err) {
  char buf[256];
  // GNU strerror_r returns the message, which may or may not live in buf.
  const char* msg = strerror_r(err, buf, sizeof(buf));
  return absl::Status(ErrnoToStatusCode(err),
                      absl::StrCat(context, ": ", msg, " (", ErrnoName(err), ")"));
}

}  // namespace offload
