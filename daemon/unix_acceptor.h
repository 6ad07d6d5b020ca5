// The daemon's gRPC Unix socket, accepted by offloadd rather than by gRPC:
// each connection's peer is known (SO_PEERCRED) before gRPC sees a byte of
// it, so that
//   - a user other than offloadd's own and root (a member of
//     server.socket_group) holds at most `max_connections_per_user`
//     connections at once; past it a new one is closed at once;
//   - when fewer than `reserved_descriptors` descriptors are free, only
//     offloadd's own user (and root) gets in: the operator's control calls
//     keep their way in;
//   - out of descriptors (EMFILE), accepting pauses and resumes by itself
//     (gRPC 1.51's own accept loop gives a listener up for good: grpc#20418);
//   - a connection whose peer has not sent HTTP/2's client preface within
//     `handshake_timeout` is closed, and one that sends anything else at
//     once (gRPC's handshake timeout does not apply to connections it is
//     handed).
// A connection whose peer sent the preface goes to `deliver` (GrpcServer:
// grpc::AddInsecureChannelFromFd), which owns it from then on. The acceptor
// remembers which user each delivered connection of a bounded user belongs
// to and which socket it is (its inode), so that one gRPC has closed since
// no longer counts.
//
// Thread-safety: one thread of its own runs the accept loop; `deliver` is
// called on it.
#ifndef OFFLOADD_DAEMON_UNIX_ACCEPTOR_H_
#define OFFLOADD_DAEMON_UNIX_ACCEPTOR_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/log.h"
#include "base/unique_fd.h"

namespace offload {

// What the gRPC listeners did with connections, for the daemon's counters
// (offloadctl stats, Prometheus): the Unix socket's connections, which
// offloadd accepts itself, and the rebuilds of TCP's listener (whose
// connections gRPC accepts). Owned by whoever starts the listeners (the
// daemon), outliving them; counted on the listeners' threads. Connections
// still waiting when offloadd stops are in none of them.
struct ConnectionCounters {
  std::atomic<int64_t> accepted{0};  // handed to gRPC
  // Closed at once, unserved: a user neither offloadd's nor its group's,
  // the descriptors kept for offloadd's own user, a user's bound, a full
  // queue.
  std::atomic<int64_t> refused{0};
  // Closed before gRPC saw them: something other than HTTP/2 sent, hung up
  // (before its credentials were read too), nothing within the handshake
  // timeout, or pushed out of a full queue.
  std::atomic<int64_t> dropped{0};
  std::atomic<int64_t> accept_pauses{0};      // accept failed (EMFILE...): paused 100 ms
  std::atomic<int64_t> listener_rebuilds{0};  // TCP's gRPC listener built anew
};

struct UnixAcceptorOptions {
  std::string path;            // created owner-only (0600), or 0660 for `group`
  std::optional<gid_t> group;  // its members may connect too
  absl::Duration handshake_timeout = absl::Seconds(10);
  int64_t max_connections_per_user = 0;  // 0: no bound
  int64_t reserved_descriptors = 64;
  int max_pending = 256;                   // connections waiting for their first bytes
  ConnectionCounters* counters = nullptr;  // outlives the acceptor; null: not counted
};

class UnixAcceptor {
 public:
  static absl::StatusOr<std::unique_ptr<UnixAcceptor>> Start(
      UnixAcceptorOptions options, std::function<void(UniqueFd connection)> deliver);
  // Stops the thread and closes the waiting connections (not the delivered
  // ones, which are gRPC's).
  ~UnixAcceptor();
  UnixAcceptor(const UnixAcceptor&) = delete;
  UnixAcceptor& operator=(const UnixAcceptor&) = delete;

 private:
  using Clock = std::chrono::steady_clock;
  struct Waiting {
    UniqueFd connection;
    uid_t uid;
    Clock::time_point deadline;
    bool partial = false;  // part of the preface came: looked at again on a tick
  };
  struct Delivered {
    int fd;       // gRPC's now: only looked at (fstat), never closed here
    ino_t inode;  // the socket's: another file on the same number is not it
    uid_t uid;
  };

  UnixAcceptor(UnixAcceptorOptions options, UniqueFd listener, UniqueFd stop,
               std::function<void(UniqueFd)> deliver);
  void Serve();
  void Accept();
  // Whether `w`'s peer sent the whole preface (then it is delivered),
  // something else or hung up (closed), or part of it (waits on).
  enum class Preface { kWhole, kPartial, kBad };
  Preface Peek(const Waiting& w) const;
  void Deliver(Waiting w);
  // Whether the connection of `uid` just accepted as descriptor number
  // `at` would leave fewer than reserved_descriptors free.
  bool ShortOfDescriptors(int at);
  bool Bounded(uid_t uid) const {
    return uid != self_ && uid != 0 && options_.max_connections_per_user > 0;
  }
  // Drops what gRPC closed since; then the live ones of `uid`.
  int64_t CountLive(uid_t uid);
  void Count(std::atomic<int64_t> ConnectionCounters::*counter) {
    if (options_.counters != nullptr) {
      (options_.counters->*counter).fetch_add(1, std::memory_order_relaxed);
    }
  }

  const UnixAcceptorOptions options_;
  const UniqueFd listener_;
  const UniqueFd stop_;
  const std::function<void(UniqueFd)> deliver_;
  const uid_t self_;
  // Only the serving thread touches these.
  std::vector<Waiting> waiting_;
  std::vector<Delivered> delivered_;
  Clock::time_point paused_until_{};
  Clock::time_point descriptors_counted_{};
  int64_t free_descriptors_ = 0;  // as counted then
  LogLimiter accept_errors_{absl::Seconds(10)}, refusals_{absl::Seconds(10)};
  std::thread thread_;
};

}  // namespace offload

#endif  // OFFLOADD_DAEMON_UNIX_ACCEPTOR_H_
