// Element types of partitions and their scalar conversions. The conversions
// here are the reference semantics every vectorised kernel must reproduce:
// fp32 -> bf16 rounds to nearest even and keeps NaN a (quiet) NaN; fp32 ->
// fp16 rounds to nearest even, overflows to infinity, and keeps subnormals.
// Pure functions; safe from any thread.
#ifndef OFFLOADD_CPU_ADAM_DTYPE_H_
#define OFFLOADD_CPU_ADAM_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace offload {

enum class DType : uint8_t { kFp32 = 1, kBf16 = 2, kFp16 = 3 };

constexpr size_t DTypeSize(DType t) { return t == DType::kFp32 ? 4 : 2; }
const char* DTypeName(DType t);
std::optional<DType> ParseDType(std::string_view name);

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(uint32_t{h} << 16); }

inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    // NaN: truncate but force the quiet bit so it stays NaN.
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

float Fp16ToFloat(uint16_t h);
uint16_t FloatToFp16(float f);

// Converts `n` elements of `dtype` at `src` to fp32, and back (rounding as
// above). Scalar loops: for set-up and tests, not for hot paths.
void WidenToFloat(const void* src, DType dtype, float* dst, size_t n);
void NarrowFromFloat(const float* src, DType dtype, void* dst, size_t n);

}  // namespace offload

#endif  // OFFLOADD_CPU_ADAM_DTYPE_H_
