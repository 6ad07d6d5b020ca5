#include "engine/optimizer_shares.h"

#include <algorithm>
#include <limits>

namespace offload {

OptimizerShares::Turn::~Turn() {
  if (shares_ != nullptr) shares_->End(session_);
}

bool OptimizerShares::Present(const State& s, Clock::time_point now) {
  return s.in_step || s.waiting > 0 || now < s.ended + kAnticipation;
}

double OptimizerShares::Floor(Clock::time_point now) const {
  double least = std::numeric_limits<double>::infinity();
  for (const auto& [id, s] : sessions_) {
    if (Present(s, now)) least = std::min(least, s.virtual_time);
  }
  return least;
}

double OptimizerShares::LargestRun(Clock::time_point now) const {
  double largest = 0;
  for (const auto& [id, s] : sessions_) {
    if (Present(s, now)) largest = std::max(largest, s.last_cost);
  }
  return largest;
}

bool OptimizerShares::Next(uint64_t session, Clock::time_point now,
                           Clock::time_point* recheck) const {
  const State& me = sessions_.at(session);
  // All of one weight: their runs share the pool as they come (nothing to
  // divide unequally, and no hand-over between runs to pay for).
  bool uniform = true;
  for (const auto& [id, s] : sessions_) {
    if (!Present(s, now) || s.weight == me.weight) continue;
    uniform = false;
    // One of another weight between its steps: gone when its moment ends
    // (then this one may run beside the runs of its own weight; nothing
    // else would wake it before the running one ends).
    if (!s.in_step && s.waiting == 0) *recheck = std::min(*recheck, s.ended + kAnticipation);
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
    const Clock::time_point until = s.ended + kAnticipation;
    if (now < until) {
      *recheck = std::min(*recheck, until);
      return false;
    }
  }
  return true;
}

OptimizerShares::Turn OptimizerShares::Take(uint64_t session, int64_t weight, uint64_t elems) {
  const Clock::time_point asked = Clock::now();
  const double cost =
      static_cast<double>(elems) / static_cast<double>(std::max<int64_t>(1, weight));
  absl::MutexLock lock(&mu_);
  State& me = sessions_[session];
  if (!Present(me, asked)) {
    // Back from idle, or new: no credit for the time away, beyond the one
    // run (the largest of anyone's) by which present sessions' virtual
    // times may differ anyway. Where nobody is present (the others between
    // their steps), from where the optimizer's virtual time got to: else a
    // newcomer would start at zero, and a session that ran alone for hours
    // would wait at every contended run until the newcomer caught up.
    const double floor = Floor(asked);
    const double level = floor != std::numeric_limits<double>::infinity() ? floor : clock_;
    me.virtual_time = std::max(me.virtual_time, level - std::max(cost, LargestRun(asked)));
  }
  me.in_step = true;
  me.weight = std::max<int64_t>(1, weight);
  ++me.waiting;
  for (;;) {
    const Clock::time_point now = Clock::now();
    Clock::time_point recheck = Clock::time_point::max();
    if (Next(session, now, &recheck)) break;
    struct Changed {
      const OptimizerShares* shares;
      uint64_t session;
      Clock::time_point recheck;
    } changed{this, session, recheck};
    // Woken when it may go, or when a kept turn starts that ends before
    // the deadline waited for (it then waits for that one); at the latest
    // at the deadline.
    const absl::Duration wait =
        recheck == Clock::time_point::max()
            ? absl::InfiniteDuration()
            : absl::FromChrono(std::chrono::duration_cast<std::chrono::nanoseconds>(recheck - now));
    mu_.AwaitWithTimeout(absl::Condition(
                             +[](Changed* c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                               Clock::time_point until = Clock::time_point::max();
                               return c->shares->Next(c->session, Clock::now(), &until) ||
                                      until < c->recheck;
                             },
                             &changed),
                         wait);
  }
  --me.waiting;
  ++running_;
  me.started = Clock::now();
  me.usage.queued_nanos +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(me.started - asked).count();
  me.usage.elems += elems;
  me.virtual_time += cost;
  me.last_cost = cost;
  clock_ = std::max(clock_, Floor(me.started));  // (`me` is present: finite)
  return Turn(this, session);
}

void OptimizerShares::End(uint64_t session) {
  absl::MutexLock lock(&mu_);
  --running_;
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return;
  it->second.ended = Clock::now();
  it->second.usage.running_nanos +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(it->second.ended - it->second.started)
          .count();
}

void OptimizerShares::Idle(uint64_t session) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return;
  it->second.in_step = false;
  if (it->second.forgotten && it->second.waiting == 0) sessions_.erase(it);
}

OptimizerShares::Usage OptimizerShares::UsageOf(uint64_t session) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session);
  return it == sessions_.end() ? Usage{} : it->second.usage;
}

void OptimizerShares::Forget(uint64_t session) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return;
  if (it->second.waiting == 0 && !it->second.in_step) {
    sessions_.erase(it);
  } else {
    it->second.forgotten = true;  // Idle erases it when its step ends
  }
}

}  // namespace offload
