// A fault-injecting IoBackend for tests of this component and of the ones
// built on it: wraps a real backend and, through its result hook, turns
// matching attempts into short transfers, errors (EIO, ENOSPC, EAGAIN, ...)
// or delayed completions. The real I/O still happens underneath, so a
// shortened transfer is simply redone from where the fake count says.
// Thread-safe.
#ifndef OFFLOADD_NVME_FAULT_INJECTION_H_
#define OFFLOADD_NVME_FAULT_INJECTION_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "nvme/io_backend.h"

namespace offload {

struct FaultRule {
  enum class Kind { kShort, kError, kDelay };
  Kind kind = Kind::kError;
  // Which attempts match: this operation (or both) within [offset_begin,
  // offset_end) of this file (-1 = any).
  bool any_op = true;
  IoOp op = IoOp::kRead;
  int file = -1;
  uint64_t offset_begin = 0;
  uint64_t offset_end = std::numeric_limits<uint64_t>::max();
  // Let `skip` matching attempts through, then fire `times` times (-1: always).
  int64_t skip = 0;
  int64_t times = 1;
  // kError: the errno reported. kShort: report half the bytes, rounded down
  // to `short_align` (at least one unit); for reads the bytes past that are
  // overwritten, as if never read. kDelay: wait this long first.
  int error = 5;  // EIO
  uint64_t short_align = 4096;
  absl::Duration delay = absl::Milliseconds(10);
};

class FaultInjectingBackend final : public IoBackend {
 public:
  explicit FaultInjectingBackend(std::unique_ptr<IoBackend> inner);

  // Returns the rule's index for fired().
  size_t AddRule(const FaultRule& rule);
  void ClearRules();
  int64_t fired(size_t rule) const;

  std::string name() const override { return "faulty " + inner_->name(); }
  absl::StatusOr<int> AddFile(int fd, const std::string& path) override {
    return inner_->AddFile(fd, path);
  }
  absl::Status AddBuffer(void* base, uint64_t length) override {
    return inner_->AddBuffer(base, length);
  }
  void RemoveBuffer(void* base, uint64_t length) override { inner_->RemoveBuffer(base, length); }
  using IoBackend::Run;
  absl::Status Run(absl::Span<const IoRequest> requests, const RequestDone& done) override {
    return inner_->Run(requests, done);
  }
  absl::Status SetQueueDepth(int64_t d) override { return inner_->SetQueueDepth(d); }
  absl::Status SetRequestBytes(int64_t b) override { return inner_->SetRequestBytes(b); }
  absl::Status SetSubmitBatch(int64_t b) override { return inner_->SetSubmitBatch(b); }
  // The wrapper owns the inner backend's hook.
  void SetResultHookForTesting(IoResultHook) override {}
  void SetEnterHookForTesting(IoEnterHook hook) override {
    inner_->SetEnterHookForTesting(std::move(hook));
  }

 private:
  int64_t Apply(const IoRequest& attempt, int64_t result);

  struct Armed {
    FaultRule rule;
    int64_t matched = 0;
    int64_t fired = 0;
  };
  const std::unique_ptr<IoBackend> inner_;
  mutable absl::Mutex mu_;
  std::vector<Armed> rules_ ABSL_GUARDED_BY(mu_);
};

}  // namespace offload

#endif  // OFFLOADD_NVME_FAULT_INJECTION_H_
