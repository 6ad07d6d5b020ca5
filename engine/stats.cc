#include "engine/stats.h"

namespace offload {

std::vector<CounterValue> Stats::Snapshot() const {
  auto v = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
  return {
      {"sessions_opened", v(sessions_opened), "sessions"},
      {"sessions_closed", v(sessions_closed), "sessions"},
      {"sessions_abandoned", v(sessions_abandoned), "sessions"},
      {"sessions_expired", v(sessions_expired), "sessions"},
      {"checkpoints", v(checkpoints), "checkpoints"},
      {"auto_checkpoints", v(auto_checkpoints), "checkpoints"},
      {"auto_checkpoint_failures", v(auto_checkpoint_failures), "checkpoints"},
      {"partitions_registered", v(partitions_registered), "partitions"},
      {"arena_attaches", v(arena_attaches), "attaches"},
      {"fetches", v(fetches), "partitions"},
      {"gradients_returned", v(gradients_returned), "partitions"},
      {"gradient_stats_given", v(gradient_stats_given), "partitions"},
      {"steps", v(steps), "steps"},
      {"steps_skipped_nonfinite", v(steps_skipped), "steps"},
      {"steps_dropped", v(steps_dropped), "steps"},
      {"params_updated", v(params_updated), "params"},
      {"step_time", v(step_nanos) / 1000, "us"},
      {"step_state_wait_time", v(step_state_wait_nanos) / 1000, "us"},
      {"step_compute_time", v(step_compute_nanos) / 1000, "us"},
      {"waits_for_step", v(waits_for_step), "calls"},
      {"grad_holds_not_ready", v(grad_holds_not_ready), "calls"},
      {"requests_failed", v(requests_failed), "requests"},
      {"gpu_h2d_bytes", v(gpu_h2d_bytes), "bytes"},
      {"gpu_h2d_staged_bytes", v(gpu_h2d_staged_bytes), "bytes"},
      {"gpu_d2h_bytes", v(gpu_d2h_bytes), "bytes"},
      {"gpu_tensor_uses", v(gpu_tensor_uses), "uses"},
      {"gpu_resident_hits", v(gpu_resident_hits), "uses"},
      {"gpu_prefetch_hits", v(gpu_prefetch_hits), "uses"},
      {"gpu_host_waits", v(gpu_host_waits), "waits"},
      {"gpu_evictions", v(gpu_evictions), "tensors"},
  };
}

void AppendSwapperCounters(const SwapperStats& s, std::vector<CounterValue>* out) {
  auto add = [out](const char* name, uint64_t v, const char* unit) {
    out->push_back({name, static_cast<int64_t>(v), unit});
  };
  auto level = [out](const char* name, uint64_t v, const char* unit) {
    out->push_back({name, static_cast<int64_t>(v), unit, /*gauge=*/true});
  };
  level("swap_blocks", s.blocks, "blocks");
  level("swap_resident_bytes", s.resident_bytes, "bytes");
  level("swap_pinned_bytes", s.pinned_bytes, "bytes");
  level("swap_host_placed_bytes", s.host_home_bytes, "bytes");
  level("swap_nvme_placed_bytes", s.nvme_home_bytes, "bytes");
  add("swap_acquires", s.acquires, "acquires");
  add("swap_hits", s.hits, "acquires");
  add("swap_unlocked_pins", s.unlocked_pins, "acquires");  // of them, without the swapper's lock
  add("swap_waited_reads", s.waited_reads, "acquires");
  add("swap_misses", s.misses, "acquires");
  add("prefetch_issued", s.prefetches, "blocks");
  add("prefetch_used", s.prefetch_used, "blocks");
  add("prefetch_wasted", s.prefetch_wasted, "blocks");
  level("prefetch_pending", s.prefetch_pending, "blocks");
  add("swap_ins", s.swap_ins, "blocks");
  add("swap_outs", s.swap_outs, "blocks");
  add("swap_clean_drops", s.clean_drops, "blocks");
  add("swap_copy_outs", s.copy_outs, "blocks");
  add("swap_copy_out_bytes", s.copy_out_bytes, "bytes");
  add("swap_in_bytes", s.bytes_in, "bytes");
  add("swap_out_bytes", s.bytes_out, "bytes");
  add("swap_staged_bytes", s.staged_bytes, "bytes");
  add("swap_in_time", s.read_nanos / 1000, "us");
  add("swap_out_time", s.write_nanos / 1000, "us");
  add("swap_io_errors", s.io_errors, "errors");
  level("swap_io_queue", s.io_queue, "tasks");
  level("swap_io_oldest_running", s.io_oldest_running_seconds, "seconds");
  add("swap_order_relearned", s.relearned, "times");
  add("swap_order_passes", s.order_passes, "passes");
  add("swap_repages", s.repages, "blocks");
  add("swap_idle_evictions", s.idle_evictions, "blocks");
  add("swap_share_evictions", s.share_evictions, "blocks");
  add("swap_turns", s.turns, "turns");
}

}  // namespace offload
