// The node's one optimizer shared between sessions by weight.
//
// A step updates its partitions in runs (StepRunner); each run takes the
// whole optimizer pool. Where the sessions stepping at once all have one
// weight (the default: 1), their runs share the pool as they come. Where
// weights differ, runs go one at a time by weighted fair queueing: each session's virtual time
// advances by a run's elements divided by its weight, and of the sessions waiting, the one with the
// least virtual time goes next. A session that was idle, or is new, starts again at the least
// virtual time of those present (less one run), or where none is, where that least virtual time
// last got to: so idleness earns no credit (nor does coming while the others rest between their
// steps), and while a session is idle its share goes to the others (nothing waits for an absent
// session). A session that stalls inside its step (pinning its next chunks) keeps its lag and
// catches up after: that is what makes the shares exact, the heavier session being the one whose
// pinning between runs costs it most (forgiving all lag beyond one run, tried 2026-11-28: the 2:1
// bench off by 9.9-10.5% against 0.3-0.9%); a long stall is paid back in a burst. Between two runs
// (pinning the next) or two steps, a session ahead keeps its turn for up to 2 ms, so that being not
// quite waiting when a run ends does not cost it its share. Two sessions of weights 2 and 1
// stepping without pause get 2:1 of the updated parameters.
//
// Thread-safe. Take() blocks; a Turn ends (lets the next run go) when
// destroyed.
#ifndef OFFLOADD_ENGINE_OPTIMIZER_SHARES_H_
#define OFFLOADD_ENGINE_OPTIMIZER_SHARES_H_

#include <chrono>
#include <cstdint>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace offload {

class OptimizerShares {
 public:
  // A session's use of the optimizer so far.
  struct Usage {
    uint64_t elems = 0;         // parameters updated
    int64_t queued_nanos = 0;   // time its runs waited for others'
    int64_t running_nanos = 0;  // time its runs held the optimizer
  };

  class Turn {
   public:
    Turn(Turn&& other) noexcept : shares_(other.shares_), session_(other.session_) {
      other.shares_ = nullptr;
    }
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;
    ~Turn();

   private:
    friend class OptimizerShares;
    Turn(OptimizerShares* shares, uint64_t session) : shares_(shares), session_(session) {}
    OptimizerShares* shares_;
    uint64_t session_;
  };

  // Waits for `session`'s turn to update `elems` parameters with weight
  // `weight` (>= 1).
  Turn Take(uint64_t session, int64_t weight, uint64_t elems) ABSL_LOCKS_EXCLUDED(mu_);
  // `session`'s step is over: unless its next Take comes within
  // kAnticipation, it is idle, and the others share the optimizer without
  // it.
  void Idle(uint64_t session) ABSL_LOCKS_EXCLUDED(mu_);
  Usage UsageOf(uint64_t session) const ABSL_LOCKS_EXCLUDED(mu_);
  // The session is gone: its accounting goes (the daemon's sessions call it
  // as they are destroyed, when no step of theirs runs; one still in a step
  // goes as that step ends).
  void Forget(uint64_t session) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Monotonic: a wall clock stepped back would stretch kept turns.
  using Clock = std::chrono::steady_clock;
  struct State {
    double virtual_time = 0;                             // elements served / weight
    double last_cost = 0;                                // of its last run
    int64_t weight = 1;                                  // at its last Take
    int waiting = 0;                                     // runs queued
    bool in_step = false;                                // from its first Take to Idle
    Clock::time_point started;                           // of the run holding the optimizer
    Clock::time_point ended = Clock::time_point::min();  // its last run's end
    bool forgotten = false;                              // its session closed mid-step
    Usage usage;
  };
  void End(uint64_t session) ABSL_LOCKS_EXCLUDED(mu_);
  // In a step, or out of one for less than kAnticipation.
  static bool Present(const State& s, Clock::time_point now);
  // The least virtual time of the sessions present (infinite if none).
  double Floor(Clock::time_point now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The largest last run of the sessions present (in virtual time).
  double LargestRun(Clock::time_point now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `session` goes now: at once where every session present has its
  // weight (runs then share the pool as they come); else once nobody holds
  // the optimizer, no waiting session is ahead of it (less virtual time;
  // ties: the lower id), and no session ahead of it ended a run less than
  // kAnticipation ago (its next run is coming; `recheck` is lowered to when
  // that runs out).
  bool Next(uint64_t session, Clock::time_point now, Clock::time_point* recheck) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static constexpr std::chrono::milliseconds kAnticipation{2};

  mutable absl::Mutex mu_;
  std::map<uint64_t, State> sessions_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;  // runs holding the optimizer
  // The least virtual time of the sessions present, as far as it got (it
  // never goes back): where a session starts that comes while none is.
  double clock_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_OPTIMIZER_SHARES_H_
