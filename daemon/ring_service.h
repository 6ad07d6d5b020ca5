// The request ring's service: the calls that come through a session's ring
// (ipc/request_ring.h), decoded into the session manager's Fetch, Release
// and ReturnGradients, with the same checks and answers as the gRPC
// service's (service.h), its twin. The engine runs each session's ring
// thread (engine/request_ring_server.h) and hands it every request through
// SessionManager::RingCalls.
//
// Nothing in a request is trusted: a dtype or flag it does not know is
// INVALID_ARGUMENT for that call, naming the value; the ring serves on.
//
// Thread-safety: Serve is called from every session's ring thread at once.
#ifndef OFFLOADD_DAEMON_RING_SERVICE_H_
#define OFFLOADD_DAEMON_RING_SERVICE_H_

#include "engine/request_ring_server.h"
#include "engine/session_manager.h"
#include "engine/stats.h"

namespace offload {

class RingService final : public SessionManager::RingCalls {
 public:
  // `sessions` and `stats` must outlive it.
  RingService(SessionManager* sessions, Stats* stats) : sessions_(sessions), stats_(stats) {}

  RingAnswer Serve(const SessionKey& key, const RingRequest& request) override;

 private:
  SessionManager* const sessions_;
  Stats* const stats_;
};

}  // namespace offload

#endif  // OFFLOADD_DAEMON_RING_SERVICE_H_
