#include "swapper/host_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/posix_error.h"
#include "base/status_macros.h"

namespace offload {

struct HostPool::Slab {
  HostMemory memory;
  uint64_t slot_bytes = 0;
  int cls = 0;
  std::vector<uint32_t> free;  // slot indices
  uint32_t in_use = 0;
  bool with_room = false;  // listed in with_room_
};

PoolMemory& PoolMemory::operator=(PoolMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    memory_ = std::move(other.memory_);
    pool_ = std::exchange(other.pool_, nullptr);
    charged_ = std::exchange(other.charged_, 0);
    locked_ = std::exchange(other.locked_, false);
    pages_ = other.pages_;
    slot_ = std::exchange(other.slot_, Slot{});
    extent_ = std::exchange(other.extent_, PoolFile::Extent{});
    size_ = other.size_;
  }
  return *this;
}

void PoolMemory::Reset() {
  if (pool_ != nullptr && slot_.slab == nullptr && !locked_ && !memory_.empty() &&
      pool_->KeepSpare(memory_, pages_, charged_)) {
    pool_ = nullptr;
    charged_ = 0;
    return;
  }
  // munmap (in ~HostMemory) also unlocks a locked lease.
  memory_ = HostMemory();
  if (slot_.slab != nullptr) {
    pool_->FreeSlot(slot_);
    slot_ = Slot{};
  }
  bool retained = false;
  if (extent_.data != nullptr) {
    if (locked_) munlock(extent_.data, extent_.length);
    // A lease a kept checkpoint names keeps its memory, and its charge with
    // it: what the pool then holds stays within its limit.
    retained = pool_->file_->Give(extent_);
    extent_ = PoolFile::Extent{};
  }
  if (pool_ != nullptr && !retained) pool_->Release(charged_, locked_);
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
  // (Spares give way: used() leaves them out.)
  const uint64_t need = Charge(bytes);
  const uint64_t lim = limit();
  const uint64_t u = used();
  return need <= lim && u <= lim - need;
}

absl::Status HostPool::Take(uint64_t charge, absl::string_view what) {
  for (;;) {
    absl::Status taken = TakeOnce(charge, what);
    if (taken.ok() || spare_bytes() == 0) return taken;
    // Spares give way: as many as the shortfall.
    const uint64_t u = used_.load(std::memory_order_relaxed), lim = limit();
    DropSpares(u + charge > lim ? u + charge - lim : charge);
  }
}

absl::Status HostPool::TakeOnce(uint64_t charge, absl::string_view what) {
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

HostPool::HostPool(Env* env, uint64_t limit, bool lock_memory)
    : env_(env), lock_memory_(lock_memory), limit_(limit) {}

HostPool::~HostPool() { DropSpares(UINT64_MAX); }

int64_t HostPool::slabs() const {
  absl::MutexLock lock(&slab_mu_);
  int64_t n = 0;
  for (const auto& c : slabs_) n += static_cast<int64_t>(c.size());
  return n;
}

absl::StatusOr<PoolMemory::Slot> HostPool::TakeSlot(uint64_t bytes) {
  const uint64_t page = PageSize();
  int cls = 0;
  while ((page << cls) < bytes) ++cls;
  const uint64_t slot_bytes = page << cls;
  absl::MutexLock lock(&slab_mu_);
  std::vector<Slab*>& room = with_room_[cls];
  if (room.empty()) {
    // A new slab (outside nothing: its mapping is lazy, so this is quick).
    ASSIGN_OR_RETURN(HostMemory memory, env_->Allocate(kSlabBytes, Pages::kSmall));
    auto slab = std::make_unique<Slab>();
    slab->memory = std::move(memory);
    slab->slot_bytes = slot_bytes;
    slab->cls = cls;
    const uint32_t slots = static_cast<uint32_t>(kSlabBytes / slot_bytes);
    slab->free.reserve(slots);
    for (uint32_t i = slots; i > 0; --i) slab->free.push_back(i - 1);  // slot 0 first
    slab->with_room = true;
    room.push_back(slab.get());
    slabs_[cls].push_back(std::move(slab));
  }
  Slab* slab = room.back();
  const uint32_t index = slab->free.back();
  slab->free.pop_back();
  ++slab->in_use;
  if (slab->free.empty()) {
    room.pop_back();
    slab->with_room = false;
  }
  return PoolMemory::Slot{slab, index, slab->memory.data() + uint64_t{index} * slot_bytes, bytes};
}

void HostPool::FreeSlot(const PoolMemory::Slot& slot) {
  auto* slab = static_cast<Slab*>(slot.slab);
  // Its pages back to the kernel (zero when touched again), outside the
  // lock: the slot is this lease's alone until it is listed free.
  if (madvise(slot.data, slab->slot_bytes, MADV_DONTNEED) != 0) {
    std::memset(slot.data, 0, slab->slot_bytes);  // zero for the next lease all the same
  }
  absl::MutexLock lock(&slab_mu_);
  slab->free.push_back(slot.index);
  --slab->in_use;
  std::vector<Slab*>& room = with_room_[slab->cls];
  if (!slab->with_room) {
    slab->with_room = true;
    room.push_back(slab);
  }
  if (slab->in_use == 0 && room.size() > 1) {
    // Empty, and another slab of its size has room: unmapped.
    room.erase(std::find(room.begin(), room.end(), slab));
    auto& all = slabs_[slab->cls];
    all.erase(std::find_if(all.begin(), all.end(),
                           [slab](const std::unique_ptr<Slab>& s) { return s.get() == slab; }));
  }
}

absl::StatusOr<PoolMemory> HostPool::Allocate(uint64_t bytes, absl::string_view what, Pages pages,
                                              Contents contents) {
  const uint64_t charge = Charge(bytes);
  if (contents == Contents::kOverwritten && bytes >= kSpareMinBytes && !lock_memory_) {
    absl::MutexLock lock(&spare_mu_);
    for (auto it = spares_.begin(); it != spares_.end(); ++it) {
      if (it->memory.size() != bytes || it->pages != pages || it->charged != charge) continue;
      // Its charge was never given back: the lease takes it over.
      HostMemory memory = std::move(it->memory);
      spare_bytes_ -= it->charged;
      spares_.erase(it);
      spares_taken_.fetch_add(1, std::memory_order_relaxed);
      return PoolMemory(std::move(memory), this, charge, /*locked=*/false, pages);
    }
  }
  if (absl::Status taken = Take(charge, what); !taken.ok()) return taken;
  if (file_ != nullptr && bytes > 0) {
    // Huge-page aligned where the file gets huge pages (shmem_enabled
    // advise or more) and the lease fills one.
    const uint64_t huge = SharedHugePageBytes();
    uint64_t align = std::max(PageSize(), io_alignment_.load(std::memory_order_relaxed));
    if (huge > align && bytes >= huge) align = huge;
    // Charged as the file holds it: the extent is whole aligned units (up
    // to a huge page more than the bytes), all of them the file's pages.
    const uint64_t whole = RoundUp(bytes, align);
    if (whole == charge || Take(whole - charge, what).ok()) {
      absl::StatusOr<PoolFile::Extent> extent = file_->Take(bytes, align);
      if (extent.ok()) {
        const bool locked = LockLease(extent->data, extent->length, whole);
        return PoolMemory(*extent, bytes, this, whole, locked, pages);
      }
      used_.fetch_sub(whole - charge, std::memory_order_relaxed);
    }
    // No room left in its file (or in the pool for its alignment): private
    // memory, as without one.
  }
  if (bytes > 0 && bytes <= kSlabLeaseMaxBytes && !lock_memory_ && file_ == nullptr &&
      io_alignment_.load(std::memory_order_relaxed) <= PageSize()) {
    absl::StatusOr<PoolMemory::Slot> slot = TakeSlot(bytes);
    if (!slot.ok()) {
      used_.fetch_sub(charge, std::memory_order_relaxed);
      return absl::Status(slot.status().code(),
                          absl::StrCat("host pool: ", what, ": ", slot.status().message()));
    }
    return PoolMemory(*slot, this, charge, /*locked=*/false, pages);
  }
  absl::StatusOr<HostMemory> memory = env_->Allocate(bytes, pages);
  if (!memory.ok()) {
    used_.fetch_sub(charge, std::memory_order_relaxed);
    return absl::Status(memory.status().code(),
                        absl::StrCat("host pool: ", what, ": ", memory.status().message()));
  }
  const bool locked = LockLease(memory->data(), bytes, charge);
  return PoolMemory(std::move(*memory), this, charge, locked, pages);
}

absl::StatusOr<PoolMemory> HostPool::Claim(uint64_t offset, uint64_t bytes,
                                           absl::string_view what) {
  if (file_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("host pool: ", what, ": no pool file"));
  }
  const uint64_t charge = Charge(bytes);
  if (absl::Status taken = Take(charge, what); !taken.ok()) return taken;
  absl::StatusOr<PoolFile::Extent> extent = file_->Claim(offset, bytes);
  if (!extent.ok()) {
    used_.fetch_sub(charge, std::memory_order_relaxed);
    return absl::Status(extent.status().code(),
                        absl::StrCat("host pool: ", what, ": ", extent.status().message()));
  }
  const bool locked = LockLease(extent->data, extent->length, charge);
  return PoolMemory(*extent, bytes, this, charge, locked, Pages::kSystemDefault);
}

bool HostPool::LockLease(void* data, uint64_t bytes, uint64_t charge) {
  if (!lock_memory_ || bytes == 0) return false;
  if (mlock(data, bytes) == 0) {
    locked_.fetch_add(charge, std::memory_order_relaxed);
    return true;
  }
  if (!lock_warned_.exchange(true)) {
    LogWarning("host pool: mlock refused (%s); pool memory stays swappable",
               PosixError("mlock", errno).message());
  }
  return false;
}

void HostPool::Release(uint64_t charged, bool was_locked) {
  used_.fetch_sub(charged, std::memory_order_relaxed);
  if (was_locked) locked_.fetch_sub(charged, std::memory_order_relaxed);
}

bool HostPool::KeepSpare(HostMemory& memory, Pages pages, uint64_t charged) {
  if (memory.size() < kSpareMinBytes || lock_memory_ || file_ != nullptr) return false;
  // A pool over its limit (lowered) gives it back instead.
  if (used_.load(std::memory_order_relaxed) > limit()) return false;
  std::vector<Spare> older;  // made way for this one
  {
    absl::MutexLock lock(&spare_mu_);
    if (charged > spare_limit_) return false;
    // The newest are kept (they are the sizes reads ask for now).
    if (spare_bytes_ + charged > spare_limit_) {
      older = TakeOldestLocked(spare_bytes_ + charged - spare_limit_);
    }
    spares_.push_back(Spare{std::move(memory), pages, charged});
    spare_bytes_ += charged;
  }
  GiveBack(std::move(older));
  return true;
}

std::vector<HostPool::Spare> HostPool::TakeOldestLocked(uint64_t bytes) {
  std::vector<Spare> taken;
  uint64_t freed = 0;
  while (!spares_.empty() && freed < bytes) {
    freed += spares_.front().charged;
    spare_bytes_ -= spares_.front().charged;
    taken.push_back(std::move(spares_.front()));
    spares_.erase(spares_.begin());
  }
  return taken;
}

void HostPool::GiveBack(std::vector<Spare> spares) {
  for (Spare& s : spares) {
    s.memory = HostMemory();  // unmapped (outside spare_mu_), then the charge goes
    Release(s.charged, /*was_locked=*/false);
  }
}

void HostPool::DropSpares(uint64_t bytes) {
  std::vector<Spare> dropped;
  {
    absl::MutexLock lock(&spare_mu_);
    dropped = TakeOldestLocked(bytes);
  }
  GiveBack(std::move(dropped));
}

void HostPool::SetLimit(uint64_t limit) {
  limit_.store(limit, std::memory_order_relaxed);
  const uint64_t charged = used_.load(std::memory_order_relaxed);
  if (charged > limit && spare_bytes() > 0) DropSpares(charged - limit);
}

void HostPool::SetSpareBytes(uint64_t bytes) {
  uint64_t excess = 0;
  {
    absl::MutexLock lock(&spare_mu_);
    spare_limit_ = bytes;
    if (spare_bytes_ > bytes) excess = spare_bytes_ - bytes;
  }
  if (excess > 0) DropSpares(excess);
}

}  // namespace offload
