// The io_uring backend: `rings` rings of 256 entries, each serving one Run()
// at a time. Files are registered (fixed files) and declared buffers are
// registered (fixed buffers, in pieces of at most 1 GiB) when the kernel and
// RLIMIT_MEMLOCK allow; otherwise plain descriptors and buffers are used, with
// a logged warning.
#ifndef OFFLOADD_NVME_URING_BACKEND_H_
#define OFFLOADD_NVME_URING_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "nvme/io_backend.h"

namespace offload {

absl::StatusOr<std::unique_ptr<IoBackend>> MakeUringBackend(const IoOptions& options);

// Whether this kernel lets the process set up a ring: 0, or -errno (ENOSYS
// on old kernels, EPERM under seccomp or io_uring_disabled).
int ProbeIoUring();

}  // namespace offload

#endif  // OFFLOADD_NVME_URING_BACKEND_H_
