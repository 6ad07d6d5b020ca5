// cpu_adam/division_sweep: the check behind the vector kernels' division by
// the bias correction (adam.h): for divisors b, every float significand of
// the dividend a, the divide instruction's RN(a/b) against
// q = RN(a * y), r = RN(a - b * q), q' = RN(q + r * y) with y = RN(1/b).
// Significands are all that matter: scaling a or b by a power of two scales
// every step exactly where nothing underflows or overflows (adam.h).
//
//   bazel build -c opt //cpu_adam:division_sweep
//   bazel-bin/cpu_adam/division_sweep FIRST END
//   bazel-bin/cpu_adam/division_sweep --beta2=0.999,0.95 [--steps=N]
//
// The first checks the divisors b = 1 + k * 2^-23 for k in [FIRST, END)
// (k < 2^23: every significand of b is one of them); the second every
// distinct divisor ComputeStepConstants gives for those beta2 at steps 1..N
// (default: until it reaches 1), those a training run with them divides by.
// About a millisecond a divisor on one core; prints progress every 65536
// divisors, each divisor with a mismatch, and the total. Exit status 0 where
// none differ, 1 where any do, 2 for a bad command line (or no divisor to
// check) or a CPU without AVX-512.
#include <immintrin.h>

#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "cpu_adam/adam.h"

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
  const __m512i first =
      _mm512_add_epi32(_mm512_set1_epi32(0x3f800000),
                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  uint64_t bad = 0;
  for (uint32_t j = 0; j < (1u << 23); j += 16) {
    const __m512 a =
        _mm512_castsi512_ps(_mm512_add_epi32(first, _mm512_set1_epi32(static_cast<int>(j))));
    const __m512 want = _mm512_div_ps(a, bv);
    const __m512 q = _mm512_mul_ps(a, yv);
    const __m512 r = _mm512_fnmadd_ps(q, bv, a);
    const __m512 got = _mm512_fmadd_ps(r, yv, q);
    bad += static_cast<uint64_t>(__builtin_popcount(
        _mm512_cmp_epi32_mask(_mm512_castps_si512(want), _mm512_castps_si512(got), _MM_CMPINT_NE)));
  }
  return bad;
}

// Checks `divisors`; prints and returns the number of differences.
uint64_t Sweep(const std::vector<float>& divisors, const char* what) {
  uint64_t bad = 0;
  for (size_t i = 0; i < divisors.size(); ++i) {
    if (const uint64_t here = Mismatches(divisors[i]); here != 0) {
      bad += here;
      std::printf("b = %a: %" PRIu64 " dividends differ\n", static_cast<double>(divisors[i]), here);
    }
    if (i % 65536 == 65535) {
      std::printf("%zu of %zu divisors checked, %" PRIu64 " differences\n", i + 1, divisors.size(),
                  bad);
      std::fflush(stdout);
    }
  }
  std::printf("%s: %zu divisors, %" PRIu64 " differences\n", what, divisors.size(), bad);
  return bad;
}

// `text` whole as an unsigned number (decimal, or hex with 0x); false for
// anything else.
bool ParseUint(const char* text, uint64_t* value) {
  if (*text == '\0' || *text == '-') return false;
  char* end;
  errno = 0;
  *value = std::strtoull(text, &end, 0);
  return *end == '\0' && errno == 0;
}

}  // namespace

int main(int argc, char** argv) {
  const char* usage =
      "usage: division_sweep FIRST END  (divisors 1 + k * 2^-23, k < 2^23)\n"
      "       division_sweep --beta2=B[,B...] [--steps=N]\n";
  if (!__builtin_cpu_supports("avx512f")) {
    std::fprintf(stderr, "division_sweep: this CPU has no AVX-512\n");
    return 2;
  }
  std::vector<float> divisors;
  std::string what;
  if (argc >= 2 && std::strncmp(argv[1], "--beta2=", 8) == 0) {
    uint64_t steps = 0;  // 0: until the divisor reaches 1
    if (argc == 3) {
      if (std::strncmp(argv[2], "--steps=", 8) != 0 || !ParseUint(argv[2] + 8, &steps) ||
          steps == 0) {
        std::fputs(usage, stderr);
        return 2;
      }
    } else if (argc != 2) {
      std::fputs(usage, stderr);
      return 2;
    }
    std::set<uint32_t> seen;
    for (const char* b = argv[1] + 8;;) {
      char* end;
      offload::AdamHyperparams h;
      h.beta2 = std::strtod(b, &end);
      if (end == b || (*end != ',' && *end != '\0') || !(h.beta2 > 0 && h.beta2 < 1)) {
        std::fprintf(stderr, "division_sweep: each beta2 a number in (0, 1): %s\n", argv[1]);
        return 2;
      }
      for (uint64_t t = 1; steps == 0 || t <= steps; ++t) {
        const float d = offload::ComputeStepConstants(h, t).bias_correction2_sqrt;
        if (d == 1.0f) break;  // and so for every later step
        uint32_t bits;
        std::memcpy(&bits, &d, sizeof(bits));
        if (seen.insert(bits).second) divisors.push_back(d);
      }
      if (*end == '\0') break;
      b = end + 1;
    }
    what = std::string("the steps' divisors for beta2 ") + (argv[1] + 8);
  } else if (argc == 3) {
    uint64_t first, end;
    if (!ParseUint(argv[1], &first) || !ParseUint(argv[2], &end) || first > end ||
        end > (uint64_t{1} << 23)) {
      std::fprintf(stderr, "division_sweep: want numbers FIRST <= END <= %u\n%s", 1u << 23, usage);
      return 2;
    }
    for (uint64_t k = first; k < end; ++k) {
      divisors.push_back(FromBits(0x3f800000u + static_cast<uint32_t>(k)));
    }
    what = "divisors 1 + k * 2^-23 for k in [" + std::to_string(first) + ", " +
           std::to_string(end) + ")";
  } else {
    std::fputs(usage, stderr);
    return 2;
  }
  if (divisors.empty()) {
    std::fprintf(stderr, "division_sweep: no divisor to check\n");
    return 2;
  }
  return Sweep(divisors, what.c_str()) == 0 ? 0 : 1;
}
