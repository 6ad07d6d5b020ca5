#include "nvme/io_backend.h"

#include <liburing.h>

#include "absl/strings/str_cat.h"
#include "engine/log.h"
#include "engine/posix_error.h"
#include "engine/status_macros.h"
#include "nvme/posix_backend.h"
#include "nvme/uring_backend.h"

namespace offload {
namespace {

int ProbeIoUring() {
  io_uring ring;
  int rc = io_uring_queue_init(4, &ring, 0);
  if (rc == 0) io_uring_queue_exit(&ring);
  return rc;
}

}  // namespace

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
