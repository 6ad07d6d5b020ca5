#include "engine/arena_channel.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/posix_error.h"
#include "base/status_macros.h"
#include "ipc/arena_protocol.h"
#include "ipc/unix_socket.h"

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
  std::vector<pollfd> fds;
  for (;;) {
    fds.assign({{listener_.get(), POLLIN, 0}, {stop_event_.get(), POLLIN, 0}});
    for (const Attached& a : attached_) fds.push_back({a.connection.get(), POLLIN | POLLRDHUP, 0});
    int n = poll(fds.data(), fds.size(), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      LogError("arena channel poll failed: %s", PosixError("poll", errno).ToString());
      return;
    }
    if (fds[1].revents != 0) return;
    // Attached trainers: anything but more bytes means the peer is gone.
    for (size_t i = attached_.size(); i-- > 0;) {
      if (fds[2 + i].revents == 0) continue;
      char buf[256];
      ssize_t got = recv(attached_[i].connection.get(), buf, sizeof(buf), MSG_DONTWAIT);
      if (got > 0 || (got < 0 && (errno == EAGAIN || errno == EINTR))) continue;  // chatter
      Drop(i);
    }
    if (fds[0].revents == 0) continue;
    UniqueFd conn(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!conn.valid()) {
      if (errno != EINTR && errno != ECONNABORTED && errno != EAGAIN) {
        LogWarning("arena channel: %s", PosixError("accept", errno).ToString());
      }
      continue;
    }
    if (std::optional<Attached> a = Answer(std::move(conn))) attached_.push_back(std::move(*a));
  }
}

void ArenaChannel::Drop(size_t i) {
  const uint64_t id = attached_[i].session_id;
  const pid_t pid = attached_[i].pid;
  attached_.erase(attached_.begin() + static_cast<std::ptrdiff_t>(i));
  for (const Attached& a : attached_) {
    if (a.session_id == id) return;  // another process still holds it
  }
  if (sessions_->Abandon(id)) {
    LogInfo("session %d closed: its trainer (pid %d) went away without closing it",
            static_cast<int64_t>(id), pid);
  }
}

std::optional<ArenaChannel::Attached> ArenaChannel::Answer(UniqueFd conn) {
  SetReceiveTimeout(conn.get(), kReceiveTimeoutMs);
  auto reply_error = [&conn](const absl::Status& status) -> std::optional<Attached> {
    // The peer may be gone; there is nobody else to tell.
    SendWithFd(conn.get(), FormatAttachError(status), -1).IgnoreError();
    return std::nullopt;
  };
  absl::StatusOr<ucred> cred = PeerCredentials(conn.get());
  if (!cred.ok()) return reply_error(cred.status());
  if (cred->uid != geteuid() && cred->uid != 0) {
    return reply_error(absl::PermissionDeniedError(absl::StrCat(
        "uid ", cred->uid, " may not attach to sessions of a daemon running as uid ",
        geteuid())));
  }
  absl::StatusOr<ReceivedMessage> request = ReceiveWithFd(conn.get());
  if (!request.ok()) return std::nullopt;  // timed out or hung up: nobody to answer
  absl::StatusOr<AttachRequest> attach =
      ParseAttachRequest(request->payload, SessionManager::kTokenBytes);
  if (!attach.ok()) return reply_error(attach.status());
  absl::StatusOr<UniqueFd> fd =
      sessions_->DupArenaFd(SessionKey{attach->session_id, attach->token});
  if (!fd.ok()) return reply_error(fd.status());
  absl::Status sent = SendWithFd(conn.get(), "OK", fd->get());
  if (!sent.ok()) {
    LogWarning("arena channel: answering pid %d: %s", cred->pid, sent.ToString());
    return std::nullopt;
  }
  return Attached{std::move(conn), attach->session_id, cred->pid};
}

}  // namespace offload
