// The request ring's service: the calls that come through a session's ring
// (ipc/request_ring.h), decoded into the session manager's Fetch, Release,
// ReturnGradients, Pending, Step and WaitStep, with the same checks and answers as
// the gRPC service's (service.h), its twin. The engine runs each session's ring
// thread (engine/request_ring_server.h) and hands it every request through
// SessionManager::RingCalls.
//
// Nothing in a request is trusted: a dtype or flag it does not know is
// INVALID_ARGUMENT for that call, naming the value; the ring serves on.
// Calls pass the daemon's CallGate as gRPC calls do: once offloadd is
// stopping, a new one is UNAVAILABLE (and did not happen), and the stop
// waits for those in flight.
//
// Thread-safety: Serve is called from every session's ring thread at once.
#ifndef OFFLOADD_DAEMON_RING_SERVICE_H_
#define OFFLOADD_DAEMON_RING_SERVICE_H_

#include "daemon/call_gate.h"
#include "engine/request_ring_server.h"
#include "engine/session_manager.h"
#include "engine/stats.h"

namespace offload {

class RingService final : public SessionManager::RingCalls {
 public:
  // `sessions`, `stats` and `gate` must outlive it.
  RingService(SessionManager* sessions, Stats* stats, CallGate* gate)
      : sessions_(sessions), stats_(stats), gate_(gate) {}

  RingAnswer Serve(const SessionKey& key, const RingRequest& request) override;

 private:
  SessionManager* const sessions_;
  Stats* const stats_;
  CallGate* const gate_;
};

}  // namespace offload

#endif  // OFFLOADD_DAEMON_RING_SERVICE_H_
