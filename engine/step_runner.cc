#include "engine/step_runner.h"

#include <algorithm>
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
  std::vector<ItemOutcome> outcomes(items.size());
  for (size_t i = 0; i < items.size(); ++i) outcomes[i].next_chunk = items[i].first_chunk;

  std::vector<AdamTask> all;
  all.reserve(items.size());
  for (const StepItem& item : items) all.push_back(item.task);
  const uint64_t nonfinite = optimizer_->CountNonFinite(all);
  const bool resuming = std::any_of(items.begin(), items.end(),
                                    [](const StepItem& item) { return item.first_chunk != 0; });
  if (nonfinite != 0 && resuming) {
    // Part of the step was applied with these gradients, when they were
    // finite: the trainer changed them since. Nothing changes; the step can
    // still be resumed with the gradients it started with.
    Sync(StepPoint::kOptimized);
    set.EndStep(items, outcomes);
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", set.session_id(), ": the gradients of a step that stopped midway now hold ",
        nonfinite, " NaN/Inf values; they must stay as returned until that step completes"));
  }
  if (nonfinite != 0) {
    Sync(StepPoint::kOptimized);
    for (ItemOutcome& o : outcomes) o.outcome = StepOutcome::kSkipped;
    set.EndStep(items, outcomes);
    stats_->steps_skipped.fetch_add(1, std::memory_order_relaxed);
    StepSummary skipped;
    skipped.skipped = true;
    skipped.nonfinite = nonfinite;
    skipped.wall_nanos = NanosSince(start);
    return skipped;
  }

  // Units of work: (item, chunk), in order.
  struct Unit {
    size_t item;
    uint64_t chunk;
  };
  std::vector<Unit> units;
  for (size_t i = 0; i < items.size(); ++i) {
    const uint64_t chunks = set.StateChunks(items[i].id);
    for (uint64_t c = items[i].first_chunk; c < chunks; ++c) units.push_back({i, c});
  }

  // Small enough to leave the pool's cache to prefetch and write-back (the
  // arena's pages count against the same pool), large enough to keep the
  // optimizer's threads busy.
  const uint64_t group_limit = std::min<uint64_t>(pool_->limit() / 8, uint64_t{256} << 20);
  absl::Status status;
  StepSummary summary;
  int64_t wait_nanos = 0, compute_nanos = 0;
  size_t next = 0;
  while (next < units.size() && status.ok()) {
    const size_t first = next;
    std::vector<StatePins> pins;
    std::vector<AdamTask> tasks;
    std::vector<bool> init_master;
    uint64_t group_bytes = 0;
    const auto pinning = std::chrono::steady_clock::now();
    while (next < units.size()) {
      const StepItem& item = items[units[next].item];
      absl::StatusOr<StatePins> got = set.PinState(item.id, units[next].chunk);
      if (!got.ok()) {
        // The pool is full of this group: update it, then try again.
        if (!tasks.empty() && absl::IsResourceExhausted(got.status())) break;
        status = absl::Status(
            got.status().code(),
            absl::StrCat("step of session ", set.session_id(), " stopped at state chunk ",
                         units[next].chunk, " of partition ", item.id,
                         " (the next Step resumes there): ", got.status().message()));
        break;
      }
      const uint64_t begin = got->begin, n = got->end - got->begin;
      AdamTask task = item.task;
      AdamSpan& span = task.span;
      span.grads = static_cast<const std::byte*>(span.grads) + begin * DTypeSize(span.grad_dtype);
      span.working = static_cast<std::byte*>(span.working) + begin * DTypeSize(span.working_dtype);
      span.numel = n;
      span.master = reinterpret_cast<float*>(got->master.data());
      span.exp_avg = reinterpret_cast<float*>(got->exp_avg.data());
      span.exp_avg_sq = reinterpret_cast<float*>(got->exp_avg_sq.data());
      tasks.push_back(task);
      init_master.push_back(item.init_master);
      pins.push_back(*std::move(got));
      group_bytes += n * kStateBytesPerParam;
      ++next;
      if (group_bytes >= group_limit) break;
    }
    wait_nanos += NanosSince(pinning);
    if (tasks.empty()) break;
    const auto computing = std::chrono::steady_clock::now();
    for (size_t t = 0; t < tasks.size(); ++t) {
      const AdamSpan& span = tasks[t].span;
      if (init_master[t]) WidenToFloat(span.working, span.working_dtype, span.master, span.numel);
    }
    absl::Status updated = optimizer_->Update(tasks, h);
    compute_nanos += NanosSince(computing);
    if (!updated.ok()) {
      status = updated;
      next = first;
      break;
    }
    for (size_t u = first; u < first + tasks.size(); ++u) {
      outcomes[units[u].item].next_chunk = units[u].chunk + 1;
      summary.params_updated += tasks[u - first].span.numel;
    }
  }
  for (size_t i = 0; i < items.size(); ++i) {
    if (outcomes[i].next_chunk == set.StateChunks(items[i].id)) {
      outcomes[i].outcome = StepOutcome::kApplied;
      ++summary.partitions_updated;
    }
  }
  Sync(StepPoint::kOptimized);
  set.EndStep(items, outcomes);
  stats_->step_state_wait_nanos.fetch_add(wait_nanos, std::memory_order_relaxed);
  stats_->step_compute_nanos.fetch_add(compute_nanos, std::memory_order_relaxed);
  stats_->params_updated.fetch_add(static_cast<int64_t>(summary.params_updated),
                                   std::memory_order_relaxed);
  if (!status.ok()) return status;
  summary.wall_nanos = NanosSince(start);
  summary.state_wait_nanos = wait_nanos;
  summary.compute_nanos = compute_nanos;
  stats_->steps.fetch_add(1, std::memory_order_relaxed);
  stats_->step_nanos.fetch_add(summary.wall_nanos, std::memory_order_relaxed);
  return summary;
}

}  // namespace offload
