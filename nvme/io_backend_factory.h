// Chooses and builds the I/O backend IoOptions::backend asks for. Apart from
// io_backend.h so that code which only uses an IoBackend (the swap space, its
// tests' fakes) does not link the concrete backends or liburing.
#ifndef OFFLOADD_NVME_IO_BACKEND_FACTORY_H_
#define OFFLOADD_NVME_IO_BACKEND_FACTORY_H_

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "nvme/io_backend.h"

namespace offload {

// The backend options.backend asks for. "auto" falls back to posix, with a
// logged warning, when io_uring cannot be set up (old kernel, seccomp).
absl::StatusOr<std::unique_ptr<IoBackend>> MakeIoBackend(const IoOptions& options);

// As MakeIoBackend, with the io_uring probe replaced (tests simulate a
// kernel without io_uring): `probe` returns 0 or -errno.
absl::StatusOr<std::unique_ptr<IoBackend>> MakeIoBackendWithProbe(
    const IoOptions& options, const std::function<int()>& probe);

}  // namespace offload

#endif  // OFFLOADD_NVME_IO_BACKEND_FACTORY_H_
