#include "nvme/uring_backend.h"

#include <liburing.h>
#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <deque>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/log.h"
#include "base/posix_error.h"
#include "base/status_macros.h"
#include "nvme/io_backend_base.h"

namespace offload {
namespace {

constexpr unsigned kRingEntries = 256;  // also the largest queue_depth
constexpr unsigned kMaxFiles = 256;
constexpr unsigned kMaxBuffers = 1024;
constexpr uint64_t kMaxFixedBuffer = uint64_t{1} << 30;

class UringBackend final : public IoBackendBase {
 public:
  explicit UringBackend(const IoOptions& o) : IoBackendBase(o) {}

  ~UringBackend() override {
    for (auto& r : rings_) {
      absl::MutexLock lock(&r->mu);
      io_uring_queue_exit(&r->ring);
    }
  }

  absl::Status Init(const IoOptions& o) {
    for (int64_t i = 0; i < o.rings; ++i) {
      auto r = std::make_unique<Ring>();
      io_uring_params params = {};
      if (o.sqpoll) {
        params.flags |= IORING_SETUP_SQPOLL;
        params.sq_thread_idle = 1000;  // ms before the poller sleeps
      }
      // Completions are run when the submitter next enters the kernel
      // instead of interrupting it (Linux 5.19+); rings are used by whichever
      // thread holds them, so SINGLE_ISSUER/DEFER_TASKRUN do not apply.
      params.flags |= IORING_SETUP_COOP_TASKRUN;
      int rc = io_uring_queue_init_params(kRingEntries, &r->ring, &params);
      if (rc == -EINVAL) {  // older kernel: without the hint
        params.flags &= ~IORING_SETUP_COOP_TASKRUN;
        rc = io_uring_queue_init_params(kRingEntries, &r->ring, &params);
      }
      if (rc < 0) return PosixError(absl::StrCat("io_uring_queue_init (ring ", i, ")"), -rc);
      // Sparse tables, filled by AddFile/AddBuffer. Without them, plain
      // descriptors and buffers still work.
      r->fixed_files = io_uring_register_files_sparse(&r->ring, kMaxFiles) == 0;
      r->fixed_buffers = io_uring_register_buffers_sparse(&r->ring, kMaxBuffers) == 0;
      rings_.push_back(std::move(r));
    }
    return absl::OkStatus();
  }

  std::string name() const override { return "io_uring"; }

  absl::StatusOr<int> AddFile(int fd, const std::string& path) override {
    ASSIGN_OR_RETURN(const int index, AddFileEntry(fd, path, kMaxFiles));
    for (auto& r : rings_) {
      absl::MutexLock ring_lock(&r->mu);
      if (r->fixed_files && io_uring_register_files_update(&r->ring, index, &fd, 1) != 1) {
        LogWarning("io_uring: cannot register %s as a fixed file; using its descriptor", path);
        r->fixed_files = false;
      }
    }
    return index;
  }

  absl::Status AddBuffer(void* base, uint64_t length) override {
    absl::MutexLock lock(&buffers_mu_);
    auto* p = static_cast<std::byte*>(base);
    for (uint64_t done = 0; done < length; done += kMaxFixedBuffer) {
      // A slot RemoveBuffer emptied, else a new one.
      size_t slot = 0;
      while (slot < buffers_.size() && buffers_[slot].base != nullptr) ++slot;
      if (slot >= kMaxBuffers) break;
      iovec iov{p + done, std::min(kMaxFixedBuffer, length - done)};
      const unsigned index = static_cast<unsigned>(slot);
      int failed = 0;  // the first ring's error
      for (auto& r : rings_) {
        absl::MutexLock ring_lock(&r->mu);
        __u64 tag = 0;
        const int rc = r->fixed_buffers
                           ? io_uring_register_buffers_update_tag(&r->ring, index, &iov, &tag, 1)
                           : -EOPNOTSUPP;
        if (rc != 1 && failed == 0) failed = rc < 0 ? rc : -EINVAL;
      }
      if (failed != 0) {
        // Plain I/O still works. No ring keeps the slot (nor pins the
        // memory) when another could not take it.
        ClearSlotLocked(index);
        if (!warned_register_) {
          warned_register_ = true;
          LogWarning(
              "io_uring: cannot register %d bytes as a fixed buffer (%s); using plain "
              "buffers (raise RLIMIT_MEMLOCK for fixed-buffer I/O; said once)",
              static_cast<int64_t>(iov.iov_len), PosixError("register", -failed).message());
        }
        return absl::OkStatus();
      }
      const BufferEntry entry{static_cast<std::byte*>(iov.iov_base), iov.iov_len};
      if (slot == buffers_.size()) {
        buffers_.push_back(entry);
      } else {
        buffers_[slot] = entry;
      }
    }
    return absl::OkStatus();
  }

  // Empties fixed-buffer slot `index` in every ring (the kernel unpins what
  // it held).
  void ClearSlotLocked(unsigned index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(buffers_mu_) {
    iovec empty{nullptr, 0};
    for (auto& r : rings_) {
      absl::MutexLock ring_lock(&r->mu);
      __u64 tag = 0;
      if (r->fixed_buffers) io_uring_register_buffers_update_tag(&r->ring, index, &empty, &tag, 1);
    }
  }

  void RemoveBuffer(void* base, uint64_t length) override {
    absl::MutexLock lock(&buffers_mu_);
    auto* p = static_cast<std::byte*>(base);
    for (size_t i = 0; i < buffers_.size(); ++i) {
      BufferEntry& e = buffers_[i];
      if (e.base == nullptr || e.base < p || e.base + e.length > p + length) continue;
      ClearSlotLocked(static_cast<unsigned>(i));
      e = BufferEntry{nullptr, 0};
    }
  }

  using IoBackend::Run;
  absl::Status Run(absl::Span<const IoRequest> requests, const RequestDone& done) override;

 private:
  struct Ring {
    absl::Mutex mu;
    io_uring ring;
    bool fixed_files = false;
    bool fixed_buffers = false;
    // A hard error of io_uring_enter: entries may linger in the ring, so it
    // is used no more (set under mu, read by RingLease without it).
    std::atomic<bool> broken{false};
  };
  struct BufferEntry {
    std::byte* base;
    uint64_t length;
  };

  int FixedBufferIndex(const std::byte* p, uint64_t len) const
      ABSL_SHARED_LOCKS_REQUIRED(buffers_mu_) {
    for (size_t i = 0; i < buffers_.size(); ++i) {
      if (buffers_[i].base != nullptr && p >= buffers_[i].base &&
          p + len <= buffers_[i].base + buffers_[i].length) {
        return static_cast<int>(i);
      }
    }
    return -1;
  }

  // A ring held for one Run(): the first free one, else wait for one.
  // Rings out of service (broken) are passed over while another is not.
  class RingLease {
   public:
    explicit RingLease(UringBackend& b) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      const size_t n = b.rings_.size();
      const size_t start = b.next_ring_.fetch_add(1) % n;
      for (size_t k = 0; k < n && ring_ == nullptr; ++k) {
        Ring* r = b.rings_[(start + k) % n].get();
        if (r->broken.load(std::memory_order_relaxed)) continue;
        if (r->mu.TryLock()) ring_ = r;
      }
      for (size_t k = 0; k < n && ring_ == nullptr; ++k) {
        Ring* r = b.rings_[(start + k) % n].get();
        if (!r->broken.load(std::memory_order_relaxed) || k == n - 1) {
          ring_ = r;
          ring_->mu.Lock();
        }
      }
    }
    ~RingLease() ABSL_NO_THREAD_SAFETY_ANALYSIS { ring_->mu.Unlock(); }
    RingLease(const RingLease&) = delete;
    RingLease& operator=(const RingLease&) = delete;
    Ring& operator*() const { return *ring_; }

   private:
    Ring* ring_ = nullptr;
  };

  std::vector<std::unique_ptr<Ring>> rings_;
  std::atomic<size_t> next_ring_{0};
  mutable absl::Mutex buffers_mu_;
  std::vector<BufferEntry> buffers_ ABSL_GUARDED_BY(buffers_mu_);
  bool warned_register_ ABSL_GUARDED_BY(buffers_mu_) = false;
};

absl::Status UringBackend::Run(absl::Span<const IoRequest> requests, const RequestDone& done) {
  ASSIGN_OR_RETURN(PreparedBatch prepared, Prepare(requests));
  std::vector<IoChunk>& chunks = prepared.chunks;
  RequestProgress progress(chunks, requests.size(), done);
  const std::vector<IoFileEntry>& files = prepared.files;
  const IoResultHook& hook = prepared.hook;
  const IoEnterHook& enter_hook = prepared.enter_hook;
  auto entered = [&](int rc) { return enter_hook ? enter_hook(rc) : rc; };
  {
    absl::ReaderMutexLock lock(&buffers_mu_);
    for (IoChunk& c : chunks) c.buf_index = FixedBufferIndex(c.buffer, c.remaining);
  }
  if (chunks.empty()) return absl::OkStatus();

  RingLease lease(*this);
  Ring& r = *lease;
  if (r.broken) {
    return absl::InternalError("io_uring ring failed earlier and is out of service");
  }
  const size_t depth = settings_.queue_depth();
  const size_t batch = settings_.submit_batch();
  std::deque<size_t> todo;
  for (size_t i = 0; i < chunks.size(); ++i) todo.push_back(i);
  size_t in_flight = 0, queued = 0;
  ChunkOutcome outcome;

  // After a hard error of io_uring_enter: what the kernel took stays its
  // own, buffers and all, until it completes, whatever the ring says; Run
  // must not return before (the caller reuses those buffers). Waits for
  // each without entering the kernel through the ring (reading its
  // completion queue; any system call runs the deferred completions).
  auto drain_after_error = [&] {
    r.broken = true;
    size_t owned = in_flight - std::min<size_t>(in_flight, io_uring_sq_ready(&r.ring));
    const absl::Time give_up = absl::Now() + absl::Minutes(5);
    while (owned > 0) {
      io_uring_cqe* cqe = nullptr;
      if (io_uring_peek_cqe(&r.ring, &cqe) != 0 || cqe == nullptr) {
        if (absl::Now() > give_up) {
          // Returning would hand buffers the kernel may still write to the
          // caller: stop here instead.
          LogError(
              "io_uring: %d requests never completed after the ring failed (%s); their "
              "buffers cannot be handed back: aborting",
              static_cast<int64_t>(owned), outcome.status().ToString());
          std::abort();
        }
        absl::SleepFor(absl::Milliseconds(1));
        continue;
      }
      unsigned head, seen = 0;
      io_uring_for_each_cqe(&r.ring, head, cqe) {
        ++seen;
        if (hook) {
          const size_t idx = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
          hook(chunks[idx].AsRequest(), cqe->res);
        }
      }
      io_uring_cq_advance(&r.ring, seen);
      owned -= std::min<size_t>(owned, seen);
      in_flight -= std::min<size_t>(in_flight, seen);
    }
  };

  auto submit = [&]() -> bool {
    for (;;) {
      int rc = entered(io_uring_submit(&r.ring));
      if (rc >= 0) {
        // The kernel may take fewer than offered (its requests' allocation
        // failing after the first): the rest stay queued for the next submit.
        queued = io_uring_sq_ready(&r.ring);
        return true;
      }
      if (rc == -EINTR) continue;
      if (rc == -EAGAIN || rc == -EBUSY) return false;  // reap completions, then retry
      outcome.Fail(PosixError("io_uring_submit", -rc));
      r.broken = true;  // prepared entries may linger in the ring
      return false;
    }
  };

  while (!todo.empty() || in_flight > 0) {
    while (outcome.ok() && !r.broken && !todo.empty() && in_flight < depth) {
      io_uring_sqe* sqe = io_uring_get_sqe(&r.ring);
      if (sqe == nullptr) break;
      const size_t idx = todo.front();
      todo.pop_front();
      IoChunk& c = chunks[idx];
      const IoFileEntry& f = files[static_cast<size_t>(c.file)];
      const int fd = r.fixed_files ? c.file : f.fd;
      const unsigned len = static_cast<unsigned>(c.remaining);
      if (c.op == IoOp::kRead) {
        if (c.buf_index >= 0 && r.fixed_buffers) {
          io_uring_prep_read_fixed(sqe, fd, c.buffer, len, c.offset, c.buf_index);
        } else {
          io_uring_prep_read(sqe, fd, c.buffer, len, c.offset);
        }
      } else {
        if (c.buf_index >= 0 && r.fixed_buffers) {
          io_uring_prep_write_fixed(sqe, fd, c.buffer, len, c.offset, c.buf_index);
        } else {
          io_uring_prep_write(sqe, fd, c.buffer, len, c.offset);
        }
      }
      if (r.fixed_files) sqe->flags |= IOSQE_FIXED_FILE;
      io_uring_sqe_set_data64(sqe, idx);
      ++in_flight;
      if (++queued >= batch) submit();
    }
    if (!outcome.ok() || r.broken) todo.clear();  // stop issuing; drain what is in flight
    if (in_flight == 0) {
      if (queued > 0) submit();
      if (r.broken || !outcome.ok()) break;
      continue;
    }
    io_uring_cqe* cqe = nullptr;
    int rc;
    if (queued > 0) {
      // Submit and wait for a completion in one system call.
      rc = entered(io_uring_submit_and_wait(&r.ring, 1));
      if (rc >= 0) {
        queued = io_uring_sq_ready(&r.ring);  // (as in submit)
        rc = io_uring_peek_cqe(&r.ring, &cqe);
      } else if (rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
        outcome.Fail(PosixError("io_uring_submit_and_wait", -rc));
        drain_after_error();
        break;
      }
    } else {
      rc = entered(io_uring_wait_cqe(&r.ring, &cqe));
    }
    if (rc == -EINTR || rc == -EAGAIN || rc == -EBUSY) continue;
    if (rc < 0) {
      outcome.Fail(PosixError("io_uring_wait_cqe", -rc));
      drain_after_error();
      break;
    }
    unsigned head, seen = 0;
    io_uring_for_each_cqe(&r.ring, head, cqe) {
      ++seen;
      --in_flight;
      const size_t idx = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
      IoChunk& c = chunks[idx];
      int64_t res = cqe->res;
      if (hook) res = hook(c.AsRequest(), res);
      if (HandleResult(c, res, files[static_cast<size_t>(c.file)].path, &outcome)) {
        todo.push_back(idx);
      } else if (c.remaining == 0) {
        progress.ChunkDone(c);
      }
    }
    io_uring_cq_advance(&r.ring, seen);
  }
  return outcome.status();
}

}  // namespace

absl::StatusOr<std::unique_ptr<IoBackend>> MakeUringBackend(const IoOptions& options) {
  RETURN_IF_ERROR(ValidateIoOptions(options));
  auto backend = std::make_unique<UringBackend>(options);
  RETURN_IF_ERROR(backend->Init(options));
  return std::unique_ptr<IoBackend>(std::move(backend));
}

int ProbeIoUring() {
  io_uring ring;
  int rc = io_uring_queue_init(4, &ring, 0);
  if (rc == 0) io_uring_queue_exit(&ring);
  return rc;
}

}  // namespace offload
