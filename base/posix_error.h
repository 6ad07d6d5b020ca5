// Turns errno values into absl::Status with the operation that failed, so a
// caller sees "open /x/y.sock: Permission denied (EACCES)" rather than a bare
// code. Thread-safe (uses strerror_r).
#ifndef OFFLOADD_BASE_POSIX_ERROR_H_
#define OFFLOADD_BASE_POSIX_ERROR_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace offload {

// The status code a caller should act on for `err`: ENOENT is NOT_FOUND,
// EACCES/EPERM PERMISSION_DENIED, ENOSPC/ENOMEM/EMFILE RESOURCE_EXHAUSTED,
// EIO DATA_LOSS, EAGAIN/EINTR UNAVAILABLE, EINVAL INVALID_ARGUMENT, and so on.
absl::StatusCode ErrnoToStatusCode(int err);

// "<context>: <strerror> (<ENAME>)" with the code from ErrnoToStatusCode.
absl::Status PosixError(absl::string_view context, int err);

// The symbolic name of `err` ("EIO"), or its number if unknown.
std::string ErrnoName(int err);

}  // namespace offload

#endif  // OFFLOADD_BASE_POSIX_ERROR_H_
