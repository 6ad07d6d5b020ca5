// Included only by the instruction-set kernel files (adam_avx2.cc,
// adam_avx512.cc): maps a span's dtypes and options onto the kernel's loop
// template. Each file instantiates it with its own kernel type from an
// anonymous namespace, so every instantiation is private to its target and
// compiled with that target's -m flags.
#ifndef OFFLOADD_CPU_ADAM_ADAM_DISPATCH_H_
#define OFFLOADD_CPU_ADAM_ADAM_DISPATCH_H_

#include <cstddef>
#include <type_traits>

#include "cpu_adam/adam.h"

namespace offload::adam_internal {

// What the kernel writes as the working copy.
enum class Out { kNone, kFp32, kBf16, kFp16 };

// Calls Kernel::template Loop<G, W, kL2>(c, s) with G the gradient dtype, W
// the working-copy output and kL2 whether Adam's L2 term applies.
template <typename Kernel>
void Dispatch(const AdamStepConstants& c, const AdamSpan& s) {
  auto with_out = [&](auto grad) {
    constexpr DType G = decltype(grad)::value;
    auto with_l2 = [&](auto out) {
      constexpr Out W = decltype(out)::value;
      if (c.l2 != 0.0f) {
        Kernel::template Loop<G, W, true>(c, s);
      } else {
        Kernel::template Loop<G, W, false>(c, s);
      }
    };
    if (s.working == nullptr) return with_l2(std::integral_constant<Out, Out::kNone>{});
    switch (s.working_dtype) {
      case DType::kFp32:
        return with_l2(std::integral_constant<Out, Out::kFp32>{});
      case DType::kBf16:
        return with_l2(std::integral_constant<Out, Out::kBf16>{});
      case DType::kFp16:
        return with_l2(std::integral_constant<Out, Out::kFp16>{});
    }
  };
  switch (s.grad_dtype) {
    case DType::kFp32:
      return with_out(std::integral_constant<DType, DType::kFp32>{});
    case DType::kBf16:
      return with_out(std::integral_constant<DType, DType::kBf16>{});
    case DType::kFp16:
      return with_out(std::integral_constant<DType, DType::kFp16>{});
  }
}

// Calls Accumulator::template Run<G, kFirst, kStore>(grads, acc, n) with G
// the gradient dtype, kFirst whether the accumulator is copied into, and
// kStore whether there is one (without: the gradients are only measured,
// as a first micro-batch's would be).
template <typename Accumulator>
GradStats DispatchAccumulate(const void* grads, DType dtype, float* acc, size_t n, bool first) {
  auto with_first = [&](auto grad) {
    constexpr DType G = decltype(grad)::value;
    if (acc == nullptr) return Accumulator::template Run<G, true, false>(grads, acc, n);
    return first ? Accumulator::template Run<G, true, true>(grads, acc, n)
                 : Accumulator::template Run<G, false, true>(grads, acc, n);
  };
  switch (dtype) {
    case DType::kFp32:
      return with_first(std::integral_constant<DType, DType::kFp32>{});
    case DType::kBf16:
      return with_first(std::integral_constant<DType, DType::kBf16>{});
    case DType::kFp16:
      return with_first(std::integral_constant<DType, DType::kFp16>{});
  }
  return GradStats{};
}

// The accumulation's statistics as the scalar reference sums them: squares
// in fp32 over 16 lanes for each block of this many values, each block's
// lanes then added in double in lane order.
inline constexpr size_t kAccumulateBlock = kGradStatsBlock;
inline constexpr float kMaxFloat = 3.40282346638528859811704183484516925e+38F;

}  // namespace offload::adam_internal

#endif  // OFFLOADD_CPU_ADAM_ADAM_DISPATCH_H_
