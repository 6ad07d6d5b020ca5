#include "nvme/io_backend_factory.h"

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/posix_error.h"
#include "base/status_macros.h"
#include "nvme/posix_backend.h"
#include "nvme/uring_backend.h"

namespace offload {

absl::StatusOr<std::unique_ptr<IoBackend>> MakeIoBackendWithProbe(
    const IoOptions& options, const std::function<int()>& probe) {
  RETURN_IF_ERROR(ValidateIoOptions(options));
  if (options.backend == "posix") return MakePosixBackend(options);
  const int rc = probe();
  if (rc == 0) return MakeUringBackend(options);
  absl::Status why = PosixError("io_uring_queue_init", -rc);
  if (options.backend == "io_uring") {
    return absl::FailedPreconditionError(
        absl::StrCat("io_uring was asked for but is unavailable: ", why.message()));
  }
  LogWarning("io_uring unavailable (%s); falling back to the pread/pwrite thread pool",
             why.message());
  return MakePosixBackend(options);
}

absl::StatusOr<std::unique_ptr<IoBackend>> MakeIoBackend(const IoOptions& options) {
  return MakeIoBackendWithProbe(options, &ProbeIoUring);
}

}  // namespace offload
