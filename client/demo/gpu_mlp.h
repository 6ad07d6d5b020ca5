// The demo MLP (mlp.h) trained on a device by ranks in data parallel with
// ZeRO-3 (client/zero3.h): each rank's session holds its slice of every
// tensor, the GPU tier brings the slices to the device, the communicator
// all-gathers them per unit and reduce-scatters the gradients per bucket,
// the daemons step. Each rank trains on batch / ranks samples of the batch
// a single process would, so the loss curve equals mlp.h's Train with an
// in-process store (to rounding: the batch's gradient is summed in another
// order).
//
// The model's math runs on the device through MlpKernels: CUDA kernels
// (mlp_kernels.cu, where the build has the toolkit), or the host math of
// mlp.h as work on an emulated device's stream.
#ifndef OFFLOADD_CLIENT_DEMO_GPU_MLP_H_
#define OFFLOADD_CLIENT_DEMO_GPU_MLP_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/demo/mlp.h"
#include "client/gpu_tier.h"
#include "client/zero3.h"
#include "gpu/communicator.h"
#include "gpu/device.h"
#include "gpu/emulated_device.h"

namespace offload::demo {

class MlpKernels {
 public:
  virtual ~MlpKernels() = default;
  // Issues, on `stream`, the forward and backward of `count` samples (x:
  // count x inputs, y: count) under `p` (w1, b1, w2, b2), writing the
  // gradients to `g` (their first numel elements; padding untouched) and
  // the mean squared error to `loss` (one float). All device memory.
  virtual absl::Status ForwardBackward(const MlpConfig& config, const float* x, const float* y,
                                       int count, const float* const p[4], float* const g[4],
                                       float* loss, const gpu::Stream& stream) = 0;
};

// mlp.h's ForwardBackward as a host function on the emulated device's
// stream (its device memory is host memory).
std::unique_ptr<MlpKernels> MakeEmulatedMlpKernels(gpu::EmulatedDevice* device);
// CUDA kernels on `device` (a CUDA one); FAILED_PRECONDITION in a build
// without the toolkit.
absl::StatusOr<std::unique_ptr<MlpKernels>> MakeCudaMlpKernels(gpu::Device* device);

struct GpuRank {
  Session* session = nullptr;
  gpu::Device* device = nullptr;
  gpu::Communicator* comm = nullptr;
  MlpKernels* kernels = nullptr;
  GpuTierOptions tier;
  Zero3Options zero3;
};

struct GpuTrainResult {
  std::vector<double> losses;  // the whole batch's, before each step
  Zero3Stats zero3;
  GpuTierStats tier;
};

// Trains config.steps steps as rank comm->rank() (config.param_dtype must be
// fp32; batch a multiple of the ranks). Every rank calls it at once.
absl::StatusOr<GpuTrainResult> TrainZero3(const MlpConfig& config, const GpuRank& rank);

}  // namespace offload::demo

#endif  // OFFLOADD_CLIENT_DEMO_GPU_MLP_H_
