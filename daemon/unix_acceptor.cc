#include "daemon/unix_acceptor.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/descriptors.h"
#include "base/posix_error.h"
#include "base/status_macros.h"
#include "ipc/unix_socket.h"

namespace offload {

absl::StatusOr<std::unique_ptr<UnixAcceptor>> UnixAcceptor::Start(
    UnixAcceptorOptions options, std::function<void(UniqueFd)> deliver) {
  ASSIGN_OR_RETURN(UniqueFd listener, ListenUnixOwnerOnly(options.path, /*backlog=*/1024));
  if (options.group.has_value()) RETURN_IF_ERROR(ShareWithGroup(options.path, *options.group));
  UniqueFd stop(eventfd(0, EFD_CLOEXEC));
  if (!stop.valid()) return PosixError("eventfd", errno);
  auto acceptor = std::unique_ptr<UnixAcceptor>(new UnixAcceptor(
      std::move(options), std::move(listener), std::move(stop), std::move(deliver)));
  acceptor->thread_ = std::thread([a = acceptor.get()] { a->Serve(); });
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

int64_t UnixAcceptor::ConnectionsOf(uid_t uid) { return CountLive(uid); }

int64_t UnixAcceptor::CountLive(uid_t uid) {
  absl::MutexLock lock(&mu_);
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

void UnixAcceptor::Serve() {
  std::vector<pollfd> fds;
  for (;;) {
    const Clock::time_point now = Clock::now();
    const bool accepting = now >= paused_until_;
    fds.assign({{accepting ? listener_.get() : -1, POLLIN, 0}, {stop_.get(), POLLIN, 0}});
    for (const Waiting& w : waiting_) fds.push_back({w.connection.get(), POLLIN | POLLRDHUP, 0});
    Clock::time_point wake = Clock::time_point::max();
    if (!accepting) wake = paused_until_;
    for (const Waiting& w : waiting_) wake = std::min(wake, w.deadline);
    int timeout_ms = -1;
    if (wake != Clock::time_point::max()) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count();
      timeout_ms = static_cast<int>(std::max<int64_t>(0, left) + 1);
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      LogError("gRPC acceptor: %s", PosixError("poll", errno).ToString());
      return;
    }
    if (fds[1].revents != 0) return;
    // Waiting connections: delivered once their peer said something (its
    // HTTP/2 preface; a hang-up goes too, gRPC reads the end), closed past
    // their deadline. Back to front, so that erasing keeps the indices of
    // those not yet seen.
    const Clock::time_point after = Clock::now();
    for (size_t i = waiting_.size(); i-- > 0;) {
      const bool ready = fds[2 + i].revents != 0;
      if (!ready && waiting_[i].deadline > after) continue;
      Waiting w = std::move(waiting_[i]);
      waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
      if (!ready) {
        timed_out_.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      char first;
      const ssize_t got = recv(w.connection.get(), &first, 1, MSG_PEEK | MSG_DONTWAIT);
      if (got > 0) Deliver(std::move(w));  // (else it hung up first: closed)
    }
    if (fds[0].revents != 0) Accept();
  }
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
    if (int64_t held = errors_.Admit(absl::Now()); held >= 0) {
      LogWarning("gRPC acceptor: %s; accepting again in 100 ms%s",
                 PosixError("accept", err).message(), LogLimiter::Held(held));
    }
    return;
  }
  absl::StatusOr<ucred> cred = PeerCredentials(conn.get());
  if (!cred.ok()) return;  // the peer is gone
  const bool owner = cred->uid == self_ || cred->uid == 0;
  auto refuse = [&](const std::string& why) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    if (int64_t held = errors_.Admit(absl::Now()); held >= 0) {
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
    // Descriptors short: the rest are offloadd's own user's. (The kernel
    // hands out the lowest free number: every one below this is open.)
    rlimit limit{};
    getrlimit(RLIMIT_NOFILE, &limit);
    const int64_t max = static_cast<int64_t>(limit.rlim_cur);
    const int64_t at = conn.get();
    const bool short_of_descriptors =
        at + options_.reserved_descriptors >= max ||
        (2 * at >= max && CountDescriptors().free() < options_.reserved_descriptors);
    if (short_of_descriptors) {
      return refuse(absl::StrCat("fewer than server.reserved_descriptors (",
                                 options_.reserved_descriptors,
                                 ") free, kept for offloadd's own user"));
    }
    if (options_.max_connections_per_user > 0) {
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
    // The oldest waiting one goes (a flood of silent connections must not
    // keep new ones out).
    waiting_.erase(waiting_.begin());
    timed_out_.fetch_add(1, std::memory_order_relaxed);
  }
  waiting_.push_back(Waiting{std::move(conn), cred->uid,
                             Clock::now() + absl::ToChronoNanoseconds(options_.handshake_timeout)});
}

void UnixAcceptor::Deliver(Waiting w) {
  struct stat st;
  if (fstat(w.connection.get(), &st) != 0) return;
  {
    absl::MutexLock lock(&mu_);
    delivered_.push_back(Delivered{w.connection.get(), st.st_ino, w.uid});
  }
  deliver_(std::move(w.connection));
}

}  // namespace offload
