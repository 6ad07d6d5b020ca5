// The fallback backend for kernels without io_uring (or where seccomp forbids
// it): `posix_threads` worker threads doing pread/pwrite. These threads are
// this backend's I/O executor; they only block in I/O and never compute.
#ifndef OFFLOADD_NVME_POSIX_BACKEND_H_
#define OFFLOADD_NVME_POSIX_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "nvme/io_backend.h"

namespace offload {

absl::StatusOr<std::unique_ptr<IoBackend>> MakePosixBackend(const IoOptions& options);

}  // namespace offload

#endif  // OFFLOADD_NVME_POSIX_BACKEND_H_
