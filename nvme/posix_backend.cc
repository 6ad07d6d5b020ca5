#include "nvme/posix_backend.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <deque>
#include <limits>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "nvme/io_backend_base.h"

namespace offload {
namespace {

class PosixBackend final : public IoBackendBase {
 public:
  explicit PosixBackend(const IoOptions& o) : IoBackendBase(o) {
    for (int64_t i = 0; i < o.posix_threads; ++i) workers_.emplace_back([this] { Work(); });
  }

  ~PosixBackend() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    for (std::thread& t : workers_) t.join();
  }

  std::string name() const override { return "posix"; }

  absl::StatusOr<int> AddFile(int fd, const std::string& path) override {
    return AddFileEntry(fd, path, std::numeric_limits<size_t>::max());
  }

  absl::Status AddBuffer(void*, uint64_t) override { return absl::OkStatus(); }
  void RemoveBuffer(void*, uint64_t) override {}

  using IoBackend::Run;
  absl::Status Run(absl::Span<const IoRequest> requests, const RequestDone& done) override;

 private:
  // One Run(): its prepared chunks, how many are unfinished, its first error.
  struct Batch : PreparedBatch {
    // The rest is guarded by the backend's mu_.
    size_t next = 0;        // first chunk not yet handed out
    size_t in_flight = 0;   // chunks being worked on
    size_t unfinished = 0;  // chunks not yet done or cancelled
    size_t depth = 1;       // at most this many in flight
    ChunkOutcome outcome;
    RequestProgress* progress = nullptr;  // told of chunks done, without mu_
  };

  void Work();
  // Runs one chunk to completion (or failure); returns its outcome.
  absl::Status DoChunk(IoChunk c, const IoFileEntry& f, const IoResultHook& hook);

  absl::Mutex mu_;
  std::deque<Batch*> batches_ ABSL_GUARDED_BY(mu_);  // batches with chunks left to hand out
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

absl::Status PosixBackend::DoChunk(IoChunk c, const IoFileEntry& f, const IoResultHook& hook) {
  ChunkOutcome outcome;
  for (;;) {
    const IoRequest attempt = c.AsRequest();
    ssize_t n = c.op == IoOp::kRead
                    ? pread(f.fd, c.buffer, c.remaining, static_cast<off_t>(c.offset))
                    : pwrite(f.fd, c.buffer, c.remaining, static_cast<off_t>(c.offset));
    int64_t result = n >= 0 ? n : -static_cast<int64_t>(errno);
    if (hook) result = hook(attempt, result);
    if (!HandleResult(c, result, f.path, &outcome)) return outcome.status();
  }
}

void PosixBackend::Work() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    mu_.Await(absl::Condition(
        +[](PosixBackend* b)
             ABSL_EXCLUSIVE_LOCKS_REQUIRED(b->mu_) { return b->stopping_ || !b->batches_.empty(); },
        this));
    if (batches_.empty()) return;  // stopping, nothing left
    // A batch is queued exactly while it has chunks to hand out and fewer
    // than `depth` in flight.
    Batch* b = batches_.front();
    const size_t idx = b->next++;
    ++b->in_flight;
    if (b->next == b->chunks.size() || b->in_flight == b->depth) batches_.pop_front();
    const IoChunk chunk = b->chunks[idx];
    const IoFileEntry file = b->files[static_cast<size_t>(chunk.file)];
    const IoResultHook hook = b->hook;
    RequestProgress* progress = b->progress;
    mu_.Unlock();
    absl::Status s = DoChunk(chunk, file, hook);
    if (s.ok()) progress->ChunkDone(chunk);  // before the batch can end: Run waits for this
    mu_.Lock();
    b->outcome.Fail(s);
    const bool was_full = b->in_flight == b->depth;
    --b->in_flight;
    --b->unfinished;
    const size_t left = b->chunks.size() - b->next;
    if (left == 0) continue;
    if (!b->outcome.ok()) {
      // Cancel what was never started; the chunks in flight still finish.
      if (!was_full) batches_.erase(std::find(batches_.begin(), batches_.end(), b));
      b->unfinished -= left;
      b->next = b->chunks.size();
    } else if (was_full) {
      batches_.push_back(b);
    }
  }
}

absl::Status PosixBackend::Run(absl::Span<const IoRequest> requests, const RequestDone& done) {
  ASSIGN_OR_RETURN(PreparedBatch prepared, Prepare(requests));
  RequestProgress progress(prepared.chunks, requests.size(), done);
  if (prepared.chunks.empty()) return absl::OkStatus();
  Batch batch;
  static_cast<PreparedBatch&>(batch) = std::move(prepared);
  batch.progress = &progress;
  batch.depth = settings_.queue_depth();
  absl::MutexLock lock(&mu_);
  batch.unfinished = batch.chunks.size();
  batches_.push_back(&batch);
  mu_.Await(absl::Condition(
      +[](Batch* b) { return b->unfinished == 0; }, &batch));
  return batch.outcome.status();
}

}  // namespace

absl::StatusOr<std::unique_ptr<IoBackend>> MakePosixBackend(const IoOptions& options) {
  RETURN_IF_ERROR(ValidateIoOptions(options));
  return std::unique_ptr<IoBackend>(new PosixBackend(options));
}

}  // namespace offload
