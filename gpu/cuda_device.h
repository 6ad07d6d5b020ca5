// The CUDA implementation of gpu::Device, over the CUDA runtime API
// (cudart, linked statically: the machine it runs on needs the driver, not
// the toolkit).
//
// Where offloadd was built without the toolkit (bazel/cuda.bzl found none),
// this header's functions come from cuda_device_none.cc: OpenCudaDevice
// always fails with FAILED_PRECONDITION and says how to rebuild, so callers
// need no #ifdef and fall back to the emulated device or a host-only path.
//
// Threads: every Device method may be called from any thread. Each one first
// makes the device current on the calling thread (cudaSetDevice), and leaves
// it current, as torch.cuda.device would; a thread that also works on
// another device sets that one again itself.
//
// Errors: each CUDA error becomes a Status whose code says what the caller
// should do (cudaErrorMemoryAllocation RESOURCE_EXHAUSTED; bad arguments and
// handles INVALID_ARGUMENT; no device, no or too old a driver
// FAILED_PRECONDITION; devices busy in exclusive mode UNAVAILABLE; anything
// else INTERNAL) and whose message names the call, its size and address and
// CUDA's own text. The runtime's last-error state is cleared after each one,
// so that a framework in the same process (torch checks cudaGetLastError
// after its launches) does not take offloadd's error for its own.
#ifndef OFFLOADD_GPU_CUDA_DEVICE_H_
#define OFFLOADD_GPU_CUDA_DEVICE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "gpu/device.h"

namespace offload::gpu {

// Whether this binary was built with the CUDA toolkit (if not, OpenCudaDevice
// always fails).
bool BuiltWithCuda();

// The CUDA device `ordinal` (as CUDA numbers them: after CUDA_VISIBLE_DEVICES),
// with its primary context initialised. FAILED_PRECONDITION without a CUDA
// device or driver, or in a build without the toolkit; INVALID_ARGUMENT for
// an ordinal that names no device. The Device must outlive its Handles.
absl::StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int ordinal);

}  // namespace offload::gpu

#endif  // OFFLOADD_GPU_CUDA_DEVICE_H_
