// Dynamic loss scaling for fp16 training, per session, driven by the global
// overflow decision of each step (the trainer combines every rank's
// overflow flag with its own collective and tells the daemon).
//
// The rule is DeepSpeed's DynamicLossScaler (with hysteresis, not
// consecutive): an overflowing step is skipped; it lowers the scale by
// `backoff_factor` (never below `min_scale`) from the `hysteresis`-th
// overflow since the scale last grew on (each further one lowers it
// again); `growth_interval` steps without an overflow since the last one
// raise it by `growth_factor`.
// bf16 and fp32 training need none: a session without LossScaling has no
// scale (1).
//
// Thread-safe.
#ifndef OFFLOADD_ENGINE_LOSS_SCALER_H_
#define OFFLOADD_ENGINE_LOSS_SCALER_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace offload {

struct LossScalingOptions {
  double initial_scale = 65536;
  int64_t growth_interval = 1000;
  double growth_factor = 2;
  double backoff_factor = 0.5;
  int64_t hysteresis = 2;
  double min_scale = 1;
};

// INVALID_ARGUMENT naming the field for values the rule cannot use.
absl::Status ValidateLossScaling(const LossScalingOptions& o);

class LossScaler {
 public:
  explicit LossScaler(const LossScalingOptions& options);

  double scale() const ABSL_LOCKS_EXCLUDED(mu_);
  // Everything that changes, for checkpoints.
  struct State {
    double scale = 0;
    int64_t hysteresis_left = 0;
    int64_t clean_steps = 0;
  };
  State state() const ABSL_LOCKS_EXCLUDED(mu_);
  // INVALID_ARGUMENT for a state these options could not reach (a scale
  // that is not finite and positive, counters out of range).
  absl::Status Restore(const State& state) ABSL_LOCKS_EXCLUDED(mu_);
  const LossScalingOptions& options() const { return options_; }
  // The outcome of one step: whether any rank overflowed.
  void Update(bool overflow) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const LossScalingOptions options_;
  mutable absl::Mutex mu_;
  double scale_ ABSL_GUARDED_BY(mu_);
  int64_t hysteresis_left_ ABSL_GUARDED_BY(mu_);
  int64_t clean_steps_ ABSL_GUARDED_BY(mu_) = 0;  // since the last overflow or growth
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_LOSS_SCALER_H_
