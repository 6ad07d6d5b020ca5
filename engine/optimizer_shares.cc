#include "engine/optimizer_shares.h"

#include <algorithm>
#include <limits>

#include "absl/time/clock.h"

namespace offload {

OptimizerShares::Turn::~Turn() {
  if (shares_ != nullptr) shares_->End(session_);
}

bool OptimizerShares::Present(const State& s, absl::Time now) {
  return s.in_step || s.waiting > 0 || now < s.ended + kAnticipation;
}

double OptimizerShares::Floor(absl::Time now) const {
  double least = std::numeric_limits<double>::infinity();
  for (const auto& [id, s] : sessions_) {
    if (Present(s, now)) least = std::min(least, s.virtual_time);
  }
  return least;
}

double OptimizerShares::LargestRun(absl::Time now) const {
  double largest = 0;
  for (const auto& [id, s] : sessions_) {
    if (Present(s, now)) largest = std::max(largest, s.last_cost);
  }
  return largest;
}

bool OptimizerShares::Next(uint64_t session, absl::Time now, absl::Time* recheck) const {
  const State& me = sessions_.at(session);
  // All of one weight: their runs share the pool as they come (nothing to
  // divide unequally, and no hand-over between runs to pay for).
  bool uniform = true;
  for (const auto& [id, s] : sessions_) {
    if (Present(s, now) && s.weight != me.weight) uniform = false;
  }
  if (uniform) return true;
  if (running_ > 0) return false;
  for (const auto& [id, s] : sessions_) {
    if (id == session) continue;
    const bool ahead =
        s.virtual_time < me.virtual_time || (s.virtual_time == me.virtual_time && id < session);
    if (!ahead) continue;
    if (s.waiting > 0) return false;
    // Between two of its runs (pinning the next) or two of its steps (the
    // trainer's next one coming): it keeps its turn for a moment, so that a
    // session that is never quite waiting when a run ends still gets its
    // share.
    const absl::Time until = s.ended + kAnticipation;
    if (now < until) {
      *recheck = std::min(*recheck, until);
      return false;
    }
  }
  return true;
}

OptimizerShares::Turn OptimizerShares::Take(uint64_t session, int64_t weight, uint64_t elems) {
  const absl::Time asked = absl::Now();
  const double cost =
      static_cast<double>(elems) / static_cast<double>(std::max<int64_t>(1, weight));
  absl::MutexLock lock(&mu_);
  State& me = sessions_[session];
  if (!Present(me, asked)) {
    // Back from idle: no credit for the time away, beyond the one run (the
    // largest of anyone's) by which present sessions' virtual times may
    // differ anyway.
    const double floor = Floor(asked);
    if (floor != std::numeric_limits<double>::infinity()) {
      me.virtual_time = std::max(me.virtual_time, floor - std::max(cost, LargestRun(asked)));
    }
  }
  me.in_step = true;
  me.weight = std::max<int64_t>(1, weight);
  ++me.waiting;
  for (;;) {
    const absl::Time now = absl::Now();
    absl::Time recheck = absl::InfiniteFuture();
    if (Next(session, now, &recheck)) break;
    struct Changed {
      const OptimizerShares* shares;
      uint64_t session;
      absl::Time recheck;
    } changed{this, session, recheck};
    // Woken when it may go, or when a kept turn starts that ends before
    // the deadline waited for (it then waits for that one); at the latest
    // at the deadline.
    mu_.AwaitWithDeadline(absl::Condition(
                              +[](Changed* c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                absl::Time until = absl::InfiniteFuture();
                                return c->shares->Next(c->session, absl::Now(), &until) ||
                                       until < c->recheck;
                              },
                              &changed),
                          recheck);
  }
  --me.waiting;
  ++running_;
  me.started = absl::Now();
  me.usage.queued_nanos += absl::ToInt64Nanoseconds(me.started - asked);
  me.usage.elems += elems;
  me.virtual_time += cost;
  me.last_cost = cost;
  return Turn(this, session);
}

void OptimizerShares::End(uint64_t session) {
  absl::MutexLock lock(&mu_);
  --running_;
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return;
  it->second.ended = absl::Now();
  it->second.usage.running_nanos += absl::ToInt64Nanoseconds(it->second.ended - it->second.started);
}

void OptimizerShares::Idle(uint64_t session) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session);
  if (it != sessions_.end()) it->second.in_step = false;
}

OptimizerShares::Usage OptimizerShares::UsageOf(uint64_t session) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session);
  return it == sessions_.end() ? Usage{} : it->second.usage;
}

void OptimizerShares::Forget(uint64_t session) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session);
  if (it != sessions_.end() && it->second.waiting == 0 && !it->second.in_step) {
    sessions_.erase(it);
  }
}

}  // namespace offload
