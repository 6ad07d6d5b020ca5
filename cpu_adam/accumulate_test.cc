#include "cpu_adam/accumulate.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_adam/kernel_select.h"
#include "cpu_adam/optimizer.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

std::vector<float> Pattern(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * std::sin(0.37f * static_cast<float>(i) + scale);
  return v;
}

TEST(Accumulate, AddsInFp32LikeTorchAndMeasuresTheSum) {
  const size_t n = 1001;
  const std::vector<float> a = Pattern(n, 1.0f), b = Pattern(n, 0.5f);
  std::vector<float> acc(n, 123.0f);  // garbage: the first micro-batch copies
  AccumulateGrads(a.data(), DType::kFp32, acc.data(), n, /*first=*/true);
  const GradStats s = AccumulateGrads(b.data(), DType::kFp32, acc.data(), n, /*first=*/false);
  double want = 0;
  for (size_t i = 0; i < n; ++i) {
    const float sum = a[i] + b[i];
    ASSERT_EQ(acc[i], sum) << i;
    want += static_cast<double>(sum) * sum;
  }
  EXPECT_NEAR(s.sq_norm, want, 1e-6 * want);
  EXPECT_EQ(s.nonfinite, 0u);
}

TEST(Accumulate, WidensBf16AndFp16AndKeepsNegativeZero) {
  std::vector<uint16_t> bf = {FloatToBf16(1.5f), FloatToBf16(-0.0f), FloatToBf16(2.0f)};
  std::vector<uint16_t> hf = {FloatToFp16(0.25f), FloatToFp16(1.0f), FloatToFp16(-3.0f)};
  std::vector<float> acc(3);
  AccumulateGrads(bf.data(), DType::kBf16, acc.data(), 3, true);
  EXPECT_EQ(acc[0], 1.5f);
  EXPECT_TRUE(std::signbit(acc[1]));
  const GradStats s = AccumulateGrads(hf.data(), DType::kFp16, acc.data(), 3, false);
  EXPECT_EQ(acc[0], 1.75f);
  EXPECT_EQ(acc[1], 1.0f);
  EXPECT_EQ(acc[2], -1.0f);
  EXPECT_EQ(s.sq_norm, 1.75 * 1.75 + 1.0 + 1.0);
}

TEST(Accumulate, CountsNonFiniteAccumulatedValues) {
  std::vector<float> g = {1.0f, std::numeric_limits<float>::infinity(), std::nanf(""), 2.0f};
  std::vector<float> acc(4);
  const GradStats s = AccumulateGrads(g.data(), DType::kFp32, acc.data(), 4, true);
  EXPECT_EQ(s.nonfinite, 2u);
  EXPECT_FALSE(std::isfinite(s.sq_norm));
  // Overflow by accumulation: two finite fp16-range values whose fp32 sum
  // is still finite, but max-float twice is not.
  std::vector<float> big = {std::numeric_limits<float>::max()};
  std::vector<float> one(1);
  AccumulateGrads(big.data(), DType::kFp32, one.data(), 1, true);
  EXPECT_EQ(AccumulateGrads(big.data(), DType::kFp32, one.data(), 1, false).nonfinite, 1u);
}

// Every instruction set's kernel gives the reference's bits: accumulator
// values, squared norm and non-finite count; for each gradient dtype, a
// first and a later micro-batch, lengths around the 1024-value blocks and
// the vector widths and the groups of blocks a kernel interleaves (4 x
// 1024), aligned accumulators (non-temporal stores) and not, and gradients
// with Inf and NaN among them; and measuring only (no accumulator), which
// gives a first micro-batch's statistics.
TEST(Accumulate, EveryKernelMatchesTheReferenceBitForBit) {
  const std::vector<size_t> lengths = {0,
                                       1,
                                       7,
                                       15,
                                       16,
                                       17,
                                       1023,
                                       1024,
                                       1025,
                                       3000,
                                       4096,
                                       4096 + 13,
                                       5 * 1024 + 17,
                                       9 * 1024,
                                       12 * 1024 + 1000};
  constexpr size_t kMax = 12 * 1024 + 1000;
  for (const AdamKernels* k : SupportedAdamKernels()) {
    for (DType dtype : {DType::kFp32, DType::kBf16, DType::kFp16}) {
      for (size_t n : lengths) {
        for (size_t offset : {size_t{0}, size_t{1}}) {  // acc 64-byte aligned, or not
          for (bool poisoned : {false, true}) {
            SCOPED_TRACE(testing::Message()
                         << k->name << " dtype " << static_cast<int>(dtype) << " n " << n
                         << " offset " << offset << " poisoned " << poisoned);
            std::vector<float> values = Pattern(n, 3.0f);
            if (poisoned && n > 5) {
              values[n / 2] = std::numeric_limits<float>::infinity();
              values[n - 1] = std::nanf("");
            }
            std::vector<uint16_t> narrow(n);
            const void* grads = values.data();
            if (dtype != DType::kFp32) {
              NarrowFromFloat(values.data(), dtype, narrow.data(), n);
              // The NaN a signalling one: each kernel widens it to the same bits.
              if (poisoned && n > 5) narrow[n - 1] = dtype == DType::kFp16 ? 0x7c01 : 0x7f81;
              grads = narrow.data();
            }
            // Two accumulators with the same history: the reference's and
            // the kernel's, at the same alignment.
            alignas(64) static float want_buf[kMax + 64], got_buf[kMax + 64];
            float* want = want_buf + offset;
            float* got = got_buf + offset;
            const std::vector<float> start = Pattern(n, 0.7f);
            for (bool first : {true, false}) {
              std::memcpy(want, start.data(), n * sizeof(float));
              std::memcpy(got, start.data(), n * sizeof(float));
              const GradStats a = AccumulateGrads(grads, dtype, want, n, first);
              const GradStats b = k->accumulate(grads, dtype, got, n, first);
              EXPECT_EQ(std::memcmp(want, got, n * sizeof(float)), 0) << "first " << first;
              EXPECT_EQ(std::memcmp(&a.sq_norm, &b.sq_norm, sizeof(double)), 0)
                  << "first " << first << ": " << a.sq_norm << " vs " << b.sq_norm;
              EXPECT_EQ(a.nonfinite, b.nonfinite) << "first " << first;
              if (!first) continue;
              const GradStats measured = AccumulateGrads(grads, dtype, nullptr, n, false);
              const GradStats kernel_measured = k->accumulate(grads, dtype, nullptr, n, false);
              for (const GradStats& m : {measured, kernel_measured}) {
                EXPECT_EQ(std::memcmp(&a.sq_norm, &m.sq_norm, sizeof(double)), 0)
                    << "measured: " << a.sq_norm << " vs " << m.sq_norm;
                EXPECT_EQ(a.nonfinite, m.nonfinite) << "measured";
              }
            }
          }
        }
      }
    }
  }
}

TEST(Accumulate, TheOptimizerPoolGivesTheSameBitsEveryRun) {
  OptimizerOptions o;
  o.threads = 2;
  o.tile_elems = 4096;
  Optimizer opt(o);
  const size_t n = 100000;
  const std::vector<float> g = Pattern(n, 0.01f);
  std::vector<float> acc1(n), acc2(n);
  GradStats first;
  for (int run = 0; run < 5; ++run) {
    AccumulateTask t{g.data(), DType::kFp32, acc1.data(), n, true};
    const GradStats s = opt.Accumulate(absl::MakeConstSpan(&t, 1));
    if (run == 0) first = s;
    EXPECT_EQ(s.sq_norm, first.sq_norm);  // bit for bit
  }
  // One pass over the whole equals the tiles' sum up to rounding.
  const GradStats whole = MeasureGrads(acc1.data(), n);
  EXPECT_NEAR(whole.sq_norm, first.sq_norm, 1e-6 * whole.sq_norm);
}

}  // namespace
}  // namespace offload
