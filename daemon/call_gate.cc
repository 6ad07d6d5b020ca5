#include "daemon/call_gate.h"

namespace offload {

bool CallGate::Enter() {
  absl::MutexLock lock(&mu_);
  if (closed_) return false;
  ++in_flight_;
  return true;
}

void CallGate::Exit() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

bool UserCallLimit::Enter(uid_t uid) {
  absl::MutexLock lock(&mu_);
  int& n = in_flight_[uid];
  if (n >= max_) {
    if (n == 0) in_flight_.erase(uid);
    return false;
  }
  ++n;
  return true;
}

void UserCallLimit::Exit(uid_t uid) {
  absl::MutexLock lock(&mu_);
  auto it = in_flight_.find(uid);
  if (it != in_flight_.end() && --it->second <= 0) in_flight_.erase(it);
}

bool CallGate::CloseAndDrain(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&drained), timeout);
}

}  // namespace offload
