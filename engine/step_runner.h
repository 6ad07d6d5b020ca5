// The step runner: carries out one session's optimizer step, and the
// accumulation of returned gradients that precedes it.
//
// Returning gradients (Accumulate): the trainer's micro-batch gradients
// (fp32, bf16 or fp16, in its held gradient buffer) are added into the
// partition's fp32 accumulator (a swapper block placed like optimizer
// state) chunk by chunk, in one pass that also sums the squares and counts
// the non-finite values of the accumulated gradient; the buffer is handed
// back at once. The step then reads the accumulator.
//
//   1. Validate the hyperparameters (INVALID_ARGUMENT changes nothing).
//   2. PartitionStore::BeginStep pins every partition whose gradients were
//      returned (waiting for the session's previous step to end).
//   3. Non-finite gradients, counted when they were accumulated (see
//      Accumulate), skip the whole step (with optimizer.check_finite), as
//      does an explicit skip.
//   4. Stream the update, in the order the next iteration will wait for its
//      partitions (PartitionStore::BeginStep), through groups of chunks
//      pinned at once (at most an eighth of the host pool, and 256 MiB): pin
//      a group's optimizer state, parameters and gradients (the swapper
//      reads in what is on NVMe; its prefetch, which has learned this order
//      from earlier steps, is already reading the next groups), initialise
//      master copies on first steps, update, unpin, drop the consumed
//      gradients (the swapper writes the rest back when it needs the room,
//      while later groups compute). So with data on NVMe, reading group
//      i+1, updating i and writing i-1 overlap, in bounded memory. A group
//      is updated in runs that end with a partition or with the group
//      (batching small partitions to kMinRunElems, step_runner.cc), and
//      each partition leaves the step as soon as its run is done.
//   5. PartitionStore::EndStep unpins the partitions: applied, skipped
//      (non-finite gradients: consumed, nothing else changes) or failed. A
//      swap-in that fails midway (or a full pool) stops the step with its
//      error; the groups before it stay applied, the rest keep their
//      gradients, and the next step finishes it alone. The session's step
//      count advances once a step is finished.
//
// The step protocol (accumulation, the decisions a step takes on clipping
// and overflow, the overlapped step, the delayed parameter update) lives
// here; the store stays the owner of the bytes.
//
// Thread-safety: Run() may be called from any thread, for any sets at once;
// steps of different sessions share the optimizer pool.
#ifndef OFFLOADD_ENGINE_STEP_RUNNER_H_
#define OFFLOADD_ENGINE_STEP_RUNNER_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cpu_adam/adam.h"
#include "cpu_adam/optimizer.h"
#include "engine/optimizer_shares.h"
#include "engine/partition_store.h"
#include "engine/stats.h"
#include "swapper/host_pool.h"

namespace offload {

struct StepSummary {
  uint64_t partitions_updated = 0;
  uint64_t params_updated = 0;
  // Non-finite gradients were found: nothing was updated, step counts did
  // not advance, and the partitions need fresh gradients.
  bool skipped = false;
  uint64_t nonfinite = 0;
  // Where the step's time went (nanoseconds): in all, waiting for optimizer
  // state to be pinned (swap-ins), and in the optimizer's update.
  int64_t wall_nanos = 0;
  int64_t state_wait_nanos = 0;
  int64_t compute_nanos = 0;
  // The session's loss scale after this step (1 without loss scaling).
  double loss_scale = 1;
  // Started overlapped (StepRunner::Start): the update runs on; the
  // figures above are the decision's, and the outcome comes later.
  bool running = false;
  // The session's delayed update was on (SessionManager::Step sets it).
  bool delayed_update = false;
};

// Hyperparameters of some partitions that differ from the step's (torch's
// param groups: another lr, no weight decay). The step's grad_scale (the
// global clip coefficient and loss scale) applies to every group.
struct ParamGroup {
  std::vector<uint64_t> partition_ids;
  AdamHyperparams hyperparams;
};

// Named points inside Run(), for tests that need a deterministic
// interleaving with other calls (RocksDB's sync points, in small).
enum class StepPoint {
  kPinned,       // after BeginStep, before the optimizer runs
  kGroupPinned,  // a group of chunks is pinned, before its update
  kRunDone,      // after one optimizer call over some of a group's chunks
                 // (ending where a partition does, or with the group), its
                 // finished partitions out of the step
  kGroupDone,    // after a group of chunks was updated and its finished
                 // partitions left the step
  kOptimized,    // after the optimizer, before EndStep
  kMeasuring,    // on the measuring thread, before it measures handed-over gradients
};

// The checks StepRunner::Accumulate makes of the trainer's statistics of
// partition `id`'s `numel` gradients (`given`): INVALID_ARGUMENT without
// `hand_over`, for a negative norm, a NaN one with no non-finite value
// counted, or more non-finite values than `numel`.
absl::Status CheckGivenGradStats(uint64_t id, uint64_t numel, bool hand_over,
                                 const GradStats& given);

class StepRunner {
 public:
  using Done = std::function<void(absl::StatusOr<StepSummary>)>;

  // `optimizer`, `pool` and `stats` must outlive the runner. Starts the
  // worker thread that runs overlapped steps.
  StepRunner(Optimizer* optimizer, const HostPool* pool, Stats* stats);
  // Runs the overlapped steps already started to their end.
  ~StepRunner();

  // Returns once no overlapped step or measurement is queued or running:
  // what they keep alive (a session and its manager's call reference) is
  // let go. The owner of those (SessionManager) calls it before it goes,
  // once nothing starts more.
  void Quiesce() ABSL_LOCKS_EXCLUDED(mu_);

  // How sessions stepping at once share the optimizer (by their stores'
  // share_weight), and what each used.
  OptimizerShares& shares() { return shares_; }

  // Adds a micro-batch's gradients (held by the trainer in partition
  // `id`'s gradient buffer) into the partition's fp32 accumulator, chunk
  // by chunk on the optimizer pool, measuring the accumulated values' norm
  // and non-finite count in the same pass (PartitionStore::BeginAccumulate
  // for the errors).
  //
  // `hand_over` (PartitionStore::BeginAccumulate): the gradients are only
  // measured, and stay for the step. Given `keep_alive` (what owns `set`),
  // the measuring runs on the runner's measuring thread and the call
  // returns once the request is checked: the trainer does not wait for it
  // (the buffer is the daemon's anyway); Pending, Step and a fetch of the
  // buffer wait for it, and if it fails the gradients are lost (the step
  // must be skipped), as for a failed addition.
  //
  // `given` (CheckGivenGradStats first): the trainer's statistics of the
  // buffer. On a step's first micro-batch they are taken as measured and
  // nothing reads the buffer before the step; on a later one they are
  // ignored (the sum is measured as it is added).
  absl::Status Accumulate(PartitionStore& set, uint64_t id, uint64_t numel, DType grad_dtype,
                          bool hand_over = false, std::shared_ptr<void> keep_alive = nullptr,
                          const std::optional<GradStats>& given = std::nullopt)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Gives the trainer back the handed-over gradient buffers of `ids` (empty:
  // all) that no step has read yet, copying their gradients into the
  // accumulators first (PartitionStore::BeginReclaim); a fetch with grads and
  // a checkpoint call it. The swapper's errors if a copy fails (the
  // gradients stay in the buffer then).
  absl::Status Reclaim(PartitionStore& set, absl::Span<const uint64_t> ids)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Whether a step skips itself where the gradients hold non-finite values
  // (optimizer.check_finite).
  bool check_finite() const { return optimizer_->check_finite(); }

  // One step over every partition with accumulated gradients; with `skip`,
  // the gradients are consumed and nothing else changes.
  // `groups`: INVALID_ARGUMENT for a partition named twice or bad
  // hyperparameters, NOT_FOUND for one the set does not hold.
  absl::StatusOr<StepSummary> Run(PartitionStore& set, const AdamHyperparams& h, bool skip = false,
                                  absl::Span<const ParamGroup> groups = {});

  // The overlapped step: decides as Run does (its errors, a skip) and
  // returns at once; the update runs on the runner's worker thread, in the
  // order the trainer fetched the partitions, each partition leaving the
  // step as soon as it is updated (so the next iteration's fetch of it
  // waits only for its own update). `done` gets the outcome (also when
  // the step ended at once); `keep_alive` holds what owns `set` until then.
  absl::StatusOr<StepSummary> Start(PartitionStore& set, std::shared_ptr<void> keep_alive,
                                    const AdamHyperparams& h, bool skip,
                                    absl::Span<const ParamGroup> groups, Done done);

  // `hook` runs on the stepping thread at each StepPoint, with no engine
  // lock held; it may block. Tests only.
  void SetSyncPointForTesting(std::function<void(StepPoint)> hook) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Sync(StepPoint point) ABSL_LOCKS_EXCLUDED(mu_);

  // A step decided and its partitions pinned (or, `done`, already ended).
  struct Prepared {
    std::chrono::steady_clock::time_point start;
    std::vector<StepItem> items;
    std::vector<ItemOutcome> outcomes;
    // The groups' hyperparameters; items' tasks point into it (a move keeps
    // the elements where they are).
    std::vector<AdamHyperparams> group_hyperparams;
    bool done = false;
    StepSummary summary;
  };
  absl::StatusOr<Prepared> Prepare(PartitionStore& set, const AdamHyperparams& h, bool skip,
                                   absl::Span<const ParamGroup> groups) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<StepSummary> Execute(PartitionStore& set, const AdamHyperparams& h,
                                      Prepared prepared) ABSL_LOCKS_EXCLUDED(mu_);
  struct Job {
    std::shared_ptr<void> keep_alive;
    PartitionStore* set = nullptr;
    AdamHyperparams h;
    Prepared prepared;
    Done done;
  };
  void Worker() ABSL_LOCKS_EXCLUDED(mu_);
  // Accumulates (or measures) `item` chunk by chunk and ends it.
  absl::Status AccumulateChunks(PartitionStore& set, const AccumulateItem& item)
      ABSL_LOCKS_EXCLUDED(mu_);
  struct Measure {
    std::shared_ptr<void> keep_alive;
    PartitionStore* set = nullptr;
    AccumulateItem item;
  };
  void Measurer() ABSL_LOCKS_EXCLUDED(mu_);
  // How long a background measurement waits for room in the pool.
  static constexpr absl::Duration kBackgroundRoomWait = absl::Seconds(5);

  Optimizer* const optimizer_;
  const HostPool* const pool_;
  Stats* const stats_;
  absl::Mutex mu_;
  std::function<void(StepPoint)> sync_point_ ABSL_GUARDED_BY(mu_);
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  std::deque<Measure> measures_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;  // jobs and measures taken, not yet let go
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;
  std::thread measurer_;  // handed-over gradients, measured in order
  OptimizerShares shares_;
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_STEP_RUNNER_H_
