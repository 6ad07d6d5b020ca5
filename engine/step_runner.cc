#include "engine/step_runner.h"

#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "cpu_adam/dtype.h"

namespace offload {
namespace {

int64_t NanosSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              start)
      .count();
}

constexpr uint64_t kStateBytesPerParam = 3 * sizeof(float);

}  // namespace

void StepRunner::SetSyncPointForTesting(std::function<void(StepPoint)> hook) {
  absl::MutexLock lock(&mu_);
  sync_point_ = std::move(hook);
}

void StepRunner::Sync(StepPoint point) {
  std::function<void(StepPoint)> hook;
  {
    absl::MutexLock lock(&mu_);
    hook = sync_point_;
  }
  if (hook) hook(point);
}

absl::StatusOr<StepSummary> StepRunner::Run(PartitionSet& set, const AdamHyperparams& h) {
  RETURN_IF_ERROR(ValidateHyperparams(h));
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(std::vector<StepItem> items, set.BeginStep());
  Sync(StepPoint::kPinned);
  std::vector<StepOutcome> outcomes(items.size(), StepOutcome::kFailed);

  std::vector<AdamTask> all;
  all.reserve(items.size());
  for (const StepItem& item : items) all.push_back(item.task);
  const uint64_t nonfinite = optimizer_->CountNonFinite(all);
  if (nonfinite != 0) {
    Sync(StepPoint::kOptimized);
    outcomes.assign(items.size(), StepOutcome::kSkipped);
    set.EndStep(items, outcomes);
    stats_->steps_skipped.fetch_add(1, std::memory_order_relaxed);
    return StepSummary{0, 0, true, nonfinite};
  }

  const uint64_t group_limit = pool_->limit() / 4;
  absl::Status status;
  StepSummary summary;
  int64_t wait_nanos = 0, compute_nanos = 0;
  size_t next = 0;
  while (next < items.size() && status.ok()) {
    const size_t first = next;
    std::vector<StatePins> pins;
    std::vector<AdamTask> tasks;
    uint64_t group_bytes = 0;
    const auto pinning = std::chrono::steady_clock::now();
    while (next < items.size()) {
      const uint64_t bytes = items[next].task.span.numel * kStateBytesPerParam;
      if (!tasks.empty() && group_bytes + bytes > group_limit) break;
      absl::StatusOr<StatePins> got = set.PinState(items[next].id);
      if (!got.ok()) {
        // The pool is full of this group: update it, then try again.
        if (!tasks.empty() && absl::IsResourceExhausted(got.status())) break;
        status = absl::Status(
            got.status().code(),
            absl::StrCat("step of session ", set.session_id(), " stopped at partition ",
                         items[next].id, " (", next, " of ", items.size(),
                         " partitions updated): ", got.status().message()));
        break;
      }
      AdamTask task = items[next].task;
      task.span.master = reinterpret_cast<float*>(got->master.data());
      task.span.exp_avg = reinterpret_cast<float*>(got->exp_avg.data());
      task.span.exp_avg_sq = reinterpret_cast<float*>(got->exp_avg_sq.data());
      if (items[next].init_master) {
        WidenToFloat(task.span.working, task.span.working_dtype, task.span.master, task.span.numel);
      }
      tasks.push_back(task);
      pins.push_back(*std::move(got));
      group_bytes += bytes;
      ++next;
    }
    wait_nanos += NanosSince(pinning);
    if (tasks.empty()) break;
    const auto computing = std::chrono::steady_clock::now();
    absl::Status updated = optimizer_->Update(tasks, h);
    compute_nanos += NanosSince(computing);
    if (!updated.ok()) {
      status = updated;
      next = first;
      break;
    }
    for (size_t i = first; i < first + tasks.size(); ++i) {
      outcomes[i] = StepOutcome::kApplied;
      summary.params_updated += items[i].task.span.numel;
      ++summary.partitions_updated;
    }
  }
  Sync(StepPoint::kOptimized);
  set.EndStep(items, outcomes);
  stats_->step_state_wait_nanos.fetch_add(wait_nanos, std::memory_order_relaxed);
  stats_->step_compute_nanos.fetch_add(compute_nanos, std::memory_order_relaxed);
  if (!status.ok()) return status;
  stats_->steps.fetch_add(1, std::memory_order_relaxed);
  stats_->params_updated.fetch_add(static_cast<int64_t>(summary.params_updated),
                                   std::memory_order_relaxed);
  stats_->step_nanos.fetch_add(NanosSince(start), std::memory_order_relaxed);
  return summary;
}

}  // namespace offload
