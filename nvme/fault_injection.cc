#include "nvme/fault_injection.h"

#include <cstring>
#include <thread>

namespace offload {

FaultInjectingBackend::FaultInjectingBackend(std::unique_ptr<IoBackend> inner)
    : inner_(std::move(inner)) {
  inner_->SetResultHookForTesting(
      [this](const IoRequest& attempt, int64_t result) { return Apply(attempt, result); });
}

size_t FaultInjectingBackend::AddRule(const FaultRule& rule) {
  absl::MutexLock lock(&mu_);
  rules_.push_back({rule, 0, 0});
  return rules_.size() - 1;
}

void FaultInjectingBackend::ClearRules() {
  absl::MutexLock lock(&mu_);
  rules_.clear();
}

int64_t FaultInjectingBackend::fired(size_t rule) const {
  absl::MutexLock lock(&mu_);
  return rule < rules_.size() ? rules_[rule].fired : 0;
}

int64_t FaultInjectingBackend::Apply(const IoRequest& attempt, int64_t result) {
  absl::Duration delay;
  {
    absl::MutexLock lock(&mu_);
    for (Armed& a : rules_) {
      const FaultRule& r = a.rule;
      if (!r.any_op && r.op != attempt.op) continue;
      if (r.file >= 0 && r.file != attempt.file) continue;
      if (attempt.offset < r.offset_begin || attempt.offset >= r.offset_end) continue;
      if (a.matched++ < r.skip) continue;
      if (r.times >= 0 && a.fired >= r.times) continue;
      switch (r.kind) {
        case FaultRule::Kind::kError:
          ++a.fired;
          result = -r.error;
          break;
        case FaultRule::Kind::kShort: {
          const uint64_t unit = std::max<uint64_t>(r.short_align, 1);
          if (result > 0 && static_cast<uint64_t>(result) > unit) {
            ++a.fired;
            const uint64_t full = static_cast<uint64_t>(result);
            const uint64_t kept = std::max<uint64_t>(unit, full / 2 / unit * unit);
            if (attempt.op == IoOp::kRead) {
              // As after a real short read: the rest of the buffer was never
              // filled. Poison it, so only a resubmission repairs it.
              std::memset(static_cast<std::byte*>(attempt.buffer) + kept, 0xEE, full - kept);
            }
            result = static_cast<int64_t>(kept);
          }
          break;
        }
        case FaultRule::Kind::kDelay:
          ++a.fired;
          delay += r.delay;
          break;
      }
    }
  }
  if (delay > absl::ZeroDuration()) std::this_thread::sleep_for(absl::ToChronoNanoseconds(delay));
  return result;
}

}  // namespace offload
