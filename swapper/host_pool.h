// The node's host pool: the memory offloadd may hold for all sessions'
// swappable state, with exact accounting (whole pages, as the kernel charges
// them; no power-of-two rounding) against a limit that may change while
// running. Memory comes from HostMemory, on the pages the caller asks for
// (transparent huge pages by default: the same buffers are the I/O staging
// memory, and O_DIRECT transfers go straight from and to them), optionally
// locked (mlock) where RLIMIT_MEMLOCK permits.
//
// A PoolMemory is a lease: its memory plus its charge; destroying it gives
// both back. A lease of more than kSlabLeaseMaxBytes is a mapping of its
// own; smaller ones are slots of shared slabs (one mapping for many small
// partitions' blocks: a process has vm.max_map_count mappings in all), whose
// pages go back to the kernel when the lease ends (MADV_DONTNEED: zeroed
// when taken again).
//
// Spares (SetSpareBytes): a lease of its own mapping of at least
// kSpareMinBytes, not locked, that ends keeps its pages in the pool, still
// charged, up to the spare bytes given. An Allocate whose caller overwrites
// all of it before anyone reads it (Contents::kOverwritten: the swapper's
// reads from NVMe) takes a spare of its size and pages instead of fresh
// pages, which the kernel would clear first (and fault in, under the I/O
// that reads into them). A Take that finds no room gives spares back first
// (as many as it lacks), and so does a lower limit: they never keep a lease
// out nor the pool over its limit. When the cap is reached the oldest
// spares make way for newer ones.
//
// With a file (UseFile: memory.pool_dir), every lease is an extent of one
// file on tmpfs instead (PoolFile): no slabs, no spares, the same charges;
// a SIGTERM stop can then leave kept sessions' state where it is.
//
// Thread-safety: all methods are safe from any thread (lock-free
// accounting).
#ifndef OFFLOADD_SWAPPER_HOST_POOL_H_
#define OFFLOADD_SWAPPER_HOST_POOL_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "base/env.h"
#include "base/host_memory.h"
#include "swapper/pool_file.h"

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
        pages_(other.pages_),
        slot_(std::exchange(other.slot_, Slot{})),
        extent_(std::exchange(other.extent_, PoolFile::Extent{})),
        size_(other.size_) {}
  PoolMemory& operator=(PoolMemory&& other) noexcept;
  PoolMemory(const PoolMemory&) = delete;
  PoolMemory& operator=(const PoolMemory&) = delete;
  ~PoolMemory() { Reset(); }

  std::byte* data() const {
    return slot_.slab != nullptr     ? slot_.data
           : extent_.data != nullptr ? extent_.data
                                     : memory_.data();
  }
  uint64_t size() const {
    return slot_.slab != nullptr ? slot_.size : extent_.data != nullptr ? size_ : memory_.size();
  }
  uint64_t charged() const { return charged_; }
  // The pages the lease asked for (HostPool::Allocate's `pages`; a slab's
  // slot is on small pages whatever was asked).
  Pages pages() const { return pages_; }
  bool empty() const { return slot_.slab == nullptr && extent_.data == nullptr && memory_.empty(); }
  // Whether it shares a mapping (a slot of a shared slab, an extent of the
  // pool's file) rather than being a mapping of its own.
  bool shared() const { return slot_.slab != nullptr || extent_.data != nullptr; }
  void Reset();

 private:
  friend class HostPool;
  struct Slot {
    void* slab = nullptr;  // HostPool::Slab
    uint32_t index = 0;
    std::byte* data = nullptr;
    uint64_t size = 0;
  };
  PoolMemory(HostMemory memory, HostPool* pool, uint64_t charged, bool locked, Pages pages)
      : memory_(std::move(memory)),
        pool_(pool),
        charged_(charged),
        locked_(locked),
        pages_(pages) {}
  PoolMemory(Slot slot, HostPool* pool, uint64_t charged, bool locked, Pages pages)
      : pool_(pool), charged_(charged), locked_(locked), pages_(pages), slot_(slot) {}
  PoolMemory(PoolFile::Extent extent, uint64_t size, HostPool* pool, uint64_t charged, bool locked,
             Pages pages)
      : pool_(pool),
        charged_(charged),
        locked_(locked),
        pages_(pages),
        extent_(extent),
        size_(size) {}

  HostMemory memory_;
  HostPool* pool_ = nullptr;
  uint64_t charged_ = 0;
  bool locked_ = false;
  Pages pages_ = Pages::kSystemDefault;
  Slot slot_;
  PoolFile::Extent extent_;  // of the pool's file (HostPool::UseFile)
  uint64_t size_ = 0;        // with extent_: the bytes asked for
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
  HostPool(Env* env, uint64_t limit, bool lock_memory);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // From now on every lease is an extent of `file` (memory.pool_dir: a file
  // on a memory file system that kept sessions can name, PoolFile), none a
  // slot of a slab nor a spare; a lease the file has no room for is private
  // memory as before. Call before the first lease.
  void UseFile(std::unique_ptr<PoolFile> file) { file_ = std::move(file); }
  // The file, if UseFile gave one.
  PoolFile* file() const { return file_.get(); }

  // Leases of at most this many bytes are slots of shared slabs of
  // kSlabBytes (slots of 1, 2, 4, 8 or 16 pages), except in a pool that
  // locks its memory (a lock on part of a mapping splits it in two, which
  // would take the mappings back) or one whose leases take I/O aligned to
  // more than a page (SetIoAlignment).
  static constexpr uint64_t kSlabLeaseMaxBytes = uint64_t{64} << 10;
  static constexpr uint64_t kSlabBytes = uint64_t{4} << 20;
  // Leases are read and written by I/O in units of `bytes` (the swapper's
  // NVMe tier: its direct-I/O alignment): above a page, no lease is a slot.
  void SetIoAlignment(uint64_t bytes) { io_alignment_.store(bytes, std::memory_order_relaxed); }

  // What a lease of `bytes` is charged: whole pages.
  static uint64_t Charge(uint64_t bytes) { return RoundUpToPage(bytes); }

  // Whether Charge(bytes) more fit under the limit now.
  bool Fits(uint64_t bytes) const;

  // What the caller does with a lease's first contents.
  enum class Contents {
    kZeroed,       // reads them: zeros
    kOverwritten,  // writes every byte before anyone reads: a spare's will do
  };
  // Memory for `bytes` on `pages`, charged to the pool: zeroed, or with
  // kOverwritten whatever a spare of that size held. RESOURCE_EXHAUSTED
  // naming `what` and the numbers if it does not fit; the errno's code if
  // the mapping fails (nothing charged then).
  absl::StatusOr<PoolMemory> Allocate(uint64_t bytes, absl::string_view what,
                                      Pages pages = Pages::kHuge,
                                      Contents contents = Contents::kZeroed);

  // The kept range at `offset` of the pool's file (PoolFile::Claim: bytes a
  // session reopened by the next offloadd takes where they are), charged as
  // a lease of `bytes`. RESOURCE_EXHAUSTED as Allocate; FAILED_PRECONDITION
  // without a file or a kept range there.
  absl::StatusOr<PoolMemory> Claim(uint64_t offset, uint64_t bytes, absl::string_view what);

  // Leases of at least this many bytes may become spares.
  static constexpr uint64_t kSpareMinBytes = uint64_t{1} << 20;
  // The most bytes spares may hold (0, the default: none; lowering it gives
  // the excess back).
  void SetSpareBytes(uint64_t bytes) ABSL_LOCKS_EXCLUDED(spare_mu_);
  // Bytes spares hold now (not part of used()), and leases that took one.
  uint64_t spare_bytes() const { return spare_bytes_.load(std::memory_order_relaxed); }
  uint64_t spares_taken() const { return spares_taken_.load(std::memory_order_relaxed); }

  // Charges Charge(bytes) without mapping anything. RESOURCE_EXHAUSTED as
  // Allocate.
  absl::StatusOr<PoolCharge> Reserve(uint64_t bytes, absl::string_view what);

  // A lower limit gives back spares down to it at once (leases are the
  // caller's to give back: the swapper evicts).
  void SetLimit(uint64_t limit) ABSL_LOCKS_EXCLUDED(spare_mu_);
  uint64_t limit() const { return limit_.load(std::memory_order_relaxed); }
  // Bytes leased and reserved now; spares are not counted (they give way
  // to any lease), though their pages are charged against the limit too.
  // (Two counters read one after the other: a reader racing a lease that
  // becomes a spare sees it in neither, never less than nothing.)
  uint64_t used() const {
    const uint64_t charged = used_.load(std::memory_order_relaxed);
    const uint64_t spares = spare_bytes_.load(std::memory_order_relaxed);
    return charged > spares ? charged - spares : 0;
  }
  // Bytes of leases that mlock succeeded on.
  uint64_t locked() const { return locked_.load(std::memory_order_relaxed); }
  // Slabs mapped now (each one mapping, shared by small leases).
  int64_t slabs() const ABSL_LOCKS_EXCLUDED(slab_mu_);

 private:
  friend class PoolMemory;
  friend class PoolCharge;
  // Adds `charge` to used_ unless that would exceed the limit (after
  // giving spares back).
  absl::Status Take(uint64_t charge, absl::string_view what);
  absl::Status TakeOnce(uint64_t charge, absl::string_view what);
  void Release(uint64_t charged, bool was_locked);
  // A lease ending: true if its memory stays as a spare (its charge with
  // it), false if the caller unmaps and releases it as before.
  bool KeepSpare(HostMemory& memory, Pages pages, uint64_t charged) ABSL_LOCKS_EXCLUDED(spare_mu_);
  // Gives back spares holding at least `bytes` (all: UINT64_MAX); their
  // pages go to the kernel, their charges with them.
  void DropSpares(uint64_t bytes) ABSL_LOCKS_EXCLUDED(spare_mu_);
  struct Spare {
    HostMemory memory;
    Pages pages;
    uint64_t charged;
  };
  // Takes the oldest spares out, at least `bytes` of them (all there are if
  // fewer), for GiveBack outside the lock.
  std::vector<Spare> TakeOldestLocked(uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(spare_mu_);
  // Unmaps `spares` and gives their charges back.
  void GiveBack(std::vector<Spare> spares) ABSL_LOCKS_EXCLUDED(spare_mu_);
  // A slot of at least `bytes` (<= kSlabLeaseMaxBytes) in a slab with room,
  // a new slab if none has; the env's error if one cannot be mapped.
  struct Slab;
  absl::StatusOr<PoolMemory::Slot> TakeSlot(uint64_t bytes) ABSL_LOCKS_EXCLUDED(slab_mu_);
  // Gives a slot back (its pages to the kernel); a slab left empty goes
  // unless it is its size's only one with room.
  void FreeSlot(const PoolMemory::Slot& slot) ABSL_LOCKS_EXCLUDED(slab_mu_);
  static constexpr int kSlotClasses = 5;  // 1, 2, 4, 8, 16 pages

  // Locks `bytes` at `data` if the pool locks its memory; whether it did.
  bool LockLease(void* data, uint64_t bytes, uint64_t charge);

  Env* const env_;
  const bool lock_memory_;
  std::unique_ptr<PoolFile> file_;
  std::atomic<uint64_t> limit_;
  std::atomic<uint64_t> used_{0};
  std::atomic<uint64_t> locked_{0};
  std::atomic<bool> lock_warned_{false};
  std::atomic<uint64_t> io_alignment_{0};

  mutable absl::Mutex spare_mu_;
  std::vector<Spare> spares_ ABSL_GUARDED_BY(spare_mu_);  // the oldest first
  std::atomic<uint64_t> spare_bytes_{0};                  // changed under spare_mu_
  uint64_t spare_limit_ ABSL_GUARDED_BY(spare_mu_) = 0;
  std::atomic<uint64_t> spares_taken_{0};

  mutable absl::Mutex slab_mu_;
  // Per slot size: every slab, and those with a free slot.
  std::array<std::vector<std::unique_ptr<Slab>>, kSlotClasses> slabs_ ABSL_GUARDED_BY(slab_mu_);
  std::array<std::vector<Slab*>, kSlotClasses> with_room_ ABSL_GUARDED_BY(slab_mu_);
};

}  // namespace offload

#endif  // OFFLOADD_SWAPPER_HOST_POOL_H_
