#include "engine/step_runner.h"

#include <chrono>
#include <vector>

#include "base/status_macros.h"
#include "cpu_adam/dtype.h"

namespace offload {

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
  std::vector<AdamTask> tasks;
  tasks.reserve(items.size());
  StepSummary summary;
  for (const StepItem& item : items) {
    const AdamSpan& s = item.task.span;
    if (item.init_master) WidenToFloat(s.working, s.working_dtype, s.master, s.numel);
    tasks.push_back(item.task);
    summary.params_updated += s.numel;
  }
  absl::StatusOr<StepReport> report = optimizer_->Step(tasks, h);
  Sync(StepPoint::kOptimized);
  if (!report.ok()) {
    set.EndStep(items, StepOutcome::kFailed);
    return report.status();
  }
  if (report->skipped) {
    set.EndStep(items, StepOutcome::kSkipped);
    stats_->steps_skipped.fetch_add(1, std::memory_order_relaxed);
    return StepSummary{0, 0, true, report->nonfinite};
  }
  set.EndStep(items, StepOutcome::kApplied);
  summary.partitions_updated = items.size();
  stats_->steps.fetch_add(1, std::memory_order_relaxed);
  stats_->params_updated.fetch_add(static_cast<int64_t>(summary.params_updated),
                                   std::memory_order_relaxed);
  stats_->step_nanos.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now() - start)
                                   .count(),
                               std::memory_order_relaxed);
  return summary;
}

}  // namespace offload
