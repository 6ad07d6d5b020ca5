#include "nvme/io_backend_base.h"

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "base/posix_error.h"
#include "base/status_macros.h"

namespace offload {

absl::Status LiveIoSettings::SetQueueDepth(int64_t depth) {
  RETURN_IF_ERROR(kQueueDepthRange.Check("queue_depth", depth));
  queue_depth_.store(depth);
  return absl::OkStatus();
}

absl::Status LiveIoSettings::SetRequestBytes(int64_t bytes) {
  RETURN_IF_ERROR(ValidateRequestBytes(bytes));
  request_bytes_.store(bytes);
  return absl::OkStatus();
}

absl::Status LiveIoSettings::SetSubmitBatch(int64_t batch) {
  RETURN_IF_ERROR(kSubmitBatchRange.Check("submit_batch", batch));
  submit_batch_.store(batch);
  return absl::OkStatus();
}

absl::Status SplitIntoChunks(absl::Span<const IoRequest> requests, uint64_t max_bytes,
                             size_t num_files, std::vector<IoChunk>* out) {
  for (size_t i = 0; i < requests.size(); ++i) {
    const IoRequest& r = requests[i];
    if (r.file < 0 || static_cast<size_t>(r.file) >= num_files) {
      return absl::InvalidArgumentError(
          absl::StrCat("I/O request names file ", r.file, "; ", num_files, " are registered"));
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
      c.request = i;
      out->push_back(c);
    }
  }
  return absl::OkStatus();
}

RequestProgress::RequestProgress(absl::Span<const IoChunk> chunks, size_t requests,
                                 const RequestDone& done)
    : done_(done) {
  if (!done_) return;
  left_ = std::make_unique<std::atomic<uint32_t>[]>(requests);
  for (size_t r = 0; r < requests; ++r) left_[r].store(0, std::memory_order_relaxed);
  for (const IoChunk& c : chunks) left_[c.request].fetch_add(1, std::memory_order_relaxed);
  for (size_t r = 0; r < requests; ++r) {
    if (left_[r].load(std::memory_order_relaxed) == 0) done_(r);
  }
}

void IoBackendBase::SetResultHookForTesting(IoResultHook hook) {
  absl::MutexLock lock(&table_mu_);
  hook_ = std::move(hook);
}

void IoBackendBase::SetEnterHookForTesting(IoEnterHook hook) {
  absl::MutexLock lock(&table_mu_);
  enter_hook_ = std::move(hook);
}

absl::StatusOr<int> IoBackendBase::AddFileEntry(int fd, const std::string& path, size_t max_files) {
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
  batch.enter_hook = enter_hook_;
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
    outcome->Fail(absl::InternalError(
        absl::StrCat(DescribeIo(c.AsRequest(), path), ": kernel reported ", done, " bytes")));
    return false;
  }
  c.offset += done;
  c.buffer += done;
  c.remaining -= done;
  return c.remaining > 0;  // the remainder of a short transfer goes again
}

}  // namespace offload
