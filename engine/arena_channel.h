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
// Threading: one thread accepts and answers connections one at a time with
// a short receive timeout, so a stalled peer delays others by at most that.
#ifndef OFFLOADD_ENGINE_ARENA_CHANNEL_H_
#define OFFLOADD_ENGINE_ARENA_CHANNEL_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "engine/session_manager.h"
#include "engine/unique_fd.h"

namespace offload {

class ArenaChannel {
 public:
  static absl::StatusOr<std::unique_ptr<ArenaChannel>> Start(const std::string& path,
                                                             SessionManager* sessions);
  // Stops the thread and removes the socket file.
  ~ArenaChannel();

  const std::string& path() const { return path_; }

 private:
  ArenaChannel(std::string path, UniqueFd listener, UniqueFd stop_event,
               SessionManager* sessions);
  void Serve();
  void Answer(int conn);

  const std::string path_;
  const UniqueFd listener_;
  const UniqueFd stop_event_;
  SessionManager* const sessions_;
  std::thread thread_;
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_ARENA_CHANNEL_H_
