// Accounting of bytes held in one memory tier against a budget that may
// change while running. Reservations that would exceed the budget fail with
// RESOURCE_EXHAUSTED and change nothing; lowering the budget below current
// use only blocks new reservations. Lock-free; safe from any thread.
#ifndef OFFLOADD_ENGINE_MEMORY_BUDGET_H_
#define OFFLOADD_ENGINE_MEMORY_BUDGET_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace offload {

class MemoryBudget {
 public:
  MemoryBudget(std::string tier, uint64_t limit) : tier_(std::move(tier)), limit_(limit) {}

  // `what` names the allocation in the error ("partition 'w1' of session 3").
  absl::Status Reserve(uint64_t bytes, absl::string_view what);
  void Release(uint64_t bytes);
  void SetLimit(uint64_t limit) { limit_.store(limit, std::memory_order_relaxed); }

  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t limit() const { return limit_.load(std::memory_order_relaxed); }
  const std::string& tier() const { return tier_; }

 private:
  const std::string tier_;
  std::atomic<uint64_t> limit_;
  std::atomic<uint64_t> used_{0};
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_MEMORY_BUDGET_H_
