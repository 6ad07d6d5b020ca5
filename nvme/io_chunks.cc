#include "nvme/io_chunks.h"

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "engine/posix_error.h"
#include "engine/status_macros.h"

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

namespace {

absl::Status InRange(const char* name, int64_t value, int64_t lo, int64_t hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(name, " must be in [", lo, ", ", hi, "], got ", value));
}

// io_uring rings have 256 entries; the other backends use the same bound.
constexpr int64_t kMaxQueueDepth = 256;

}  // namespace

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

absl::Status LiveIoSettings::SetQueueDepth(int64_t depth) {
  RETURN_IF_ERROR(InRange("queue_depth", depth, 1, kMaxQueueDepth));
  queue_depth_.store(depth);
  return absl::OkStatus();
}

absl::Status LiveIoSettings::SetRequestBytes(int64_t bytes) {
  RETURN_IF_ERROR(ValidateRequestBytes(bytes));
  request_bytes_.store(bytes);
  return absl::OkStatus();
}

absl::Status LiveIoSettings::SetSubmitBatch(int64_t batch) {
  RETURN_IF_ERROR(InRange("submit_batch", batch, 1, kMaxQueueDepth));
  submit_batch_.store(batch);
  return absl::OkStatus();
}

absl::Status SplitIntoChunks(absl::Span<const IoRequest> requests, uint64_t max_bytes,
                             size_t num_files, std::vector<IoChunk>* out) {
  for (const IoRequest& r : requests) {
    if (r.file < 0 || static_cast<size_t>(r.file) >= num_files) {
      return absl::InvalidArgumentError(absl::StrCat("I/O request names file ", r.file,
                                                     "; ", num_files, " are registered"));
    }
    if (r.buffer == nullptr && r.length != 0) {
      return absl::InvalidArgumentError("I/O request without a buffer");
    }
    for (uint64_t done = 0; done < r.length; done += max_bytes) {
      IoChunk c;
      c.op = r.op;
      c.file = r.file;
      c.offset = r.offset + done;
      c.buffer = static_cast<std::byte*>(r.buffer) + done;
      c.remaining = std::min(max_bytes, r.length - done);
      out->push_back(c);
    }
  }
  return absl::OkStatus();
}

void IoBackendBase::SetResultHookForTesting(IoResultHook hook) {
  absl::MutexLock lock(&table_mu_);
  hook_ = std::move(hook);
}

absl::StatusOr<int> IoBackendBase::AddFileEntry(int fd, const std::string& path,
                                                size_t max_files) {
  absl::MutexLock lock(&table_mu_);
  if (files_.size() >= max_files) {
    return absl::ResourceExhaustedError(
        absl::StrCat("at most ", max_files, " files can be registered; cannot add ", path));
  }
  files_.push_back({fd, path});
  return static_cast<int>(files_.size() - 1);
}

absl::StatusOr<PreparedBatch> IoBackendBase::Prepare(absl::Span<const IoRequest> requests) const {
  PreparedBatch batch;
  absl::MutexLock lock(&table_mu_);
  RETURN_IF_ERROR(
      SplitIntoChunks(requests, settings_.request_bytes(), files_.size(), &batch.chunks));
  batch.files = files_;
  batch.hook = hook_;
  return batch;
}

bool HandleResult(IoChunk& c, int64_t result, const std::string& path, ChunkOutcome* outcome) {
  if (result < 0) {
    const int err = static_cast<int>(-result);
    if ((err == EAGAIN || err == EINTR) && ++c.retries <= kMaxIoRetries) return true;
    outcome->Fail(PosixError(DescribeIo(c.AsRequest(), path), err));
    return false;
  }
  if (result == 0) {
    if (c.op == IoOp::kRead) {
      outcome->Fail(absl::OutOfRangeError(
          absl::StrCat(DescribeIo(c.AsRequest(), path), ": end of file reached")));
      return false;
    }
    if (++c.retries <= kMaxIoRetries) return true;
    outcome->Fail(absl::DataLossError(
        absl::StrCat(DescribeIo(c.AsRequest(), path), ": no progress after retries")));
    return false;
  }
  const uint64_t done = static_cast<uint64_t>(result);
  if (done > c.remaining) {
    outcome->Fail(absl::InternalError(absl::StrCat(DescribeIo(c.AsRequest(), path),
                                                   ": kernel reported ", done, " bytes")));
    return false;
  }
  c.offset += done;
  c.buffer += done;
  c.remaining -= done;
  return c.remaining > 0;  // the remainder of a short transfer goes again
}

}  // namespace offload
