// nvme/: block I/O between host memory and files on NVMe (or any) storage.
// Owns the I/O backends and the swap-file layout (swap_space.h); knows
// nothing of sessions, partitions or the optimizer.
//
// IoBackend is the one interface to "read or write these byte ranges": the
// io_uring backend (uring_backend.h), a thread-pool pread/pwrite fallback
// (posix_backend.h), and a fault-injecting wrapper for tests
// (fault_injection.h). A batch runs to completion before Run() returns, so
// no buffer is in use by the kernel afterwards, even when a request failed.
//
// Every backend: splits requests larger than request_bytes, resubmits the
// remainder of short reads and writes, retries EAGAIN and EINTR, and turns
// any other error into a status naming the operation, path, offset, length
// and errno (EIO -> DATA_LOSS, ENOSPC -> RESOURCE_EXHAUSTED).
//
// Thread-safety: Run() may be called from several threads at once.
// AddFile/AddBuffer must happen before the I/O that uses them.
#ifndef OFFLOADD_NVME_IO_BACKEND_H_
#define OFFLOADD_NVME_IO_BACKEND_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "nvme/nvme_options.h"

namespace offload {

enum class IoOp { kRead, kWrite };

struct IoRequest {
  IoOp op = IoOp::kRead;
  int file = -1;  // index returned by AddFile
  uint64_t offset = 0;
  void* buffer = nullptr;
  uint64_t length = 0;
};

// Test hook at the syscall/completion site: sees each attempt and its raw
// result (bytes, or -errno) and may replace it, e.g. with a short count,
// -EIO, -EAGAIN or -ENOSPC, or sleep to add delay.
using IoResultHook = std::function<int64_t(const IoRequest& attempt, int64_t result)>;
// Test hook at io_uring's entries into the kernel (submitting, waiting):
// sees each call's result (>= 0, or -errno) and may replace it, e.g. with a
// hard error after the kernel took the requests. The POSIX backend never
// calls it.
using IoEnterHook = std::function<int(int result)>;

// Told by Run() that all of request `request`'s bytes (an index into the
// requests given) are transferred, while later ones may still be in flight,
// so that work on them (a checksum) overlaps the rest of the I/O. Called on
// whichever thread completed the request (the caller's, or one of the
// backend's own), for different requests possibly at the same time; not
// for a request that failed.
using RequestDone = std::function<void(size_t request)>;

class IoBackend {
 public:
  virtual ~IoBackend() = default;

  virtual std::string name() const = 0;

  // Registers an open file (borrowed: it must stay open while registered).
  // `path` is used in error messages.
  virtual absl::StatusOr<int> AddFile(int fd, const std::string& path) = 0;

  // Declares a long-lived buffer (a staging buffer); io_uring registers it
  // for fixed-buffer I/O. Optional: any buffer may be used for I/O.
  virtual absl::Status AddBuffer(void* base, uint64_t length) = 0;
  // Forgets a buffer AddBuffer declared (same base and length) before it is
  // unmapped; no I/O on it may be in flight. Unknown buffers are ignored.
  virtual void RemoveBuffer(void* base, uint64_t length) = 0;

  // Performs every request; returns the first error, after all requests in
  // flight have completed. `done`, if set, hears of each request finished.
  virtual absl::Status Run(absl::Span<const IoRequest> requests, const RequestDone& done) = 0;
  absl::Status Run(absl::Span<const IoRequest> requests) { return Run(requests, nullptr); }

  // The settings that change while running (nvme_options.h has their
  // ranges); INVALID_ARGUMENT if out of range.
  virtual absl::Status SetQueueDepth(int64_t depth) = 0;
  virtual absl::Status SetRequestBytes(int64_t bytes) = 0;
  virtual absl::Status SetSubmitBatch(int64_t batch) = 0;

  virtual void SetResultHookForTesting(IoResultHook hook) = 0;
  virtual void SetEnterHookForTesting(IoEnterHook hook) = 0;
};

// "read 1048576 bytes at offset 4096 of /x/swap0" style context.
std::string DescribeIo(const IoRequest& r, const std::string& path);

}  // namespace offload

#endif  // OFFLOADD_NVME_IO_BACKEND_H_
