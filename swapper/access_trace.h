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

  void RecordUse(uint64_t id);
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
  // changed order, learned again); iterations with no prediction (the
  // first, or after an empty one) are not counted.
  uint64_t relearned() const { return relearned_; }
  size_t trace_length() const { return trace_.size(); }
  // Where this iteration is along the order (NextUse counts from here): a
  // use expected `d` uses from now is at position() + d until the
  // iteration ends, or skips ahead past it (RecordUse).
  size_t position() const { return pos_; }
  // EndIteration calls so far, and how many of them changed the order
  // predicted: where the latter did not move, the order is the same and a
  // position p of one iteration is p + trace_length() in the next
  // (VictimIndex counts on both).
  uint64_t iterations() const { return iterations_; }
  uint64_t orders() const { return orders_; }

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
};

}  // namespace offload

#endif  // OFFLOADD_SWAPPER_ACCESS_TRACE_H_
