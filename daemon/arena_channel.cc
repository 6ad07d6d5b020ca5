#include "daemon/arena_channel.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/host_memory.h"
#include "base/log.h"
#include "base/posix_error.h"
#include "base/status_macros.h"
#include "ipc/arena_protocol.h"
#include "ipc/unix_socket.h"

namespace offload {
namespace {

// How long an accepted connection may take to send its request.
constexpr auto kRequestDeadline = std::chrono::seconds(2);
// Connections waiting for their request at once; more are refused.
constexpr size_t kMaxPending = 256;
// Of those, one user's other than offloadd's own (and root's): a member of
// server.socket_group that opens connections and sends nothing holds at
// most these, not every slot (every other user's attach then refused).
constexpr size_t kMaxPendingPerUser = 64;
// Connections attached to one session at once (each a descriptor of
// offloadd's for as long as it stays open): a trainer attaches once, again
// after a restart; one that attached, kept the connection and asked again
// took a descriptor each time, until offloadd had none left.
constexpr size_t kMaxAttachedPerSession = 16;
// And one user's other than offloadd's own (and root's), over its sessions.
constexpr size_t kMaxAttachedPerUser = 256;
// Reading a request that poll said is there never waits long.
constexpr int kReceiveTimeoutMs = 100;

void SetReceiveTimeout(int fd, int ms) {
  timeval tv{ms / 1000, (ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ArenaChannel>> ArenaChannel::Start(
    const std::string& path, SessionManager* sessions, absl::Duration attach_lease,
    absl::Duration idle_lease, absl::Duration reconnect_lease, std::optional<gid_t> group,
    int64_t max_sessions_per_user) {
  ASSIGN_OR_RETURN(UniqueFd listener, ListenUnixOwnerOnly(path));
  // (A start that fails here leaves no socket file behind.)
  auto failed = [&path](absl::Status why) {
    unlink(path.c_str());
    return why;
  };
  if (group.has_value()) {
    if (absl::Status shared = ShareWithGroup(path, *group); !shared.ok()) return failed(shared);
  }
  UniqueFd stop(eventfd(0, EFD_CLOEXEC));
  if (!stop.valid()) return failed(PosixError("eventfd", errno));
  auto channel = std::unique_ptr<ArenaChannel>(
      new ArenaChannel(path, std::move(listener), std::move(stop), sessions, attach_lease,
                       idle_lease, reconnect_lease, max_sessions_per_user));
  channel->group_ = group;
  // (No thread to be had is an error, not an abort; the channel's
  // destructor removes the socket file.)
  ASSIGN_OR_RETURN(channel->thread_,
                   Env::Default()->StartThread([c = channel.get()] { c->Serve(); }));
  return channel;
}

ArenaChannel::ArenaChannel(std::string path, UniqueFd listener, UniqueFd stop_event,
                           SessionManager* sessions, absl::Duration attach_lease,
                           absl::Duration idle_lease, absl::Duration reconnect_lease,
                           int64_t max_sessions_per_user)
    : path_(std::move(path)),
      listener_(std::move(listener)),
      stop_event_(std::move(stop_event)),
      sessions_(sessions),
      attach_lease_(attach_lease),
      idle_lease_(idle_lease),
      reconnect_lease_(reconnect_lease),
      max_sessions_per_user_(max_sessions_per_user) {}

void ArenaChannel::ExpireSessions() {
  SessionManager::Teardowns later;
  std::vector<std::string> lines;
  for (const SessionManager::Expired& e :
       sessions_->CloseExpired(std::chrono::steady_clock::now(), attach_lease_, idle_lease_,
                               reconnect_lease_, &later)) {
    if (e.why == SessionManager::Expired::kNeverAttached) {
      lines.push_back(
          absl::StrFormat("session %d closed: no trainer attached to it within %s of opening",
                          static_cast<int64_t>(e.id), absl::FormatDuration(attach_lease_)));
    } else if (e.why == SessionManager::Expired::kNotResumed) {
      lines.push_back(
          absl::StrFormat("session %d closed: its trainer went away and none resumed it within %s",
                          static_cast<int64_t>(e.id), absl::FormatDuration(reconnect_lease_)));
    } else {
      lines.push_back(absl::StrFormat("session %d closed: no call for %s (its trainer hung?)",
                                      static_cast<int64_t>(e.id),
                                      absl::FormatDuration(idle_lease_)));
    }
  }
  if (!lines.empty()) Later(std::move(later), std::move(lines));
}

void ArenaChannel::Later(SessionManager::Teardowns work, std::vector<std::string> lines) {
  teardowns_->Add(std::move(work), std::move(lines));
}

ArenaChannel::~ArenaChannel() {
  uint64_t one = 1;
  ssize_t unused = write(stop_event_.get(), &one, sizeof(one));
  (void)unused;
  if (thread_.joinable()) thread_.join();
  teardowns_.reset();  // (sessions handed to it are closed first)
  unlink(path_.c_str());
}

void ArenaChannel::Serve() {
  std::vector<pollfd> fds;
  constexpr auto kSweepEvery = std::chrono::seconds(1);
  constexpr auto kHeapLookEvery = std::chrono::seconds(10);
  auto next_sweep = std::chrono::steady_clock::now() + kSweepEvery;
  auto next_heap_look = next_sweep;
  for (;;) {
    const bool accepting = std::chrono::steady_clock::now() >= accept_paused_until_;
    fds.assign({{accepting ? listener_.get() : -1, POLLIN, 0}, {stop_event_.get(), POLLIN, 0}});
    for (const Attached& a : attached_) fds.push_back({a.connection.get(), POLLIN | POLLRDHUP, 0});
    for (const Pending& p : pending_) fds.push_back({p.connection.get(), POLLIN | POLLRDHUP, 0});
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_sweep) {
      ExpireSessions();
      // What closed sessions left on the heap; every 10 s, what anything
      // else left (a burst of gRPC streams) once it is 32 MiB or more.
      if (!TrimHeapIfRequested() && now >= next_heap_look) {
        TrimHeapIfHoarding(uint64_t{32} << 20);
        next_heap_look = now + kHeapLookEvery;
      }
      next_sweep = now + kSweepEvery;
    }
    int timeout_ms = -1;
    auto until = [&](std::chrono::steady_clock::time_point t) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(t - now).count();
      const int ms = static_cast<int>(std::max<int64_t>(0, left) + 1);
      if (timeout_ms < 0 || ms < timeout_ms) timeout_ms = ms;
    };
    until(next_sweep);
    if (!accepting) until(accept_paused_until_);
    for (const Pending& p : pending_) until(p.deadline);
    int n = poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      LogError("arena channel poll failed: %s", PosixError("poll", errno).ToString());
      return;
    }
    if (fds[1].revents != 0) return;
    const size_t first_pending = 2 + attached_.size();
    // Attached trainers first: anything but more bytes means the peer is
    // gone. (Before the attaches below: a restarted trainer attaching in
    // the same round as its predecessor's hang-up finds the session
    // detached and its request ring reset, not the other way round.)
    // Back to front, so that dropping keeps the indices of those not seen.
    for (size_t i = first_pending - 2; i-- > 0;) {
      if (fds[2 + i].revents == 0) continue;
      char buf[256];
      ssize_t got = recv(attached_[i].connection.get(), buf, sizeof(buf), MSG_DONTWAIT);
      if (got > 0 || (got < 0 && (errno == EAGAIN || errno == EINTR))) continue;  // chatter
      Drop(i);
    }
    // Pending connections: answer the ones whose request (or hang-up)
    // arrived, close the ones past their deadline. Back to front, so that
    // erasing keeps the indices of those not yet seen.
    const auto after = std::chrono::steady_clock::now();
    for (size_t i = pending_.size(); i-- > 0;) {
      const bool ready = fds[first_pending + i].revents != 0;
      if (!ready && pending_[i].deadline > after) continue;
      Pending p = std::move(pending_[i]);
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
      if (!ready) continue;  // silent past its deadline: closed
      if (std::optional<Attached> a = Answer(std::move(p))) attached_.push_back(std::move(*a));
    }
    if (fds[0].revents != 0) Accept();
  }
}

void ArenaChannel::Accept() {
  UniqueFd conn(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
  if (!conn.valid()) {
    const int err = errno;
    if (err == EINTR || err == ECONNABORTED || err == EAGAIN) return;
    if (err == EMFILE || err == ENFILE) return RefuseOutOfDescriptors(err);
    if (int64_t held = accept_errors_.Admit(absl::Now()); held >= 0) {
      LogWarning("arena channel: %s%s", PosixError("accept", err).ToString(),
                 LogLimiter::Held(held));
    }
    return;
  }
  auto refuse = [&conn](const absl::Status& status) {
    // The peer may be gone; there is nobody else to tell.
    SendWithFd(conn.get(), FormatAttachError(status), -1).IgnoreError();
  };
  absl::StatusOr<ucred> cred = PeerCredentials(conn.get());
  if (!cred.ok()) return refuse(cred.status());
  if (cred->uid != geteuid() && cred->uid != 0) {
    absl::StatusOr<bool> member =
        group_.has_value() ? PeerInGroup(conn.get(), *cred, *group_) : false;
    if (!member.ok()) return refuse(member.status());
    if (!*member) {
      return refuse(absl::PermissionDeniedError(absl::StrCat(
          "uid ", cred->uid, " may not attach to sessions of a daemon running as uid ", geteuid(),
          group_.has_value() ? absl::StrCat(" (nor is it in group ", *group_, ")") : "")));
    }
  }
  if (pending_.size() >= kMaxPending) {
    return refuse(absl::UnavailableError(
        absl::StrCat(kMaxPending, " connections are already waiting to attach; retry")));
  }
  if (cred->uid != geteuid() && cred->uid != 0) {
    const size_t mine = std::count_if(pending_.begin(), pending_.end(),
                                      [&](const Pending& p) { return p.cred.uid == cred->uid; });
    if (mine >= kMaxPendingPerUser) {
      return refuse(absl::UnavailableError(absl::StrCat(
          "uid ", cred->uid, " has ", mine, " connections waiting to attach already (at most ",
          kMaxPendingPerUser, " a user): send their requests, or retry")));
    }
  }
  SetReceiveTimeout(conn.get(), kReceiveTimeoutMs);
  pending_.push_back(
      Pending{std::move(conn), *cred, std::chrono::steady_clock::now() + kRequestDeadline});
}

void ArenaChannel::RefuseOutOfDescriptors(int err) {
  const DescriptorUse use = CountDescriptors();
  const absl::Status why = absl::ResourceExhaustedError(
      absl::StrCat("offloadd is out of file descriptors (", PosixError("accept", err).message(),
                   "; ", use.open, " open, limit ", use.limit,
                   "): close sessions, or raise its limit (LimitNOFILE=, ulimit -n); retry"));
  // The waiting connections, each into the spare's number and refused.
  int refused = 0;
  for (; refused < 64; ++refused) {
    pollfd waiting{listener_.get(), POLLIN, 0};
    if (poll(&waiting, 1, 0) != 1) break;  // (accept would wait for the next one)
    const bool taken = spare_.WithSpare([&] {
      UniqueFd c(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!c.valid()) return false;
      SendWithFd(c.get(), FormatAttachError(why), -1).IgnoreError();
      return true;
    });
    if (!taken) break;
  }
  if (refused == 0 || !spare_.held()) {
    // Not even the spare's number: the listener waits a moment (no spin).
    accept_paused_until_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  }
  if (int64_t held = accept_errors_.Admit(absl::Now()); held >= 0) {
    LogWarning("arena channel: %s; refused %d attach(es)%s", why.message(), refused,
               LogLimiter::Held(held));
  }
}

void ArenaChannel::Drop(size_t i) {
  const uint64_t id = attached_[i].session_id;
  const pid_t pid = attached_[i].pid;
  attached_.erase(attached_.begin() + static_cast<std::ptrdiff_t>(i));
  for (const Attached& a : attached_) {
    if (a.session_id == id) return;  // another process still holds it
  }
  if (reconnect_lease_ > absl::ZeroDuration()) {
    if (sessions_->Detach(id)) {
      LogInfo(
          "session %d: its trainer (pid %d) went away without closing it; its holds are "
          "released and it is kept %s for a restarted trainer to resume",
          static_cast<int64_t>(id), pid, absl::FormatDuration(reconnect_lease_));
    }
    return;
  }
  // Closed here (before any attach answered next); torn down on the
  // teardown thread, so that a large session's teardown delays no attach.
  SessionManager::Teardowns later;
  if (sessions_->Abandon(id, &later)) {
    Later(std::move(later),
          {absl::StrFormat("session %d closed: its trainer (pid %d) went away without closing it",
                           static_cast<int64_t>(id), pid)});
  }
}

std::optional<ArenaChannel::Attached> ArenaChannel::Answer(Pending p) {
  const int conn = p.connection.get();
  auto reply_error = [conn](const absl::Status& status) -> std::optional<Attached> {
    // The peer may be gone; there is nobody else to tell.
    SendWithFd(conn, FormatAttachError(status), -1).IgnoreError();
    return std::nullopt;
  };
  absl::StatusOr<ReceivedMessage> request = ReceiveWithFd(conn);
  if (!request.ok()) {
    // Hung up: nobody to answer. Descriptors sent along: refused, closed.
    if (absl::IsInvalidArgument(request.status())) return reply_error(request.status());
    return std::nullopt;
  }
  absl::StatusOr<AttachRequest> attach =
      ParseAttachRequest(request->payload, SessionManager::kTokenBytes);
  if (!attach.ok()) return reply_error(attach.status());
  const uid_t uid = p.cred.uid;
  // Another user's (a member of the socket's group) is bounded by sessions
  // (they hold memory, a ring thread and descriptors of the node's; several
  // processes attached to one count once) and by connections; any trainer's
  // by its session's connections (each a descriptor of offloadd's).
  const bool other_user = uid != geteuid() && uid != 0;
  size_t attachments = 0, mine = 0;
  absl::flat_hash_set<uint64_t> held;  // the user's other sessions
  for (const Attached& a : attached_) {
    if (a.session_id == attach->session_id) ++attachments;
    if (other_user && a.uid == uid) {
      ++mine;
      if (a.session_id != attach->session_id) held.insert(a.session_id);
    }
  }
  if (other_user && max_sessions_per_user_ > 0) {
    if (static_cast<int64_t>(held.size()) >= max_sessions_per_user_) {
      // The session it asked for is closed if it is new (unattached, it
      // would only wait for its attach lease); one resumed or kept across
      // a restart stays for a later attach. Torn down off this thread.
      SessionManager::Teardowns later;
      const bool closed =
          sessions_->CloseNeverAttached(SessionKey{attach->session_id, attach->token}, &later);
      if (closed) Later(std::move(later), {});
      return reply_error(absl::ResourceExhaustedError(absl::StrCat(
          "uid ", uid, " has ", held.size(),
          " sessions attached, the most a user other than offloadd's may "
          "(server.max_sessions_per_user ",
          max_sessions_per_user_,
          "): close sessions that are done, or ask the operator to raise it",
          closed ? absl::StrCat("; session ", attach->session_id, " is closed") : "")));
    }
  }
  if (other_user && mine >= kMaxAttachedPerUser) {
    return reply_error(absl::ResourceExhaustedError(
        absl::StrCat("uid ", uid, " has ", mine, " connections attached already (at most ",
                     kMaxAttachedPerUser, " a user): close those of sessions that are done")));
  }
  if (attachments >= kMaxAttachedPerSession) {
    return reply_error(absl::ResourceExhaustedError(
        absl::StrCat("session ", attach->session_id, " has ", attachments,
                     " connections attached already (at most ", kMaxAttachedPerSession,
                     "): a trainer attaches once; close the connections of earlier attaches")));
  }
  absl::StatusOr<UniqueFd> fd =
      sessions_->DupArenaFd(SessionKey{attach->session_id, attach->token});
  if (!fd.ok()) return reply_error(fd.status());
  absl::Status sent = SendWithFd(conn, "OK", fd->get());
  if (!sent.ok()) {
    LogWarning("arena channel: answering pid %d: %s", p.cred.pid, sent.ToString());
    return std::nullopt;
  }
  // Only now, on this thread (which also runs the expiry sweep): a trainer
  // that died before the reply never attached.
  if (!sessions_->MarkAttached(attach->session_id)) return std::nullopt;
  return Attached{std::move(p.connection), attach->session_id, p.cred.pid, uid};
}

}  // namespace offload
