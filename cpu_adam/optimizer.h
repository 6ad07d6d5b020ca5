// The daemon's CPU optimizer: runs Adam over many partitions at once on one
// oneTBB arena that it owns (the only optimizer thread pool in the process),
// with the kernels kernel_select.h picks for this CPU.
//
// Three kinds of work share the pool's cores:
// - Updates (Step, Update) run in the first arena.
// - Accumulations a trainer waits for (inside ReturnGradients) run in a
//   second arena of the same size at high priority, so the pool's threads
//   move to it at their next tile instead of finishing a background update
//   first (which put the update on the trainer's timeline). While an update
//   runs, its threads also take such an accumulation's tiles at their next
//   tile boundary: the update's calling thread is a master that oneTBB never
//   moves to another arena, and the pool's thread moves only once the
//   update's run ends.
// - Measuring only (no accumulator: gradients handed over) waits for nobody
//   but the step. It runs in the update's arena, whose slots (oneTBB gives
//   an arena max(2, threads)) cap the threads computing in it: when the
//   update's threads fill them, the call is queued for those threads (the
//   update's caller may run it inside its own Update) instead of adding a
//   thread beside them, as the high-priority arena did. With one thread the
//   arena's second slot lets it run beside the update.
// What each of these gains the delayed update: benches/RESULTS.md,
// step_overlap.
//
// Thread-safety: Step() may be called from several threads at once (each
// call joins the same arena); the setters wait for running steps to finish.
#ifndef OFFLOADD_CPU_ADAM_OPTIMIZER_H_
#define OFFLOADD_CPU_ADAM_OPTIMIZER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "cpu_adam/accumulate.h"
#include "cpu_adam/adam.h"
#include "cpu_adam/optimizer_options.h"
#include "tbb/task_arena.h"

namespace offload {

// One partition's update: the spans plus its 1-based step number, and the
// hyperparameters of its group when they differ from the call's (torch's
// param groups: another lr, no weight decay, ...).
struct AdamTask {
  AdamSpan span;
  uint64_t step = 1;
  const AdamHyperparams* hyperparams = nullptr;  // null: the call's
};

// One micro-batch's gradients added into an accumulator (accumulate.h).
struct AccumulateTask {
  const void* grads = nullptr;
  DType grad_dtype = DType::kFp32;
  // Null: measure only. The statistics are those accumulating into an
  // empty accumulator would give (first), and nothing is written: gradients
  // that the step will read where they are (the engine's hand-over).
  float* acc = nullptr;
  uint64_t numel = 0;
  bool first = false;  // the accumulator holds nothing yet: copy
};

struct StepReport {
  // True when non-finite gradients were found; nothing was changed then.
  bool skipped = false;
  uint64_t nonfinite = 0;
};

class Optimizer {
 public:
  // Uses options.kernel if this CPU supports it, else "auto"; call
  // SetKernel() to get the error instead.
  explicit Optimizer(const OptimizerOptions& options);
  ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Applies one Adam step to every task. INVALID_ARGUMENT for bad
  // hyperparameters (nothing is changed then).
  absl::StatusOr<StepReport> Step(absl::Span<const AdamTask> tasks, const AdamHyperparams& h);

  // A step in several calls, for state that is not all in memory at once:
  // CountNonFinite scans the gradients of every task first (only the grads
  // and numel of each span are read; 0 when check_finite is off), then
  // Update applies the update to one group of tasks at a time, without a
  // scan.
  uint64_t CountNonFinite(absl::Span<const AdamTask> tasks);
  absl::Status Update(absl::Span<const AdamTask> tasks, const AdamHyperparams& h);

  // Accumulates every task on the pool; the statistics of the accumulated
  // values, summed over tiles in a fixed order (the same bits every run
  // for the same tile size).
  GradStats Accumulate(absl::Span<const AccumulateTask> tasks);

  // INVALID_ARGUMENT outside kOptimizerThreadsRange / kOptimizerTileElemsRange.
  absl::Status SetThreads(int64_t threads);
  absl::Status SetTileElems(int64_t tile_elems);
  // FAILED_PRECONDITION if the CPU lacks the instruction set.
  absl::Status SetKernel(const std::string& name);
  void SetCheckFinite(bool check);
  bool check_finite() const;

  // Threads actually in use (0 resolved to the CPU count).
  int threads() const;
  // Tiles of accumulations that a running update's threads took (see the
  // top of this file), since construction.
  uint64_t tiles_helped() const;
  std::string kernel_name() const;

 private:
  struct Tile {
    size_t task;
    size_t begin;
    size_t end;
  };
  std::vector<Tile> MakeTiles(absl::Span<const AdamTask> tasks) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Tiles over tasks of the given sizes.
  std::vector<Tile> MakeTilesOf(absl::Span<const uint64_t> numels) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Runs `fn` over the tiles in `arena` (arena_ or urgent_arena_).
  template <typename Fn>
  void ParallelTiles(tbb::task_arena& arena, const std::vector<Tile>& tiles, Fn&& fn)
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void MakeArenasLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t CountNonFiniteLocked(absl::Span<const AdamTask> tasks, const std::vector<Tile>& tiles)
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void UpdateLocked(absl::Span<const AdamTask> tasks, const AdamHyperparams& h,
                    const std::vector<Tile>& tiles) ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // An accumulation a trainer waits for, offered to running updates' threads.
  struct UrgentJob;
  // At an update's tile: takes tiles of offered accumulations until none is left.
  void HelpUrgent() ABSL_LOCKS_EXCLUDED(urgent_mu_);

  mutable absl::Mutex mu_;
  absl::Mutex urgent_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::vector<UrgentJob*> urgent_jobs_ ABSL_GUARDED_BY(urgent_mu_);
  std::atomic<int> urgent_offered_{0};   // urgent_jobs_.size(), read at every tile
  std::atomic<int> updates_running_{0};  // UpdateLocked calls inside ParallelTiles
  std::atomic<uint64_t> tiles_helped_{0};
  std::unique_ptr<tbb::task_arena> arena_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<tbb::task_arena> urgent_arena_ ABSL_GUARDED_BY(mu_);  // accumulation
  int threads_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t tile_elems_ ABSL_GUARDED_BY(mu_);
  const AdamKernels* kernels_ ABSL_GUARDED_BY(mu_);
  bool check_finite_ ABSL_GUARDED_BY(mu_);
};

}  // namespace offload

#endif  // OFFLOADD_CPU_ADAM_OPTIMIZER_H_
