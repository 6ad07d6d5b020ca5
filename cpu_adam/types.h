// The optimizer's vocabulary, without its kernels: the hyperparameters a
// step takes and the statistics of a gradient. The client library and the
// wire conversion use these (with dtype.h); the kernels are adam.h's.
#ifndef OFFLOADD_CPU_ADAM_TYPES_H_
#define OFFLOADD_CPU_ADAM_TYPES_H_

#include <cstdint>

namespace offload {

// Doubles, as Python passes them to torch: 1 - beta2 must be computed from
// 0.999, not from 0.999f (which differs by 1.3e-5 relative).
struct AdamHyperparams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // true: AdamW (weight decay applied to the parameter, decoupled from the
  // gradient); false: Adam with the L2 penalty added to the gradient.
  bool decoupled_weight_decay = true;
  bool bias_correction = true;
  // Gradients are multiplied by this first, in the same pass: the gradient
  // unscale and clip coefficient together (clip_coef / loss_scale).
  double grad_scale = 1.0;
};

// A gradient's squared norm and its count of non-finite values (measured
// by the accumulation kernels, or given by the trainer).
struct GradStats {
  double sq_norm = 0;      // sum of squares of the accumulated values (inf/NaN if any is)
  uint64_t nonfinite = 0;  // accumulated values that are NaN or +-Inf

  GradStats& operator+=(const GradStats& o) {
    sq_norm += o.sq_norm;
    nonfinite += o.nonfinite;
    return *this;
  }
};

}  // namespace offload

#endif  // OFFLOADD_CPU_ADAM_TYPES_H_
