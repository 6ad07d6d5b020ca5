// The arena channel: a Unix socket (owner-only, next to the gRPC socket) on
// which a trainer trades its session id and secret token for its arena's
// memfd (SCM_RIGHTS). This is the only way a session's memory leaves the
// daemon.
//
// Checks, in order: the peer's uid (SO_PEERCRED) must be the daemon's own or
// root; the session must be open; the token must match. Any failure answers
// with an error line and no descriptor.
//
// Wire format: arena_protocol.h.
//
// The trainer keeps its connection open while it uses the session. When the
// last connection of a session closes (the trainer exited, crashed or was
// killed: the kernel closes its descriptors), the session is closed and its
// memory freed, so a dead trainer cannot hold the node's memory; or, with a
// positive `reconnect_lease`, its holds are released and the session is
// kept that long for a restarted trainer to resume (attaching again with
// the same id and token), then closed.
//
// Threading: one thread accepts connections, waits for their requests and
// watches the attached trainers, all in one poll loop: a peer that connects
// and sends nothing delays nobody (it waits among the pending connections
// until its 2 s deadline, then is closed), and at most kMaxPending wait at
// once (more are refused at once). The same loop closes the sessions whose
// trainer went away (or, with a reconnect lease, detaches them) and, about
// once a second, those nobody attached to within `attach_lease` of opening
// and (a positive `idle_lease`) those no call reached for longer than it
// (SessionManager::CloseExpired): each before any attach it answers next.
// Other threads then tear what they closed down (TeardownQueue: their
// memory, ring threads, files, final checkpoints; sessions side by side), so
// that a large session's teardown delays no attach and no other teardown.
#ifndef OFFLOADD_DAEMON_ARENA_CHANNEL_H_
#define OFFLOADD_DAEMON_ARENA_CHANNEL_H_

#include <sys/socket.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/descriptors.h"
#include "base/log.h"
#include "base/unique_fd.h"
#include "daemon/teardown_queue.h"
#include "engine/session_manager.h"

namespace offload {

class ArenaChannel {
 public:
  static absl::StatusOr<std::unique_ptr<ArenaChannel>> Start(
      const std::string& path, SessionManager* sessions,
      absl::Duration attach_lease = absl::Seconds(60),
      absl::Duration idle_lease = absl::ZeroDuration(),
      absl::Duration reconnect_lease = absl::ZeroDuration(),
      std::optional<gid_t> group = std::nullopt, int64_t max_sessions_per_user = 0);
  // Stops the thread and removes the socket file.
  ~ArenaChannel();

  const std::string& path() const { return path_; }

 private:
  ArenaChannel(std::string path, UniqueFd listener, UniqueFd stop_event, SessionManager* sessions,
               absl::Duration attach_lease, absl::Duration idle_lease,
               absl::Duration reconnect_lease, int64_t max_sessions_per_user);
  struct Attached {
    UniqueFd connection;
    uint64_t session_id;
    pid_t pid;
    uid_t uid;
  };
  // Accepted, credentials checked, its request not read yet.
  struct Pending {
    UniqueFd connection;
    ucred cred;
    std::chrono::steady_clock::time_point deadline;
  };

  void Serve();
  void ExpireSessions();
  // Hands `work` to the teardown threads, `lines` logged once it is done.
  void Later(SessionManager::Teardowns work, std::vector<std::string> lines);
  void Accept();
  // accept failed with `err` (EMFILE, ENFILE).
  void RefuseOutOfDescriptors(int err);
  // Answers the attach request `p` sent; on success returns what to keep
  // watching.
  std::optional<Attached> Answer(Pending p);
  // The trainer behind attached_[i] went away.
  void Drop(size_t i);

  const std::string path_;
  const UniqueFd listener_;
  const UniqueFd stop_event_;
  SessionManager* const sessions_;
  const absl::Duration attach_lease_;
  const absl::Duration idle_lease_;       // zero: off
  const absl::Duration reconnect_lease_;  // zero: a trainer gone is a session closed
  // Sessions a user other than offloadd's own (and root) may have attached
  // at once (a member of server.socket_group); 0: no bound.
  const int64_t max_sessions_per_user_;
  std::vector<Attached> attached_;  // only the serving thread touches these
  std::vector<Pending> pending_;
  // server.socket_group: its members may attach too (the socket is 0660).
  std::optional<gid_t> group_;
  // Out of descriptors (EMFILE): a pending connection is accepted into the
  // spare's number and refused, so that the listener does not stay readable
  // (a poll loop spinning); where even that fails, the listener is left out
  // of the poll until `accept_paused_until_`. Warned about once an interval.
  SpareDescriptor spare_;
  std::chrono::steady_clock::time_point accept_paused_until_{};
  LogLimiter accept_errors_{absl::Seconds(10)};
  // What the serving thread closed, torn down (emptied and destroyed after
  // the serving thread ended: sessions handed to it are closed first).
  std::unique_ptr<TeardownQueue> teardowns_ = std::make_unique<TeardownQueue>();
  std::thread thread_;
};

}  // namespace offload

#endif  // OFFLOADD_DAEMON_ARENA_CHANNEL_H_
