#include "cpu_adam/accumulate.h"

#include <cmath>
#include <limits>

namespace offload {
namespace {

// One pass: widen, add (or copy), store, and measure. Squares are summed
// in fp32 over 16 lanes for blocks of 1024 elements (independent lanes the
// compiler vectorises), each block's sum then added in double; the lanes
// and blocks combine in a fixed order, so the same bits every run.
template <bool kFirst, bool kStore, typename Load>
GradStats AddAndMeasure(Load load, float* acc, size_t n) {
  constexpr size_t kLanes = 16, kBlock = 1024;
  double total = 0;
  uint64_t nonfinite = 0;
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    float part[kLanes] = {};
    uint32_t bad[kLanes] = {};
    for (size_t j = 0; j < kBlock; j += kLanes) {
      for (size_t k = 0; k < kLanes; ++k) {
        const float g = load(i + j + k);
        const float x = kFirst ? g : acc[i + j + k] + g;
        if constexpr (kStore) acc[i + j + k] = x;
        part[k] += x * x;
        bad[k] += std::fabs(x) <= std::numeric_limits<float>::max() ? 0 : 1;  // NaN too
      }
    }
    double block = 0;
    for (size_t k = 0; k < kLanes; ++k) {
      block += part[k];
      nonfinite += bad[k];
    }
    total += block;
  }
  for (; i < n; ++i) {
    const float g = load(i);
    const float x = kFirst ? g : acc[i] + g;
    if constexpr (kStore) acc[i] = x;
    total += static_cast<double>(x) * x;
    nonfinite += std::isfinite(x) ? 0 : 1;
  }
  GradStats out;
  out.sq_norm = total;
  out.nonfinite = nonfinite;
  return out;
}

template <typename Load>
GradStats AddAndMeasure(Load load, float* acc, size_t n, bool first) {
  if (acc == nullptr) return AddAndMeasure<true, false>(load, acc, n);
  return first ? AddAndMeasure<true, true>(load, acc, n) : AddAndMeasure<false, true>(load, acc, n);
}

}  // namespace

GradStats MeasureGrads(const float* v, size_t n) {
  return AddAndMeasure([v](size_t i) { return v[i]; }, nullptr, n, /*first=*/true);
}

GradStats AccumulateGrads(const void* grads, DType grad_dtype, float* acc, size_t n, bool first) {
  switch (grad_dtype) {
    case DType::kFp32: {
      const auto* g = static_cast<const float*>(grads);
      return AddAndMeasure([g](size_t i) { return g[i]; }, acc, n, first);
    }
    case DType::kBf16: {
      const auto* g = static_cast<const uint16_t*>(grads);
      return AddAndMeasure([g](size_t i) { return Bf16ToFloat(g[i]); }, acc, n, first);
    }
    case DType::kFp16: {
      const auto* g = static_cast<const uint16_t*>(grads);
      return AddAndMeasure([g](size_t i) { return Fp16ToFloat(g[i]); }, acc, n, first);
    }
  }
  return GradStats{};
}

}  // namespace offload
