#include "daemon/unix_acceptor.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/descriptors.h"
#include "base/env.h"
#include "base/posix_error.h"
#include "base/status_macros.h"
#include "ipc/unix_socket.h"

namespace offload {

absl::StatusOr<std::unique_ptr<UnixAcceptor>> UnixAcceptor::Start(
    UnixAcceptorOptions options, std::function<void(UniqueFd)> deliver) {
  ASSIGN_OR_RETURN(UniqueFd listener, ListenUnixOwnerOnly(options.path, /*backlog=*/1024));
  if (options.group.has_value()) {
    if (absl::Status shared = ShareWithGroup(options.path, *options.group); !shared.ok()) {
      unlink(options.path.c_str());
      return shared;
    }
  }
  UniqueFd stop(eventfd(0, EFD_CLOEXEC));
  if (!stop.valid()) {
    const int err = errno;
    unlink(options.path.c_str());
    return PosixError("eventfd", err);
  }
  const std::string path = options.path;
  auto acceptor = std::unique_ptr<UnixAcceptor>(new UnixAcceptor(
      std::move(options), std::move(listener), std::move(stop), std::move(deliver)));
  // (No thread to be had is an error, not an abort.)
  absl::StatusOr<std::thread> thread =
      Env::Default()->StartThread([a = acceptor.get()] { a->Serve(); });
  if (!thread.ok()) {
    acceptor.reset();
    unlink(path.c_str());
    return thread.status();
  }
  acceptor->thread_ = std::move(*thread);
  return acceptor;
}

UnixAcceptor::UnixAcceptor(UnixAcceptorOptions options, UniqueFd listener, UniqueFd stop,
                           std::function<void(UniqueFd)> deliver)
    : options_(std::move(options)),
      listener_(std::move(listener)),
      stop_(std::move(stop)),
      deliver_(std::move(deliver)),
      self_(geteuid()) {}

UnixAcceptor::~UnixAcceptor() {
  const uint64_t one = 1;
  if (write(stop_.get(), &one, sizeof(one)) != sizeof(one)) {
    LogError("gRPC acceptor: %s", PosixError("waking its thread", errno).ToString());
  }
  if (thread_.joinable()) thread_.join();
}

int64_t UnixAcceptor::CountLive(uid_t uid) {
  int64_t n = 0;
  delivered_.erase(std::remove_if(delivered_.begin(), delivered_.end(),
                                  [](const Delivered& d) {
                                    struct stat st;
                                    return fstat(d.fd, &st) != 0 || !S_ISSOCK(st.st_mode) ||
                                           st.st_ino != d.inode;
                                  }),
                   delivered_.end());
  for (const Delivered& d : delivered_) n += d.uid == uid ? 1 : 0;
  return n;
}

namespace {
// What an HTTP/2 client sends first (RFC 9113, 3.4).
constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
constexpr size_t kPrefaceBytes = sizeof(kPreface) - 1;
// How often a connection that sent part of the preface is looked at again.
constexpr auto kPartialTick = std::chrono::milliseconds(20);
}  // namespace

UnixAcceptor::Preface UnixAcceptor::Peek(const Waiting& w) const {
  char got[kPrefaceBytes];
  const ssize_t n = recv(w.connection.get(), got, sizeof(got), MSG_PEEK | MSG_DONTWAIT);
  if (n < 0) return errno == EAGAIN || errno == EINTR ? Preface::kPartial : Preface::kBad;
  if (n == 0) return Preface::kBad;  // hung up
  if (std::memcmp(got, kPreface, static_cast<size_t>(n)) != 0) return Preface::kBad;
  return static_cast<size_t>(n) == kPrefaceBytes ? Preface::kWhole : Preface::kPartial;
}

void UnixAcceptor::Serve() {
  std::vector<pollfd> fds;
  for (;;) {
    const Clock::time_point now = Clock::now();
    const bool accepting = now >= paused_until_;
    fds.assign({{accepting ? listener_.get() : -1, POLLIN, 0}, {stop_.get(), POLLIN, 0}});
    Clock::time_point wake = Clock::time_point::max();
    if (!accepting) wake = paused_until_;
    for (const Waiting& w : waiting_) {
      // One that sent part of the preface stays readable: looked at on a
      // tick instead of waking every poll.
      fds.push_back({w.connection.get(),
                     static_cast<int16_t>(w.partial ? POLLRDHUP : POLLIN | POLLRDHUP), 0});
      wake = std::min(wake, w.partial ? std::min(w.deadline, now + kPartialTick) : w.deadline);
    }
    int timeout_ms = -1;
    if (wake != Clock::time_point::max()) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count();
      timeout_ms = static_cast<int>(std::max<int64_t>(0, left) + 1);
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      // (ENOMEM: try again in a moment; never give up.)
      if (int64_t held = accept_errors_.Admit(absl::Now()); held >= 0) {
        LogError("gRPC acceptor: %s%s", PosixError("poll", err).message(), LogLimiter::Held(held));
      }
      absl::SleepFor(absl::Milliseconds(100));
      continue;
    }
    if (fds[1].revents != 0) return;
    // Waiting connections: delivered once their peer sent the preface,
    // closed if it sent anything else, hung up, or is past its deadline.
    // Back to front, so that erasing keeps the indices of those not yet
    // seen.
    const Clock::time_point after = Clock::now();
    for (size_t i = waiting_.size(); i-- > 0;) {
      Waiting& w = waiting_[i];
      const int16_t revents = fds[2 + i].revents;
      const bool looked_at = revents != 0 || w.partial || w.deadline <= after;
      if (!looked_at) continue;
      Preface preface = Peek(w);
      // A peer that shut its end can never finish the preface (what it
      // sent stays queued: it would look partial for ever).
      if (preface == Preface::kPartial && (revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
        preface = Preface::kBad;
      }
      if (preface == Preface::kPartial && w.deadline > after) {
        w.partial = true;
        continue;
      }
      Waiting taken = std::move(w);
      waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
      if (preface == Preface::kWhole) {
        Deliver(std::move(taken));
      } else {
        Count(&ConnectionCounters::dropped);  // (closed)
      }
    }
    if (fds[0].revents != 0) Accept();
  }
}

bool UnixAcceptor::ShortOfDescriptors(int at) {
  rlimit limit{};
  getrlimit(RLIMIT_NOFILE, &limit);
  const int64_t max = static_cast<int64_t>(limit.rlim_cur);
  // The kernel hands out the lowest free number: every one below `at` is
  // open, so this many at least.
  if (at + options_.reserved_descriptors >= max) return true;
  // Otherwise counted (holes below may hide many open above): at most once
  // every 100 ms while far from the reserve, each admitted connection
  // taking one from the count meanwhile; every time when close to it.
  const Clock::time_point now = Clock::now();
  if (now - descriptors_counted_ >= std::chrono::milliseconds(100) ||
      free_descriptors_ < 2 * options_.reserved_descriptors) {
    free_descriptors_ = CountDescriptors().free();
    descriptors_counted_ = now;
  }
  if (free_descriptors_ < options_.reserved_descriptors) return true;
  --free_descriptors_;  // this one, admitted
  return false;
}

void UnixAcceptor::Accept() {
  UniqueFd conn(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  if (!conn.valid()) {
    const int err = errno;
    if (err == EINTR || err == ECONNABORTED || err == EAGAIN) return;
    // Out of descriptors (or anything else): the connection stays queued,
    // and accepting resumes in a moment, without spinning on a readable
    // listener.
    paused_until_ = Clock::now() + std::chrono::milliseconds(100);
    Count(&ConnectionCounters::accept_pauses);
    if (int64_t held = accept_errors_.Admit(absl::Now()); held >= 0) {
      LogWarning("gRPC acceptor: %s; accepting again in 100 ms%s",
                 PosixError("accept", err).message(), LogLimiter::Held(held));
    }
    return;
  }
  absl::StatusOr<ucred> cred = PeerCredentials(conn.get());
  if (!cred.ok()) {
    Count(&ConnectionCounters::dropped);  // the peer is gone
    return;
  }
  const bool owner = cred->uid == self_ || cred->uid == 0;
  auto refuse = [&](const std::string& why) {
    Count(&ConnectionCounters::refused);
    if (int64_t held = refusals_.Admit(absl::Now()); held >= 0) {
      LogWarning("gRPC acceptor: refused a connection of uid %d (pid %d): %s%s",
                 static_cast<int>(cred->uid), static_cast<int>(cred->pid), why,
                 LogLimiter::Held(held));
    }
  };
  if (!owner) {
    if (options_.group.has_value()) {
      absl::StatusOr<bool> member = PeerInGroup(conn.get(), *cred, *options_.group);
      if (!member.ok() || !*member) return refuse("not offloadd's user nor in its group");
    } else {
      return refuse("not offloadd's user");
    }
    // Descriptors short: the rest are offloadd's own user's.
    if (ShortOfDescriptors(conn.get())) {
      return refuse(absl::StrCat("fewer than server.reserved_descriptors (",
                                 options_.reserved_descriptors,
                                 ") free, kept for offloadd's own user"));
    }
    if (Bounded(cred->uid)) {
      int64_t waiting = 0;
      for (const Waiting& w : waiting_) waiting += w.uid == cred->uid ? 1 : 0;
      const int64_t held = CountLive(cred->uid) + waiting;
      if (held >= options_.max_connections_per_user) {
        return refuse(absl::StrCat("it has ", held,
                                   " connections, the most a user other than "
                                   "offloadd's may (server.max_connections_per_user ",
                                   options_.max_connections_per_user, ")"));
      }
    }
  }
  if (static_cast<int>(waiting_.size()) >= options_.max_pending) {
    // One waiting goes, so that a flood of silent connections does not keep
    // new ones out: the oldest of the user with the most waiting, offloadd's
    // own user's last.
    absl::flat_hash_map<uid_t, int> count;
    for (const Waiting& w : waiting_) ++count[w.uid];
    auto weight = [&](uid_t uid) {
      return (uid == self_ || uid == 0 ? 0 : 1 << 20) + count.at(uid);
    };
    uid_t most = waiting_.front().uid;
    for (const auto& [uid, n] : count) {
      if (weight(uid) > weight(most)) most = uid;
    }
    // Only offloadd's own user's wait: another user's newcomer is the one
    // that goes.
    if (!owner && weight(most) < (1 << 20)) return refuse("the queue of connections is full");
    for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
      if (it->uid == most) {
        waiting_.erase(it);
        Count(&ConnectionCounters::dropped);
        break;
      }
    }
  }
  waiting_.push_back(Waiting{std::move(conn), cred->uid,
                             Clock::now() + absl::ToChronoNanoseconds(options_.handshake_timeout)});
}

void UnixAcceptor::Deliver(Waiting w) {
  if (Bounded(w.uid)) {
    struct stat st;
    if (fstat(w.connection.get(), &st) != 0) {
      Count(&ConnectionCounters::dropped);
      return;
    }
    delivered_.push_back(Delivered{w.connection.get(), st.st_ino, w.uid});
  }
  Count(&ConnectionCounters::accepted);
  deliver_(std::move(w.connection));
}

}  // namespace offload
