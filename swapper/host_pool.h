// The node's host pool: the memory offloadd may hold for all sessions'
// swappable state, with exact accounting (whole pages, as the kernel charges
// them; no power-of-two rounding) against a limit that may change while
// running. Memory comes from HostMemory, on the pages the caller asks for
// (transparent huge pages by default: the same buffers are the I/O staging
// memory, and O_DIRECT transfers go straight from and to them), optionally
// locked (mlock) where RLIMIT_MEMLOCK permits.
//
// A PoolMemory is a lease: the mapping plus its charge; destroying it
// unmaps and gives the bytes back.
//
// Thread-safety: all methods are safe from any thread (lock-free
// accounting).
#ifndef OFFLOADD_SWAPPER_HOST_POOL_H_
#define OFFLOADD_SWAPPER_HOST_POOL_H_

#include <atomic>
#include <cstdint>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/env.h"
#include "base/host_memory.h"

namespace offload {

class HostPool;

class PoolMemory {
 public:
  PoolMemory() = default;
  PoolMemory(PoolMemory&& other) noexcept
      : memory_(std::move(other.memory_)),
        pool_(std::exchange(other.pool_, nullptr)),
        charged_(std::exchange(other.charged_, 0)),
        locked_(std::exchange(other.locked_, false)),
        pages_(other.pages_) {}
  PoolMemory& operator=(PoolMemory&& other) noexcept;
  PoolMemory(const PoolMemory&) = delete;
  PoolMemory& operator=(const PoolMemory&) = delete;
  ~PoolMemory() { Reset(); }

  std::byte* data() const { return memory_.data(); }
  uint64_t size() const { return memory_.size(); }
  uint64_t charged() const { return charged_; }
  // The pages the lease asked for (HostPool::Allocate's `pages`).
  Pages pages() const { return pages_; }
  bool empty() const { return memory_.empty(); }
  void Reset();

 private:
  friend class HostPool;
  PoolMemory(HostMemory memory, HostPool* pool, uint64_t charged, bool locked, Pages pages)
      : memory_(std::move(memory)),
        pool_(pool),
        charged_(charged),
        locked_(locked),
        pages_(pages) {}

  HostMemory memory_;
  HostPool* pool_ = nullptr;
  uint64_t charged_ = 0;
  bool locked_ = false;
  Pages pages_ = Pages::kSystemDefault;
};

// A charge for host memory the pool does not map itself (a session arena's
// pages): counted against the limit until destroyed. Movable.
class PoolCharge {
 public:
  PoolCharge() = default;
  PoolCharge(PoolCharge&& other) noexcept
      : pool_(std::exchange(other.pool_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  PoolCharge& operator=(PoolCharge&& other) noexcept;
  PoolCharge(const PoolCharge&) = delete;
  PoolCharge& operator=(const PoolCharge&) = delete;
  ~PoolCharge() { Reset(); }

  uint64_t bytes() const { return bytes_; }
  void Reset();

 private:
  friend class HostPool;
  PoolCharge(HostPool* pool, uint64_t bytes) : pool_(pool), bytes_(bytes) {}
  HostPool* pool_ = nullptr;
  uint64_t bytes_ = 0;
};

class HostPool {
 public:
  // `env` must outlive the pool, and the pool every PoolMemory it leased.
  HostPool(Env* env, uint64_t limit, bool lock_memory)
      : env_(env), lock_memory_(lock_memory), limit_(limit) {}

  // What a lease of `bytes` is charged: whole pages.
  static uint64_t Charge(uint64_t bytes) { return RoundUpToPage(bytes); }

  // Whether Charge(bytes) more fit under the limit now.
  bool Fits(uint64_t bytes) const;

  // Zeroed memory for `bytes` on `pages`, charged to the pool.
  // RESOURCE_EXHAUSTED naming `what` and the numbers if it does not fit; the
  // errno's code if the mapping fails (nothing charged then).
  absl::StatusOr<PoolMemory> Allocate(uint64_t bytes, absl::string_view what,
                                      Pages pages = Pages::kHuge);

  // Charges Charge(bytes) without mapping anything. RESOURCE_EXHAUSTED as
  // Allocate.
  absl::StatusOr<PoolCharge> Reserve(uint64_t bytes, absl::string_view what);

  void SetLimit(uint64_t limit) { limit_.store(limit, std::memory_order_relaxed); }
  uint64_t limit() const { return limit_.load(std::memory_order_relaxed); }
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  // Bytes of leases that mlock succeeded on.
  uint64_t locked() const { return locked_.load(std::memory_order_relaxed); }

 private:
  friend class PoolMemory;
  friend class PoolCharge;
  // Adds `charge` to used_ unless that would exceed the limit.
  absl::Status Take(uint64_t charge, absl::string_view what);
  void Release(uint64_t charged, bool was_locked);

  Env* const env_;
  const bool lock_memory_;
  std::atomic<uint64_t> limit_;
  std::atomic<uint64_t> used_{0};
  std::atomic<uint64_t> locked_{0};
  std::atomic<bool> lock_warned_{false};
};

}  // namespace offload

#endif  // OFFLOADD_SWAPPER_HOST_POOL_H_
