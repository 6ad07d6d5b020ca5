// The arena channel's wire format, shared by the daemon (arena_channel.h)
// and the client library, and the client's half of the exchange.
//
//   request:  "ATTACH <session id> <token as lowercase hex>"
//   response: "OK" with the arena's descriptor attached (SCM_RIGHTS), or
//             "ERR <absl status code number> <message>" with none.
// After "OK" the client keeps the connection open for as long as the
// session lives and sends nothing more: when the connection closes (the
// trainer exited or crashed), the daemon closes the session and frees its
// memory.
#ifndef OFFLOADD_IPC_ARENA_PROTOCOL_H_
#define OFFLOADD_IPC_ARENA_PROTOCOL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/unique_fd.h"

namespace offload {

struct AttachRequest {
  uint64_t session_id = 0;
  std::string token;  // raw bytes
};

std::string FormatAttachRequest(const AttachRequest& request);
// INVALID_ARGUMENT for anything malformed; `token_bytes` is the exact size.
absl::StatusOr<AttachRequest> ParseAttachRequest(absl::string_view text, size_t token_bytes);
std::string FormatAttachError(const absl::Status& status);

struct Attachment {
  UniqueFd arena;       // the session's memfd
  UniqueFd connection;  // keep open while the session is in use
};

// Connects to the channel at `path`, presents the request and returns the
// arena descriptor and the connection, or the daemon's error with its
// original code.
absl::StatusOr<Attachment> AttachArena(const std::string& path, const AttachRequest& request);

}  // namespace offload

#endif  // OFFLOADD_IPC_ARENA_PROTOCOL_H_
