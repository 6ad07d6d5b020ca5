// Gradient accumulation: a micro-batch's gradients (fp32, bf16 or fp16)
// added into an fp32 accumulator in one pass that also measures what the
// step's global decisions need: the squared L2 norm of the accumulated
// gradient and how many of its values are not finite.
//
// The accumulator adds in fp32, as torch accumulates `.grad` over
// micro-batches (the first micro-batch is copied, not added to zeros, so a
// -0.0 stays -0.0 as torch's first backward leaves it). The squared norm is
// summed in fp32 over blocks of 1024 values and in double across blocks, in
// a fixed order for a fixed tiling, so that it is the same bits on every
// run (and within about 1e-6 of the exact sum).
//
// Each instruction set has its kernel (AdamKernels::accumulate, the
// optimizer's choice); this file holds the scalar reference they match.
//
// Thread-compatible: plain functions over the caller's buffers.
#ifndef OFFLOADD_CPU_ADAM_ACCUMULATE_H_
#define OFFLOADD_CPU_ADAM_ACCUMULATE_H_

#include <cstddef>
#include <cstdint>

#include "cpu_adam/adam.h"
#include "cpu_adam/dtype.h"

namespace offload {

// acc[i] = first ? grads[i] : acc[i] + grads[i] for i < n (a copy: -0.0
// stays), then the statistics of
// acc[0..n) (GradStats, adam.h). With `acc` null (`first` is then ignored):
// the statistics of the gradients alone, as a first micro-batch's, nothing
// stored (a handed-over buffer measured). The scalar reference: the vector
// kernels (AdamKernels::accumulate) give the same bits.
GradStats AccumulateGrads(const void* grads, DType grad_dtype, float* acc, size_t n, bool first);

// The statistics of `n` fp32 values, as AccumulateGrads computes them
// (tests and tools).
GradStats MeasureGrads(const float* values, size_t n);

}  // namespace offload

#endif  // OFFLOADD_CPU_ADAM_ACCUMULATE_H_
