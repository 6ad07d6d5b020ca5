#include "cpu_adam/adam.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "cpu_adam/accumulate.h"

namespace offload {
namespace {

absl::Status Invalid(const char* field, double value, const char* want) {
  return absl::InvalidArgumentError(
      absl::StrCat("Adam hyperparameter ", field, " = ", value, ": must be ", want));
}

float LoadGrad(const void* g, DType t, size_t i) {
  switch (t) {
    case DType::kFp32:
      return static_cast<const float*>(g)[i];
    case DType::kBf16:
      return Bf16ToFloat(static_cast<const uint16_t*>(g)[i]);
    case DType::kFp16:
      return Fp16ToFloat(static_cast<const uint16_t*>(g)[i]);
  }
  return NAN;
}

void StoreWorking(void* w, DType t, size_t i, float value) {
  switch (t) {
    case DType::kFp32:
      static_cast<float*>(w)[i] = value;
      return;
    case DType::kBf16:
      static_cast<uint16_t*>(w)[i] = FloatToBf16(value);
      return;
    case DType::kFp16:
      static_cast<uint16_t*>(w)[i] = FloatToFp16(value);
      return;
  }
}

}  // namespace

absl::Status ValidateHyperparams(const AdamHyperparams& h) {
  if (!(h.lr >= 0.0) || !std::isfinite(h.lr)) return Invalid("lr", h.lr, "finite and >= 0");
  if (!(h.beta1 >= 0.0 && h.beta1 < 1.0)) return Invalid("beta1", h.beta1, "in [0, 1)");
  if (!(h.beta2 >= 0.0 && h.beta2 < 1.0)) return Invalid("beta2", h.beta2, "in [0, 1)");
  if (!(h.eps > 0.0) || !std::isfinite(h.eps)) return Invalid("eps", h.eps, "finite and > 0");
  if (!(h.weight_decay >= 0.0) || !std::isfinite(h.weight_decay)) {
    return Invalid("weight_decay", h.weight_decay, "finite and >= 0");
  }
  if (!(h.grad_scale > 0.0) || !std::isfinite(h.grad_scale) ||
      !std::isfinite(static_cast<float>(h.grad_scale))) {
    return Invalid("grad_scale", h.grad_scale, "finite and > 0");
  }
  // The update runs in fp32: values that are finite doubles but overflow a
  // float, or an eps that rounds to 0, would turn the weights into Inf/NaN.
  constexpr const char* kFloat = "representable as a float (the update runs in fp32)";
  if (!std::isfinite(static_cast<float>(h.lr))) return Invalid("lr", h.lr, kFloat);
  if (!std::isfinite(static_cast<float>(h.weight_decay))) {
    return Invalid("weight_decay", h.weight_decay, kFloat);
  }
  if (!std::isfinite(static_cast<float>(h.eps)) || !(static_cast<float>(h.eps) > 0.0f)) {
    return Invalid("eps", h.eps, "a float > 0 that does not round to 0 (the update runs in fp32)");
  }
  // The derived constants are largest at step 1 (bias correction 1 - beta1).
  const AdamStepConstants c = ComputeStepConstants(h, 1);
  if (!std::isfinite(c.neg_step_size)) {
    return Invalid("lr", h.lr, "small enough that lr / (1 - beta1) is a finite float");
  }
  if (!std::isfinite(c.decay_factor)) {
    return Invalid("weight_decay", h.weight_decay,
                   "small enough that 1 - lr * weight_decay is a finite float");
  }
  return absl::OkStatus();
}

AdamStepConstants ComputeStepConstants(const AdamHyperparams& h, uint64_t step) {
  // Python computes these in double and torch rounds the scalars to float.
  const double lr = h.lr, b1 = h.beta1, b2 = h.beta2;
  const double t = static_cast<double>(step);
  double bc1 = 1.0, bc2 = 1.0;
  if (h.bias_correction) {
    bc1 = 1.0 - std::pow(b1, t);
    bc2 = 1.0 - std::pow(b2, t);
  }
  AdamStepConstants c;
  c.grad_scale = static_cast<float>(h.grad_scale);
  c.beta1 = static_cast<float>(h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - b1);
  c.one_minus_beta2 = static_cast<float>(1.0 - b2);
  c.neg_step_size = static_cast<float>(-(lr / bc1));
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bc2));
  // beta2 < 1 keeps bc2 >= 1.1e-16 (its square root >= 1e-8); the range
  // check is the kernels' precondition (adam.h), not a case that occurs.
  const float b = c.bias_correction2_sqrt;
  c.inv_bias_correction2_sqrt = b >= 0x1p-30f && b <= 1.0f ? 1.0f / b : 0.0f;
  c.eps = static_cast<float>(h.eps);
  c.decay_factor = h.decoupled_weight_decay ? static_cast<float>(1.0 - lr * h.weight_decay) : 1.0f;
  c.l2 = h.decoupled_weight_decay ? 0.0f : static_cast<float>(h.weight_decay);
  return c;
}

void AdamScalar(const AdamStepConstants& c, const AdamSpan& s) {
  const bool l2 = c.l2 != 0.0f;
  for (size_t i = 0; i < s.numel; ++i) {
    float g = LoadGrad(s.grads, s.grad_dtype, i) * c.grad_scale;
    float p = s.master[i];
    if (l2) g = std::fma(p, c.l2, g);
    p = p * c.decay_factor;
    const float m = std::fma(g, c.one_minus_beta1, s.exp_avg[i] * c.beta1);
    const float v = std::fma(c.one_minus_beta2 * g, g, s.exp_avg_sq[i] * c.beta2);
    const float denom = std::sqrt(v) / c.bias_correction2_sqrt + c.eps;
    p = p + (c.neg_step_size * m) / denom;
    s.exp_avg[i] = m;
    s.exp_avg_sq[i] = v;
    s.master[i] = p;
    if (s.working != nullptr) StoreWorking(s.working, s.working_dtype, i, p);
  }
}

uint64_t CountNonFiniteScalar(const void* grads, DType dtype, size_t n) {
  uint64_t count = 0;
  if (dtype == DType::kFp32) {
    const float* g = static_cast<const float*>(grads);
    for (size_t i = 0; i < n; ++i) count += (FloatBits(g[i]) & 0x7f800000u) == 0x7f800000u;
    return count;
  }
  const uint16_t exp_mask = dtype == DType::kBf16 ? 0x7f80u : 0x7c00u;
  const uint16_t* g = static_cast<const uint16_t*>(grads);
  for (size_t i = 0; i < n; ++i) count += (g[i] & exp_mask) == exp_mask;
  return count;
}

const AdamKernels& ScalarAdamKernels() {
  static const AdamKernels kernels = {"scalar", &AdamScalar, &CountNonFiniteScalar,
                                      &AccumulateGrads};
  return kernels;
}

}  // namespace offload
