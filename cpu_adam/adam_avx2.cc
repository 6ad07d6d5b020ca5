// AVX2 Adam: 8 lanes; the tail runs one vector iteration on padded local
// copies. Performs the IEEE operations of AdamScalar in the same order,
// fusing only where it does (this target builds with -ffp-contract=off),
// but for the division by the bias correction (adam.h), so its results are
// bit-identical to the reference (for the divisors checked there).
//
// This file must not call inline functions shared with other targets (such
// as those in dtype.h): the compiler could emit an AVX2 copy that the linker
// then uses everywhere.
#include "cpu_adam/adam_avx2.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_adam/adam_dispatch.h"

namespace offload {
namespace {

using adam_internal::Out;

template <DType G>
inline __m256 LoadGrad(const void* g, size_t i) {
  if constexpr (G == DType::kFp32) {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (G == DType::kBf16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// fp32 -> bf16, round to nearest even; NaN stays NaN (quiet bit forced).
inline __m128i ToBf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  // Every lane is <= 0xffff, so unsigned saturation is exact; packing works
  // per 128-bit half, so gather the two low quadwords.
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

template <Out W>
inline void StoreWorking(void* w, size_t i, __m256 p) {
  if constexpr (W == Out::kFp32) {
    _mm256_storeu_ps(static_cast<float*>(w) + i, p);
  } else if constexpr (W == Out::kBf16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(w) + i), ToBf16(p));
  } else if constexpr (W == Out::kFp16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(w) + i),
                     _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

struct Kernel {
  template <DType G, Out W, bool kL2>
  static void Loop(const AdamStepConstants& c, const AdamSpan& s);
};

template <DType G, Out W, bool kL2>
void Kernel::Loop(const AdamStepConstants& c, const AdamSpan& s) {
  const __m256 grad_scale = _mm256_set1_ps(c.grad_scale);
  const __m256 beta1 = _mm256_set1_ps(c.beta1);
  const __m256 beta2 = _mm256_set1_ps(c.beta2);
  const __m256 omb1 = _mm256_set1_ps(c.one_minus_beta1);
  const __m256 omb2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 neg_step_size = _mm256_set1_ps(c.neg_step_size);
  const __m256 bc2 = _mm256_set1_ps(c.bias_correction2_sqrt);
  const __m256 inv_bc2 = _mm256_set1_ps(c.inv_bias_correction2_sqrt);
  const __m256 eps = _mm256_set1_ps(c.eps);
  const __m256 decay = _mm256_set1_ps(c.decay_factor);
  const __m256 l2 = _mm256_set1_ps(c.l2);

  // kDivide: root / bc2 with a divide where the constants have no reciprocal
  // for it (adam.h); a template argument so that the loop carries no test.
  auto run = [&](auto divide) {
    constexpr bool kDivide = decltype(divide)::value;
    auto body = [&](float* master, float* exp_avg, float* exp_avg_sq, const void* grads,
                    void* working, size_t i) {
      __m256 g = _mm256_mul_ps(LoadGrad<G>(grads, i), grad_scale);
      __m256 p = _mm256_loadu_ps(master + i);
      if constexpr (kL2) g = _mm256_fmadd_ps(p, l2, g);
      p = _mm256_mul_ps(p, decay);
      const __m256 m = _mm256_fmadd_ps(g, omb1, _mm256_mul_ps(_mm256_loadu_ps(exp_avg + i), beta1));
      const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g,
                                       _mm256_mul_ps(_mm256_loadu_ps(exp_avg_sq + i), beta2));
      const __m256 root = _mm256_sqrt_ps(v);
      __m256 scaled;  // root / bc2, correctly rounded (adam.h)
      if constexpr (kDivide) {
        scaled = _mm256_div_ps(root, bc2);
      } else {
        const __m256 q = _mm256_mul_ps(root, inv_bc2);
        const __m256 r = _mm256_fnmadd_ps(q, bc2, root);
        scaled =
            _mm256_blendv_ps(q, _mm256_fmadd_ps(r, inv_bc2, q), _mm256_cmp_ps(r, r, _CMP_ORD_Q));
      }
      const __m256 denom = _mm256_add_ps(scaled, eps);
      p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step_size, m), denom));
      _mm256_storeu_ps(exp_avg + i, m);
      _mm256_storeu_ps(exp_avg_sq + i, v);
      _mm256_storeu_ps(master + i, p);
      StoreWorking<W>(working, i, p);
    };

    const size_t n = s.numel;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) body(s.master, s.exp_avg, s.exp_avg_sq, s.grads, s.working, i);
    if (i == n) return;
    // Tail: padded copies in, one iteration, results out.
    const size_t rest = n - i;
    const size_t gsize = G == DType::kFp32 ? 4 : 2;
    const size_t wsize = W == Out::kFp32 ? 4 : 2;
    alignas(32) float p[8] = {}, m[8] = {}, v[8] = {};
    alignas(32) unsigned char g[32] = {}, w[32] = {};
    std::memcpy(p, s.master + i, rest * 4);
    std::memcpy(m, s.exp_avg + i, rest * 4);
    std::memcpy(v, s.exp_avg_sq + i, rest * 4);
    std::memcpy(g, static_cast<const unsigned char*>(s.grads) + i * gsize, rest * gsize);
    body(p, m, v, g, w, 0);
    std::memcpy(s.master + i, p, rest * 4);
    std::memcpy(s.exp_avg + i, m, rest * 4);
    std::memcpy(s.exp_avg_sq + i, v, rest * 4);
    if constexpr (W != Out::kNone) {
      std::memcpy(static_cast<unsigned char*>(s.working) + i * wsize, w, rest * wsize);
    }
  };
  if (c.inv_bias_correction2_sqrt == 0.0f) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
}

void AdamAvx2(const AdamStepConstants& c, const AdamSpan& s) {
  adam_internal::Dispatch<Kernel>(c, s);
}

uint64_t CountNonFiniteAvx2(const void* grads, DType dtype, size_t n) {
  uint64_t count = 0;
  size_t i = 0;
  if (dtype == DType::kFp32) {
    const uint32_t* g = static_cast<const uint32_t*>(grads);
    const __m256i exp = _mm256_set1_epi32(0x7f800000);
    for (; i + 8 <= n; i += 8) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i));
      const __m256i hit = _mm256_cmpeq_epi32(_mm256_and_si256(u, exp), exp);
      count +=
          static_cast<uint64_t>(__builtin_popcount(_mm256_movemask_ps(_mm256_castsi256_ps(hit))));
    }
    for (; i < n; ++i) count += (g[i] & 0x7f800000u) == 0x7f800000u;
    return count;
  }
  const uint16_t mask16 = dtype == DType::kBf16 ? 0x7f80u : 0x7c00u;
  const uint16_t* g = static_cast<const uint16_t*>(grads);
  const __m256i exp = _mm256_set1_epi16(static_cast<short>(mask16));
  for (; i + 16 <= n; i += 16) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i));
    const __m256i hit = _mm256_cmpeq_epi16(_mm256_and_si256(u, exp), exp);
    // Two mask bits per 16-bit lane.
    count += static_cast<uint64_t>(
                 __builtin_popcount(static_cast<unsigned>(_mm256_movemask_epi8(hit)))) /
             2;
  }
  for (; i < n; ++i) count += (g[i] & mask16) == mask16;
  return count;
}

// AccumulateGrads (accumulate.h), bit for bit: the reference's 16 lanes of
// fp32 squares are two vectors here (lanes 0-7, 8-15), summed per block of
// 1024 in double in lane order; the tail element by element. Without
// kStore (no accumulator: measure only), the values are not stored.
struct Accumulator {
  static float Widen(const void* g, DType dtype, size_t i) {
    if (dtype == DType::kFp32) return static_cast<const float*>(g)[i];
    const uint16_t h = static_cast<const uint16_t*>(g)[i];
    if (dtype == DType::kFp16) return _cvtsh_ss(h);
    const uint32_t bits = uint32_t{h} << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }

  template <DType G, bool kFirst, bool kStore>
  static GradStats Run(const void* g, float* acc, size_t n) {
    constexpr size_t kBlock = adam_internal::kAccumulateBlock;
    const __m256 max = _mm256_set1_ps(adam_internal::kMaxFloat);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    auto bad = [&](__m256 x) {
      return static_cast<uint64_t>(__builtin_popcount(static_cast<unsigned>(
          _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(x, magnitude), max, _CMP_NLE_UQ)))));
    };
    GradStats out;
    size_t i = 0;
    for (; i + kBlock <= n; i += kBlock) {
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      for (size_t j = i; j < i + kBlock; j += 16) {
        __m256 x0 = LoadGrad<G>(g, j), x1 = LoadGrad<G>(g, j + 8);
        if constexpr (!kFirst) {
          x0 = _mm256_add_ps(_mm256_loadu_ps(acc + j), x0);
          x1 = _mm256_add_ps(_mm256_loadu_ps(acc + j + 8), x1);
        }
        if constexpr (kStore) {
          _mm256_storeu_ps(acc + j, x0);
          _mm256_storeu_ps(acc + j + 8, x1);
        }
        lo = _mm256_add_ps(lo, _mm256_mul_ps(x0, x0));
        hi = _mm256_add_ps(hi, _mm256_mul_ps(x1, x1));
        out.nonfinite += bad(x0) + bad(x1);
      }
      alignas(32) float lanes[16];
      _mm256_store_ps(lanes, lo);
      _mm256_store_ps(lanes + 8, hi);
      double block = 0;
      for (float lane : lanes) block += lane;
      out.sq_norm += block;
    }
    for (; i < n; ++i) {
      const float v = Widen(g, G, i);
      const float x = kFirst ? v : acc[i] + v;
      if constexpr (kStore) acc[i] = x;
      out.sq_norm += static_cast<double>(x) * x;
      uint32_t bits;
      std::memcpy(&bits, &x, sizeof(bits));
      out.nonfinite += (bits & 0x7f800000u) == 0x7f800000u ? 1 : 0;
    }
    return out;
  }
};

GradStats AccumulateAvx2(const void* grads, DType dtype, float* acc, size_t n, bool first) {
  return adam_internal::DispatchAccumulate<Accumulator>(grads, dtype, acc, n, first);
}

}  // namespace

const AdamKernels& Avx2AdamKernels() {
  static const AdamKernels kernels = {"avx2", &AdamAvx2, &CountNonFiniteAvx2, &AccumulateAvx2};
  return kernels;
}

}  // namespace offload
