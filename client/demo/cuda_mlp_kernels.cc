// MakeCudaMlpKernels where the build has the CUDA toolkit: launches
// mlp_kernels.cu's kernels on the trainer's stream.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "client/demo/gpu_mlp.h"
#include "client/demo/mlp_kernels.h"

namespace offload::demo {
namespace {

class CudaMlpKernels final : public MlpKernels {
 public:
  explicit CudaMlpKernels(gpu::Device* device) : device_(device) {}

  absl::Status ForwardBackward(const MlpConfig& c, const float* x, const float* y, int count,
                               const float* const p[4], float* const g[4], float* loss,
                               const gpu::Stream& stream) override {
    const uint64_t need = static_cast<uint64_t>(count) * (c.hidden + 1) * sizeof(float);
    if (workspace_.bytes() < need) {
      // The old workspace may still be read by work in flight: cudaFree
      // (the handle's release) waits for the device first.
      workspace_.Reset();
      ASSIGN_OR_RETURN(workspace_, device_->Allocate(need));
    }
    float* h = static_cast<float*>(workspace_.get());
    OffloadDemoMlpArgs args{};
    args.inputs = c.inputs;
    args.hidden = c.hidden;
    args.count = count;
    args.x = x;
    args.y = y;
    args.w1 = p[0];
    args.b1 = p[1];
    args.w2 = p[2];
    args.b2 = p[3];
    args.gw1 = g[0];
    args.gb1 = g[1];
    args.gw2 = g[2];
    args.gb2 = g[3];
    args.loss = loss;
    args.h = h;
    args.err = h + static_cast<uint64_t>(count) * c.hidden;
    if (int err = OffloadDemoMlpForwardBackward(&args, stream.get()); err != 0) {
      return absl::InternalError(absl::StrCat("launching the demo MLP's kernels: ",
                                              cudaGetErrorString(static_cast<cudaError_t>(err))));
    }
    return absl::OkStatus();
  }

 private:
  gpu::Device* const device_;
  gpu::DeviceMemory workspace_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MlpKernels>> MakeCudaMlpKernels(gpu::Device* device) {
  return std::unique_ptr<MlpKernels>(new CudaMlpKernels(device));
}

}  // namespace offload::demo
