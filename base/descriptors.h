// This process's file descriptors: how many are open against its limit, and
// a spare one held back so that a listener at EMFILE can still take a
// pending connection off its queue (to refuse it) instead of finding the
// socket readable on every poll. Thread-safe.
#ifndef OFFLOADD_BASE_DESCRIPTORS_H_
#define OFFLOADD_BASE_DESCRIPTORS_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "base/unique_fd.h"

namespace offload {

struct DescriptorUse {
  int64_t open = 0;   // descriptors open now
  int64_t limit = 0;  // RLIMIT_NOFILE's soft limit
  int64_t free() const { return limit - open; }
};

// Counts the entries of `fd_dir` (a test's directory; /proc/self/fd by
// default), not the one reading it takes. A process with no descriptor left
// to read the directory with counts as full.
DescriptorUse CountDescriptors(const std::string& fd_dir = "/proc/self/fd");

// One descriptor (/dev/null) kept open to be given up for a moment: a
// listener whose accept failed with EMFILE or ENFILE closes it, accepts the
// pending connection into its number, answers or closes it, and takes it
// back (WithSpare).
class SpareDescriptor {
 public:
  SpareDescriptor();
  // Runs `fn` with the spare closed (if one was held), then opens it again.
  template <typename Fn>
  auto WithSpare(Fn&& fn) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    spare_.reset();
    struct Reopen {
      SpareDescriptor* self;
      ~Reopen() { self->Open(); }
    } reopen{this};
    return fn();
  }
  bool held() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Open() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  mutable absl::Mutex mu_;
  UniqueFd spare_ ABSL_GUARDED_BY(mu_);
};

}  // namespace offload

#endif  // OFFLOADD_BASE_DESCRIPTORS_H_
