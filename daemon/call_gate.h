// Counts calls in flight so that shutdown can drain them: once Close()d, new
// calls are refused and Drain() waits for the running ones to leave.
// (gRPC's own Shutdown(deadline) also waits out its whole deadline while
// idle client channels stay connected, so the daemon drains by itself and
// then shuts gRPC down at once.) Thread-safe.
#ifndef OFFLOADD_DAEMON_CALL_GATE_H_
#define OFFLOADD_DAEMON_CALL_GATE_H_

#include <sys/types.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace offload {

class CallGate {
 public:
  // False once the gate is closed; a true Enter() must be paired with Exit().
  bool Enter() ABSL_LOCKS_EXCLUDED(mu_);
  void Exit() ABSL_LOCKS_EXCLUDED(mu_);

  // Refuses new calls from now on and waits up to `timeout` for the calls in
  // flight to finish. Returns whether they all did.
  bool CloseAndDrain(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

// Calls in flight per Unix user other than offloadd's own (members of
// server.socket_group), each at most `max_per_user` at once: one user's
// blocking calls (waits for a step, a checkpoint, a final checkpoint) must
// not take every one of gRPC's threads from the others. Thread-safe.
class UserCallLimit {
 public:
  explicit UserCallLimit(int max_per_user) : max_(max_per_user) {}
  // True if `uid` may start one more call (then Exit(uid) after it).
  bool Enter(uid_t uid) ABSL_LOCKS_EXCLUDED(mu_);
  void Exit(uid_t uid) ABSL_LOCKS_EXCLUDED(mu_);
  int max_per_user() const { return max_; }

 private:
  const int max_;
  absl::Mutex mu_;
  absl::flat_hash_map<uid_t, int> in_flight_ ABSL_GUARDED_BY(mu_);
};

// RAII: enters on construction (check entered()), exits on destruction.
class CallScope {
 public:
  explicit CallScope(CallGate* gate) : gate_(gate), entered_(gate->Enter()) {}
  ~CallScope() {
    if (entered_) gate_->Exit();
  }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;
  bool entered() const { return entered_; }

 private:
  CallGate* const gate_;
  const bool entered_;
};

}  // namespace offload

#endif  // OFFLOADD_DAEMON_CALL_GATE_H_
