// The step runner: carries out one session's optimizer step.
//
//   1. Validate the hyperparameters (INVALID_ARGUMENT changes nothing).
//   2. PartitionSet::BeginStep pins every partition whose gradients were
//      returned (waiting for the session's previous step to end).
//   3. Outside every engine lock: on a partition's first step, initialise its
//      fp32 master copy from the working copy; run the optimizer pool over
//      all pinned partitions (cpu_adam/optimizer.h, which takes only its own
//      lock).
//   4. PartitionSet::EndStep unpins them: applied (steps advance), skipped
//      (non-finite gradients: consumed, nothing else changes) or failed
//      (nothing changes).
//
// The step protocol of the coming issues (accumulation, global clipping,
// an update overlapped with the next forward pass, the delayed parameter
// update) lands here; the store stays the owner of the bytes.
//
// Thread-safety: Run() may be called from any thread, for any sets at once;
// steps of different sessions share the optimizer pool.
#ifndef OFFLOADD_ENGINE_STEP_RUNNER_H_
#define OFFLOADD_ENGINE_STEP_RUNNER_H_

#include <cstdint>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cpu_adam/adam.h"
#include "cpu_adam/optimizer.h"
#include "engine/partition_store.h"
#include "engine/stats.h"

namespace offload {

struct StepSummary {
  uint64_t partitions_updated = 0;
  uint64_t params_updated = 0;
  // Non-finite gradients were found: nothing was updated, step counts did
  // not advance, and the partitions need fresh gradients.
  bool skipped = false;
  uint64_t nonfinite = 0;
};

// Named points inside Run(), for tests that need a deterministic
// interleaving with other calls (RocksDB's sync points, in small).
enum class StepPoint {
  kPinned,     // after BeginStep, before the optimizer runs
  kOptimized,  // after the optimizer, before EndStep
};

class StepRunner {
 public:
  // `optimizer` and `stats` must outlive the runner.
  StepRunner(Optimizer* optimizer, Stats* stats) : optimizer_(optimizer), stats_(stats) {}

  absl::StatusOr<StepSummary> Run(PartitionSet& set, const AdamHyperparams& h);

  // `hook` runs on the stepping thread at each StepPoint, with no engine
  // lock held; it may block. Tests only.
  void SetSyncPointForTesting(std::function<void(StepPoint)> hook) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Sync(StepPoint point) ABSL_LOCKS_EXCLUDED(mu_);

  Optimizer* const optimizer_;
  Stats* const stats_;
  absl::Mutex mu_;
  std::function<void(StepPoint)> sync_point_ ABSL_GUARDED_BY(mu_);
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_STEP_RUNNER_H_
