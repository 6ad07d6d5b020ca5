#include "engine/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace offload {

absl::Status ValidateLossScaling(const LossScalingOptions& o) {
  auto bad = [](const char* field, double v, const char* want) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_scaling.", field, " must be ", want, ", got ", v));
  };
  // (The trainer scales its loss by it in fp32 or lower.)
  if (!(o.initial_scale > 0 && o.initial_scale <= std::numeric_limits<float>::max())) {
    return bad("initial_scale", o.initial_scale, "positive and at most fp32's largest");
  }
  // (Each step's gradients are multiplied by 1 / scale in fp32: it must fit.)
  if (!std::isfinite(o.min_scale) || o.min_scale < 1.0 / std::numeric_limits<float>::max() ||
      o.min_scale > o.initial_scale) {
    return bad("min_scale", o.min_scale,
               "at least 1 / fp32's largest (its reciprocal scales the gradients) and at most "
               "initial_scale");
  }
  if (o.growth_interval < 1) return bad("growth_interval", o.growth_interval, "at least 1");
  if (!std::isfinite(o.growth_factor) || o.growth_factor < 1) {
    return bad("growth_factor", o.growth_factor, "at least 1");
  }
  if (!(o.backoff_factor > 0 && o.backoff_factor <= 1)) {
    return bad("backoff_factor", o.backoff_factor, "in (0, 1]");
  }
  if (o.hysteresis < 1) return bad("hysteresis", o.hysteresis, "at least 1");
  return absl::OkStatus();
}

LossScaler::LossScaler(const LossScalingOptions& options)
    : options_(options), scale_(options.initial_scale), hysteresis_left_(options.hysteresis) {}

double LossScaler::scale() const {
  absl::MutexLock lock(&mu_);
  return scale_;
}

void LossScaler::Update(bool overflow) {
  absl::MutexLock lock(&mu_);
  if (overflow) {
    clean_steps_ = 0;
    if (hysteresis_left_ <= 1) {
      // From here every overflow lowers it, until it grows again.
      scale_ = std::max(scale_ * options_.backoff_factor, options_.min_scale);
    } else {
      --hysteresis_left_;
    }
    return;
  }
  if (++clean_steps_ >= options_.growth_interval) {
    clean_steps_ = 0;
    // Grown while fp32 holds it (as torch's GradScaler: only to a finite
    // scale); an infinite one would overflow every step after, for good.
    const double grown = scale_ * options_.growth_factor;
    if (grown <= std::numeric_limits<float>::max()) scale_ = grown;
    hysteresis_left_ = options_.hysteresis;
  }
}

}  // namespace offload

namespace offload {

LossScaler::State LossScaler::state() const {
  absl::MutexLock lock(&mu_);
  return State{scale_, hysteresis_left_, clean_steps_};
}

absl::Status LossScaler::Restore(const State& s) {
  if (!(s.scale >= options_.min_scale) || !std::isfinite(s.scale) || s.hysteresis_left < 0 ||
      s.hysteresis_left > options_.hysteresis || s.clean_steps < 0 ||
      s.clean_steps > options_.growth_interval) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss scaler state (scale ", s.scale, ", hysteresis left ", s.hysteresis_left,
                     ", clean steps ", s.clean_steps, ") does not fit its options"));
  }
  absl::MutexLock lock(&mu_);
  scale_ = s.scale;
  hysteresis_left_ = s.hysteresis_left;
  clean_steps_ = s.clean_steps;
  return absl::OkStatus();
}

}  // namespace offload
