// AVX-512 Adam: 16 lanes, masked loads and stores for the tail (no scalar
// remainder loop). Performs the IEEE operations of AdamScalar in the same
// order, fusing only where it does (this target builds with
// -ffp-contract=off), but for the division by the bias correction (adam.h),
// so its results are bit-identical to the reference (for the divisors
// checked there).
//
// This file must not call inline functions shared with other targets (such
// as those in dtype.h): the compiler could emit an AVX-512 copy that the
// linker then uses everywhere.
#include "cpu_adam/adam_avx512.h"

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "cpu_adam/adam_dispatch.h"

namespace offload {
namespace {

using adam_internal::Out;

template <DType G>
inline __m512 LoadGrad(const void* g, size_t i, __mmask16 mask) {
  if constexpr (G == DType::kFp32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(g) + i);
  } else {
    __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(g) + i);
    if constexpr (G == DType::kBf16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// fp32 -> bf16, round to nearest even; NaN stays NaN (quiet bit forced).
inline __m256i ToBf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan,
                            _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

template <Out W, bool kStream = false>
inline void StoreWorking(void* w, size_t i, __m512 p, __mmask16 mask) {
  if constexpr (W == Out::kFp32 && kStream) {
    _mm512_stream_ps(static_cast<float*>(w) + i, p);  // a whole aligned vector
  } else if constexpr (W == Out::kFp32) {
    _mm512_mask_storeu_ps(static_cast<float*>(w) + i, mask, p);
  } else if constexpr (W == Out::kBf16 && kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(w) + i), ToBf16(p));
  } else if constexpr (W == Out::kBf16) {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(w) + i, mask, ToBf16(p));
  } else if constexpr (W == Out::kFp16) {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(w) + i, mask,
                             _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

struct Kernel {
  template <DType G, Out W, bool kL2>
  static void Loop(const AdamStepConstants& c, const AdamSpan& s);
};

template <DType G, Out W, bool kL2>
void Kernel::Loop(const AdamStepConstants& c, const AdamSpan& s) {
  const __m512 grad_scale = _mm512_set1_ps(c.grad_scale);
  const __m512 beta1 = _mm512_set1_ps(c.beta1);
  const __m512 beta2 = _mm512_set1_ps(c.beta2);
  const __m512 omb1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 neg_step_size = _mm512_set1_ps(c.neg_step_size);
  const __m512 bc2 = _mm512_set1_ps(c.bias_correction2_sqrt);
  const __m512 inv_bc2 = _mm512_set1_ps(c.inv_bias_correction2_sqrt);
  const __m512 eps = _mm512_set1_ps(c.eps);
  const __m512 decay = _mm512_set1_ps(c.decay_factor);
  const __m512 l2 = _mm512_set1_ps(c.l2);
  float* const master = s.master;
  float* const exp_avg = s.exp_avg;
  float* const exp_avg_sq = s.exp_avg_sq;
  const void* const grads = s.grads;
  void* const working = s.working;
  const size_t n = s.numel;

  // kDivide: root / bc2 with a divide where the constants have no reciprocal
  // for it (adam.h). kStream: the working copy's vector goes around the cache
  // (whole, aligned vectors only): nothing reads it back in the step, and a
  // write-allocate would read each of its lines first. Both are template
  // arguments so that the loops carry no test of them.
  auto run = [&](auto divide) {
    constexpr bool kDivide = decltype(divide)::value;
    auto body = [&](size_t i, __mmask16 mask, auto stream) {
      constexpr bool kStream = decltype(stream)::value;
      __m512 g = _mm512_mul_ps(LoadGrad<G>(grads, i, mask), grad_scale);
      __m512 p = _mm512_maskz_loadu_ps(mask, master + i);
      if constexpr (kL2) g = _mm512_fmadd_ps(p, l2, g);
      p = _mm512_mul_ps(p, decay);
      const __m512 m =
          _mm512_fmadd_ps(g, omb1, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, exp_avg + i), beta1));
      const __m512 v =
          _mm512_fmadd_ps(_mm512_mul_ps(omb2, g), g,
                          _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, exp_avg_sq + i), beta2));
      const __m512 root = _mm512_sqrt_ps(v);
      __m512 scaled;  // root / bc2, correctly rounded (adam.h)
      if constexpr (kDivide) {
        scaled = _mm512_div_ps(root, bc2);
      } else {
        const __m512 q = _mm512_mul_ps(root, inv_bc2);
        const __m512 r = _mm512_fnmadd_ps(q, bc2, root);
        scaled = _mm512_mask3_fmadd_ps(r, inv_bc2, q, _mm512_cmp_ps_mask(r, r, _CMP_ORD_Q));
      }
      const __m512 denom = _mm512_add_ps(scaled, eps);
      p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_step_size, m), denom));
      _mm512_mask_storeu_ps(exp_avg + i, mask, m);
      _mm512_mask_storeu_ps(exp_avg_sq + i, mask, v);
      _mm512_mask_storeu_ps(master + i, mask, p);
      StoreWorking<W, kStream>(working, i, p, mask);
    };

    size_t i = 0;
    if constexpr (W == Out::kFp32 || W == Out::kBf16) {
      // An fp32 or bf16 working copy (4 or 2 bytes a parameter, and as many
      // again for its allocate reads) on a 64-byte boundary, as the arena's are.
      if (reinterpret_cast<uintptr_t>(working) % 64 == 0) {
        for (; i + 16 <= n; i += 16) body(i, static_cast<__mmask16>(0xffff), std::true_type{});
        _mm_sfence();  // ordered before whatever tells others the step is done
      }
    }
    for (; i + 16 <= n; i += 16) body(i, static_cast<__mmask16>(0xffff), std::false_type{});
    if (i < n) body(i, static_cast<__mmask16>((1u << (n - i)) - 1u), std::false_type{});
  };
  if (c.inv_bias_correction2_sqrt == 0.0f) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
}

void AdamAvx512(const AdamStepConstants& c, const AdamSpan& s) {
  adam_internal::Dispatch<Kernel>(c, s);
}

uint64_t CountNonFiniteAvx512(const void* grads, DType dtype, size_t n) {
  uint64_t count = 0;
  size_t i = 0;
  if (dtype == DType::kFp32) {
    const float* g = static_cast<const float*>(grads);
    const __m512i exp = _mm512_set1_epi32(0x7f800000);
    for (; i < n; i += 16) {
      const __mmask16 mask = n - i >= 16 ? static_cast<__mmask16>(0xffff)
                                         : static_cast<__mmask16>((1u << (n - i)) - 1u);
      const __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(mask, g + i));
      count += static_cast<uint64_t>(
          __builtin_popcount(_mm512_mask_cmpeq_epi32_mask(mask, _mm512_and_si512(u, exp), exp)));
    }
    return count;
  }
  const uint16_t* g = static_cast<const uint16_t*>(grads);
  const __m512i exp =
      _mm512_set1_epi16(static_cast<short>(dtype == DType::kBf16 ? 0x7f80 : 0x7c00));
  for (; i < n; i += 32) {
    const __mmask32 mask = n - i >= 32 ? static_cast<__mmask32>(0xffffffffu)
                                       : static_cast<__mmask32>((uint64_t{1} << (n - i)) - 1u);
    const __m512i u = _mm512_maskz_loadu_epi16(mask, g + i);
    count += static_cast<uint64_t>(
        __builtin_popcount(_mm512_mask_cmpeq_epi16_mask(mask, _mm512_and_si512(u, exp), exp)));
  }
  return count;
}

// AccumulateGrads (accumulate.h), bit for bit: the same 16 lanes of fp32
// squares per block of 1024, the lanes then summed in double in order, the
// tail element by element in double. Without kStore (no accumulator:
// measure only) the values are not stored. Non-finite values are counted
// per lane in a vector (a popcount per vector instead: 0.8-0.9x measuring
// at 100M values). (Non-temporal stores for a first micro-batch were
// tried: no faster on the machines measured; so was summing four blocks at
// once, to break the chain of dependent additions: 0.7x with stores and
// 0.5x measuring.)
struct Accumulator {
  template <DType G, bool kFirst, bool kStore>
  static GradStats Run(const void* g, float* acc, size_t n) {
    constexpr size_t kBlock = adam_internal::kAccumulateBlock;
    const __m512 max = _mm512_set1_ps(adam_internal::kMaxFloat);
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    const __m512i one = _mm512_set1_epi32(1);
    __m512i bad = _mm512_setzero_si512();  // per lane: values not finite
    auto value = [&](size_t at, __mmask16 mask) {
      __m512 x = LoadGrad<G>(g, at, mask);
      if constexpr (!kFirst) x = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, acc + at), x);
      if constexpr (kStore) _mm512_mask_storeu_ps(acc + at, mask, x);
      const __mmask16 nonfinite =
          _mm512_mask_cmp_ps_mask(mask, _mm512_and_ps(x, magnitude), max, _CMP_NLE_UQ);
      bad = _mm512_mask_add_epi32(bad, nonfinite, bad, one);
      return x;
    };
    constexpr __mmask16 kAll = static_cast<__mmask16>(0xffff);
    GradStats out;
    alignas(64) float lanes[16];
    size_t i = 0;
    for (; i + kBlock <= n; i += kBlock) {
      __m512 part = _mm512_setzero_ps();
      for (size_t j = i; j < i + kBlock; j += 16) {
        const __m512 x = value(j, kAll);
        part = _mm512_add_ps(part, _mm512_mul_ps(x, x));
      }
      _mm512_store_ps(lanes, part);
      double block = 0;
      for (float lane : lanes) block += lane;
      out.sq_norm += block;
    }
    for (; i < n; i += 16) {
      const size_t left = n - i < 16 ? n - i : 16;
      _mm512_store_ps(lanes, value(i, static_cast<__mmask16>((1u << left) - 1u)));
      for (size_t k = 0; k < left; ++k) {
        out.sq_norm += static_cast<double>(lanes[k]) * lanes[k];
      }
    }
    alignas(64) uint32_t counts[16];
    _mm512_store_si512(counts, bad);
    for (uint32_t c : counts) out.nonfinite += c;
    return out;
  }
};

GradStats AccumulateAvx512(const void* grads, DType dtype, float* acc, size_t n, bool first) {
  return adam_internal::DispatchAccumulate<Accumulator>(grads, dtype, acc, n, first);
}

}  // namespace

const AdamKernels& Avx512AdamKernels() {
  static const AdamKernels kernels = {"avx512", &AdamAvx512, &CountNonFiniteAvx512,
                                      &AccumulateAvx512};
  return kernels;
}

}  // namespace offload
