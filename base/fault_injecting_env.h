// An Env for tests that forwards to another and makes chosen calls fail with
// a chosen errno, as the real call would (same status text and code through
// PosixError), to test that callers clean up and report clearly.
//
//   FaultInjectingEnv env(Env::Default());
//   env.FailNth(EnvOp::kAllocate, 2, ENOMEM);  // the 2nd Allocate from now
//
// Thread-safety: all methods are safe from any thread.
#ifndef OFFLOADD_BASE_FAULT_INJECTING_ENV_H_
#define OFFLOADD_BASE_FAULT_INJECTING_ENV_H_

#include <array>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "base/env.h"

namespace offload {

enum class EnvOp { kAllocate, kMapShared, kCreateMemfd, kResizeFile, kRandomBytes, kStartThread };

class FaultInjectingEnv final : public Env {
 public:
  explicit FaultInjectingEnv(Env* target) : target_(target) {}

  // The `n`th call (1 = the next) of `op` from now fails with `err`; later
  // calls go through again. Replaces an earlier plan for `op`.
  void FailNth(EnvOp op, int n, int err) ABSL_LOCKS_EXCLUDED(mu_);
  // Calls of `op` made so far.
  int64_t calls(EnvOp op) const ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<HostMemory> Allocate(uint64_t bytes, Pages pages) override;
  absl::StatusOr<HostMemory> MapShared(int fd, uint64_t offset, uint64_t bytes,
                                       Pages pages) override;
  absl::StatusOr<UniqueFd> CreateMemfd(const std::string& label) override;
  absl::Status ResizeFile(int fd, uint64_t bytes) override;
  absl::Status RandomBytes(void* out, size_t bytes) override;
  absl::StatusOr<std::thread> StartThread(std::function<void()> body) override;

 private:
  struct Plan {
    int64_t calls = 0;
    int64_t fail_at = 0;  // call number that fails; 0: none
    int err = 0;
  };
  // Counts the call; the errno to fail it with, or 0.
  int Next(EnvOp op) ABSL_LOCKS_EXCLUDED(mu_);

  Env* const target_;
  mutable absl::Mutex mu_;
  std::array<Plan, 6> plans_ ABSL_GUARDED_BY(mu_);
};

}  // namespace offload

#endif  // OFFLOADD_BASE_FAULT_INJECTING_ENV_H_
