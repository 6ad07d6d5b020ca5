// AVX-512 (F, BW, VL, DQ) Adam kernels. Compiled with AVX-512 flags: call
// only after kernel_select.h confirmed the CPU supports them.
#ifndef OFFLOADD_CPU_ADAM_ADAM_AVX512_H_
#define OFFLOADD_CPU_ADAM_ADAM_AVX512_H_

#include "cpu_adam/adam.h"

namespace offload {

const AdamKernels& Avx512AdamKernels();

}  // namespace offload

#endif  // OFFLOADD_CPU_ADAM_ADAM_AVX512_H_
