// Adam / AdamW on raw spans: the hyperparameters, the per-step constants, and
// the scalar reference kernel that every vectorised kernel is tested against.
//
// Semantics follow torch.optim.Adam / AdamW (PyTorch 1.13): constants derived
// from the step number are computed in double, as Python does, then rounded
// to float once. The kernel reads gradients in fp32/bf16/fp16, updates fp32
// master weights and moments in place and, in the same pass, may write the
// working copy as fp32, bf16 or fp16.
//
// Kernels are pure functions of their arguments; callers split work into
// disjoint ranges to run them in parallel.
#ifndef OFFLOADD_CPU_ADAM_ADAM_H_
#define OFFLOADD_CPU_ADAM_ADAM_H_

#include <cstddef>
#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "cpu_adam/dtype.h"
#include "cpu_adam/types.h"

namespace offload {

// INVALID_ARGUMENT naming the offending field when a value is out of range
// (negative lr, beta outside [0, 1), non-positive eps, grad_scale not finite
// and positive, NaN anywhere).
absl::Status ValidateHyperparams(const AdamHyperparams& h);

// Everything the element loop needs, for one partition at one step (step is
// the 1-based count including this update).
struct AdamStepConstants {
  float grad_scale;
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float neg_step_size;          // -lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  // 1 / bias_correction2_sqrt rounded to float, or 0 where the vector
  // kernels must divide (see AdamScalar).
  float inv_bias_correction2_sqrt;
  float eps;
  float decay_factor;  // AdamW: 1 - lr * wd; else 1
  float l2;            // Adam: wd; else 0
};

AdamStepConstants ComputeStepConstants(const AdamHyperparams& h, uint64_t step);

// One contiguous range of a partition. `grads` holds `numel` elements of
// `grad_dtype`; `working` (if non-null) receives `numel` elements of
// `working_dtype`.
struct AdamSpan {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  const void* grads = nullptr;
  DType grad_dtype = DType::kFp32;
  void* working = nullptr;
  DType working_dtype = DType::kFp32;
  size_t numel = 0;
};

// The scalar reference kernel. Per element, in this order, fusing exactly
// the multiply-adds marked fma (each one rounding) and no others. This is the
// operation sequence of torch 1.13's single-tensor Adam/AdamW on CPU, so the
// results match torch bit for bit; the vector kernels give the same results
// (the same IEEE operations but for the one division below, exact for the
// divisors checked), so all kernels agree bit for bit too:
//   g = grad * grad_scale
//   g = fma(p, l2, g)                            (Adam with weight decay)
//   p = p * decay_factor                         (AdamW)
//   m = fma(g, 1 - beta1, m * beta1)
//   v = fma((1 - beta2) * g, g, v * beta2)
//   d = sqrt(v) / bias_correction2_sqrt + eps
//   p = p + (neg_step_size * m) / d
//   working = round(p)                           (if requested)
// The vector kernels divide by bias_correction2_sqrt (b, the same for every
// element) without a divide instruction where inv_bias_correction2_sqrt
// (y = RN(1/b)) is set: q = RN(a * y), r = RN(a - b * q) (one fma),
// q' = RN(q + r * y) (one fma), the "one multiplication and two fused
// multiply-adds" of Brisebarre, Muller and Raina (IEEE Trans. Computers,
// 2004). For some divisors b it gives RN(a/b) for every a; which ones
// depends on b, and no proof is offered here: checked against the divide
// instruction over every float
// significand of a for every divisor in kernels_test (those of real steps
// included) and, outside the tests (cpu_adam:division_sweep), for every
// divisor of every step with beta2 0.9, 0.95, 0.98, 0.99, 0.995, 0.997,
// 0.999, 0.9995 or 0.9999 (98,389 divisors) and for every one of the 2^23
// divisor significands (benches/RESULTS.md, cpu_adam): no difference. It
// holds where no step underflows or
// overflows: ComputeStepConstants sets y only for b in [2^-30, 1], and
// a = sqrt(v) lies in [2^-75, 2^64]. Inf and NaN take q (r is NaN there);
// a = -0 gives +0, which the + eps that follows makes equal.
// One divide instead of two: where the state is in cache the divider bounds
// the step (1M parameters: 1.27-1.31x faster); where it streams from memory
// this changes nothing measurable.
void AdamScalar(const AdamStepConstants& c, const AdamSpan& span);

// Number of NaN or infinite values among `n` gradients of `dtype`.
uint64_t CountNonFiniteScalar(const void* grads, DType dtype, size_t n);

// What a gradient accumulation pass measures (accumulate.h; GradStats in
// types.h): its squared norm is summed in fp32 within blocks of this many
// values and in double across blocks, in block order.
inline constexpr size_t kGradStatsBlock = 1024;

// One instruction set's kernels. The vectorised ones live in their own
// targets (adam_avx2, adam_avx512) compiled with their own -m flags;
// kernel_select.h picks one at run time.
struct AdamKernels {
  const char* name;
  void (*adam)(const AdamStepConstants& c, const AdamSpan& span);
  uint64_t (*count_nonfinite)(const void* grads, DType dtype, size_t n);
  // AccumulateGrads (accumulate.h), bit for bit (`acc` null: measure only).
  GradStats (*accumulate)(const void* grads, DType dtype, float* acc, size_t n, bool first);
};

const AdamKernels& ScalarAdamKernels();

}  // namespace offload

#endif  // OFFLOADD_CPU_ADAM_ADAM_H_
