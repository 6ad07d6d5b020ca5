// AVX2 + FMA + F16C Adam kernels. Compiled with those flags: call only after
// kernel_select.h confirmed the CPU supports them.
#ifndef OFFLOADD_CPU_ADAM_ADAM_AVX2_H_
#define OFFLOADD_CPU_ADAM_ADAM_AVX2_H_

#include "cpu_adam/adam.h"

namespace offload {

const AdamKernels& Avx2AdamKernels();

}  // namespace offload

#endif  // OFFLOADD_CPU_ADAM_ADAM_AVX2_H_
