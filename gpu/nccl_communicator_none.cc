// nccl_communicator.h in a build without NCCL (bazel/cuda.bzl found no
// toolkit, or one without nccl.h and libnccl.so.2).
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gpu/nccl_communicator.h"

#ifndef OFFLOADD_CUDA_PATH
#define OFFLOADD_CUDA_PATH "/usr/local/cuda"
#endif

namespace offload::gpu {
namespace {

absl::Status NoNccl(absl::string_view what) {
  return absl::FailedPreconditionError(absl::StrCat(
      what,
      ": offloadd was built without NCCL (the build looks in $CUDA_PATH, else "
      "/usr/local/cuda, now " OFFLOADD_CUDA_PATH
      ", for include/nccl.h and "
      "lib64/libnccl.so.2); install NCCL into the toolkit, then rebuild (bazel sync --configure "
      "first if CUDA_PATH did not change)"));
}

}  // namespace

bool BuiltWithNccl() { return false; }

absl::StatusOr<std::string> NewNcclId() { return NoNccl("cannot create an NCCL id"); }

absl::StatusOr<std::unique_ptr<Communicator>> OpenNcclCommunicator(int, absl::string_view, int,
                                                                   int) {
  return NoNccl("cannot open an NCCL communicator");
}

}  // namespace offload::gpu
