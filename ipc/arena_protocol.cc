#include "ipc/arena_protocol.h"

#include <sys/socket.h>
#include <sys/time.h>

#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "ipc/unix_socket.h"

namespace offload {

std::string FormatAttachRequest(const AttachRequest& request) {
  return absl::StrCat("ATTACH ", request.session_id, " ", absl::BytesToHexString(request.token));
}

absl::StatusOr<AttachRequest> ParseAttachRequest(absl::string_view text, size_t token_bytes) {
  std::vector<absl::string_view> parts =
      absl::StrSplit(absl::StripAsciiWhitespace(text), ' ', absl::SkipEmpty());
  AttachRequest request;
  if (parts.size() != 3 || parts[0] != "ATTACH" ||
      !absl::SimpleAtoi(parts[1], &request.session_id)) {
    return absl::InvalidArgumentError("malformed attach request");
  }
  if (parts[2].size() != 2 * token_bytes) {
    return absl::InvalidArgumentError("malformed session token");
  }
  for (char c : parts[2]) {
    if (!absl::ascii_isxdigit(c)) return absl::InvalidArgumentError("malformed session token");
  }
  request.token = absl::HexStringToBytes(parts[2]);
  return request;
}

std::string FormatAttachError(const absl::Status& status) {
  return absl::StrCat("ERR ", static_cast<int>(status.code()), " ", status.message());
}

absl::StatusOr<Attachment> AttachArena(const std::string& path, const AttachRequest& request) {
  ASSIGN_OR_RETURN(UniqueFd sock, ConnectUnix(path));
  timeval tv{30, 0};  // the daemon answers at once; this only bounds a hang
  setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  const absl::Status sent = SendWithFd(sock.get(), FormatAttachRequest(request), -1);
  absl::StatusOr<ReceivedMessage> received = ReceiveWithFd(sock.get());
  if (!sent.ok()) {
    // The daemon may refuse before reading the request (the uid check at
    // accept) and close: then its answer is still there to read, and says
    // more than the broken pipe.
    if (!received.ok() || received->payload.empty()) return sent;
  }
  if (!received.ok()) return received.status();
  ReceivedMessage reply = *std::move(received);
  if (reply.payload == "OK" && reply.fd.valid()) {
    return Attachment{std::move(reply.fd), std::move(sock)};
  }
  std::vector<absl::string_view> parts = absl::StrSplit(reply.payload, absl::MaxSplits(' ', 2));
  int code;
  if (parts.size() == 3 && parts[0] == "ERR" && absl::SimpleAtoi(parts[1], &code) && code > 0 &&
      code <= 16) {
    return absl::Status(static_cast<absl::StatusCode>(code),
                        absl::StrCat("attaching to session arena: ", parts[2]));
  }
  return absl::InternalError(
      absl::StrCat("unexpected reply from arena channel ", path, ": '", reply.payload, "'"));
}

}  // namespace offload
