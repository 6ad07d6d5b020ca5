#include "engine/memory_budget.h"

#include "absl/strings/str_cat.h"

namespace offload {

absl::Status MemoryBudget::Reserve(uint64_t bytes, absl::string_view what) {
  uint64_t used = used_.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t limit = limit_.load(std::memory_order_relaxed);
    if (bytes > limit || used > limit - bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          tier_, " memory budget exceeded by ", what, ": needs ", bytes, " bytes, ", used,
          " of ", limit, " in use"));
    }
    if (used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed)) {
      return absl::OkStatus();
    }
  }
}

void MemoryBudget::Release(uint64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

}  // namespace offload
