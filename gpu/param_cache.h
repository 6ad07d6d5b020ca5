// The GPU tier's parameter side: a trainer's working parameters on the
// device before they are needed, under a device memory budget.
//
// A trainer declares units (AddUnit: the tensors gathered together, as FSDP
// wraps a module with its submodules) and, every iteration, uses them in
// the order its model runs: BeginIteration, then Use(unit) before a unit's
// compute and Done(unit) after it, on the trainer's compute stream. The
// cache:
//   1. keeps one slab of device memory (the budget) and places each tensor
//      in it while resident, from the bottom; a holder's (a unit in use
//      while others are used: a parent module's parameters while its
//      children run) from the top, and where the room left beside it would
//      not hold, in one piece, what its children held at once (learnt), on
//      top of what is in use, placed again there at its use if it lies
//      elsewhere: what nesting holds at once fits in a budget of that size.
//      A use refused for room in pieces gives back all that is not in use
//      and places its tensors again;
//   2. copies a unit's tensors from the host (HostSource: the partitions'
//      bytes in the daemon's arena, held only while a copy reads them) on
//      its own copy stream, straight from DMA-registered memory, or through
//      a pinned staging buffer where the host memory is not registered;
//   3. makes the compute stream wait for those copies with an event, so a
//      use never sees a copy in flight, and makes each copy into memory a
//      previous unit used wait for that unit's Done, so a copy never
//      overwrites what compute still reads;
//   4. prefetches the next units along the order recorded in the previous
//      iteration (prefetch_depth units, at most prefetch_bytes ahead),
//      evicting only tensors needed later than the one it brings;
//   5. evicts by next use (Belady): the resident tensor whose next use in
//      the recorded order is farthest, those not reused within
//      max_reuse_distance_bytes first, persistent ones (small tensors, at
//      most persistence_threshold_bytes each) last (a holder placed on top
//      of what is in use takes what lies there, whatever its next use);
//   6. after an optimizer step (Invalidate), treats every copy as stale.
// A copy that fails marks its tensors failed: the next Use of a unit
// holding one returns the error (naming the tensor) and forgets it, so the
// Use after that copies again; a failure found after a use was already
// issued is returned by Synchronize (ABORTED: the iteration's results are
// not valid; the host copy is intact). Nothing is lost in either case.
//
// Budget: the slab is all the device memory the cache uses; max_live_bytes
// bounds the non-persistent bytes resident in it, where it can: a use it
// would refuse because every such tensor resident is in use or in flight
// (a parent module's own parameters while a child's are gathered) goes
// past it (counted: over_live_cap), as DeepSpeed fetches what a module
// needs whatever stage3_max_live_parameters says. A unit larger than what
// can be made free (everything not in use) is RESOURCE_EXHAUSTED.
//
// Thread-safety: all methods are safe from any thread (one lock); a unit's
// Use and Done come from the thread that runs its compute.
#ifndef OFFLOADD_GPU_PARAM_CACHE_H_
#define OFFLOADD_GPU_PARAM_CACHE_H_

#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "gpu/device.h"

namespace offload::gpu {

// Where a tensor's bytes are on the host. Implemented over a client
// Session (client/gpu_source.h) and by tests.
class HostSource {
 public:
  struct Span {
    const void* data = nullptr;
    // Registered for DMA (or pinned): copied from directly. Otherwise the
    // cache copies through its pinned staging buffer.
    bool dma = false;
    // What the host holds there: a tensor declared larger is refused, not
    // copied past it.
    uint64_t bytes = 0;
  };
  virtual ~HostSource() = default;
  // Holds the keys' bytes in place until Release; where they are, in order.
  virtual absl::StatusOr<std::vector<Span>> Hold(absl::Span<const uint64_t> keys) = 0;
  virtual absl::Status Release(absl::Span<const uint64_t> keys) = 0;
};

struct ParamCacheOptions {
  // Device memory for parameters, allocated once as one slab (unless the
  // caller gives the slab). Larger values keep more of the model resident
  // between its forward and backward uses. Default: 1 GiB.
  uint64_t budget_bytes = 1ull << 30;
  // Units copied ahead of the one in use, along the recorded order, and the
  // most bytes ahead. 0: no prefetch (copies start at Use). Dynamically
  // changeable (SetPrefetch).
  int prefetch_depth = 2;
  uint64_t prefetch_bytes = 256ull << 20;
  // Tensors of at most this many bytes stay resident once copied (until
  // Invalidate), at most half the budget of them (DeepSpeed's
  // stage3_param_persistence_threshold, in bytes). 0: none.
  uint64_t persistence_threshold_bytes = 0;
  // At most this many non-persistent bytes resident (DeepSpeed's
  // stage3_max_live_parameters, in bytes). 0: the budget.
  uint64_t max_live_bytes = 0;
  // A released tensor whose next use is within this many bytes of other
  // units' tensors is evicted after those that are not (DeepSpeed's
  // stage3_max_reuse_distance, in bytes). 0: next use alone decides.
  uint64_t max_reuse_distance_bytes = 0;
  // Pinned host memory for copies from host memory that is not registered.
  uint64_t staging_bytes = 16ull << 20;
};

struct ParamCacheStats {
  uint64_t uses = 0;
  uint64_t tensor_uses = 0;
  // Tensor uses that found the tensor resident from an earlier use
  // (resident_hits), or its copy issued ahead by a prefetch, done or in
  // flight (prefetch_hits; waited on by the compute stream, not the host).
  // Disjoint: resident_hits + prefetch_hits <= tensor_uses.
  uint64_t resident_hits = 0;
  uint64_t prefetch_hits = 0;
  uint64_t in_flight_at_use = 0;
  uint64_t prefetched_units = 0;
  uint64_t copies = 0;
  uint64_t h2d_bytes = 0;
  uint64_t staged_bytes = 0;  // of h2d_bytes, through the staging buffer
  uint64_t evictions = 0;
  uint64_t invalidations = 0;
  uint64_t copy_failures = 0;
  uint64_t off_trace_uses = 0;  // uses the recorded order did not predict
  uint64_t over_live_cap = 0;   // tensors placed past max_live_bytes (see Budget)
  uint64_t resident_bytes = 0;
  uint64_t peak_resident_bytes = 0;
  uint64_t budget_bytes = 0;
};

class ParamCache {
 public:
  // `device` and `source` must outlive the cache. Without `slab` the cache
  // allocates budget_bytes of device memory; with one, the budget is its
  // size (a framework's allocation, say, so the framework accounts it).
  static absl::StatusOr<std::unique_ptr<ParamCache>> Create(Device* device, HostSource* source,
                                                            ParamCacheOptions options,
                                                            DeviceMemory slab = {});
  // Waits for the copies in flight and releases their holds.
  ~ParamCache();

  // Declares a unit of tensors (key, device bytes); returns its index. A
  // key may be in several units (a tied weight); its bytes must agree.
  // `holder`: the unit stays in use while others are used (a parent
  // module's parameters while its children run), so its tensors are placed
  // from the slab's top (see Bring); a unit in use when another's Use comes
  // is found to be one anyway, from then on.
  absl::StatusOr<int> AddUnit(absl::Span<const std::pair<uint64_t, uint64_t>> tensors,
                              bool holder = false);

  // An iteration starts: the order recorded since the last call drives
  // prefetch and eviction from now on.
  void BeginIteration();
  // Makes the unit's tensors resident (or on their way) and has `compute`
  // wait for them; the tensors stay until Done. Returns each tensor's byte
  // offset in the slab, in the unit's order.
  absl::StatusOr<std::vector<uint64_t>> Use(int unit, const Stream& compute);
  // Use of each of `units`, in that order, in one call: the copies it issues
  // go together (one hold of the host's bytes, one event), and `compute`
  // waits once for each batch still in flight (those and earlier
  // prefetches), so for all of them. For a trainer whose budget holds every
  // unit, at the iteration's start: one call instead of one per unit as its
  // modules run (a unit its forward never reaches is copied all the same).
  // RESOURCE_EXHAUSTED if they do not fit at once; on any error none of
  // them is in use and the recorded order and the use counts are as they
  // were (as for one unit): the use may be asked again.
  absl::StatusOr<std::vector<std::vector<uint64_t>>> Use(absl::Span<const int> units,
                                                         const Stream& compute);
  // The units' copies issued now, ahead of their next Use (one batch), as
  // the recorded order's prefetch issues them: for a trainer that knows
  // what its next iteration uses before it starts (every unit, where the
  // budget holds them all), so that the copies run while it prepares the
  // iteration (after an optimizer step and its Invalidate, say). Nothing is
  // used: the next Use of each waits for its copies on the compute stream,
  // not the host. Room is made as the order's prefetch makes it (only
  // tensors not used again this iteration are evicted; copies in flight are
  // not waited for); RESOURCE_EXHAUSTED, nothing issued, where that is not
  // enough (its Use brings it then). A unit whose last copy failed is left
  // to its Use, which reports the failure. (INVALID_ARGUMENT for a unit not
  // declared or named twice.)
  absl::Status PrefetchUnits(absl::Span<const int> units);
  // The unit's compute is issued on `compute`: its tensors may be evicted
  // once the work issued so far there completes.
  absl::Status Done(int unit, const Stream& compute);
  // Done of each of `units`, all or (an error) none: FAILED_PRECONDITION if
  // one is not in use, a device error recording the events. (Either:
  // INVALID_ARGUMENT for a unit not declared or named twice.)
  absl::Status Done(absl::Span<const int> units, const Stream& compute);
  // The host values changed: every resident copy is stale. Copies made
  // after this wait for the work issued so far on `compute`.
  absl::Status Invalidate(const Stream& compute);
  // Waits for every copy in flight; ABORTED if one failed after its use
  // was issued (reported once).
  absl::Status Synchronize();
  // Waits for every copy in flight, the report of one that failed after
  // its use kept for Synchronize.
  void AwaitCopies();

  void SetPrefetch(int depth, uint64_t bytes);
  // How the host waits for copies in flight (see HostWait); null: the
  // device's Synchronize.
  void SetHostWait(HostWait wait);
  // Every key declared, once each.
  std::vector<uint64_t> Keys() const;
  ParamCacheStats stats() const;
  // The slab the offsets are in.
  void* slab() const { return slab_.get(); }
  uint64_t slab_bytes() const { return budget_; }

 private:
  enum class State {
    kAbsent,   // no device copy
    kCopying,  // a copy is in flight (batch)
    kReady,    // the device copy is current
    kStale,    // placed, its values out of date (Invalidate): the next use copies in place
    kFailed,   // its copy failed; the next Use reports it, then kAbsent
  };
  struct Batch;
  struct Entry {
    uint64_t key = 0;
    uint64_t bytes = 0;
    uint64_t offset = 0;
    State state = State::kAbsent;
    int pins = 0;  // units in use holding it
    bool persistent = false;
    bool prefetched = false;       // copied ahead of its use, not yet used
    bool used_in_flight = false;   // a use was issued while its copy ran
    std::shared_ptr<Batch> batch;  // while kCopying
    // While kCopying: into the place it kept while stale (undone or failed,
    // it is stale there again, not forgotten).
    bool in_place = false;
    // A Done of one of its units was recorded since it was copied.
    bool released_recorded = false;
    // While kFailed, or kStale after its copy in place failed: reported at
    // its next Use.
    absl::Status error;
    std::vector<int> units;
  };
  struct Unit {
    std::vector<int> entries;
    uint64_t bytes = 0;
    Event released;  // recorded on the compute stream by Done
    bool released_recorded = false;
    int in_use = 0;  // Uses not yet Done
    // Was in use while another unit's Use came (a parent module's
    // parameters while its children run): placed from the slab's top.
    bool holder = false;
    // The most bytes other units held in use at once while this one was,
    // or asked for in a use refused for room (learnt, over every use), and
    // the bytes in use from which that counts (at its last Use, lowered
    // where a unit used before it is done first).
    uint64_t below = 0;
    uint64_t pinned_at_use = 0;
  };
  // One issue of copies: one hold, one event.
  struct Batch {
    Event done;
    std::vector<int> entries;
    std::vector<uint64_t> keys;  // held until done
  };

  ParamCache(Device* device, HostSource* source, ParamCacheOptions options, DeviceMemory slab,
             Stream copy_stream, Event fence, PinnedMemory staging);

  static constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();

  // Position in the recorded order of the entry's next use after the
  // cursor (kNever if none).
  uint64_t NextUse(const Entry& e) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t NextUseOfUnit(int unit) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Places the units' missing tensors in the slab, evicting as the policy
  // allows (only tensors used after `limit` when prefetching; none of the
  // units'), and issues their copies as one batch. FAILED_PRECONDITION-free:
  // RESOURCE_EXHAUSTED if no room (then nothing is placed).
  absl::Status Bring(absl::Span<const int> units, uint64_t limit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An out-of-range unit, or one named twice: INVALID_ARGUMENT.
  absl::Status CheckUnits(absl::Span<const int> units) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A copy failure of one of the unit's tensors, reported once: the error,
  // and the unit's tensors are copied again at the next use.
  absl::Status TakeFailure(int unit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Places a tensor, evicting as the policy allows (see Bring); a
  // holder's (`room_below` > 0: RoomBelow) from the top.
  absl::StatusOr<uint64_t> Place(uint64_t bytes, bool persistent, uint64_t limit,
                                 const std::vector<int>& keep, uint64_t room_below)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Where placed tensors stay, sorted: those in use, in flight, `wanted`
  // (by entry), or for a prefetch (`limit` not kNever) persistent or used
  // before `limit`; the others may be given back.
  std::vector<std::pair<uint64_t, uint64_t>> Stays(uint64_t limit,
                                                   const std::vector<bool>& wanted) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The largest room in one piece besides what stays (Stays) and `also`
  // ([start, end): a place about to be taken).
  uint64_t LargestRoom(uint64_t limit, const std::vector<bool>& wanted,
                       std::pair<uint64_t, uint64_t> also = {0, 0}) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // For a holder's tensor: the highest place of `rounded` bytes where
  // nothing stays (Stays of `keep`), what is there given back; none if no
  // such place.
  absl::StatusOr<std::optional<uint64_t>> PlaceOnTop(uint64_t rounded, uint64_t limit,
                                                     const std::vector<int>& keep)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes [offset, offset + bytes) where it is free in one piece (false:
  // it is not, and nothing is taken).
  bool TakeAt(uint64_t offset, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether one of the entry's units is a holder (Unit::holder).
  bool Holds(int entry) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The room in one piece a holder's tensor needs beside it: the most its
  // units' children held at once (Unit::below), the largest unit where
  // that is not known yet; 0 for a tensor of no holder.
  uint64_t RoomBelow(int entry) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether all above the (placed) entry stays for a use (Stays with
  // `wanted`): nothing there free or to be given back.
  bool OnTop(int entry, const std::vector<bool>& wanted) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives the entry's memory to the next copy into it, which waits for the
  // compute that read it (the copy stream waits on the device; where it
  // cannot, this thread waits). An error: the memory is not safe to reuse,
  // and the entry stays.
  absl::Status Evict(int entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives the entry's device memory back; it becomes kAbsent.
  void Forget(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A copy into `e` that will not complete (undone, failed, given up): a
  // copy in place leaves it stale in its place (true), else it is
  // forgotten (false).
  bool GiveUpCopy(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An event for a batch: one a finished batch gave back, or a new one
  // (creating one per batch would cost a driver call on every copy).
  absl::StatusOr<Event> TakeEvent() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeRange(uint64_t offset, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A free range of `bytes`: the lowest that fits, or with `top` the
  // highest, its top end.
  std::optional<uint64_t> TakeRange(uint64_t bytes, bool top) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CopyIn(Entry& e, const HostSource::Span& span) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes the batches whose copies are done (all of them with `wait`).
  void Reap(bool wait) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishBatch(Batch& b, const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Prefetch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether one of the unit's tensors has a failed copy its next Use
  // reports (TakeFailure): prefetches leave such a unit to it.
  bool HasFailureToReport(int unit) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Brings `units` ahead of their use, evicting only tensors used after
  // `limit`; marks what it copies prefetched. (Prefetch and PrefetchUnits.)
  absl::Status BringAhead(absl::Span<const int> units, uint64_t limit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AdvanceCursor(int unit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  Device* const device_;
  HostSource* const source_;
  const uint64_t budget_;
  DeviceMemory slab_;
  Stream copy_stream_;
  Event fence_;  // staging reuse and Invalidate's wait
  PinnedMemory staging_;

  mutable absl::Mutex mu_;
  HostWait host_wait_ ABSL_GUARDED_BY(mu_);
  // The host's wait for `event`: host_wait_, else the device's Synchronize.
  absl::Status WaitOnHost(const Event& event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ParamCacheOptions options_ ABSL_GUARDED_BY(mu_);
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, int> by_key_ ABSL_GUARDED_BY(mu_);
  std::vector<Unit> units_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, uint64_t> free_ ABSL_GUARDED_BY(mu_);  // offset -> bytes
  std::deque<std::shared_ptr<Batch>> in_flight_ ABSL_GUARDED_BY(mu_);
  std::vector<Event> spare_events_ ABSL_GUARDED_BY(mu_);
  uint64_t staging_head_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t persistent_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t declared_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // every entry, placed
  uint64_t max_unit_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // the largest unit, placed
  uint64_t pinned_bytes_ ABSL_GUARDED_BY(mu_) = 0;    // of tensors in use, placed
  uint64_t live_bytes_ ABSL_GUARDED_BY(mu_) = 0;      // resident, non-persistent
  // The order of the previous iteration's uses, each unit's positions in
  // it, the running sum of bytes along it, and where this iteration is.
  std::vector<int> trace_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<uint64_t>> positions_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> trace_bytes_ ABSL_GUARDED_BY(mu_);
  int64_t cursor_ ABSL_GUARDED_BY(mu_) = -1;
  bool on_trace_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<int> recording_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_after_use_ ABSL_GUARDED_BY(mu_);
  ParamCacheStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace offload::gpu

#endif  // OFFLOADD_GPU_PARAM_CACHE_H_
