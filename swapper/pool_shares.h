// Which traces are at work, and how far each is ahead of its share of the
// host pool's traffic: what the swapper's eviction asks before Belady's
// distances, which count each trace's own uses and so say little between
// traces.
//
// Idle: a trace none of whose blocks was acquired for kIdleAfter, or for two
// of its iterations where those are longer (an iteration: from its first
// Acquire after an EndIteration to the next EndIteration, so that a pause
// between iterations does not lengthen it). The caller also checks that the
// trace holds and waits for no block: a slow swap-in is not a rest.
//
// Shares: each trace counts the bytes of NVMe-homed blocks it acquired over
// its weight (`served`, as a fair queue's virtual time). An Acquire of the
// iteration's work (Swapper::Use: in the learned order, or measuring
// gradients in the background) counts its block once a pass (an
// iteration: to its EndIteration; where none comes, a second, or eight of
// its iterations, of use without a rest): a block acquired again within an
// iteration (a fetch's hold and the step's, forward and backward) is the
// same state worked on, so the shares count the state each trace works
// through, as its updates do (its state on NVMe: a trace with more of it on
// the host is charged less), not how often it is touched, nor re-reads after
// an eviction. Acquires beside the iteration's work (a checkpoint's reads)
// count each time. The traces using the pool are those that acquired one within their
// idle time; one more than Slack() ahead of the least served of them is
// ahead, and gives room first, the farthest ahead first. A trace whose
// blocks all fit counts too, so it may hold the floor low and make every
// other ahead (then the farthest ahead gives first, and their weights still
// tell them apart); counting only the traces that read from NVMe lately let
// one that came to fit stop giving room (the other got a tenth of the
// updates in benches/shares). A trace back from a rest (or new) starts at
// least at the least of the others' that compete for room (brought a block
// into the pool within their idle time), else of all using the pool, else
// (all the others resting) where that least last got to: no credit for the
// time away (nor for coming while the others rest), and none from one that
// holds the least low without competing (slow, and its blocks fit). A lead
// built while others use the pool is not forgiven (a burst, such as a
// checkpoint's reads through the pool, is paid for in room until the
// others catch up): capping it let the heavier of two sessions
// keep what it took beyond its share (benches/shares: off by 21-25% with a
// cap of four slacks). Where the traces want more than the pool holds, its
// traffic, and so the updates it serves, goes by weight.
//
// Turns: where two or more traces at work at once (holding or waiting for
// blocks) want more room than they hold (each waited for a read of its
// blocks, or had one evicted, within its idle time), sharing the room lets
// each keep only part of its state, so every trace streams from NVMe and
// the node runs at the disk's pace; worse, a trace whose state nearly fits
// takes back what it gives (it steps faster than a block is written out)
// and keeps the room (benches/shares on 16 cores: the other got 0.5% of the
// updates). So the pool goes to one of them at a time: the turn's holder
// (Turn) takes room from the others before its own (their blocks are the
// victims first, to anyone). A turn lasts the longer of kMinTurn and
// kTurnSwitches times the switch (from its start to the end of the
// holder's first iteration begun in it, which brought its state in), or
// kUnmeasuredTurn where none ends, or until the holder rests (holds and
// waits for nothing, begins no Acquire, for kMinTurn; a holder gone idle,
// so for its idle time, ends its turn unjudged); then it goes to the
// least served of the traces at work (the traffic's shares, below, decide
// who is owed, and so the weights; the same holder again if it still is).
// A turn pays where its holder got through two iterations more than each
// other trace at work; one that did not (the ranks of one job stepping
// together: the holder waits for the others at every step) moved state to
// and fro for nothing: no turns then for four times its length, at least
// 2 s, twice that after each such turn in a row, at most a minute. Where
// only one trace is at work at a time (trainers stepping while the others
// compute), there are no turns, and a turn lapses when nobody competes for
// kMinTurn (judged; found over a second late, unjudged).
//
// Times are given (the swapper's clock; tests use their own); not
// thread-safe: the owner locks.
#ifndef OFFLOADD_SWAPPER_POOL_SHARES_H_
#define OFFLOADD_SWAPPER_POOL_SHARES_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"

namespace offload {

class PoolShares {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::seconds kIdleAfter{1};
  // In bytes over weight: more than this far ahead (or than two of the
  // largest blocks served, where that is more) is ahead (Slack()).
  static constexpr double kShareSlack = 32.0 * (1 << 20);
  // Turns (see the top).
  static constexpr std::chrono::milliseconds kMinTurn{200};
  static constexpr int kTurnSwitches = 3;
  static constexpr std::chrono::seconds kUnmeasuredTurn{10};
  static constexpr std::chrono::seconds kNoTurnsAfterAnIdleOne{2};
  static constexpr uint64_t kNone = std::numeric_limits<uint64_t>::max();

  // The trace got a block at `now`: at work, its iteration not begun.
  void Added(uint64_t trace, Clock::time_point now) { Used(trace, traces_[trace], now); }

  // The trace is at work at `now` (an Acquire begun).
  void Touched(uint64_t trace, Clock::time_point now) {
    Trace& t = traces_[trace];
    Used(trace, t, now);
    if (!t.iteration_start.has_value()) t.iteration_start = now;
  }

  // An Acquire of the iteration's work, of the trace's NVMe-homed block of
  // `bytes`, succeeded at `now`: counted once a pass (Served), however often
  // the block is acquired in it. `*block_pass` is the block's own record of the pass it
  // was last counted in (the caller keeps it with the block; 0 at first).
  void ServedInPass(uint64_t trace, uint64_t* block_pass, uint64_t bytes, Clock::time_point now) {
    Trace& t = traces_[trace];
    // A pass ends at EndIteration, and after a rest (then Served looks for
    // the others' level). Where no EndIteration comes (a trace that fetches
    // and never steps, or stopped stepping), after a second or eight of its
    // iterations, timed from its iteration's first Acquire (a pause between
    // iterations is not part of one).
    Clock::time_point since = t.pass_start;
    if (t.iteration_start.has_value()) since = std::max(since, *t.iteration_start);
    // (Pass 0 is none: a trace whose first use was counted each time, by
    // Served, has not begun one.)
    if (t.pass == 0 || !UsesPool(t, now) ||
        now - since > std::max<Clock::duration>(kIdleAfter, 8 * t.iteration)) {
      NewPass(t, now);
    }
    if (*block_pass == t.pass) {
      Used(trace, t, now);
      t.last_pool_use = now;
      return;
    }
    *block_pass = t.pass;
    Served(trace, bytes, now);
  }

  // An Acquire of `bytes` of the trace's NVMe-homed blocks succeeded at `now`
  // (outside its learned order, such as a checkpoint's reads: counted each
  // time; a burst is paid for), counted over the trace's weight (SetWeight).
  void Served(uint64_t trace, uint64_t bytes, Clock::time_point now) {
    Trace& t = traces_[trace];
    Used(trace, t, now);  // however long the Acquire waited
    // Back after a rest (or new): no credit for the time away. (The others'
    // level is looked for only then: this runs at every Acquire.)
    if (!t.last_pool_use.has_value() || now - *t.last_pool_use > Window(t)) {
      const double level = Rejoin(now, trace);
      if (level != std::numeric_limits<double>::infinity()) t.served = std::max(t.served, level);
    }
    t.served += static_cast<double>(bytes) / static_cast<double>(t.weight);
    t.largest = std::max(t.largest, bytes);
    t.last_pool_use = now;
    level_ = std::max(level_, Floor(now));  // (`trace` uses the pool: finite)
  }

  // A block of the trace came into the pool at `now` (read from NVMe, or
  // zeros): it competes for room (Rejoin).
  void BroughtIn(uint64_t trace, Clock::time_point now) { traces_[trace].last_brought_in = now; }

  // The trace waited for a read of one of its blocks (a miss, or one in
  // flight), or one of its blocks was evicted, at `now`: it wants more room
  // than it holds, or gives room to a trace that does (Turn). (A trace whose
  // blocks are evicted may never miss: stepping faster than they are written
  // out, it takes each one back before it is gone.)
  void Missed(uint64_t trace, Clock::time_point now) { traces_[trace].last_miss = now; }

  // The trace that holds the pool's turn at `now`, passing it on where the
  // holder's turn is over or it rests (see the top); kNone while fewer than
  // two traces want room and are at work (hold or wait for a block now:
  // `busy(trace)`; the holder, or did within kMinTurn): then there are no
  // turns, and the shares below alone decide (one trainer stepping while
  // the other computes takes room as the traffic's shares say).
  template <typename Busy>
  uint64_t Turn(Clock::time_point now, const Busy& busy) {
    auto held = traces_.find(turn_);
    if (held != traces_.end() && GoneIdle(held->second, now)) {
      turn_ = kNone;  // (unjudged: see GoneIdle)
      held = traces_.end();
    }
    if (held == traces_.end()) {
      turn_ = kNone;
    } else if (busy(turn_)) {
      turn_busy_ = now;
    }
    // The holder works while it holds or waits for a block, or began an
    // Acquire, within kMinTurn (a pause between its Acquires is not a rest).
    auto at_work = [&](uint64_t id, const Trace& t) {
      if (!UsesPool(t, now)) return false;
      if (id == turn_) return now - std::max(turn_busy_, t.last_use) <= kMinTurn;
      return t.last_miss.has_value() && now - *t.last_miss <= Window(t) && busy(id);
    };
    if (now < no_turns_until_) return kNone;
    // Did the turn pay? Its holder should have got through at least two
    // iterations more than each other trace `counted`; where it did not
    // (ranks of one job stepping together: the holder waits for the
    // others at every step), turns only move state to and fro: none for a
    // while, twice as long after each such turn in a row, up to a minute.
    auto ends_paid = [&](auto counted) {
      const uint64_t done = held->second.iterations - held->second.turn_mark;
      for (const auto& [id, t] : traces_) {
        if (id == turn_ || !counted(id, t) || done >= t.iterations - t.turn_mark + 2) continue;
        const Clock::duration pause = std::max<Clock::duration>(
            4 * (now - turn_since_), kNoTurnsAfterAnIdleOne * (int64_t{1} << unpaid_));
        no_turns_until_ = now + std::min<Clock::duration>(pause, std::chrono::minutes(1));
        unpaid_ = std::min(unpaid_ + 1, 5);
        turn_ = kNone;
        ++idle_turns_;
        return false;
      }
      unpaid_ = 0;
      return true;
    };
    int working = 0;
    for (const auto& [id, t] : traces_) working += at_work(id, t) ? 1 : 0;
    if (working < 2) {
      // Turns lapse while nobody competes for the room: the turn ends (and
      // is judged against every trace using the pool); the next ones start
      // afresh. Judged where that is found within kIdleAfter of its lapse
      // (this runs at evictions, which the ranks of one job, stepping
      // together, make at every step): found later, the traces' iterations
      // since were not the turn's doing, and a pause of four times that
      // stopped turns when both competed again (as GoneIdle).
      if (turn_ != kNone && now - last_turns_ > kMinTurn) {
        if (now - last_turns_ <= kMinTurn + kIdleAfter) {
          ends_paid([&](uint64_t, const Trace& t) { return UsesPool(t, now); });
        }
        turn_ = kNone;
      }
      return kNone;
    }
    last_turns_ = now;
    if (turn_ != kNone && at_work(turn_, held->second)) {
      const Clock::duration length =
          turn_switch_.has_value()
              ? std::max<Clock::duration>(kMinTurn, kTurnSwitches * *turn_switch_)
              : Clock::duration(kUnmeasuredTurn);
      if (now - turn_since_ < length) return turn_;
    }
    if (turn_ != kNone && !ends_paid(at_work)) return kNone;
    // The least served of those at work.
    uint64_t next = kNone;
    for (const auto& [id, t] : traces_) {
      if (!at_work(id, t)) continue;
      if (next == kNone || t.served < traces_.at(next).served ||
          (t.served == traces_.at(next).served && id < next)) {
        next = id;
      }
    }
    turn_since_ = now;
    for (auto& [id, t] : traces_) t.turn_mark = t.iterations;
    if (next == turn_) return turn_;  // still the least served: another turn, no switch
    turn_ = next;
    turn_busy_ = now;
    turn_switch_.reset();
    ++turns_;
    return turn_;
  }
  // The turn's holder, kNone if none: what Turn last answered wherever
  // that was not kNone (then turns may be paused or lapsing with a holder
  // still named).
  uint64_t holder() const { return turn_; }
  // Turns begun; turns that did not pay (no turns for a while after each).
  uint64_t turns() const { return turns_; }
  uint64_t idle_turns() const { return idle_turns_; }

  void EndIteration(uint64_t trace, Clock::time_point now) {
    auto it = traces_.find(trace);
    if (it == traces_.end()) return;
    Trace& t = it->second;
    ++t.iterations;
    // The switch: from the turn's start to the end of the holder's first
    // iteration begun in it (the one running at the start may end at once).
    if (trace == turn_ && !turn_switch_.has_value() && t.iterations >= t.turn_mark + 2) {
      turn_switch_ = now - turn_since_;
    }
    NewPass(t, now);
    if (!t.iteration_start.has_value()) return;
    t.iteration = now - *t.iteration_start;
    t.iteration_start.reset();
  }

  void Forget(uint64_t trace) {
    traces_.erase(trace);
    if (trace == turn_) turn_ = kNone;
  }

  // The trace's weight from now on (>= 1; lower counts as 1). A trace never
  // given one has weight 1.
  void SetWeight(uint64_t trace, int64_t weight) {
    traces_[trace].weight = std::max<int64_t>(1, weight);
  }

  // No block of the trace acquired within its idle time (a trace never seen,
  // or forgotten, is idle). The caller checks holds and waits.
  bool Quiet(uint64_t trace, Clock::time_point now) const {
    auto it = traces_.find(trace);
    return it == traces_.end() || now - it->second.last_use > Window(it->second);
  }

  // Whether the trace acquired an NVMe-homed block within its idle time.
  bool UsesPool(uint64_t trace, Clock::time_point now) const {
    auto it = traces_.find(trace);
    return it != traces_.end() && UsesPool(it->second, now);
  }

  // The least served of the traces using the pool, other than `except`
  // (infinite if none).
  double Floor(Clock::time_point now, uint64_t except = kNone) const {
    double floor = std::numeric_limits<double>::infinity();
    for (const auto& [id, t] : traces_) {
      if (id != except && UsesPool(t, now)) floor = std::min(floor, t.served);
    }
    return floor;
  }

  // How far ahead of `floor` (Floor(now)): (served - floor) / `slack`
  // (Slack(now)) rounded down, 0 within one slack (not ahead); floor and
  // slack taken once for a choice among many blocks. Of the traces ahead, the one farthest ahead
  // gives room first, so that where one trace holds the floor low (slow, or its blocks all fit) and
  // every other is ahead of it, their weights still tell them apart.
  uint64_t Lead(uint64_t trace, double floor, double slack) const {
    auto it = traces_.find(trace);
    if (it == traces_.end()) return 0;
    const double lead = it->second.served - floor;
    return lead > slack ? static_cast<uint64_t>(lead / slack) : 0;
  }
  // kShareSlack, or two of the largest blocks the traces using the pool
  // served in their last two passes, where that is more (it follows the
  // traces at work, not the largest block there ever was).
  double Slack(Clock::time_point now) const {
    uint64_t largest = 0;
    for (const auto& [id, t] : traces_) {
      if (UsesPool(t, now)) largest = std::max({largest, t.largest, t.largest_before});
    }
    return std::max(kShareSlack, 2.0 * static_cast<double>(largest));
  }

  // The part of the pool's room the trace's weight gives it among the traces
  // using the pool (1 if it is alone, or not using it).
  double RoomShare(uint64_t trace, Clock::time_point now) const {
    auto it = traces_.find(trace);
    if (it == traces_.end() || !UsesPool(it->second, now)) return 1;
    double sum = 0;
    for (const auto& [id, t] : traces_) {
      if (UsesPool(t, now)) sum += static_cast<double>(t.weight);
    }
    return static_cast<double>(it->second.weight) / sum;
  }

  double served(uint64_t trace) const {
    auto it = traces_.find(trace);
    return it == traces_.end() ? 0 : it->second.served;
  }

 private:
  // Where a trace back from a rest (or new) starts: the least served of the
  // others competing for room (using the pool and bringing blocks into it),
  // else of all using it, else (every other resting) where that least
  // served last got to: a trace that came while the others rested would
  // otherwise start at what it had (zero, new), and one that had used the
  // pool alone for a long while, back, would be ahead by all of it.
  double Rejoin(Clock::time_point now, uint64_t trace) const {
    double level = std::numeric_limits<double>::infinity();
    for (const auto& [id, t] : traces_) {
      if (id != trace && UsesPool(t, now) && t.last_brought_in.has_value() &&
          now - *t.last_brought_in <= Window(t)) {
        level = std::min(level, t.served);
      }
    }
    if (level != std::numeric_limits<double>::infinity()) return level;
    const double floor = Floor(now, trace);
    return floor != std::numeric_limits<double>::infinity() ? floor : level_;
  }
  struct Trace {
    Clock::time_point last_use;                        // its last Acquire (or Add)
    std::optional<Clock::time_point> last_pool_use;    // its last one served from the pool
    std::optional<Clock::time_point> iteration_start;  // the first Acquire since EndIteration
    Clock::duration iteration{0};                      // the last iteration's length
    double served = 0;
    int64_t weight = 1;                                // SetWeight's
    std::optional<Clock::time_point> last_brought_in;  // BroughtIn's
    std::optional<Clock::time_point> last_miss;        // Missed's
    uint64_t iterations = 0;                           // EndIteration's
    uint64_t turn_mark = 0;                            // `iterations` when the turn began
    // This pass: its number (blocks counted in it carry it; unique among all
    // traces' passes, 0 none), when it began, the largest block served in it.
    uint64_t pass = 0;
    Clock::time_point pass_start;
    uint64_t largest = 0;
    uint64_t largest_before = 0;  // the pass before's
  };
  void NewPass(Trace& t, Clock::time_point now) {
    t.pass = ++passes_;
    t.pass_start = now;
    t.largest_before = std::exchange(t.largest, 0);
  }
  static Clock::duration Window(const Trace& t) {
    return std::max<Clock::duration>(kIdleAfter, 2 * t.iteration);
  }
  static bool UsesPool(const Trace& t, Clock::time_point now) {
    return t.last_pool_use.has_value() && now - *t.last_pool_use <= Window(t);
  }
  // Whether the turn's holder `t` went idle: nothing of it at work (held,
  // waited for, an Acquire begun) for longer than its idle time, as a job
  // that stopped or paused for seconds. Its turn then ends unjudged: what
  // the others did meanwhile (one stepping alone, its state fitting, with
  // no eviction to ask for a turn) was not the turn's doing, and judging it
  // then found it unpaid and stopped turns for up to a minute. (A holder
  // that rests briefly, as a rank waiting at a step's end, is judged.)
  bool GoneIdle(const Trace& t, Clock::time_point now) const {
    return now - std::max(turn_busy_, t.last_use) > Window(t);
  }
  // The trace is at work at `now` (its last use): a holder back from idle
  // finds its turn ended (GoneIdle), to be given afresh.
  void Used(uint64_t trace, Trace& t, Clock::time_point now) {
    if (trace == turn_ && GoneIdle(t, now)) turn_ = kNone;
    t.last_use = now;
  }

  absl::flat_hash_map<uint64_t, Trace> traces_;
  uint64_t passes_ = 0;  // passes begun, of all traces
  double level_ = 0;     // the least served of the traces using the pool, as far as it got
  // The turn: its holder (kNone: no turns), since when, its first iteration
  // in the turn (the switch), turns begun.
  uint64_t turn_ = kNone;
  Clock::time_point turn_since_;
  Clock::time_point turn_busy_;  // when the holder last held or waited for a block
  std::optional<Clock::duration> turn_switch_;
  uint64_t turns_ = 0;
  uint64_t idle_turns_ = 0;
  Clock::time_point no_turns_until_;  // after a turn that did not pay
  int unpaid_ = 0;                    // such turns in a row
  Clock::time_point last_turns_;      // when two or more last competed
};

}  // namespace offload

#endif  // OFFLOADD_SWAPPER_POOL_SHARES_H_
