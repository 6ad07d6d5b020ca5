#include "cpu_adam/dtype.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(Bf16, RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between bf16 neighbours 1 and 1 + 2^-7: ties
  // go to the even mantissa (1.0).
  EXPECT_EQ(FloatToBf16(1.0f + 0.00390625f), FloatToBf16(1.0f));
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 3 * 0.00390625f)), 1.0f + 0.015625f);
  // Just above halfway rounds up.
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 0.0040f)), 1.0f + 0.0078125f);
}

TEST(Bf16, KeepsSpecialValues) {
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload lives only in the low 16 bits must not become Inf.
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(BitsToFloat(0x7f800001u)))));
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(INFINITY)), INFINITY);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(-INFINITY)), -INFINITY);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000u);
  // The largest finite float rounds up to infinity, as round-to-nearest says.
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::max())), INFINITY);
}

TEST(Fp16, ExactValuesRoundTrip) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    uint16_t bits = static_cast<uint16_t>(h);
    float f = Fp16ToFloat(bits);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(f)))) << h;
      continue;
    }
    EXPECT_EQ(FloatToFp16(f), bits) << "fp16 bits " << h;
  }
}

TEST(Fp16, RoundsToNearestEvenAcrossRanges) {
  // Compare against round-to-nearest computed in double for a sweep of values
  // covering subnormals and normals (overflow is checked below).
  for (double x = 1e-9; x < 65504.0; x *= 1.0007) {
    float f = static_cast<float>(x);
    float got = Fp16ToFloat(FloatToFp16(f));
    // Brute-force the nearest fp16 neighbours.
    uint16_t lo = FloatToFp16(f);
    float candidates[3] = {Fp16ToFloat(static_cast<uint16_t>(lo - 1)), Fp16ToFloat(lo),
                           Fp16ToFloat(static_cast<uint16_t>(lo + 1))};
    double best = std::fabs(static_cast<double>(got) - f);
    for (float c : candidates) {
      if (std::isinf(c) || std::isnan(c)) continue;
      EXPECT_LE(best, std::fabs(static_cast<double>(c) - f)) << "x=" << x;
    }
  }
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7bffu);
  EXPECT_EQ(FloatToFp16(65519.0f), 0x7bffu);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00u);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -24)), 0x0001u);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -25)), 0x0000u);  // tie to even
  EXPECT_EQ(FloatToFp16(std::ldexp(1.5f, -25)), 0x0001u);
  EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(NAN))));
}

TEST(DType, ParsesNames) {
  EXPECT_EQ(ParseDType("bf16"), DType::kBf16);
  EXPECT_EQ(ParseDType("float16"), DType::kFp16);
  EXPECT_EQ(ParseDType("fp32"), DType::kFp32);
  EXPECT_FALSE(ParseDType("int8").has_value());
  EXPECT_EQ(DTypeSize(DType::kBf16), 2u);
}

}  // namespace
}  // namespace offload
