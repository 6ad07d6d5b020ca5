// MakeCudaMlpKernels in a build without the CUDA toolkit.
#include <memory>

#include "absl/status/status.h"
#include "client/demo/gpu_mlp.h"

namespace offload::demo {

absl::StatusOr<std::unique_ptr<MlpKernels>> MakeCudaMlpKernels(gpu::Device*) {
  return absl::FailedPreconditionError(
      "the demo's CUDA kernels were not built: offloadd was built without the CUDA toolkit "
      "(see bazel/README.md); --device=emulated runs the demo without a GPU");
}

}  // namespace offload::demo
