// Shared by the I/O backends: splitting requests into chunks of at most
// request_bytes, and applying one attempt's result to a chunk (the single
// place where short transfers, retries and errors are decided).
// Not thread-safe; each Run() owns its chunks.
#ifndef OFFLOADD_NVME_IO_BACKEND_BASE_H_
#define OFFLOADD_NVME_IO_BACKEND_BASE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "nvme/io_backend.h"

namespace offload {

// EAGAIN/EINTR retries (and write attempts that made no progress) allowed
// per chunk before it fails.
inline constexpr int kMaxIoRetries = 1000;

struct IoChunk {
  IoOp op = IoOp::kRead;
  int file = -1;
  uint64_t offset = 0;
  std::byte* buffer = nullptr;
  uint64_t remaining = 0;
  int buf_index = -1;  // fixed-buffer slot, if any
  int retries = 0;
  size_t request = 0;  // index of the request it is part of

  IoRequest AsRequest() const { return {op, file, offset, buffer, remaining}; }
};

// Appends the chunks of `requests` to `out`. INVALID_ARGUMENT for a request
// naming an unknown file or a null buffer. Zero-length requests vanish.
absl::Status SplitIntoChunks(absl::Span<const IoRequest> requests, uint64_t max_bytes,
                             size_t num_files, std::vector<IoChunk>* out);

// The settings a backend may change while running (IoOptions says which),
// validated here once for every backend. Lock-free; each Run() reads them
// at its start.
class LiveIoSettings {
 public:
  explicit LiveIoSettings(const IoOptions& o)
      : queue_depth_(o.queue_depth),
        request_bytes_(o.request_bytes),
        submit_batch_(o.submit_batch) {}

  absl::Status SetQueueDepth(int64_t depth);
  absl::Status SetRequestBytes(int64_t bytes);
  absl::Status SetSubmitBatch(int64_t batch);

  size_t queue_depth() const { return static_cast<size_t>(queue_depth_.load()); }
  uint64_t request_bytes() const { return static_cast<uint64_t>(request_bytes_.load()); }
  size_t submit_batch() const { return static_cast<size_t>(submit_batch_.load()); }

 private:
  std::atomic<int64_t> queue_depth_;
  std::atomic<int64_t> request_bytes_;
  std::atomic<int64_t> submit_batch_;
};

struct IoFileEntry {
  int fd;  // borrowed
  std::string path;
};

// What one Run() works from: its chunks, and copies of the file table and
// the test hook as they were when it started.
struct PreparedBatch {
  std::vector<IoChunk> chunks;
  std::vector<IoFileEntry> files;
  IoResultHook hook;
  IoEnterHook enter_hook;
};

// Base of the concrete backends, implementing once what they share: the live
// setters, the file table, the test hook, and preparing a batch.
class IoBackendBase : public IoBackend {
 public:
  using IoBackend::Run;
  absl::Status SetQueueDepth(int64_t depth) final { return settings_.SetQueueDepth(depth); }
  absl::Status SetRequestBytes(int64_t bytes) final { return settings_.SetRequestBytes(bytes); }
  absl::Status SetSubmitBatch(int64_t batch) final { return settings_.SetSubmitBatch(batch); }
  void SetResultHookForTesting(IoResultHook hook) final ABSL_LOCKS_EXCLUDED(table_mu_);
  void SetEnterHookForTesting(IoEnterHook hook) final ABSL_LOCKS_EXCLUDED(table_mu_);

 protected:
  explicit IoBackendBase(const IoOptions& options) : settings_(options) {}

  // Appends to the file table and returns the new index; RESOURCE_EXHAUSTED
  // once it holds `max_files`.
  absl::StatusOr<int> AddFileEntry(int fd, const std::string& path, size_t max_files)
      ABSL_LOCKS_EXCLUDED(table_mu_);
  // Splits `requests` into chunks of at most request_bytes and snapshots the
  // file table and hook. INVALID_ARGUMENT for an unknown file or null buffer.
  absl::StatusOr<PreparedBatch> Prepare(absl::Span<const IoRequest> requests) const
      ABSL_LOCKS_EXCLUDED(table_mu_);

  LiveIoSettings settings_;

 private:
  mutable absl::Mutex table_mu_;
  std::vector<IoFileEntry> files_ ABSL_GUARDED_BY(table_mu_);
  IoResultHook hook_ ABSL_GUARDED_BY(table_mu_);
  IoEnterHook enter_hook_ ABSL_GUARDED_BY(table_mu_);
};

// Counts down each request's chunks and tells RequestDone of a request when
// its last chunk finished (a request with no chunks, of zero bytes, at
// once). Thread-safe.
class RequestProgress {
 public:
  RequestProgress(absl::Span<const IoChunk> chunks, size_t requests, const RequestDone& done);
  // `c` transferred all its bytes.
  void ChunkDone(const IoChunk& c) {
    if (done_ && left_[c.request].fetch_sub(1, std::memory_order_acq_rel) == 1) done_(c.request);
  }

 private:
  const RequestDone& done_;
  std::unique_ptr<std::atomic<uint32_t>[]> left_;
};

// Keeps the first failure of a batch.
class ChunkOutcome {
 public:
  void Fail(absl::Status s) {
    if (status_.ok()) status_ = std::move(s);
  }
  bool ok() const { return status_.ok(); }
  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
};

// Applies `result` (bytes transferred, or -errno) of one attempt on `c`.
// Returns true if the chunk must be submitted again: the remainder of a
// short transfer, or a retry after EAGAIN/EINTR. Errors go to `outcome`.
bool HandleResult(IoChunk& c, int64_t result, const std::string& path, ChunkOutcome* outcome);

}  // namespace offload

#endif  // OFFLOADD_NVME_IO_BACKEND_BASE_H_
