// cpu_adam/division_sweep: the check behind the vector kernels' division by
// the bias correction (adam.h): for divisors b, every float significand of
// the dividend a, the divide instruction's RN(a/b) against
// q = RN(a * y), r = RN(a - b * q), q' = RN(q + r * y) with y = RN(1/b).
// Significands are all that matter: scaling a or b by a power of two scales
// every step exactly where nothing underflows or overflows (adam.h).
//
//   bazel build -c opt //cpu_adam:division_sweep
//   bazel-bin/cpu_adam/division_sweep FIRST END
//
// checks the divisors b = 1 + k * 2^-23 for k in [FIRST, END) (k < 2^23:
// every significand of b is one of them), about a millisecond each on one
// core; prints progress every 65536 divisors, each divisor with a mismatch,
// and the total. Exit status 1 where any differ. Needs AVX-512.
#include <immintrin.h>

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Dividends a = 1 + j * 2^-23 for every j < 2^23 whose quotient by b the
// sequence rounds differently from the divide instruction.
uint64_t Mismatches(float b) {
  const float y = 1.0f / b;
  const __m512 bv = _mm512_set1_ps(b), yv = _mm512_set1_ps(y);
  const __m512i first = _mm512_add_epi32(
      _mm512_set1_epi32(0x3f800000),
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  uint64_t bad = 0;
  for (uint32_t j = 0; j < (1u << 23); j += 16) {
    const __m512 a =
        _mm512_castsi512_ps(_mm512_add_epi32(first, _mm512_set1_epi32(static_cast<int>(j))));
    const __m512 want = _mm512_div_ps(a, bv);
    const __m512 q = _mm512_mul_ps(a, yv);
    const __m512 r = _mm512_fnmadd_ps(q, bv, a);
    const __m512 got = _mm512_fmadd_ps(r, yv, q);
    bad += static_cast<uint64_t>(__builtin_popcount(_mm512_cmp_epi32_mask(
        _mm512_castps_si512(want), _mm512_castps_si512(got), _MM_CMPINT_NE)));
  }
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: division_sweep FIRST END  (divisors 1 + k * 2^-23, k < 2^23)\n");
    return 2;
  }
  if (!__builtin_cpu_supports("avx512f")) {
    std::fprintf(stderr, "division_sweep: this CPU has no AVX-512\n");
    return 2;
  }
  const uint32_t first = static_cast<uint32_t>(std::strtoul(argv[1], nullptr, 0));
  const uint32_t end = static_cast<uint32_t>(std::strtoul(argv[2], nullptr, 0));
  if (first > end || end > (1u << 23)) {
    std::fprintf(stderr, "division_sweep: want FIRST <= END <= %u\n", 1u << 23);
    return 2;
  }
  uint64_t bad = 0;
  for (uint32_t k = first; k < end; ++k) {
    const float b = FromBits(0x3f800000u + k);
    if (const uint64_t here = Mismatches(b); here != 0) {
      bad += here;
      std::printf("b = %a: %" PRIu64 " dividends differ\n", static_cast<double>(b), here);
    }
    if ((k - first) % 65536 == 65535) {
      std::printf("divisors %u..%u checked, %" PRIu64 " differences\n", first, k + 1, bad);
      std::fflush(stdout);
    }
  }
  std::printf("divisors %u..%u: %" PRIu64 " differences\n", first, end, bad);
  return bad == 0 ? 0 : 1;
}
