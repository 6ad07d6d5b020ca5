#include "engine/arena_channel.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/arena_protocol.h"
#include "engine/fd_passing.h"
#include "engine/log.h"
#include "engine/posix_error.h"
#include "engine/status_macros.h"

namespace offload {
namespace {

constexpr int kReceiveTimeoutMs = 2000;

void SetReceiveTimeout(int fd, int ms) {
  timeval tv{ms / 1000, (ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ArenaChannel>> ArenaChannel::Start(const std::string& path,
                                                                  SessionManager* sessions) {
  ASSIGN_OR_RETURN(UniqueFd listener, ListenUnixOwnerOnly(path));
  UniqueFd stop(eventfd(0, EFD_CLOEXEC));
  if (!stop.valid()) return PosixError("eventfd", errno);
  auto channel = std::unique_ptr<ArenaChannel>(
      new ArenaChannel(path, std::move(listener), std::move(stop), sessions));
  channel->thread_ = std::thread([c = channel.get()] { c->Serve(); });
  return channel;
}

ArenaChannel::ArenaChannel(std::string path, UniqueFd listener, UniqueFd stop_event,
                           SessionManager* sessions)
    : path_(std::move(path)), listener_(std::move(listener)), stop_event_(std::move(stop_event)),
      sessions_(sessions) {}

ArenaChannel::~ArenaChannel() {
  uint64_t one = 1;
  ssize_t unused = write(stop_event_.get(), &one, sizeof(one));
  (void)unused;
  if (thread_.joinable()) thread_.join();
  unlink(path_.c_str());
}

void ArenaChannel::Serve() {
  for (;;) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {stop_event_.get(), POLLIN, 0}};
    int n = poll(fds, 2, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      LogError("arena channel poll failed: %s", PosixError("poll", errno).ToString());
      return;
    }
    if (fds[1].revents != 0) return;
    if (fds[0].revents == 0) continue;
    UniqueFd conn(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!conn.valid()) {
      if (errno != EINTR && errno != ECONNABORTED && errno != EAGAIN) {
        LogWarning("arena channel: %s", PosixError("accept", errno).ToString());
      }
      continue;
    }
    Answer(conn.get());
  }
}

void ArenaChannel::Answer(int conn) {
  SetReceiveTimeout(conn, kReceiveTimeoutMs);
  auto reply_error = [conn](const absl::Status& status) {
    // The peer may be gone; there is nobody else to tell.
    SendWithFd(conn, FormatAttachError(status), -1).IgnoreError();
  };
  absl::StatusOr<ucred> cred = PeerCredentials(conn);
  if (!cred.ok()) return reply_error(cred.status());
  if (cred->uid != geteuid() && cred->uid != 0) {
    return reply_error(absl::PermissionDeniedError(absl::StrCat(
        "uid ", cred->uid, " may not attach to sessions of a daemon running as uid ",
        geteuid())));
  }
  absl::StatusOr<ReceivedMessage> request = ReceiveWithFd(conn);
  if (!request.ok()) return;  // timed out or hung up: nobody to answer
  absl::StatusOr<AttachRequest> attach =
      ParseAttachRequest(request->payload, SessionManager::kTokenBytes);
  if (!attach.ok()) return reply_error(attach.status());
  absl::StatusOr<UniqueFd> fd =
      sessions_->DupArenaFd(SessionKey{attach->session_id, attach->token});
  if (!fd.ok()) return reply_error(fd.status());
  absl::Status sent = SendWithFd(conn, "OK", fd->get());
  if (!sent.ok()) LogWarning("arena channel: answering pid %d: %s", cred->pid, sent.ToString());
}

}  // namespace offload
