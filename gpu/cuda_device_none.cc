// cuda_device.h in a build without the CUDA toolkit (bazel/cuda.bzl found
// none): no device can be opened, and the error says how to get one.
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gpu/cuda_device.h"

// Where the build looked for the toolkit (bazel/cuda.bzl's CUDA_PATH).
#ifndef OFFLOADD_CUDA_PATH
#define OFFLOADD_CUDA_PATH "/usr/local/cuda"
#endif

namespace offload::gpu {

bool BuiltWithCuda() { return false; }

absl::StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int ordinal) {
  return absl::FailedPreconditionError(absl::StrCat(
      "cannot open CUDA device ", ordinal,
      ": offloadd was built without the CUDA toolkit (none at " OFFLOADD_CUDA_PATH
      ": the build looks at $CUDA_PATH, else /usr/local/cuda, for include/cuda_runtime_api.h and "
      "lib64/libcudart_static.a); install the toolkit or set CUDA_PATH to it, then rebuild "
      "(bazel sync --configure first if CUDA_PATH did not change)"));
}

}  // namespace offload::gpu
