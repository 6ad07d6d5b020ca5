// Daemon-wide counters. Incremented lock-free from any thread; read as a
// consistent-enough snapshot (each counter is atomic, the set is not).
#ifndef OFFLOADD_ENGINE_STATS_H_
#define OFFLOADD_ENGINE_STATS_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "swapper/swapper.h"

namespace offload {

struct CounterValue {
  std::string name;
  int64_t value;
  std::string unit;
  // Goes up and down (a level now), rather than only up.
  bool gauge = false;
};

struct Stats {
  std::atomic<int64_t> sessions_opened{0};
  std::atomic<int64_t> sessions_closed{0};
  std::atomic<int64_t> sessions_abandoned{0};
  std::atomic<int64_t> sessions_expired{0};  // never attached within the lease
  std::atomic<int64_t> partitions_registered{0};
  std::atomic<int64_t> arena_attaches{0};
  std::atomic<int64_t> fetches{0};
  std::atomic<int64_t> gradients_returned{0};
  // Of those, handed over with the trainer's own statistics (not measured).
  std::atomic<int64_t> gradient_stats_given{0};
  std::atomic<int64_t> steps{0};
  // Skipped for non-finite gradients (here, or an overflow on another rank).
  std::atomic<int64_t> steps_skipped{0};
  // Skipped because the trainer dropped what it had returned (a Step with
  // skip: zero_grad after a return, an iteration given up).
  std::atomic<int64_t> steps_dropped{0};
  std::atomic<int64_t> params_updated{0};
  std::atomic<int64_t> step_nanos{0};
  // Of that: waiting for optimizer state to be pinned (swap-ins), and in the
  // optimizer's update.
  std::atomic<int64_t> step_state_wait_nanos{0};
  std::atomic<int64_t> step_compute_nanos{0};
  // Fetches and gradient returns that found their partition in a running
  // step and waited for it to end.
  std::atomic<int64_t> waits_for_step{0};
  // Fetches of gradient buffers asked only if ready, refused (FetchMode::if_ready).
  std::atomic<int64_t> grad_holds_not_ready{0};
  std::atomic<int64_t> requests_failed{0};
  std::atomic<int64_t> checkpoints{0};  // written and committed (automatic ones too)
  // Automatic checkpoints (SessionManager::SetAutoCheckpoint) committed, and
  // those that failed (the session's previous one stays).
  std::atomic<int64_t> auto_checkpoints{0};
  std::atomic<int64_t> auto_checkpoint_failures{0};
  // What the trainers' GPU tiers reported (ReportGpuTier), summed.
  std::atomic<int64_t> gpu_h2d_bytes{0};
  std::atomic<int64_t> gpu_h2d_staged_bytes{0};
  std::atomic<int64_t> gpu_d2h_bytes{0};
  std::atomic<int64_t> gpu_tensor_uses{0};
  std::atomic<int64_t> gpu_resident_hits{0};
  std::atomic<int64_t> gpu_prefetch_hits{0};
  std::atomic<int64_t> gpu_host_waits{0};
  std::atomic<int64_t> gpu_evictions{0};

  std::vector<CounterValue> Snapshot() const;
};

// The swapper's counters and gauges, named "swap_*" / "prefetch_*".
void AppendSwapperCounters(const SwapperStats& s, std::vector<CounterValue>* out);

}  // namespace offload

#endif  // OFFLOADD_ENGINE_STATS_H_
