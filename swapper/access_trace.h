// The order in which blocks are used in one iteration, learned from what
// happens, and what it predicts: which blocks come next (prefetch) and how
// far away each block's next use is (eviction: Belady's choice, the block
// needed farthest in the future, is optimal when the future is known).
//
// ZeRO-3 fetches the same partitions in the same order every iteration
// (forward in layer order, backward in reverse). An iteration is what
// happens between two EndIteration() calls (the optimizer step marks it).
//
//   1. Every use is recorded into the current iteration's recording.
//   2. With a learned trace, each use is matched against it: the expected
//      one advances the position; one expected later in this iteration skips
//      ahead to it (uses the trace holds may not recur: the first iteration
//      also saw registrations); anything else means the order changed, and
//      predictions stop for the rest of the iteration (callers fall back to
//      LRU).
//   3. At EndIteration, the next iteration's order is predicted from the
//      last four: the newest (the first iteration learns, a changed order
//      is re-learned), or, where two orders took turns twice (A B A B),
//      the other one (A): with the delayed update and the working copy on
//      NVMe, the trainer reads a partition's two working-copy buffers in
//      turn, one step each. The position goes back to the start.
//      Predictions that wrap past the iteration's end (the last prefetches
//      of an iteration, and Belady's distances near its end) assume it
//      repeats: where two orders take turns they are off there, until
//      EndIteration predicts the next one.
//   4. Passes without a step. A session that only fetches (an evaluation
//      or inference loop: forward after forward, no step) ends no
//      iteration: its uses went off the order after the first forward, and
//      its recording grew without end. So where a trace's uses since its
//      last EndIteration are more than twice its last iteration's (or it
//      never ended one) and off the order, the order is looked for in the
//      uses since they went off it: the longest run of the latest uses
//      that repeats a shorter order at least twice (a prefix function,
//      looked for each time those uses double) gives that order, learned
//      as one that repeats: each time it comes round again a pass begins
//      (RecordUse says so; iterations() counts it), and prefetch runs
//      along it as in training. The iteration's end (the loop steps again)
//      learns its whole recording as before, so that gradient
//      accumulation, whose forward and backward repeat within an iteration,
//      learns its whole order even where an iteration found passes (its
//      first, with nothing to gate it, or one after a short one, an
//      epoch's last); the gate (twice the last iteration) keeps passes out
//      of the iterations after. The recording is bounded (kMaxRecording,
//      or four times the last iteration's uses): beyond, it is dropped and
//      the iteration's end learns nothing new (an iteration of training
//      longer than the bound is then learned at the next, recorded whole).
//      A session that never steps finds its order only where a pass is at
//      most half the bound (32 Ki uses).
//
// Thread-compatible: the owner (the swapper) serialises calls.
#ifndef OFFLOADD_SWAPPER_ACCESS_TRACE_H_
#define OFFLOADD_SWAPPER_ACCESS_TRACE_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"

namespace offload {

class AccessTrace {
 public:
  static constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();

  static constexpr size_t kMaxRecording = size_t{1} << 16;  // (4 x the last iteration, if more)

  // Returns true where the use began another pass of an order that repeats
  // without EndIteration (4. above): the caller counts it as an iteration
  // of the trace's work.
  bool RecordUse(uint64_t id);
  void EndIteration();

  // Whether predictions are available: a trace is learned and this
  // iteration has followed it so far.
  bool on_trace() const { return !trace_.empty() && matched_; }

  // Uses from now until `id` is used next by the trace (0: it is the next
  // use), wrapping into the next iteration; kNever if the trace never uses
  // it or there are no predictions.
  uint64_t NextUse(uint64_t id) const;

  // The uses predicted next, in order, wrapping into the next iteration,
  // at most `max_uses` of them (ids may repeat). Empty without predictions.
  std::vector<uint64_t> Upcoming(size_t max_uses) const;
  // The same uses, in order, to `visit` until it returns false (no copy).
  // `visit` may need locks its caller holds; clang's analysis cannot see
  // them from here.
  template <typename Visit>
  void ForEachUpcoming(size_t max_uses, Visit visit) const ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (!on_trace()) return;
    const size_t n = max_uses < trace_.size() ? max_uses : trace_.size();
    for (size_t i = 0; i < n; ++i) {
      if (!visit(trace_[(pos_ + i) % trace_.size()])) return;
    }
  }

  // How many iterations did not follow the order predicted for them (a
  // changed order, learned again, or one found in passes); iterations
  // with no prediction (the first, unless it found passes, or after an
  // empty one), and those whose recording was dropped (they learn nothing),
  // are not counted.
  uint64_t relearned() const { return relearned_; }
  size_t trace_length() const { return trace_.size(); }
  // Where this iteration is along the order (NextUse counts from here): a
  // use expected `d` uses from now is at position() + d until the
  // iteration ends (or a pass, 4. above), or skips ahead past it
  // (RecordUse).
  size_t position() const { return pos_; }
  // EndIteration calls and passes (4. above) so far, and how many times
  // the order predicted changed (at those, or where an order was found in
  // passes, even the same one: the position starts again): where the
  // latter did not move, the order is the same and a position p of one
  // iteration is p + trace_length() in the next (VictimIndex counts on
  // both).
  uint64_t iterations() const { return iterations_; }
  uint64_t orders() const { return orders_; }
  // Passes begun (4. above), and the uses recorded in this iteration
  // (bounded).
  uint64_t passes() const { return passes_; }
  size_t recorded() const { return recording_.size(); }

 private:
  std::vector<uint64_t> trace_;
  // id -> its positions in trace_, ascending.
  absl::flat_hash_map<uint64_t, std::vector<size_t>> positions_;
  std::vector<uint64_t> recording_;
  // The orders of the last four iterations, newest first.
  std::vector<uint64_t> last_, before_last_, third_last_, fourth_last_;
  size_t pos_ = 0;
  bool matched_ = true;
  uint64_t relearned_ = 0;
  uint64_t iterations_ = 0;
  uint64_t orders_ = 0;
  // Passes without a step (4. above).
  static constexpr size_t kFirstLook = 8;  // uses off the order first looked at
  // Looks for an order the uses off the order repeat; learns it if found.
  void LookForRepeats();
  // The order predicted from now on (a new one for VictimIndex: orders_).
  void SetOrder(std::vector<uint64_t> order);
  bool repeats_ = false;           // trace_ was found in passes: it wraps
  uint64_t passes_ = 0;            // passes begun
  size_t uses_ = 0;                // since the last EndIteration
  size_t last_uses_ = 0;           // of the last iteration that had any
  size_t uses_off_ = 0;            // the latest uses off the order, still recorded
  size_t next_look_ = kFirstLook;  // uses_off_ at the next look
  bool dropped_ = false;           // this iteration's recording was (over the bound)
};

}  // namespace offload

#endif  // OFFLOADD_SWAPPER_ACCESS_TRACE_H_
