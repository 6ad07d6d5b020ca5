// Chooses the Adam kernels for this CPU. "auto" takes the widest instruction
// set the CPU supports (AVX-512, then AVX2, then scalar); a named one is
// refused with FAILED_PRECONDITION if the CPU lacks it. Thread-safe.
#ifndef OFFLOADD_CPU_ADAM_KERNEL_SELECT_H_
#define OFFLOADD_CPU_ADAM_KERNEL_SELECT_H_

#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cpu_adam/adam.h"

namespace offload {

bool CpuHasAvx512();  // F, BW, VL, DQ
bool CpuHasAvx2();    // AVX2, FMA, F16C

// `name`: "auto", "avx512", "avx2" or "scalar".
absl::StatusOr<const AdamKernels*> SelectAdamKernels(absl::string_view name);

// Every kernel set this CPU can run, scalar first.
std::vector<const AdamKernels*> SupportedAdamKernels();

}  // namespace offload

#endif  // OFFLOADD_CPU_ADAM_KERNEL_SELECT_H_
