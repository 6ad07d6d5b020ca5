#include "engine/stats.h"

namespace offload {

std::vector<CounterValue> Stats::Snapshot() const {
  auto v = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
  return {
      {"sessions_opened", v(sessions_opened), "sessions"},
      {"sessions_closed", v(sessions_closed), "sessions"},
      {"sessions_abandoned", v(sessions_abandoned), "sessions"},
      {"partitions_registered", v(partitions_registered), "partitions"},
      {"arena_attaches", v(arena_attaches), "attaches"},
      {"fetches", v(fetches), "partitions"},
      {"gradients_returned", v(gradients_returned), "partitions"},
      {"steps", v(steps), "steps"},
      {"steps_skipped_nonfinite", v(steps_skipped), "steps"},
      {"params_updated", v(params_updated), "params"},
      {"step_time", v(step_nanos) / 1000, "us"},
      {"waits_for_step", v(waits_for_step), "calls"},
      {"requests_failed", v(requests_failed), "requests"},
  };
}

}  // namespace offload
