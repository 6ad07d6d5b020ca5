#include "cpu_adam/dtype.h"

namespace offload {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFp32:
      return "fp32";
    case DType::kBf16:
      return "bf16";
    case DType::kFp16:
      return "fp16";
  }
  return "invalid";
}

std::optional<DType> ParseDType(std::string_view name) {
  if (name == "fp32" || name == "float32") return DType::kFp32;
  if (name == "bf16" || name == "bfloat16") return DType::kBf16;
  if (name == "fp16" || name == "float16") return DType::kFp16;
  return std::nullopt;
}

float Fp16ToFloat(uint16_t h) {
  uint32_t sign = uint32_t{h & 0x8000u} << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) {  // Inf or NaN (quieted, as x86's vcvtph2ps does)
    return BitsToFloat(sign | 0x7f800000u | (mant != 0 ? 0x400000u : 0u) | (mant << 13));
  }
  if (exp == 0) {
    if (mant == 0) return BitsToFloat(sign);
    // Subnormal: value = mant * 2^-24, exact in fp32.
    float magnitude = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t FloatToFp16(float f) {
  uint32_t u = FloatBits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // NaN: keep it NaN (quiet) with top payload bits.
    return sign | 0x7e00u | static_cast<uint16_t>((abs >> 13) & 0x1ffu);
  }
  if (abs >= 0x477ff000u) {  // rounds to >= 65520: overflow to infinity
    return sign | 0x7c00u;
  }
  if (abs < 0x38800000u) {               // below the smallest fp16 normal (2^-14)
    if (abs < 0x33000000u) return sign;  // < 2^-25 rounds to zero
    // Subnormal result: shift the full mantissa into place, round to even.
    uint32_t exp = abs >> 23;
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    // value = mant * 2^(exp-150) and the fp16 subnormal unit is 2^-24, so
    // the result is mant * 2^(exp-126) = mant >> (126 - exp); shift is in
    // [14, 24] here.
    uint32_t shift = 126u - exp;
    uint32_t result = mant >> shift;
    uint32_t remainder = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (remainder > half || (remainder == half && (result & 1u))) ++result;
    return sign | static_cast<uint16_t>(result);
  }
  // Normal: rebias exponent, round mantissa to 10 bits (carry may bump exp).
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

void WidenToFloat(const void* src, DType dtype, float* dst, size_t n) {
  switch (dtype) {
    case DType::kFp32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kBf16:
      for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(static_cast<const uint16_t*>(src)[i]);
      return;
    case DType::kFp16:
      for (size_t i = 0; i < n; ++i) dst[i] = Fp16ToFloat(static_cast<const uint16_t*>(src)[i]);
      return;
  }
}

void NarrowFromFloat(const float* src, DType dtype, void* dst, size_t n) {
  switch (dtype) {
    case DType::kFp32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kBf16:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = FloatToBf16(src[i]);
      return;
    case DType::kFp16:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = FloatToFp16(src[i]);
      return;
  }
}

}  // namespace offload
