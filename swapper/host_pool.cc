#include "swapper/host_pool.h"

#include <sys/mman.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/posix_error.h"

namespace offload {

PoolMemory& PoolMemory::operator=(PoolMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    memory_ = std::move(other.memory_);
    pool_ = std::exchange(other.pool_, nullptr);
    charged_ = std::exchange(other.charged_, 0);
    locked_ = std::exchange(other.locked_, false);
    pages_ = other.pages_;
  }
  return *this;
}

void PoolMemory::Reset() {
  // munmap (in ~HostMemory) also unlocks a locked lease.
  memory_ = HostMemory();
  if (pool_ != nullptr) pool_->Release(charged_, locked_);
  pool_ = nullptr;
  charged_ = 0;
  locked_ = false;
}

PoolCharge& PoolCharge::operator=(PoolCharge&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = std::exchange(other.pool_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void PoolCharge::Reset() {
  if (pool_ != nullptr) pool_->Release(bytes_, false);
  pool_ = nullptr;
  bytes_ = 0;
}

bool HostPool::Fits(uint64_t bytes) const {
  const uint64_t need = Charge(bytes);
  const uint64_t lim = limit();
  const uint64_t u = used();
  return need <= lim && u <= lim - need;
}

absl::Status HostPool::Take(uint64_t charge, absl::string_view what) {
  uint64_t u = used_.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t lim = limit();
    if (charge > lim || u > lim - charge) {
      return absl::ResourceExhaustedError(absl::StrCat("host pool exhausted by ", what, ": needs ",
                                                       charge, " bytes, ", u, " of ", lim,
                                                       " in use (memory.host_budget_bytes)"));
    }
    if (used_.compare_exchange_weak(u, u + charge, std::memory_order_relaxed)) {
      return absl::OkStatus();
    }
  }
}

absl::StatusOr<PoolCharge> HostPool::Reserve(uint64_t bytes, absl::string_view what) {
  const uint64_t charge = Charge(bytes);
  if (absl::Status taken = Take(charge, what); !taken.ok()) return taken;
  return PoolCharge(this, charge);
}

absl::StatusOr<PoolMemory> HostPool::Allocate(uint64_t bytes, absl::string_view what, Pages pages) {
  const uint64_t charge = Charge(bytes);
  if (absl::Status taken = Take(charge, what); !taken.ok()) return taken;
  absl::StatusOr<HostMemory> memory = env_->Allocate(bytes, pages);
  if (!memory.ok()) {
    used_.fetch_sub(charge, std::memory_order_relaxed);
    return absl::Status(memory.status().code(),
                        absl::StrCat("host pool: ", what, ": ", memory.status().message()));
  }
  bool locked = false;
  if (lock_memory_ && bytes > 0) {
    if (mlock(memory->data(), bytes) == 0) {
      locked = true;
      locked_.fetch_add(charge, std::memory_order_relaxed);
    } else if (!lock_warned_.exchange(true)) {
      LogWarning("host pool: mlock refused (%s); pool memory stays swappable",
                 PosixError("mlock", errno).message());
    }
  }
  return PoolMemory(std::move(*memory), this, charge, locked, pages);
}

void HostPool::Release(uint64_t charged, bool was_locked) {
  used_.fetch_sub(charged, std::memory_order_relaxed);
  if (was_locked) locked_.fetch_sub(charged, std::memory_order_relaxed);
}

}  // namespace offload
