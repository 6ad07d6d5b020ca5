#include "nvme/io_backend.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace offload {

std::string DescribeIo(const IoRequest& r, const std::string& path) {
  return absl::StrCat(r.op == IoOp::kRead ? "read of " : "write of ", r.length,
                      " bytes at offset ", r.offset, r.op == IoOp::kRead ? " from " : " to ", path);
}

absl::Status ValidateRequestBytes(int64_t bytes) {
  if (bytes < 4096 || bytes > (int64_t{1} << 30) || bytes % 4096 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request_bytes must be a multiple of 4096 in [4KiB, 1GiB], got ", bytes));
  }
  return absl::OkStatus();
}

absl::Status InRange(const char* name, int64_t value, int64_t lo, int64_t hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(name, " must be in [", lo, ", ", hi, "], got ", value));
}


absl::Status ValidateIoOptions(const IoOptions& o) {
  if (o.backend != "auto" && o.backend != "io_uring" && o.backend != "posix") {
    return absl::InvalidArgumentError(
        absl::StrCat("I/O backend must be auto, io_uring or posix, got '", o.backend, "'"));
  }
  RETURN_IF_ERROR(InRange("queue_depth", o.queue_depth, 1, kMaxQueueDepth));
  RETURN_IF_ERROR(InRange("submit_batch", o.submit_batch, 1, kMaxQueueDepth));
  RETURN_IF_ERROR(InRange("rings", o.rings, 1, 64));
  RETURN_IF_ERROR(InRange("posix_threads", o.posix_threads, 1, 256));
  return ValidateRequestBytes(o.request_bytes);
}

}  // namespace offload
