// Every vectorised kernel against the scalar reference: bit-identical
// results over all dtype combinations, odd sizes, unaligned starts and
// special values (denormals, huge and tiny magnitudes, signed zeros).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cpu_adam/adam.h"
#include "cpu_adam/kernel_select.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

struct Case {
  DType grad;
  int working;  // -1 none, else a DType
  bool adamw;
  bool bias_correction;
  float grad_scale;
};

bool SameBits(const void* a, const void* b, size_t bytes, size_t elem) {
  if (std::memcmp(a, b, bytes) == 0) return true;
  // Allow differing NaN payloads only where both sides are NaN.
  for (size_t i = 0; i < bytes; i += elem) {
    if (std::memcmp(static_cast<const char*>(a) + i, static_cast<const char*>(b) + i, elem) == 0) {
      continue;
    }
    if (elem != 4) return false;
    float x, y;
    std::memcpy(&x, static_cast<const char*>(a) + i, 4);
    std::memcpy(&y, static_cast<const char*>(b) + i, 4);
    if (!(std::isnan(x) && std::isnan(y))) return false;
  }
  return true;
}

// Fills values mixing ordinary numbers with special ones.
float Draw(std::mt19937& rng, bool special) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  if (special) {
    switch (rng() % 8) {
      case 0:
        return 1e-40f * (rng() % 2 ? 1.0f : -1.0f);  // denormal
      case 1:
        return 1e30f * normal(rng);
      case 2:
        return 1e-30f * normal(rng);
      case 3:
        return rng() % 2 ? 0.0f : -0.0f;
      default:
        break;
    }
  }
  return normal(rng);
}

struct Buffers {
  std::vector<float> p, m, v;
  std::vector<unsigned char> g, w;
};

Buffers MakeBuffers(size_t n, size_t offset, DType grad, uint32_t seed, bool special) {
  std::mt19937 rng(seed);
  Buffers b;
  b.p.resize(n + offset);
  b.m.resize(n + offset);
  b.v.resize(n + offset);
  b.g.resize((n + offset) * DTypeSize(grad));
  b.w.assign((n + offset) * 4, 0xAB);
  for (size_t i = 0; i < n + offset; ++i) {
    b.p[i] = Draw(rng, special);
    b.m[i] = 0.1f * Draw(rng, special);
    b.v[i] = std::fabs(0.01f * Draw(rng, special));
  }
  std::vector<float> g(n + offset);
  for (float& x : g) x = Draw(rng, special);
  NarrowFromFloat(g.data(), grad, b.g.data(), n + offset);
  return b;
}

AdamSpan SpanOf(Buffers& b, size_t n, size_t offset, const Case& c) {
  AdamSpan s;
  s.master = b.p.data() + offset;
  s.exp_avg = b.m.data() + offset;
  s.exp_avg_sq = b.v.data() + offset;
  s.grads = b.g.data() + offset * DTypeSize(c.grad);
  s.grad_dtype = c.grad;
  if (c.working >= 0) {
    s.working_dtype = static_cast<DType>(c.working);
    s.working = b.w.data() + offset * DTypeSize(s.working_dtype);
  }
  s.numel = n;
  return s;
}

class KernelTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto k = SelectAdamKernels(GetParam());
    if (!k.ok()) GTEST_SKIP() << "this CPU cannot run " << GetParam() << ": " << k.status();
    kernels_ = *k;
  }
  const AdamKernels* kernels_ = nullptr;
};

TEST_P(KernelTest, BitIdenticalToScalarReference) {
  const size_t sizes[] = {1, 7, 8, 15, 16, 17, 31, 33, 100, 1000, 4099};
  const size_t offsets[] = {0, 1, 3};
  int cases = 0;
  for (DType grad : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    for (int working : {-1, 1, 2, 3}) {
      for (bool adamw : {true, false}) {
        for (bool bias : {true, false}) {
          for (float gs : {1.0f, 0.125f}) {
            for (size_t n : sizes) {
              for (size_t off : offsets) {
                for (bool special : {false, true}) {
                  Case c{grad, working, adamw, bias, gs};
                  AdamHyperparams h;
                  h.lr = 1e-2f;
                  h.weight_decay = 0.05f;
                  h.decoupled_weight_decay = adamw;
                  h.bias_correction = bias;
                  h.grad_scale = gs;
                  const uint64_t step = 1 + (n % 7) * 13;
                  const AdamStepConstants k = ComputeStepConstants(h, step);
                  const uint32_t seed = static_cast<uint32_t>(n * 131 + off * 7 + special);
                  Buffers ref = MakeBuffers(n, off, grad, seed, special);
                  Buffers got = ref;
                  AdamScalar(k, SpanOf(ref, n, off, c));
                  kernels_->adam(k, SpanOf(got, n, off, c));
                  const std::string what =
                      "grad=" + std::string(DTypeName(grad)) +
                      " working=" + std::to_string(working) + " adamw=" + std::to_string(adamw) +
                      " bias=" + std::to_string(bias) + " n=" + std::to_string(n) +
                      " off=" + std::to_string(off) + " special=" + std::to_string(special);
                  ASSERT_TRUE(SameBits(ref.p.data(), got.p.data(), ref.p.size() * 4, 4)) << what;
                  ASSERT_TRUE(SameBits(ref.m.data(), got.m.data(), ref.m.size() * 4, 4)) << what;
                  ASSERT_TRUE(SameBits(ref.v.data(), got.v.data(), ref.v.size() * 4, 4)) << what;
                  const size_t welem = working == 1 ? 4 : 2;
                  ASSERT_TRUE(SameBits(ref.w.data(), got.w.data(), ref.w.size(), welem)) << what;
                  ++cases;
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 3 * 4 * 2 * 2 * 2 * 11 * 3 * 2);
}

// A working copy on a 64-byte boundary, as the arena's are, takes the
// kernels' whole-line stores (AVX-512 writes fp32 and bf16 ones around the
// cache): the same bits, every dtype, with and without a tail, and nothing
// written past its end.
TEST_P(KernelTest, AlignedWorkingCopiesAreBitIdenticalToo) {
  for (int working : {1, 2, 3}) {
    for (size_t n : {size_t{16}, size_t{17}, size_t{1000}, size_t{4099}}) {
      const DType wt = static_cast<DType>(working);
      auto aligned = [](size_t bytes) {
        return std::unique_ptr<unsigned char, decltype(&std::free)>(
            static_cast<unsigned char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)),
            &std::free);
      };
      Buffers ref = MakeBuffers(n, 0, DType::kFp32, static_cast<uint32_t>(n + working), false);
      Buffers got = ref;
      const size_t bytes = n * 4 + 128;  // and two lines past the largest copy
      auto w_ref = aligned(bytes), w_got = aligned(bytes);
      std::memset(w_ref.get(), 0xAB, bytes);
      std::memset(w_got.get(), 0xAB, bytes);
      ASSERT_EQ(reinterpret_cast<uintptr_t>(w_got.get()) % 64, 0u);
      AdamHyperparams h;
      h.lr = 1e-2f;
      h.weight_decay = 0.05f;
      const AdamStepConstants k = ComputeStepConstants(h, 3);
      AdamScalar(k, {ref.p.data(), ref.m.data(), ref.v.data(), ref.g.data(), DType::kFp32,
                     w_ref.get(), wt, n});
      kernels_->adam(k, {got.p.data(), got.m.data(), got.v.data(), got.g.data(), DType::kFp32,
                         w_got.get(), wt, n});
      const std::string what = "working=" + std::to_string(working) + " n=" + std::to_string(n);
      ASSERT_TRUE(SameBits(ref.p.data(), got.p.data(), n * 4, 4)) << what;
      ASSERT_TRUE(SameBits(w_ref.get(), w_got.get(), n * DTypeSize(wt), DTypeSize(wt))) << what;
      // Nothing past the copy's end written (the reference writes none).
      ASSERT_TRUE(SameBits(w_ref.get() + n * DTypeSize(wt), w_got.get() + n * DTypeSize(wt),
                           bytes - n * DTypeSize(wt), 1))
          << what;
    }
  }
}

TEST_P(KernelTest, WorkingCopyKeepsNaNAndInfinity) {
  const float specials[] = {NAN, -NAN, INFINITY, -INFINITY, 3.4e38f, 65520.0f, 1e-8f};
  for (int working : {2, 3}) {
    const size_t n = 21;
    std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), g(n, 0.0f);
    for (size_t i = 0; i < n; ++i) p[i] = specials[i % 7];
    std::vector<float> p2 = p, m2 = m, v2 = v;
    std::vector<uint16_t> w(n), w2(n);
    AdamHyperparams h;  // zero gradients: p stays as it is
    const AdamStepConstants k = ComputeStepConstants(h, 1);
    const DType wt = static_cast<DType>(working);
    AdamScalar(k, {p.data(), m.data(), v.data(), g.data(), DType::kFp32, w.data(), wt, n});
    kernels_->adam(k, {p2.data(), m2.data(), v2.data(), g.data(), DType::kFp32, w2.data(), wt, n});
    for (size_t i = 0; i < n; ++i) {
      const float ref = wt == DType::kBf16 ? Bf16ToFloat(w[i]) : Fp16ToFloat(w[i]);
      const float got = wt == DType::kBf16 ? Bf16ToFloat(w2[i]) : Fp16ToFloat(w2[i]);
      if (std::isnan(p[i])) {
        EXPECT_TRUE(std::isnan(ref) && std::isnan(got)) << i;
      } else {
        EXPECT_EQ(w[i], w2[i]) << "working " << working << " value " << p[i];
      }
    }
  }
}

// The vector kernels divide sqrt(v) by bias_correction2_sqrt with its
// reciprocal and two multiply-adds (adam.h). For the divisors of real steps,
// every float significand of sqrt(v) (v over every float in [1, 4)) and the
// special values: the denominator must equal sqrt(v) / b rounded once. The
// constants are set so that it shows: gradients 0, beta1 = beta2 = 1 (m and
// v pass through), eps too small to change a sum, p = 0 and -lr = -1, and m
// the expected denominator, so p comes out -1 exactly where the kernel's
// denominator is that one (x / y is 1 only for y == x).
TEST_P(KernelTest, ScaledRootIsSqrtOverBiasCorrectionRoundedOnce) {
  std::vector<AdamStepConstants> divisors;
  // Steps 310 (beta2 0.95) and 16000 (0.999) give b = 1 - 2^-24, where
  // q = a * y is most often more than an ulp off a/b (y = 1 + 2^-23).
  for (double beta2 : {0.999, 0.95, 0.99999}) {
    for (uint64_t step : {1, 2, 3, 10, 77, 310, 16000}) {
      AdamHyperparams h;
      h.beta2 = beta2;
      divisors.push_back(ComputeStepConstants(h, step));
      ASSERT_NE(divisors.back().inv_bias_correction2_sqrt, 0.0f) << beta2 << " " << step;
    }
  }
  // And the largest divisors below 1 directly.
  for (uint32_t below_one : {1u, 2u, 3u}) {
    divisors.push_back(divisors[0]);
    const float b = BitsToFloat(FloatBits(1.0f) - below_one);
    divisors.back().bias_correction2_sqrt = b;
    divisors.back().inv_bias_correction2_sqrt = 1.0f / b;
  }
  divisors.push_back(divisors[0]);
  divisors.back().inv_bias_correction2_sqrt = 0.0f;  // the divide, where y is not set
  constexpr size_t kChunk = size_t{1} << 20;
  std::vector<float> p(kChunk), m(kChunk), v(kChunk), g(kChunk, 0.0f);
  for (AdamStepConstants k : divisors) {
    k.grad_scale = 1.0f;
    k.beta1 = k.beta2 = 1.0f;
    k.one_minus_beta1 = k.one_minus_beta2 = 0.0f;
    k.neg_step_size = -1.0f;
    k.eps = 0x1p-100f;
    k.decay_factor = 1.0f;
    k.l2 = 0.0f;
    const float b = k.bias_correction2_sqrt;
    const uint32_t first = FloatBits(1.0f), end = FloatBits(4.0f);
    for (uint32_t at = first; at < end; at += kChunk) {
      const size_t n = std::min<size_t>(kChunk, end - at);
      for (size_t i = 0; i < n; ++i) {
        v[i] = BitsToFloat(static_cast<uint32_t>(at + i));
        m[i] = std::sqrt(v[i]) / b;
        p[i] = 0.0f;
      }
      kernels_->adam(
          k, {p.data(), m.data(), v.data(), g.data(), DType::kFp32, nullptr, DType::kFp32, n});
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(p[i], -1.0f) << "v=" << v[i] << " b=" << b
                               << " y=" << k.inv_bias_correction2_sqrt;
      }
    }
    // Special values against the reference: 0, -0, the smallest and
    // largest v, infinity, NaN.
    const float specials[] = {0.0f,  -0.0f,  1e-45f, 1e-38f, 3.4e38f, INFINITY, NAN, 1.0f, 2.0f,
                              0.25f, 1e-20f, 1e20f,  1e-45f, 0.0f,    INFINITY, NAN, 7.0f};
    const size_t n = sizeof(specials) / sizeof(specials[0]);
    std::vector<float> p2(n, 0.5f), m2(n, 1.0f), v2(specials, specials + n), g2(n, 0.0f);
    std::vector<float> p3 = p2, m3 = m2, v3 = v2;
    AdamScalar(
        k, {p2.data(), m2.data(), v2.data(), g2.data(), DType::kFp32, nullptr, DType::kFp32, n});
    kernels_->adam(
        k, {p3.data(), m3.data(), v3.data(), g2.data(), DType::kFp32, nullptr, DType::kFp32, n});
    ASSERT_TRUE(SameBits(p2.data(), p3.data(), n * 4, 4)) << "b=" << b;
  }
}

TEST_P(KernelTest, CountsNonFiniteGradients) {
  std::mt19937 rng(5);
  for (DType dt : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    for (size_t n : {0, 1, 15, 16, 17, 33, 1000}) {
      std::vector<float> g(n);
      size_t expected = 0;
      for (size_t i = 0; i < n; ++i) {
        switch (rng() % 10) {
          case 0:
            g[i] = NAN;
            ++expected;
            break;
          case 1:
            g[i] = -INFINITY;
            ++expected;
            break;
          default:
            g[i] = static_cast<float>(rng() % 1000) - 500.0f;
        }
      }
      std::vector<unsigned char> raw(std::max<size_t>(n, 1) * DTypeSize(dt));
      NarrowFromFloat(g.data(), dt, raw.data(), n);
      EXPECT_EQ(kernels_->count_nonfinite(raw.data(), dt, n), expected)
          << DTypeName(dt) << " n=" << n;
      EXPECT_EQ(CountNonFiniteScalar(raw.data(), dt, n), expected);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllKernels, KernelTest, ::testing::Values("scalar", "avx2", "avx512"),
                         [](const auto& info) { return info.param; });

TEST(KernelSelect, AutoPicksTheWidestAndNamesAreChecked) {
  auto k = SelectAdamKernels("auto");
  ASSERT_TRUE(k.ok());
  const std::string want = CpuHasAvx512() ? "avx512" : CpuHasAvx2() ? "avx2" : "scalar";
  EXPECT_EQ((*k)->name, want);
  EXPECT_EQ(SelectAdamKernels("sse9").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_GE(SupportedAdamKernels().size(), 1u);
}

}  // namespace
}  // namespace offload
