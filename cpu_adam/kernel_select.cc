#include "cpu_adam/kernel_select.h"

#include <cpuid.h>

#include "absl/strings/str_cat.h"
#include "cpu_adam/adam_avx2.h"
#include "cpu_adam/adam_avx512.h"

namespace offload {

bool CpuHasAvx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

// F16C from CPUID itself: clang's __builtin_cpu_supports does not know it.
bool CpuHasF16c() {
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

bool CpuHasAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && CpuHasF16c();
}

absl::StatusOr<const AdamKernels*> SelectAdamKernels(absl::string_view name) {
  if (name == "auto") {
    if (CpuHasAvx512()) return &Avx512AdamKernels();
    if (CpuHasAvx2()) return &Avx2AdamKernels();
    return &ScalarAdamKernels();
  }
  if (name == "scalar") return &ScalarAdamKernels();
  if (name == "avx2") {
    if (!CpuHasAvx2()) {
      return absl::FailedPreconditionError("this CPU lacks AVX2/FMA/F16C; use auto or scalar");
    }
    return &Avx2AdamKernels();
  }
  if (name == "avx512") {
    if (!CpuHasAvx512()) {
      return absl::FailedPreconditionError(
          "this CPU lacks AVX-512 F/BW/VL/DQ; use auto, avx2 or scalar");
    }
    return &Avx512AdamKernels();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown Adam kernel '", name, "': expected auto, avx512, avx2 or scalar"));
}

std::vector<const AdamKernels*> SupportedAdamKernels() {
  std::vector<const AdamKernels*> out = {&ScalarAdamKernels()};
  if (CpuHasAvx2()) out.push_back(&Avx2AdamKernels());
  if (CpuHasAvx512()) out.push_back(&Avx512AdamKernels());
  return out;
}

}  // namespace offload
