// Eviction's index of the blocks in the host pool, by trace, so that
// choosing a victim looks at a few blocks per trace rather than at all the
// held and resident ones. (It did: a walk over them at every eviction, each
// one's next use looked up in its trace, took half the process's time with
// 768 MiB in 12,800 blocks through a 256 MiB pool: benches/trace_replay.)
//
// The swapper tells it each block's standing after every change that can
// alter it (Set: its pins and waiters, state, home, removal, last use) and
// when the block goes (Erase). Per trace it keeps:
//
//   - how many of its blocks are held (pinned or waited for), and how much
//     of the pool's room its blocks homed on NVMe hold (Held, Room);
//   - its candidates (blocks that may be evicted now: resident, holding
//     room, not held) in two orders: by next use along the trace's learned
//     order (first those the order never uses, least recently used first;
//     then the farthest next use), and by last use alone (least recently
//     used first) for when the trace is off its order.
//
// A next use is kept as a position along the order, counted from an origin
// of the index's own for the trace: origin + AccessTrace::position() +
// NextUse. Within an iteration it stays right while the trace advances,
// except where the trace skipped ahead past it without using the block:
// such positions lie behind the trace's and sort lowest, and are looked up
// again the next time the trace's candidates are visited (each once a pass
// over it). When iterations end and the same order is predicted again (the
// usual case), the trace's positions move on by the order's length each
// (the origin does: nothing is looked up, nothing done at EndIteration);
// where the order changed, or a candidate was listed while the trace was off
// its order or had none (its next use unknown then), or the order was
// forgotten (Forget), every candidate of the trace is looked up again, once,
// at the next visit.
//
// Not thread-safe: the swapper calls it under its lock. The AccessTrace
// passed to a call is read during the call only.
#ifndef OFFLOADD_SWAPPER_VICTIM_INDEX_H_
#define OFFLOADD_SWAPPER_VICTIM_INDEX_H_

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "swapper/access_trace.h"

namespace offload {

class VictimIndex {
 public:
  using BlockId = uint64_t;
  static constexpr uint64_t kNever = AccessTrace::kNever;

  // A block as eviction sees it. The default one is a block the index need
  // not know (not held, holding no room).
  struct Standing {
    bool held = false;  // pinned or waited for
    uint64_t room =
        0;  // bytes of the pool's room it holds (homed on NVMe, in the pool, not removed)
    bool candidate = false;  // may be evicted now (resident, holds room, not held)
    uint64_t last_use = 0;   // the swapper's clock at its last Acquire
    bool operator==(const Standing& o) const {
      return held == o.held && room == o.room && candidate == o.candidate && last_use == o.last_use;
    }
    bool operator!=(const Standing& o) const { return !(*this == o); }
  };

  // Block `id` of `trace` now stands as `now`; `order` is the trace's
  // learned order (null: none yet, or forgotten; needed only where `now` is
  // a candidate).
  void Set(BlockId id, uint64_t trace, const Standing& now, const AccessTrace* order);
  // The block is gone.
  void Erase(BlockId id);
  // The trace's order was forgotten (a new one may begin under its id); its
  // entry goes once its blocks stand for nothing.
  void Forget(uint64_t trace);

  // Whether the trace holds a block; the room its blocks hold; all traces'.
  bool Held(uint64_t trace) const;
  uint64_t Room(uint64_t trace) const;
  uint64_t all_room() const { return all_room_; }

  // The traces with a candidate, into *out (cleared first).
  void TracesWithCandidates(std::vector<uint64_t>* out) const;

  // The trace's candidates, the one to evict first first: visit(id, next,
  // last_use) until it returns false, where `next` is the uses from now to
  // the block's next one (kNever: not used again by the order, or the trace
  // is off its order; then by last use). `order` as for Set. `visit` must
  // not call into the index. (The caller's locks: not this class's to see.)
  template <typename Visit>
  void ForEachCandidate(uint64_t trace, const AccessTrace* order,
                        Visit visit) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    auto it = traces_.find(trace);
    if (it == traces_.end()) return;
    Trace& t = it->second;
    if (order == nullptr || !order->on_trace()) {
      for (auto r = t.by_lru.rbegin(); r != t.by_lru.rend(); ++r) {
        if (!visit(r->second, kNever, ~r->first)) return;
      }
      return;
    }
    const uint64_t pos = Sync(&t, *order);
    for (auto r = t.by_next.rbegin(); r != t.by_next.rend(); ++r) {
      const auto& [at, not_last_use, id] = *r;
      if (!visit(id, at == kNever ? kNever : at - pos, ~not_last_use)) return;
    }
  }

  // What the index holds of `id` (default: nothing), and of how many blocks
  // it holds something: for tests' checks against the blocks.
  Standing Of(BlockId id) const;
  size_t size() const { return entries_.size(); }
  size_t traces() const { return traces_.size(); }  // (kept: not forgotten, or not empty)
  // Where its sums, orders and next uses disagree with its entries and the
  // traces' orders (`order_of(trace)`, as for Set) (tests): empty when
  // consistent.
  std::vector<std::string> CheckForTesting(
      const std::function<const AccessTrace*(uint64_t)>& order_of) const;

 private:
  struct Entry {
    uint64_t trace = 0;
    Standing standing;
    uint64_t at = kNever;  // a candidate's next use, a position (At)
  };
  struct Trace {
    uint64_t held = 0;  // blocks
    uint64_t room = 0;  // bytes
    // Candidates: (at, ~last_use, id), the last the first to evict; and
    // (~last_use, id), likewise.
    absl::btree_set<std::tuple<uint64_t, uint64_t, BlockId>> by_next;
    absl::btree_set<std::pair<uint64_t, BlockId>> by_lru;
    // What the positions follow: false where every one must be looked up
    // again; else the order's AccessTrace::orders() and iterations() when
    // they were last brought up to date, its length, and the origin.
    bool synced = false;
    uint64_t order = 0, iteration = 0, length = 0, origin = 0;
    // Its order forgotten: erased once its blocks stand for nothing. (A
    // trace's entry otherwise stays: a session's pins and releases would
    // make and unmake it.)
    bool forgotten = false;
    bool empty() const { return held == 0 && room == 0 && by_lru.empty(); }
  };

  // Brings the trace's positions up to date with `order` (on its order);
  // returns the trace's position along it (origin + position()), with
  // every candidate's at or after it.
  uint64_t Sync(Trace* t, const AccessTrace& order);
  // The position of `id`'s next use (kNever); `t` in step with `order`.
  static uint64_t At(const Trace& t, BlockId id, const AccessTrace& order);
  // Takes the entry's standing out of `t`'s sums and orders (its trace's).
  void Subtract(Trace* t, BlockId id, const Entry& e);
  // The same, its trace looked up (and let go, where forgotten and empty).
  void Leave(BlockId id, const Entry& e);
  // A candidate's next use looked up in `order` and put in `t`'s order by
  // next use (not there now).
  void Relook(Trace* t, BlockId id, uint64_t not_last_use, const AccessTrace& order);

  absl::flat_hash_map<BlockId, Entry> entries_;
  absl::flat_hash_map<uint64_t, Trace> traces_;
  uint64_t all_room_ = 0;
};

}  // namespace offload

#endif  // OFFLOADD_SWAPPER_VICTIM_INDEX_H_
