#include "cpu_adam/accumulate.h"

#include <cmath>
#include <cstring>

namespace offload {
namespace {

// Adds the gradients in; `Load` widens one element.
template <typename Load>
void AddInto(Load load, float* acc, size_t n, bool first) {
  if (first) {
    for (size_t i = 0; i < n; ++i) acc[i] = load(i);
  } else {
    for (size_t i = 0; i < n; ++i) acc[i] += load(i);
  }
}

}  // namespace

GradStats MeasureGrads(const float* v, size_t n) {
  // Four partial sums, combined in a fixed order: independent chains for
  // speed, the same bits every run.
  double s[4] = {0, 0, 0, 0};
  uint64_t nonfinite = 0;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) {
      const double x = v[i + k];
      s[k] += x * x;
    }
  }
  for (; i < n; ++i) s[0] += static_cast<double>(v[i]) * v[i];
  for (size_t j = 0; j < n; ++j) nonfinite += std::isfinite(v[j]) ? 0 : 1;
  GradStats out;
  out.sq_norm = (s[0] + s[1]) + (s[2] + s[3]);
  out.nonfinite = nonfinite;
  return out;
}

GradStats AccumulateGrads(const void* grads, DType grad_dtype, float* acc, size_t n, bool first) {
  switch (grad_dtype) {
    case DType::kFp32: {
      const auto* g = static_cast<const float*>(grads);
      if (first) {
        std::memcpy(acc, g, n * sizeof(float));
      } else {
        AddInto([g](size_t i) { return g[i]; }, acc, n, false);
      }
      break;
    }
    case DType::kBf16: {
      const auto* g = static_cast<const uint16_t*>(grads);
      AddInto([g](size_t i) { return Bf16ToFloat(g[i]); }, acc, n, first);
      break;
    }
    case DType::kFp16: {
      const auto* g = static_cast<const uint16_t*>(grads);
      AddInto([g](size_t i) { return Fp16ToFloat(g[i]); }, acc, n, first);
      break;
    }
  }
  return MeasureGrads(acc, n);
}

}  // namespace offload
