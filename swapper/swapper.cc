#include "swapper/swapper.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>

#include "absl/numeric/bits.h"
#include "absl/strings/str_cat.h"
#include "base/file_io.h"
#include "base/host_memory.h"
#include "base/log.h"
#include "base/posix_error.h"
#include "base/status_macros.h"

namespace offload {
namespace {

// Each I/O thread's staging buffer for blocks moved through their file, in
// whole stripes (at least one): large enough that a window's I/O keeps the
// devices busy, small enough to be a fixed overhead.
constexpr uint64_t kStagingBytes = uint64_t{4} << 20;
// The pool's spares (HostPool::SetSpareBytes) where there is an NVMe tier:
// a few blocks' worth (blocks are placement.state_chunk_bytes, 16 MiB by
// default), never in a lease's way.
constexpr uint64_t kSpareBytes = uint64_t{128} << 20;

uint64_t NanosSince(std::chrono::steady_clock::time_point start) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
}

// Frees external memory's pages: they leave the memfd (and every mapping of
// them); a later swap-in faults in fresh ones. Failing here is a kernel that
// cannot punch holes in shmem: the pages stay, uncharged, and the bound
// slips by them, which the log says.
void FreeExternalPages(Swapper::BlockId id, std::byte* data, uint64_t bytes) {
  absl::Status freed = DiscardSharedPages(data, bytes);
  if (!freed.ok()) {
    LogWarning("swapper: block %d: %s", static_cast<int64_t>(id), freed.ToString());
  }
}

}  // namespace

SwapperStats SwapperStats::Since(const SwapperStats& e) const {
  SwapperStats d = *this;
  d.acquires -= e.acquires;
  d.hits -= e.hits;
  d.waited_reads -= e.waited_reads;
  d.misses -= e.misses;
  d.prefetches -= e.prefetches;
  d.prefetch_used -= e.prefetch_used;
  d.prefetch_wasted -= e.prefetch_wasted;
  d.swap_ins -= e.swap_ins;
  d.swap_outs -= e.swap_outs;
  d.clean_drops -= e.clean_drops;
  d.zero_fills -= e.zero_fills;
  d.bytes_in -= e.bytes_in;
  d.bytes_out -= e.bytes_out;
  d.read_nanos -= e.read_nanos;
  d.write_nanos -= e.write_nanos;
  d.io_errors -= e.io_errors;
  d.relearned -= e.relearned;
  d.order_passes -= e.order_passes;
  d.discards -= e.discards;
  d.copy_outs -= e.copy_outs;
  d.copy_out_bytes -= e.copy_out_bytes;
  d.copy_out_nanos -= e.copy_out_nanos;
  d.staged_bytes -= e.staged_bytes;
  d.idle_wakeups -= e.idle_wakeups;
  d.waiter_wakeups -= e.waiter_wakeups;
  d.unlocked_pins -= e.unlocked_pins;
  d.io_fair_waits -= e.io_fair_waits;
  d.idle_evictions -= e.idle_evictions;
  d.share_evictions -= e.share_evictions;
  d.turns -= e.turns;
  d.repages -= e.repages;
  return d;
}

const char* TierName(Tier tier) { return tier == Tier::kHost ? "host" : "nvme"; }

const char* BlockStateName(BlockState state) {
  switch (state) {
    case BlockState::kResident:
      return "resident";
    case BlockState::kWritingOut:
      return "writing out";
    case BlockState::kOnNvme:
      return "on nvme";
    case BlockState::kReadingIn:
      return "reading in";
  }
  return "?";
}

struct Swapper::Block {
  BlockId id = 0;
  uint64_t bytes = 0;
  uint64_t trace = 0;
  Tier home = Tier::kHost;
  BlockState state = BlockState::kOnNvme;
  std::atomic<int> pins{0};  // taken under the lock (changed under it; read by TryDiscardFast)
  int waiters = 0;           // Acquires and CopyOuts inside the swapper for this block
  // Pinned without the lock (TryAcquireFast): bit 0, whether it may be
  // now; above it, the pins so taken (one word: a pin is taken only while
  // the bit is set, in one compare-and-swap). `fast_lingering`: no longer
  // so, with pins so taken still out (counted as held by the victim index
  // until the last goes; while it may be, the index does not count them:
  // they change without the lock).
  std::atomic<uint32_t> fast{0};
  bool fast_lingering = false;
  // The bytes, in every state but kOnNvme: a pool lease, or (external
  // blocks) the caller's shared memory at `external` with the pool charge
  // for its pages.
  PoolMemory host;
  std::byte* external = nullptr;
  uint64_t span = 0;  // external: the bytes charged and freed (whole pages)
  // External memory on small pages with its file: moved through the file
  // and a staging buffer; `file_offset` is where `external` lies in it.
  int file = -1;
  uint64_t file_offset = 0;
  PoolCharge charge;
  uint64_t extent = 0;         // the NVMe copy; 0: none (the block is zeros)
  bool nvme_current = false;   // the NVMe copy equals the host bytes
  uint64_t version = 0;        // bumped by every write pin
  uint64_t write_version = 0;  // `version` when the write-out in flight was queued
  uint64_t last_use = 0;
  uint64_t shares_pass = 0;  // its trace's pass it last counted in (PoolShares::ServedInPass)
  bool prefetched = false;   // brought in by prefetch, not acquired since
  // Written out as room for the turn's holder (out of turn): an Acquire
  // waits for the write and reads it back, rather than keep it (its trace,
  // stepping fast on what it still holds, would take back every block it
  // gives while the write is in flight).
  bool given = false;
  int moves_queued = 0;         // the mover's moves of it queued (a prefetch, a move to the host)
  bool to_host_queued = false;  // one of them a move to the host
  bool removed = false;
  bool dropping = false;  // kOnNvme, its external pages still being freed
  uint64_t failed_reads = 0;
  absl::Status read_error;
};

std::byte* Swapper::DataOf(const Block& b) {
  return b.external != nullptr ? b.external : b.host.data();
}

uint64_t Swapper::NeedOf(const Block& b) { return b.external != nullptr ? b.span : b.bytes; }

uint64_t Swapper::ChargedOf(const Block& b) {
  return b.external != nullptr ? b.charge.bytes() : b.host.charged();
}

absl::Status Swapper::TakeHostLocked(Block* b, HostPool::Contents contents) {
  const std::string what = absl::StrCat("block ", b->id);
  if (b->external != nullptr) {
    ASSIGN_OR_RETURN(b->charge, pool_->Reserve(b->span, what));
  } else {
    ASSIGN_OR_RETURN(
        b->host,
        pool_->Allocate(b->bytes, what, b->home == Tier::kHost ? host_home_pages_ : Pages::kHuge,
                        contents));
  }
  return absl::OkStatus();
}

void Swapper::DropHostNowLocked(Block* b) {
  if (b->external != nullptr) {
    FreeExternalPages(b->id, b->external, b->span);
    b->charge.Reset();
  } else {
    b->host.Reset();
  }
}

void Swapper::DropHostLocked(Block* b) {
  if (b->external == nullptr || stopping_) {
    DropHostNowLocked(b);
    return;
  }
  // Freeing tens of MiB of shmem pages takes milliseconds: an I/O thread
  // does it without the lock, first in its queue. Until then the block
  // stays charged (counted as being freed, so MakeRoom waits for it rather
  // than evicting more) and cannot be read in again.
  b->dropping = true;
  freeing_bytes_ += b->charge.bytes();
  frees_.push_back([this, id = b->id](HostMemory&) { FinishDrop(id); });
  io_work_.Signal();
  changed_.SignalAll();
}

void Swapper::FinishDrop(BlockId id) {
  std::byte* data;
  uint64_t bytes;
  {
    absl::MutexLock lock(&mu_);
    const Block* b = blocks_.at(id).get();  // dropping: never erased meanwhile
    data = b->external;
    bytes = b->span;
  }
  FreeExternalPages(id, data, bytes);
  absl::MutexLock lock(&mu_);
  Block* b = blocks_.at(id).get();
  freeing_bytes_ -= b->charge.bytes();
  b->charge.Reset();
  b->dropping = false;
  --io_running_;
  changed_.SignalAll();
  EraseIfDoneLocked(b);
}

Swapper::Pin& Swapper::Pin::operator=(Pin&& other) noexcept {
  if (this != &other) {
    Reset();
    swapper_ = std::exchange(other.swapper_, nullptr);
    id_ = other.id_;
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    fast_ = std::exchange(other.fast_, nullptr);
  }
  return *this;
}

void Swapper::Pin::Reset() {
  if (swapper_ != nullptr) {
    if (fast_ != nullptr) {
      swapper_->ReleaseFastPin(fast_, id_);
    } else {
      swapper_->ReleasePin(id_);
    }
  }
  swapper_ = nullptr;
  data_ = nullptr;
  size_ = 0;
  fast_ = nullptr;
}

absl::StatusOr<std::unique_ptr<Swapper>> Swapper::Create(const SwapperOptions& options,
                                                         HostPool* pool, SwapSpace* space) {
  RETURN_IF_ERROR(kPrefetchDepthRange.Check("swapper.prefetch_depth", options.prefetch_depth));
  RETURN_IF_ERROR(kPrefetchBytesRange.Check("swapper.prefetch_bytes", options.prefetch_bytes));
  RETURN_IF_ERROR(kSwapperIoThreadsRange.Check("swapper.io_threads", options.io_threads));
  // Blocks are read and written in whole units of the tier's alignment,
  // straight to and from their leases.
  if (space != nullptr) {
    pool->SetIoAlignment(space->alignment());
    // Evicted blocks' pages wait as spares for the next read from NVMe
    // (no clearing of fresh pages under its I/O), up to this many bytes.
    pool->SetSpareBytes(kSpareBytes);
  }
  std::unique_ptr<Swapper> s(new Swapper(options, pool, space));
  for (int64_t i = 0; i < options.io_threads; ++i) {
    s->io_threads_.emplace_back([raw = s.get()] { raw->IoThread(); });
  }
  s->mover_ = std::thread([raw = s.get()] { raw->MoverThread(); });
  return s;
}

Swapper::Swapper(const SwapperOptions& options, HostPool* pool, SwapSpace* space)
    : pool_(pool),
      space_(space),
      nvme_capacity_(space == nullptr ? 0 : space->Stats().capacity),
      staging_bytes_(space == nullptr
                         ? 0
                         : std::max<uint64_t>(1, kStagingBytes / space->stripe_bytes()) *
                               space->stripe_bytes()),
      host_home_pages_(options.host_home_pages),
      prefetch_depth_(options.prefetch_depth),
      prefetch_bytes_(options.prefetch_bytes),
      stalled_io_(std::max<int64_t>(1, options.stalled_io_seconds)) {}

Swapper::~Swapper() {
  // No spares wait for reads any more: the blocks' leases, released with
  // them below, are unmapped.
  if (space_ != nullptr) pool_->SetSpareBytes(0);
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    changed_.SignalAll();
    io_work_.SignalAll();
    move_work_.SignalAll();
  }
  mover_.join();
  for (std::thread& t : io_threads_) t.join();
  absl::MutexLock lock(&mu_);
  for (auto& [id, b] : blocks_) {
    if (b->extent != 0) space_->Free(b->extent).IgnoreError();
    if (b->state != BlockState::kOnNvme) DropHostNowLocked(b.get());
  }
  absl::MutexLock table(&table_mu_);
  blocks_.clear();
}

Swapper::Block* Swapper::FindLocked(BlockId id) const {
  auto it = blocks_.find(id);
  return it == blocks_.end() || it->second->removed ? nullptr : it->second.get();
}

bool Swapper::Held(const Block& b) { return PinsOf(b) > 0 || b.waiters > 0; }

int Swapper::PinsOf(const Block& b) { return b.pins.load() + static_cast<int>(b.fast.load() >> 1); }

bool Swapper::HoldsRoom(const Block& b) {
  // (A write-out is leaving.)
  return b.home == Tier::kNvme &&
         (b.state == BlockState::kResident || b.state == BlockState::kReadingIn);
}

bool Swapper::BusyLocked(const Block& b) const {
  return Held(b) || b.dropping || b.state == BlockState::kReadingIn ||
         b.state == BlockState::kWritingOut;
}

uint64_t Swapper::UsedAfterFreeingLocked() const {
  // Not below zero: RemoveAll's leases leave the pool (used() goes down)
  // without the lock, before freeing_bytes_ does under it.
  const uint64_t used = pool_->used();
  return used > freeing_bytes_ ? used - freeing_bytes_ : 0;
}

void Swapper::EraseIfDoneLocked(Block* b) {
  if (!b->removed || BusyLocked(*b)) return;
  if (b->state != BlockState::kOnNvme) {
    // External memory stays the caller's mapping, but its pages go: freed
    // by an I/O thread (not under the lock), which erases the block after.
    DropHostLocked(b);
    b->state = BlockState::kOnNvme;
    RelistLocked(*b);
    if (b->dropping) return;
  }
  if (b->extent != 0) space_->Free(b->extent).IgnoreError();
  victims_.Erase(b->id);
  EraseLocked(b->id);
  changed_.SignalAll();
}

void Swapper::InsertLocked(std::unique_ptr<Block> b) {
  absl::MutexLock table(&table_mu_);
  const BlockId id = b->id;
  blocks_[id] = std::move(b);
}

void Swapper::EraseLocked(BlockId id) {
  absl::MutexLock table(&table_mu_);
  blocks_.erase(id);
}

absl::Status Swapper::Add(BlockId id, uint64_t bytes, Tier home, uint64_t trace) {
  return AddBlock(id, bytes, ExternalMemory{}, 0, home, trace);
}

absl::Status Swapper::AddExternal(BlockId id, const ExternalMemory& memory, uint64_t bytes,
                                  Tier home, uint64_t trace) {
  std::byte* const data = memory.data;
  const uint64_t page_bytes = memory.page_bytes == 0 ? PageSize() : memory.page_bytes;
  if (page_bytes % PageSize() != 0 || !absl::has_single_bit(page_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("block ", id, ": page size ", page_bytes,
                                                   " is not a power-of-two multiple of ",
                                                   PageSize()));
  }
  if (data == nullptr || reinterpret_cast<uintptr_t>(data) % page_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", id, ": external memory must be aligned to its pages (", page_bytes, " bytes)"));
  }
  return AddBlock(id, bytes, memory, RoundUp(bytes, page_bytes), home, trace);
}

absl::Status Swapper::AddBlock(BlockId id, uint64_t bytes, const ExternalMemory& memory,
                               uint64_t span, Tier home, uint64_t trace,
                               std::optional<uint64_t> kept) {
  std::byte* const external = memory.data;
  if (bytes == 0) return absl::InvalidArgumentError(absl::StrCat("block ", id, " has 0 bytes"));
  if (home == Tier::kNvme && space_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", id, " cannot rest on NVMe: no NVMe tier (set nvme.dirs)"));
  }
  {
    absl::MutexLock lock(&mu_);  // before touching the memory of a live block
    if (blocks_.contains(id)) {
      return absl::AlreadyExistsError(absl::StrCat("block ", id, " exists already"));
    }
  }
  if (external != nullptr) {
    // Zeros, holding no pages, whatever the memory held before.
    RETURN_IF_ERROR(DiscardSharedPages(external, span));
  }
  std::byte* populate = nullptr;  // host memory to make resident, outside the lock
  {
    absl::MutexLock lock(&mu_);
    if (blocks_.contains(id)) {
      return absl::AlreadyExistsError(absl::StrCat("block ", id, " exists already"));
    }
    auto b = std::make_unique<Block>();
    b->id = id;
    b->bytes = bytes;
    b->trace = trace;
    trace_io_.try_emplace(trace);  // its I/O counted from here until ForgetTrace
    pool_shares_.Added(trace, SharesNowLocked());
    b->home = home;
    b->external = external;
    b->span = span;
    // Through the file only where writes through it get small pages too: a
    // mapping declines huge pages (MADV_NOHUGEPAGE) where the pool counts
    // small ones, and a write through the file has no mapping to decline.
    if (external != nullptr && memory.fd >= 0 && memory.page_bytes <= PageSize() &&
        !SharedFileWritesMayGetLargePages()) {
      b->file = memory.fd;
      b->file_offset = memory.file_offset;
    }
    // Resident from the start: homed on the host, or kept (its bytes
    // already in the pool's file; homed on NVMe, it is written there when
    // first evicted).
    if (home == Tier::kHost || kept.has_value()) {
      RETURN_IF_ERROR(MakeRoomLocked(NeedOf(*b), /*restricted=*/false, 0, trace));
      if (blocks_.contains(id)) {  // added meanwhile, while room was made
        return absl::AlreadyExistsError(absl::StrCat("block ", id, " exists already"));
      }
      if (kept.has_value()) {
        ASSIGN_OR_RETURN(b->host, pool_->Claim(*kept, bytes, absl::StrCat("block ", id)));
      } else {
        RETURN_IF_ERROR(TakeHostLocked(b.get()));
      }
      changed_.SignalAll();
      b->state = BlockState::kResident;
      if (external == nullptr && !kept.has_value()) {
        populate = b->host.data();
        ++b->waiters;  // its lease stays put (no repage, eviction or erasure) until populated
      }
    }
    // (A kept block's claim, should this fail, goes back with `b`.)
    if (home == Tier::kNvme) {
      RETURN_IF_ERROR(HomeOnNvmeLocked(id, bytes));
      CountNvmeHomeLocked(trace, +1);
    }
    traces_.try_emplace(trace);
    RelistLocked(*b);
    Block* const added = b.get();
    InsertLocked(std::move(b));
    UpdateFastLocked(added);
  }
  // A block that rests in the pool (optimizer state) gets its pages now,
  // beside the trainer's registration, not at its first use in the first
  // step (seconds of faults for a large model), without the lock; a waiter
  // meanwhile, so that a Remove, a repage or a change of its home to NVMe
  // does not give its lease back under the populating (which would fault
  // pages into memory the pool no longer counts).
  if (populate != nullptr) {
    PopulateForWrite(populate, bytes);
    absl::MutexLock lock(&mu_);
    Block* b = blocks_.at(id).get();  // a waiter: never erased meanwhile
    --b->waiters;
    RelistLocked(*b);
    EraseIfDoneLocked(b);  // removed meanwhile: goes now
    changed_.SignalAll();
  }
  return absl::OkStatus();
}

absl::Status Swapper::AddKept(BlockId id, uint64_t bytes, Tier home, uint64_t trace,
                              uint64_t offset) {
  return AddBlock(id, bytes, ExternalMemory{}, 0, home, trace, offset);
}

uint64_t Swapper::NvmeRoom() const {
  absl::MutexLock lock(&mu_);
  return nvme_capacity_ - std::min(nvme_capacity_, nvme_homed_bytes_);
}

uint64_t Swapper::NvmeFootprint(uint64_t bytes) const {
  return RoundUp(bytes, space_->alignment());
}

absl::Status Swapper::HomeOnNvmeLocked(BlockId id, uint64_t bytes) {
  const uint64_t need = NvmeFootprint(bytes);
  if (nvme_homed_bytes_ + need > nvme_capacity_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "block ", id, " (", bytes, " bytes) cannot rest on NVMe: the tier's ", nvme_capacity_,
        " bytes (nvme.bytes_per_dir in each of nvme.dirs) hold ", nvme_homed_bytes_,
        " bytes homed there already; place less on NVMe or give the tier more room"));
  }
  nvme_homed_bytes_ += need;
  return absl::OkStatus();
}

void Swapper::Remove(BlockId id) {
  absl::MutexLock lock(&mu_);
  Block* b = FindLocked(id);
  if (b == nullptr) return;
  const bool external = b->external != nullptr;
  if (b->home == Tier::kNvme) {
    nvme_homed_bytes_ -= NvmeFootprint(b->bytes);
    CountNvmeHomeLocked(b->trace, -1);
  }
  b->removed = true;
  UpdateFastLocked(b);  // (before its pins are looked at)
  RelistLocked(*b);
  EraseIfDoneLocked(b);  // may free *b: only compared against below
  if (!external) return;
  // The caller unmaps external memory next: no I/O may touch it after this.
  auto gone = [this, id, b]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = blocks_.find(id);
    return it == blocks_.end() || it->second.get() != b;
  };
  while (!gone()) changed_.Wait(&mu_);
}

void Swapper::RemoveAll(absl::Span<const BlockId> ids, std::vector<PoolCharge>* charges) {
  // Blocks of external memory still in the map (being written out or
  // freed): no I/O may touch that memory once this returns.
  std::vector<std::pair<BlockId, const Block*>> external;
  // In batches, so that other sessions' calls get the lock in between. The
  // leases of the pool blocks that nothing uses leave the lock with the
  // batch and are given back without it (a 16 MiB lease of 4 KiB pages takes
  // about a millisecond to unmap, a session's state of 1.6 GB 80 ms: other
  // sessions' steps pin and release their blocks under this lock), counted
  // as being freed until then, as the external blocks' charges below are
  // (UsedAfterFreeingLocked: the pool's count drops first).
  constexpr size_t kBatch = 512;
  std::vector<PoolMemory> leases;
  for (size_t at = 0; at < ids.size(); at += kBatch) {
    uint64_t lease_bytes = 0;
    {
      absl::MutexLock lock(&mu_);
      for (BlockId id : ids.subspan(at, kBatch)) {
        Block* b = FindLocked(id);
        if (b == nullptr) continue;
        if (b->home == Tier::kNvme) {
          nvme_homed_bytes_ -= NvmeFootprint(b->bytes);
          CountNvmeHomeLocked(b->trace, -1);
        }
        b->removed = true;
        UpdateFastLocked(b);  // (before its pins are looked at)
        if (b->external != nullptr) {
          if (!BusyLocked(*b) && b->state != BlockState::kOnNvme) {
            // Its pages go with the caller's memory; its charge until then.
            freeing_bytes_ += b->charge.bytes();
            charges->push_back(std::move(b->charge));
            b->state = BlockState::kOnNvme;
          }
          external.emplace_back(id, b);
        } else if (!BusyLocked(*b) && !b->host.empty()) {
          lease_bytes += b->host.charged();
          leases.push_back(std::move(b->host));
        }
        RelistLocked(*b);
        EraseIfDoneLocked(b);  // may free *b: only compared against below
      }
      freeing_bytes_ += lease_bytes;
    }
    if (leases.empty()) continue;
    leases.clear();  // unmapped here, without the lock
    absl::MutexLock lock(&mu_);
    freeing_bytes_ -= lease_bytes;
    changed_.SignalAll();
  }
  absl::MutexLock lock(&mu_);
  // Those still there are busy; each goes once its I/O ended.
  auto prune = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    external.erase(std::remove_if(external.begin(), external.end(),
                                  [&](const std::pair<BlockId, const Block*>& e)
                                      ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                        auto it = blocks_.find(e.first);
                                        return it == blocks_.end() || it->second.get() != e.second;
                                      }),
                   external.end());
  };
  for (prune(); !external.empty(); prune()) changed_.Wait(&mu_);
}

void Swapper::ReleaseCharges(std::vector<PoolCharge>* charges) {
  uint64_t bytes = 0;
  for (const PoolCharge& c : *charges) bytes += c.bytes();
  absl::MutexLock lock(&mu_);
  charges->clear();
  freeing_bytes_ -= bytes;
  changed_.SignalAll();
}

absl::Status Swapper::Discard(BlockId id) {
  if (std::optional<absl::Status> fast = TryDiscardFast(id)) return *fast;
  absl::MutexLock lock(&mu_);
  Block* b = FindLocked(id);
  if (b == nullptr) return absl::NotFoundError(absl::StrCat("no block ", id));
  if (BusyLocked(*b)) {
    return BusyDiscardError(id);
  }
  if (b->prefetched) {
    b->prefetched = false;
    ++stats_.prefetch_wasted;
  }
  if (b->extent != 0) space_->Free(b->extent).IgnoreError();
  b->extent = 0;
  b->nvme_current = false;
  ++stats_.discards;
  if (b->state == BlockState::kResident && b->home == Tier::kNvme) {
    DropHostLocked(b);
    b->state = BlockState::kOnNvme;
    RelistLocked(*b);
    changed_.SignalAll();  // room
  }
  UpdateFastLocked(b);  // (no NVMe copy now)
  // A block homed on the host keeps its memory and its bytes (freeing and
  // refaulting its pages every step would cost more than it saves): no
  // room for anyone waiting.
  return absl::OkStatus();
}

absl::StatusOr<Swapper::Pin> Swapper::Acquire(BlockId id, bool for_write, Use use) {
  if (Pin pin; TryAcquireFast(id, &pin)) return pin;
  const bool traced = use == Use::kInOrder;
  absl::MutexLock lock(&mu_);
  Block* b = FindLocked(id);
  if (b == nullptr) return absl::NotFoundError(absl::StrCat("no block ", id));
  ++stats_.acquires;
  b->last_use = ++clock_;
  pool_shares_.Touched(b->trace, SharesNowLocked());
  ++b->waiters;
  RelistLocked(*b);
  bool counted = false;
  absl::Status status;
  for (;;) {
    if (b->removed) {
      status = absl::NotFoundError(absl::StrCat("block ", id, " was removed"));
      break;
    }
    if (b->state == BlockState::kWritingOut && b->given) {
      if (!counted) ++stats_.misses;
      counted = true;
      pool_shares_.Missed(b->trace, SharesNowLocked());
      while (b->state == BlockState::kWritingOut) WaitForChangeLocked();
      continue;
    }
    if (b->state == BlockState::kResident || b->state == BlockState::kWritingOut) {
      if (!counted) ++stats_.hits;
      break;
    }
    if (b->state == BlockState::kReadingIn) {
      if (!counted) ++stats_.waited_reads;
      counted = true;
      pool_shares_.Missed(b->trace, SharesNowLocked());
      const uint64_t failures = b->failed_reads;
      while (b->state == BlockState::kReadingIn) WaitForChangeLocked();
      if (b->failed_reads != failures) {
        status = b->read_error;
        break;
      }
      continue;
    }
    // kOnNvme.
    if (b->dropping) {
      // Its pages are still being freed: read it in once they are.
      while (b->dropping) WaitForChangeLocked();
      continue;
    }
    if (!counted) ++stats_.misses;
    counted = true;
    pool_shares_.Missed(b->trace, SharesNowLocked());
    if (!pool_->Fits(NeedOf(*b))) {
      status = MakeRoomLocked(NeedOf(*b), /*restricted=*/false, 0, b->trace);
      // The lock may have been released: look again. A prefetch may have
      // brought this very block in meanwhile (then the room is not needed).
      if (!status.ok() && b->state == BlockState::kOnNvme) break;
      status = absl::OkStatus();
      continue;
    }
    status = StartReadLocked(b);
    if (!status.ok()) break;
  }
  if (status.ok()) ++b->pins;  // the waiter becomes a pin
  --b->waiters;
  RelistLocked(*b);
  if (!status.ok()) {
    EraseIfDoneLocked(b);
    return status;
  }
  // Only uses that happen enter the learned order (a caller that retries
  // after RESOURCE_EXHAUSTED must not make the trace look different), and
  // only uses of blocks homed on NVMe: a block homed on the host is never
  // read in nor evicted, so its uses predict nothing, and they can change
  // every iteration where the NVMe ones do not (the delayed update's two
  // working-copy buffers take turns), which made the order look new at
  // every step and stopped prefetch. (They still refill the prefetch
  // window below, as reads complete, while the trainer works.)
  // A pass of an order that repeats without EndIteration (a session that
  // only fetches: access_trace.h) is an iteration of its work for the
  // pool's shares and turns too: its turns are measured and judged by it.
  if (traced && b->home == Tier::kNvme && traces_[b->trace].RecordUse(id)) {
    ++stats_.order_passes;
    pool_shares_.EndIteration(b->trace, SharesNowLocked());
  }
  // Its share of the pool's traffic: uses that happen, a block of the
  // iteration's work once an iteration, work beside it each time (it takes
  // the pool's room all the same: a burst is paid for in room until the
  // others catch up; pool_shares.h).
  if (b->home == Tier::kNvme) {
    if (use != Use::kExtra) {
      pool_shares_.ServedInPass(b->trace, &b->shares_pass, b->bytes, SharesNowLocked());
    } else {
      pool_shares_.Served(b->trace, b->bytes, SharesNowLocked());
    }
  }
  if (b->prefetched) {
    b->prefetched = false;
    ++stats_.prefetch_used;
  }
  if (for_write) {
    ++b->version;
    b->nvme_current = false;
  }
  if (traced) SchedulePrefetchLocked(b->trace);
  if (b->home == Tier::kHost) {
    SettleOnHostLocked(b);  // (its next pins without the lock)
  }
  return Pin(this, id, DataOf(*b), b->bytes);
}

bool Swapper::TryAcquireFast(BlockId id, Pin* pin) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  Block* b = nullptr;
  {
    absl::ReaderMutexLock table(&table_mu_);
    auto it = blocks_.find(id);
    if (it == blocks_.end()) return false;
    b = it->second.get();
    // Counted only while it may be pinned so, in the same word: whoever
    // clears the bit (UpdateFastLocked, under the lock) gets the count
    // with it.
    uint32_t state = b->fast.load();
    do {
      if ((state & 1) == 0) return false;
    } while (!b->fast.compare_exchange_weak(state, state + 2));
  }
  fast_hits_.fetch_add(1, std::memory_order_relaxed);
  // Its memory stays put: nothing moves or frees it while it is pinned,
  // and whatever would first clears `fast` and finds this pin.
  *pin = Pin(this, id, DataOf(*b), b->bytes, b);
  return true;
}

void Swapper::ReleaseFastPin(Block* b, BlockId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  bool settle = false;
  {
    absl::ReaderMutexLock table(&table_mu_);  // not erased until this is done with it
    settle = b->fast.fetch_sub(2) == 2;       // the last such pin, the bit cleared
  }
  if (!settle) return;
  // The last pin taken without the lock of a block that may no longer be
  // pinned so: what a release under the lock does.
  absl::MutexLock lock(&mu_);
  auto it = blocks_.find(id);
  if (it == blocks_.end() || it->second.get() != b) return;  // gone meanwhile
  // The pins may have written it (without a version): no NVMe copy is
  // current, one being written included.
  ++b->version;
  b->nvme_current = false;
  UpdateFastLocked(b);
  ReleasedLocked(b);
}

absl::Status Swapper::BusyDiscardError(BlockId id) {
  return absl::FailedPreconditionError(
      absl::StrCat("block ", id, " is pinned or in flight; its bytes stay"));
}

std::optional<absl::Status> Swapper::TryDiscardFast(BlockId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  absl::ReaderMutexLock table(&table_mu_);
  auto it = blocks_.find(id);
  if (it == blocks_.end()) return std::nullopt;
  const Block& b = *it->second;
  if ((b.fast.load() & 1) == 0) return std::nullopt;
  // Homed on the host with no NVMe copy: its memory and bytes stay, there
  // is nothing to free (see Discard).
  if (PinsOf(b) > 0) {
    return BusyDiscardError(id);
  }
  fast_discards_.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

void Swapper::UpdateFastLocked(Block* b) {
  const bool needs_repage = b->home == Tier::kHost && !b->host.empty() && !b->host.shared() &&
                            b->host.pages() != host_home_pages_;
  const bool fast = b->home == Tier::kHost && b->state == BlockState::kResident && !b->removed &&
                    !b->dropping && b->extent == 0 && !b->prefetched && !needs_repage &&
                    !nvme_blocks_.contains(b->trace);
  // Written without the lock from now on, without a version: should it go
  // to NVMe later, it is written there when first evicted.
  if (fast) b->nvme_current = false;
  // No longer so: its uses count for the LRU again, from now (uses without
  // the lock do not tick the clock).
  const uint32_t was = fast ? b->fast.fetch_or(1) : b->fast.fetch_and(~1u);
  if (!fast && (was & 1) != 0) b->last_use = ++clock_;
  // (The count as the bit was cleared: no pin is taken so after it.)
  const bool lingering = !fast && (was >> 1) > 0;
  if (lingering != b->fast_lingering) {
    b->fast_lingering = lingering;
    RelistLocked(*b);
  }
}

void Swapper::DropNvmeCopyLocked(Block* b) {
  if (b->home != Tier::kHost || b->state != BlockState::kResident || b->extent == 0 ||
      b->waiters > 0 || b->dropping) {
    return;
  }
  space_->Free(b->extent).IgnoreError();
  b->extent = 0;
  b->nvme_current = false;
}

void Swapper::SettleOnHostLocked(Block* b) {
  DropNvmeCopyLocked(b);
  UpdateFastLocked(b);
}

void Swapper::CountNvmeHomeLocked(uint64_t trace, int delta) {
  uint64_t& n = nvme_blocks_[trace];
  const bool had = n > 0;
  n += static_cast<uint64_t>(static_cast<int64_t>(delta));
  const bool has = n > 0;
  if (!has) nvme_blocks_.erase(trace);
  if (had == has) return;
  // The trace's blocks on the host may be pinned without the lock now, or
  // no longer (their uses refill its prefetch window again).
  for (auto& [id, b] : blocks_) {
    if (b->trace == trace) UpdateFastLocked(b.get());
  }
}

uint64_t Swapper::CopyOutBytes(uint64_t bytes) const {
  return space_ == nullptr ? bytes : RoundUp(bytes, space_->alignment());
}

absl::StatusOr<uint64_t> Swapper::CopyOut(BlockId id, absl::Span<std::byte> dst) {
  absl::MutexLock lock(&mu_);
  Block* b = FindLocked(id);
  if (b == nullptr) return absl::NotFoundError(absl::StrCat("no block ", id));
  const uint64_t need = CopyOutBytes(b->bytes);
  const uint64_t alignment = space_ == nullptr ? 1 : space_->alignment();
  if (dst.size() < need || reinterpret_cast<uintptr_t>(dst.data()) % alignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("copying block ", id, " out: the buffer must span ", need,
                     " bytes aligned to ", alignment, " (", dst.size(), " given)"));
  }
  // A waiter: not evicted (so its NVMe copy is neither rewritten nor
  // freed), discarded or erased until it is done.
  ++b->waiters;
  RelistLocked(*b);
  absl::Status status;
  for (;;) {
    if (b->removed) {
      status = absl::NotFoundError(absl::StrCat("block ", id, " was removed"));
      break;
    }
    if (b->state == BlockState::kReadingIn || b->dropping) {
      changed_.Wait(&mu_);
      continue;
    }
    if (b->state != BlockState::kOnNvme) {
      // In host memory: copied under a pin, without the lock.
      ++b->pins;
      RelistLocked(*b);
      Pin pin(this, id, DataOf(*b), b->bytes);
      mu_.Unlock();
      std::memcpy(dst.data(), pin.data(), pin.size());
      pin.Reset();
      mu_.Lock();
      break;
    }
    if (b->extent == 0) {
      std::memset(dst.data(), 0, b->bytes);
      break;
    }
    const uint64_t extent = b->extent;
    std::function<void(BlockId, bool)> hook = io_hook_;
    ++copy_outs_in_flight_;  // MakeRoom waits for it: it may make a victim
    mu_.Unlock();
    if (hook) hook(id, /*is_write=*/false);
    const auto start = std::chrono::steady_clock::now();
    status = space_->Read(extent, dst.data());
    const uint64_t nanos = NanosSince(start);
    mu_.Lock();
    --copy_outs_in_flight_;
    if (status.ok()) {
      ++stats_.copy_outs;
      stats_.copy_out_bytes += b->bytes;
      stats_.copy_out_nanos += nanos;
    } else {
      ++stats_.io_errors;
      status = absl::Status(status.code(),
                            absl::StrCat("copying block ", id, " out: ", status.message()));
    }
    break;
  }
  const uint64_t bytes = b->bytes;
  --b->waiters;
  RelistLocked(*b);
  // (Moved home to the host while this read its NVMe copy: not needed now.)
  SettleOnHostLocked(b);
  changed_.SignalAll();
  EraseIfDoneLocked(b);
  if (!status.ok()) return status;
  return bytes;
}

void Swapper::ReleasePin(BlockId id) {
  absl::MutexLock lock(&mu_);
  auto it = blocks_.find(id);
  if (it == blocks_.end()) return;
  Block* b = it->second.get();
  --b->pins;
  ReleasedLocked(b);
}

void Swapper::ReleasedLocked(Block* b) {
  RelistLocked(*b);
  RepageIfIdleLocked(b);
  // Who waits on a release: room being made, for a block that can be
  // evicted now (homed on NVMe, no pins left); Remove and room, for a
  // removed block to go (EraseIfDoneLocked wakes them). A block homed on
  // the host is never evicted: its release wakes nobody (the sessions
  // whose state is on the host pin and release thousands of blocks a
  // second, and each wake of a neighbour's threads waiting for room sent
  // them through the lock to look for a victim again).
  const bool evictable = PinsOf(*b) == 0 && b->home == Tier::kNvme;
  EraseIfDoneLocked(b);  // may free *b
  if (evictable) changed_.SignalAll();
}

void Swapper::WaitForChangeLocked() {
  // (Timed: one waiting on a stalled transfer says so.)
  if (changed_.WaitWithTimeout(&mu_, absl::FromChrono(stalled_io_) / 2)) {
    WarnOfStalledIoLocked();
    return;
  }
  ++stats_.waiter_wakeups;
}

void Swapper::RepageIfIdleLocked(Block* b) {
  // Only a block moved home to the host while in memory (SetHome) holds a
  // lease of other pages: every other host-homed lease is taken with them.
  // (A slot of a shared slab is on small pages whatever it asked for.)
  if (b->home != Tier::kHost || b->host.empty() || b->host.shared() ||
      b->host.pages() == host_home_pages_ || b->removed || BusyLocked(*b) ||
      b->state != BlockState::kResident) {
    return;
  }
  // A second copy for a moment; where the pool has no room for it, the
  // block keeps its pages until a later release finds room.
  absl::StatusOr<PoolMemory> moved =
      pool_->Allocate(b->bytes, absl::StrCat("block ", b->id), host_home_pages_);
  if (!moved.ok()) return;
  std::memcpy(moved->data(), b->host.data(), b->bytes);
  b->host = *std::move(moved);
  ++stats_.repages;
  UpdateFastLocked(b);
}

void Swapper::ForgetTrace(uint64_t trace) {
  absl::MutexLock lock(&mu_);
  traces_.erase(trace);
  victims_.Forget(trace);
  io_queue_.Forget(trace);
  prefetches_.Forget(trace);
  trace_io_.erase(trace);
  pool_shares_.Forget(trace);
}

Swapper::TraceIo Swapper::IoOf(uint64_t trace) const {
  absl::MutexLock lock(&mu_);
  auto it = trace_io_.find(trace);
  TraceIo io = it == trace_io_.end() ? TraceIo{} : it->second;
  io.room = victims_.Room(trace);
  return io;
}

void Swapper::SetIoWeight(uint64_t trace, int64_t weight) {
  absl::MutexLock lock(&mu_);
  io_queue_.SetWeight(trace, weight);
  prefetches_.SetWeight(trace, weight);
  pool_shares_.SetWeight(trace, weight);
}

void Swapper::EndIteration(uint64_t trace) {
  absl::MutexLock lock(&mu_);
  pool_shares_.EndIteration(trace, SharesNowLocked());
  AccessTrace& t = traces_[trace];
  const uint64_t before = t.relearned();
  t.EndIteration();
  stats_.relearned += t.relearned() - before;
  SchedulePrefetchLocked(trace);
}

absl::Status Swapper::SetHome(BlockId id, Tier home) {
  if (home == Tier::kNvme && space_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", id, " cannot rest on NVMe: no NVMe tier (set nvme.dirs)"));
  }
  absl::MutexLock lock(&mu_);
  Block* b = FindLocked(id);
  if (b == nullptr) return absl::NotFoundError(absl::StrCat("no block ", id));
  const Tier was = b->home;
  if (was != home) {
    if (home == Tier::kNvme) {
      RETURN_IF_ERROR(HomeOnNvmeLocked(id, b->bytes));
    } else {
      nvme_homed_bytes_ -= NvmeFootprint(b->bytes);
    }
  }
  b->home = home;
  SettleOnHostLocked(b);  // (before its pins are looked at)
  if (was != home) CountNvmeHomeLocked(b->trace, home == Tier::kNvme ? +1 : -1);
  RelistLocked(*b);
  RepageIfIdleLocked(b);
  if (home == Tier::kHost && b->state == BlockState::kOnNvme) {
    // Queued as a prefetch or not: a prefetch may give up (it evicts only
    // what is needed later); a move to the host must not. (Whichever of the
    // two comes first reads it in; the other finds it resident.)
    if (!b->to_host_queued) {
      b->to_host_queued = true;
      ++b->moves_queued;
      moves_.push_back({id, MoveKind::kToHost});
      move_work_.Signal();
    }
    changed_.SignalAll();
  }
  return absl::OkStatus();
}

void Swapper::Trim() {
  absl::MutexLock lock(&mu_);
  moves_.push_back({0, MoveKind::kTrim});
  move_work_.Signal();
  changed_.SignalAll();
}

void Swapper::SetPrefetch(int64_t depth, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  prefetch_depth_ = depth;
  prefetch_bytes_ = bytes;
}

absl::StatusOr<BlockState> Swapper::State(BlockId id) const {
  absl::MutexLock lock(&mu_);
  Block* b = FindLocked(id);
  if (b == nullptr) return absl::NotFoundError(absl::StrCat("no block ", id));
  return b->state;
}

absl::StatusOr<Tier> Swapper::Home(BlockId id) const {
  absl::MutexLock lock(&mu_);
  Block* b = FindLocked(id);
  if (b == nullptr) return absl::NotFoundError(absl::StrCat("no block ", id));
  return b->home;
}

SwapperStats Swapper::Stats() const {
  absl::MutexLock lock(&mu_);
  SwapperStats s = stats_;
  const uint64_t fast_hits = fast_hits_.load(std::memory_order_relaxed);
  s.acquires += fast_hits;
  s.hits += fast_hits;
  s.unlocked_pins = fast_hits;
  s.discards += fast_discards_.load(std::memory_order_relaxed);
  s.turns = pool_shares_.turns();
  s.blocks = 0;
  s.traces = traces_.size();
  for (const auto& [id, b] : blocks_) {
    if (b->removed) continue;
    ++s.blocks;
    if (b->state != BlockState::kOnNvme) s.resident_bytes += b->bytes;
    if (PinsOf(*b) > 0) s.pinned_bytes += b->bytes;
    if (b->prefetched) ++s.prefetch_pending;
    (b->home == Tier::kHost ? s.host_home_bytes : s.nvme_home_bytes) += b->bytes;
    if (b->home == Tier::kHost && b->state != BlockState::kOnNvme) {
      s.host_home_charged_bytes += ChargedOf(*b);
    }
  }
  s.io_queue = frees_.size() + io_queue_.size() + io_running_;
  if (!io_started_.empty()) {
    s.io_oldest_running_seconds =
        static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::seconds>(
                                  std::chrono::steady_clock::now() - *io_started_.begin())
                                  .count());
  }
  return s;
}

void Swapper::WarnOfStalledIoLocked() {
  if (io_started_.empty()) return;
  const auto running = std::chrono::steady_clock::now() - *io_started_.begin();
  if (running < stalled_io_) return;
  if (const int64_t held = stalled_.Admit(absl::Now()); held >= 0) {
    LogWarning(
        "swapper: an NVMe task has been running for %s (%d running, %d queued): the disk "
        "is stalled (a frozen filesystem, a failing device?); the fetches and steps that need "
        "its blocks wait for it%s",
        absl::FormatDuration(absl::Trunc(absl::FromChrono(running), absl::Seconds(1))),
        static_cast<int64_t>(io_running_), static_cast<int64_t>(io_queue_.size()),
        LogLimiter::Held(held));
  }
}

void Swapper::WaitIdle() {
  absl::MutexLock lock(&mu_);
  while (!moves_.empty() || !prefetches_.empty() || mover_busy_ || !frees_.empty() ||
         !io_queue_.empty() || io_running_ > 0) {
    changed_.Wait(&mu_);
  }
}

void Swapper::SetIoHookForTesting(std::function<void(BlockId, bool)> hook) {
  absl::MutexLock lock(&mu_);
  io_hook_ = std::move(hook);
}

uint64_t Swapper::NextUseLocked(const Block& b) const {
  auto it = traces_.find(b.trace);
  return it == traces_.end() ? AccessTrace::kNever : it->second.NextUse(b.id);
}

namespace {

// A trace's standing for eviction, looked up once per choice: idle (gives
// room first); holding more of the pool's room than three quarters, or
// than its weight's share among the traces using the pool and half the
// rest, whichever is more (a slow trace, never ahead of its share of the
// traffic, must not take all of it: gives room next); ahead of its share of
// the traffic (then; the farthest ahead first, pool_shares.h). A tighter
// bound (half, or its weight's share) cost two sessions sharing the pool
// half their updates in benches/shares: it fought the traffic's shares,
// which let a session streaming through its state hold more for a while.
struct TraceStanding {
  bool idle = false;
  bool out_of_turn = false;  // turns are taken (PoolShares::Turn), and not this trace's
  bool over = false;
  uint64_t lead = 0;  // PoolShares::Lead: 0 within its share
  bool gives() const { return idle || out_of_turn || over || lead > 0; }
  // Who gives room before whom (a victim's key begins with it).
  std::tuple<bool, bool, bool, uint64_t> rank() const { return {idle, out_of_turn, over, lead}; }
};

// `busy`: the trace holds a block or waits for one (the one room is made
// for among them): at work however long ago its last Acquire began (a slow
// swap-in). `room`: what its NVMe-homed blocks hold of the pool's room,
// `all_room` all traces'. `holder`: the turn's (PoolShares::Turn).
TraceStanding StandingOfTrace(const PoolShares& shares, uint64_t trace, bool busy, uint64_t room,
                              uint64_t all_room, PoolShares::Clock::time_point now, double floor,
                              double slack, uint64_t holder) {
  TraceStanding s;
  s.idle = !busy && shares.Quiet(trace, now);
  s.out_of_turn = !s.idle && holder != PoolShares::kNone && trace != holder;
  const double most = std::max(0.75, (1 + shares.RoomShare(trace, now)) / 2);
  s.over = !s.idle && static_cast<double>(room) > most * static_cast<double>(all_room);
  s.lead = s.idle ? 0 : shares.Lead(trace, floor, slack);
  return s;
}

}  // namespace

VictimIndex::Standing Swapper::StandingOf(const Block& b) {
  VictimIndex::Standing s;
  // (Pins taken without the lock of a block that may be pinned so change
  // without the lock: not counted; such a block holds no room and is
  // never a candidate.)
  s.held = b.pins.load() > 0 || b.waiters > 0 || b.fast_lingering;
  s.room = HoldsRoom(b) && !b.removed ? b.bytes : 0;
  s.candidate = s.room > 0 && !s.held && b.state == BlockState::kResident;
  // (Only a candidate's matters: an Acquire, which sets it, holds the block.)
  s.last_use = s.candidate ? b.last_use : 0;
  return s;
}

const AccessTrace* Swapper::OrderOfLocked(uint64_t trace) const {
  auto it = traces_.find(trace);
  return it == traces_.end() ? nullptr : &it->second;
}

void Swapper::RelistLocked(const Block& b) {
  const VictimIndex::Standing s = StandingOf(b);
  victims_.Set(b.id, b.trace, s, s.candidate ? OrderOfLocked(b.trace) : nullptr);
}

Swapper::Block* Swapper::ChooseVictimLocked(bool restricted, uint64_t farther_than,
                                            uint64_t for_trace,
                                            const absl::flat_hash_set<BlockId>& tried,
                                            VictimKind* kind) {
  const auto now = SharesNowLocked();
  // (Called under mu_, by Turn too.)
  auto busy = [&](uint64_t trace) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return (for_trace != kNoTrace && trace == for_trace) || victims_.Held(trace);
  };
  const uint64_t holder = pool_shares_.Turn(now, busy);
  const double floor = pool_shares_.Floor(now);
  const double slack = pool_shares_.Slack(now);
  const uint64_t all_room = victims_.all_room();
  auto standing_of = [&](uint64_t trace) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return StandingOfTrace(pool_shares_, trace, busy(trace), victims_.Room(trace), all_room, now,
                           floor, slack, holder);
  };
  // A prefetch (speculative) for a trace that gives room takes none from
  // the traces that give less (those that do not, or are less far ahead);
  // from those that give more it takes any block (their next uses count in
  // their own orders, not in the prefetching trace's), from the others only
  // blocks needed later than the one it brings in.
  std::optional<std::tuple<bool, bool, bool, uint64_t>> prefetch_rank;
  std::tuple<bool, bool, bool, uint64_t> for_rank{false, false, false, 0};
  if (restricted && for_trace != kNoTrace) {
    const TraceStanding s = standing_of(for_trace);
    for_rank = s.rank();
    if (s.gives()) prefetch_rank = s.rank();
  }
  // Each trace's first candidate in its own order (the farthest next use,
  // then the least recently used: VictimIndex), against the others': an
  // idle trace's first (its uses are not coming soon, however near they
  // are in its own order), then one whose turn it is not (where turns are
  // taken), then one holding more than its room, then one
  // ahead of its share of the traffic (the farthest ahead first); then the
  // farthest next use; among equals (never used again, or no trace
  // followed), least recently used first.
  Block* best = nullptr;
  VictimKey best_key{false, false, false, 0, 0, 0};
  victims_.TracesWithCandidates(&victim_traces_);
  for (uint64_t trace : victim_traces_) {
    const TraceStanding s = standing_of(trace);
    if (restricted && !s.idle && prefetch_rank.has_value() && s.rank() < *prefetch_rank) continue;
    const bool bound = restricted && !s.idle && !(s.rank() > for_rank);
    victims_.ForEachCandidate(
        trace, OrderOfLocked(trace),
        [&](BlockId id, uint64_t next, uint64_t last_use) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          if (bound && next <= farther_than) return false;  // (the rest are needed sooner)
          if (tried.contains(id)) return true;
          const VictimKey key{s.idle, s.out_of_turn, s.over, s.lead, next, ~last_use};
          if (best == nullptr || key > best_key) {
            best = blocks_.at(id).get();
            best_key = key;
          }
          return false;
        });
  }
  if (check_victims_) {
    const std::optional<VictimKey> walked =
        WalkForVictimLocked(restricted, farther_than, for_trace, tried, now, holder);
    std::vector<std::string> errors = IndexErrorsLocked();
    auto describe = [](const std::optional<VictimKey>& k) {
      if (!k.has_value()) return std::string("none");
      const auto& [idle, out_of_turn, over, lead, next, not_last_use] = *k;
      return absl::StrCat("(idle ", idle, ", out of turn ", out_of_turn, ", over ", over, ", lead ",
                          lead, ", next ", next, ", last use ", ~not_last_use, ")");
    };
    const std::optional<VictimKey> chosen =
        best == nullptr ? std::nullopt : std::optional<VictimKey>(best_key);
    if (walked != chosen || !errors.empty()) {
      if (victim_mismatches_++ == 0) {
        first_victim_mismatch_ = errors.empty() ? absl::StrCat("chose ", describe(chosen),
                                                               ", the walk ", describe(walked))
                                                : errors.front();
      }
    }
  }
  if (best != nullptr) {
    *kind = std::get<0>(best_key)                                ? VictimKind::kIdle
            : std::get<1>(best_key)                              ? VictimKind::kOutOfTurn
            : std::get<2>(best_key) || std::get<3>(best_key) > 0 ? VictimKind::kAhead
                                                                 : VictimKind::kFarthest;
  }
  return best;
}

std::optional<Swapper::VictimKey> Swapper::WalkForVictimLocked(
    bool restricted, uint64_t farther_than, uint64_t for_trace,
    const absl::flat_hash_set<BlockId>& tried, PoolShares::Clock::time_point now,
    uint64_t holder) const {
  absl::flat_hash_set<uint64_t> busy;
  if (for_trace != kNoTrace) busy.insert(for_trace);
  absl::flat_hash_map<uint64_t, uint64_t> room;
  uint64_t all_room = 0;
  std::vector<const Block*> candidates;
  for (const auto& [id, b] : blocks_) {
    // Which sessions hold blocks: as the index counts it (pins taken without
    // the lock of blocks that may be so pinned change without it); which
    // blocks may go: by every pin, and until the last such pin's release
    // has told the index (a block the index offers while pins taken
    // without the lock are out is a mismatch).
    if (StandingOf(*b).held) busy.insert(b->trace);
    if (HoldsRoom(*b) && !b->removed) {
      room[b->trace] += b->bytes;
      all_room += b->bytes;
      if (!Held(*b) && !b->fast_lingering && b->state == BlockState::kResident &&
          !tried.contains(id)) {
        candidates.push_back(b.get());
      }
    }
  }
  const double floor = pool_shares_.Floor(now);
  const double slack = pool_shares_.Slack(now);
  auto standing_of = [&](uint64_t trace) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto r = room.find(trace);
    return StandingOfTrace(pool_shares_, trace, busy.contains(trace),
                           r == room.end() ? 0 : r->second, all_room, now, floor, slack, holder);
  };
  std::optional<std::tuple<bool, bool, bool, uint64_t>> prefetch_rank;
  std::tuple<bool, bool, bool, uint64_t> for_rank{false, false, false, 0};
  if (restricted && for_trace != kNoTrace) {
    const TraceStanding s = standing_of(for_trace);
    for_rank = s.rank();
    if (s.gives()) prefetch_rank = for_rank;
  }
  std::optional<VictimKey> best;
  for (const Block* b : candidates) {
    const TraceStanding s = standing_of(b->trace);
    const uint64_t next = NextUseLocked(*b);
    if (restricted && !s.idle &&
        ((next <= farther_than && !(s.rank() > for_rank)) ||
         (prefetch_rank.has_value() && s.rank() < *prefetch_rank))) {
      continue;
    }
    const VictimKey key{s.idle, s.out_of_turn, s.over, s.lead, next, ~b->last_use};
    if (!best.has_value() || key > *best) best = key;
  }
  return best;
}

void Swapper::CountVictimLocked(VictimKind kind) {
  if (kind == VictimKind::kIdle) ++stats_.idle_evictions;
  if (kind == VictimKind::kAhead || kind == VictimKind::kOutOfTurn) ++stats_.share_evictions;
}

void Swapper::SetClockForTesting(std::function<std::chrono::steady_clock::time_point()> clock) {
  absl::MutexLock lock(&mu_);
  clock_for_testing_ = std::move(clock);
}

std::vector<std::string> Swapper::IndexErrorsForTesting() const {
  absl::MutexLock lock(&mu_);
  return IndexErrorsLocked();
}

std::vector<std::string> Swapper::IndexErrorsLocked() const {
  std::vector<std::string> errors = victims_.CheckForTesting(
      [this](uint64_t trace) ABSL_NO_THREAD_SAFETY_ANALYSIS { return OrderOfLocked(trace); });
  auto describe = [](const VictimIndex::Standing& s) {
    return absl::StrCat(s.held ? "held" : "not held", ", room ", s.room,
                        s.candidate ? ", a candidate last used at " : "",
                        s.candidate ? absl::StrCat(s.last_use) : "");
  };
  size_t listed = 0;
  for (const auto& [id, b] : blocks_) {
    const VictimIndex::Standing want = StandingOf(*b);
    if (want != VictimIndex::Standing{}) ++listed;
    const VictimIndex::Standing has = victims_.Of(id);
    if (has != want) {
      errors.push_back(
          absl::StrCat("block ", id, ": listed as ", describe(has), "; it is ", describe(want)));
    }
  }
  if (victims_.size() != listed) {
    errors.push_back(absl::StrCat("the index lists ", victims_.size(), " blocks, ", listed,
                                  " stand for something"));
  }
  return errors;
}

void Swapper::CheckVictimsForTesting() {
  absl::MutexLock lock(&mu_);
  check_victims_ = true;
}

std::string Swapper::VictimMismatchForTesting() const {
  absl::MutexLock lock(&mu_);
  if (victim_mismatches_ == 0) return "";
  return absl::StrCat(victim_mismatches_,
                      " choices of a victim failed the check; the first: ", first_victim_mismatch_);
}

std::chrono::steady_clock::time_point Swapper::SharesNowLocked() const {
  return clock_for_testing_ ? clock_for_testing_() : std::chrono::steady_clock::now();
}

absl::Status Swapper::RoomError(uint64_t bytes) const {
  uint64_t pinned = 0, host_homed = 0;
  for (const auto& [id, b] : blocks_) {
    if (b->state == BlockState::kOnNvme || b->removed) continue;
    if (Held(*b)) pinned += NeedOf(*b);
    if (b->home == Tier::kHost) host_homed += NeedOf(*b);
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "host pool cannot hold ", bytes, " more bytes: ", pool_->used(), " of ", pool_->limit(),
      " in use, ", pinned, " held by callers, ", host_homed,
      " placed on the host; nothing left to evict (raise memory.host_budget_bytes, hold fewer "
      "partitions at once, or place more state on NVMe)"));
}

absl::Status Swapper::MakeRoomLocked(uint64_t bytes, bool restricted, uint64_t farther_than,
                                     uint64_t for_trace) {
  const uint64_t charge = HostPool::Charge(bytes);
  const uint64_t failed_writes = failed_writes_;
  absl::flat_hash_set<BlockId> tried;
  while (!pool_->Fits(bytes)) {
    // The I/O threads may already be gone: queue nothing more.
    if (stopping_) return absl::CancelledError("the swapper is shutting down");
    if (charge > pool_->limit()) return RoomError(bytes);
    // Enough is already being written out: wait for it.
    const uint64_t after = UsedAfterFreeingLocked();
    if (after <= pool_->limit() - charge) {
      WaitForChangeLocked();
      continue;
    }
    VictimKind kind = VictimKind::kFarthest;
    if (Block* victim = ChooseVictimLocked(restricted, farther_than, for_trace, tried, &kind)) {
      tried.insert(victim->id);
      CountVictimLocked(kind);
      // (Out of turn: turns are taken, and the holder is the one Turn answered.)
      victim->given = kind == VictimKind::kOutOfTurn && for_trace == pool_shares_.holder();
      EvictLocked(victim);
      continue;
    }
    if (writes_in_flight_ > 0 || reads_in_flight_ > 0 || copy_outs_in_flight_ > 0) {
      WaitForChangeLocked();
      continue;
    }
    if (restricted) return absl::UnavailableError("no block is needed later than this one");
    if (failed_writes_ != failed_writes) {
      return absl::Status(last_write_error_.code(),
                          absl::StrCat("making room for ", bytes,
                                       " bytes in the host pool: ", last_write_error_.message()));
    }
    return RoomError(bytes);
  }
  return absl::OkStatus();
}

void Swapper::EvictLocked(Block* b) {
  if (auto it = trace_io_.find(b->trace); it != trace_io_.end()) ++it->second.evictions;
  pool_shares_.Missed(b->trace, SharesNowLocked());
  if (b->prefetched) {
    b->prefetched = false;
    ++stats_.prefetch_wasted;
  }
  if (b->nvme_current && b->extent != 0) {
    b->given = false;   // (gone already)
    DropHostLocked(b);  // the NVMe copy is current: no write needed
    b->state = BlockState::kOnNvme;
    RelistLocked(*b);
    ++stats_.clean_drops;
    changed_.SignalAll();
    return;
  }
  b->state = BlockState::kWritingOut;
  RelistLocked(*b);
  // The bytes as of now are what the write-out stands for: a write pin from
  // here on (even before the write starts) makes its copy stale.
  b->write_version = b->version;
  freeing_bytes_ += ChargedOf(*b);
  ++writes_in_flight_;
  QueueIoLocked(*b, /*is_write=*/true);
}

absl::Status Swapper::StartReadLocked(Block* b) {
  // A read fills the whole lease (Space::Read of its extent); a block never
  // written out reads as zeros, which only a fresh lease is.
  RETURN_IF_ERROR(TakeHostLocked(
      b, b->extent != 0 ? HostPool::Contents::kOverwritten : HostPool::Contents::kZeroed));
  pool_shares_.BroughtIn(b->trace, SharesNowLocked());  // it competes for room
  if (b->extent == 0) {
    // Never written out (or discarded): zeros, which a fresh lease and the
    // holes of external memory already are.
    b->state = BlockState::kResident;
    RelistLocked(*b);
    ++stats_.zero_fills;
    changed_.SignalAll();
    return absl::OkStatus();
  }
  b->state = BlockState::kReadingIn;
  RelistLocked(*b);
  ++reads_in_flight_;
  QueueIoLocked(*b, /*is_write=*/false);
  return absl::OkStatus();
}

void Swapper::SchedulePrefetchLocked(uint64_t trace) {
  if (prefetch_depth_ <= 0 || space_ == nullptr) return;
  const AccessTrace& t = traces_[trace];
  if (!t.on_trace()) return;
  // The window, in blocks and in bytes, counts what prefetch has to bring
  // in (queued or being read), not blocks that are resident already (among
  // them every block homed on the host): a run of hits must not shrink it
  // (the disk would idle through it). How far it looks for them is bounded,
  // so that a trace of resident blocks costs little per Acquire.
  constexpr int64_t kLookPerBlock = 16;
  uint64_t bytes = 0;
  int64_t blocks = 0;
  // Called by ForEachUpcoming here, under mu_ (clang's analysis does not
  // follow the call into it).
  auto visit = [&](BlockId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Block* b = FindLocked(id);
    if (b == nullptr) return true;
    if (b->state == BlockState::kResident || b->state == BlockState::kWritingOut) return true;
    bytes += b->bytes;
    if (++blocks > prefetch_depth_ || bytes > static_cast<uint64_t>(prefetch_bytes_)) {
      return false;
    }
    if (b->state != BlockState::kOnNvme || b->moves_queued > 0) return true;
    ++b->moves_queued;
    prefetches_.Push(b->trace, b->bytes, Move{id, MoveKind::kPrefetch});
    move_work_.Signal();
    return true;
  };
  t.ForEachUpcoming(static_cast<size_t>(prefetch_depth_ * kLookPerBlock), visit);
  changed_.SignalAll();
}

void Swapper::QueueIoLocked(const Block& b, bool is_write) {
  io_queue_.Push(
      b.trace, b.bytes,
      [this, id = b.id, is_write](HostMemory& staging) { RunIo(id, is_write, staging); },
      std::chrono::steady_clock::now(), /*may_wait=*/!is_write);
  io_work_.Signal();
  changed_.SignalAll();
}

absl::Status Swapper::StagedIo(BlockId id, int fd, uint64_t file_offset, uint64_t bytes,
                               uint64_t* extent, bool is_write, HostMemory& staging) {
  if (staging.size() == 0) {
    ASSIGN_OR_RETURN(staging, HostMemory::Allocate(staging_bytes_, Pages::kHuge));
    space_->AddBuffer(staging.data(), staging.size());  // reused for every staged block
  }
  const absl::Span<std::byte> buffer(staging.data(), staging.size());
  auto failed = [&](const char* what, uint64_t at, int err) {
    return PosixError(absl::StrCat(what, " block ", id, "'s shared file at offset ", at), err);
  };
  if (!is_write) {
    return space_->ReadStaged(*extent, buffer, [&](uint64_t at, absl::Span<std::byte> chunk) {
      const uint64_t where = file_offset + at;
      const int e = PwriteAll(fd, chunk.data(), chunk.size(), where);
      return e == 0 ? absl::OkStatus() : failed("writing into", where, e);
    });
  }
  auto source = [&](uint64_t at, absl::Span<std::byte> chunk) {
    const uint64_t where = file_offset + at;
    size_t missing = 0;
    const int e = PreadAll(fd, chunk.data(), chunk.size(), where, &missing);
    if (e == -1) {  // the file ends inside the block: what is missing reads as zeros
      std::memset(chunk.data() + chunk.size() - missing, 0, missing);
      return absl::OkStatus();
    }
    return e == 0 ? absl::OkStatus() : failed("reading", where, e);
  };
  if (*extent != 0) return space_->RewriteStaged(*extent, bytes, buffer, source);
  ASSIGN_OR_RETURN(*extent, space_->WriteStaged(bytes, buffer, source));
  return absl::OkStatus();
}

void Swapper::RunIo(BlockId id, bool is_write, HostMemory& staging) {
  std::byte* data;
  uint64_t bytes, extent, version, file_offset;
  int file;
  std::function<void(BlockId, bool)> hook;
  {
    absl::MutexLock lock(&mu_);
    Block* b = blocks_.at(id).get();  // in flight: never erased meanwhile
    data = DataOf(*b);
    bytes = b->bytes;
    extent = b->extent;
    version = b->write_version;
    file = b->file;
    file_offset = b->file_offset;
    hook = io_hook_;
  }
  if (hook) hook(id, is_write);
  const auto start = std::chrono::steady_clock::now();
  absl::Status status;
  uint64_t new_extent = extent;
  if (file >= 0) {
    status = StagedIo(id, file, file_offset, bytes, &new_extent, is_write, staging);
  } else if (is_write) {
    // Copy-on-write: a failed rewrite leaves the older copy intact.
    if (extent != 0) {
      status = space_->Rewrite(extent, data, bytes);
    } else {
      absl::StatusOr<uint64_t> written = space_->Write(data, bytes);
      status = written.status();
      if (written.ok()) new_extent = *written;
    }
  } else {
    status = space_->Read(extent, data);
  }
  const uint64_t staged = file >= 0 && status.ok() ? bytes : 0;
  const uint64_t nanos = NanosSince(start);

  absl::MutexLock lock(&mu_);
  Block* b = blocks_.at(id).get();
  if (is_write) {
    --writes_in_flight_;
    freeing_bytes_ -= ChargedOf(*b);
    stats_.write_nanos += nanos;
    if (status.ok()) {
      ++stats_.swap_outs;
      stats_.bytes_out += bytes;
      if (auto it = trace_io_.find(b->trace); it != trace_io_.end()) it->second.bytes_out += bytes;
      stats_.staged_bytes += staged;
      b->extent = new_extent;
      b->nvme_current = b->version == version;
      // (Given, it goes even with Acquires waiting: they read it back.)
      const bool still_evictable = PinsOf(*b) == 0 && (b->waiters == 0 || b->given) &&
                                   b->nvme_current && b->home == Tier::kNvme;
      b->given = false;
      // (Removed meanwhile: its memory goes now unless pinned or waited
      // for, else at the last release, EraseIfDoneLocked.)
      if (still_evictable || (b->removed && !Held(*b))) {
        DropHostLocked(b);
        b->state = BlockState::kOnNvme;
      } else {
        b->state = BlockState::kResident;  // pinned meanwhile: stays
        // (Moved home to the host meanwhile: its new copy is not needed.)
        SettleOnHostLocked(b);
      }
      RelistLocked(*b);
    } else {
      ++stats_.io_errors;
      ++failed_writes_;
      last_write_error_ = absl::Status(
          status.code(), absl::StrCat("writing block ", id, " out: ", status.message()));
      b->state = BlockState::kResident;
      b->given = false;
      RelistLocked(*b);
      // (Retried as room is wanted: a full disk fails every block, often.)
      if (const int64_t held = write_failures_.Admit(absl::Now()); held >= 0) {
        LogWarning("swapper: writing block %d out failed, it stays in host memory: %s%s",
                   static_cast<int64_t>(id), status.ToString(), LogLimiter::Held(held));
      }
    }
  } else {
    --reads_in_flight_;
    stats_.read_nanos += nanos;
    if (status.ok()) {
      ++stats_.swap_ins;
      stats_.bytes_in += bytes;
      if (auto it = trace_io_.find(b->trace); it != trace_io_.end()) it->second.bytes_in += bytes;
      stats_.staged_bytes += staged;
      b->state = BlockState::kResident;
      RelistLocked(*b);
      b->nvme_current = true;
      // (A block moved home to the host, in memory now.)
      SettleOnHostLocked(b);
    } else {
      ++stats_.io_errors;
      DropHostLocked(b);  // external memory: the half-read pages go too
      b->state = BlockState::kOnNvme;
      RelistLocked(*b);
      b->prefetched = false;
      b->read_error = absl::Status(status.code(),
                                   absl::StrCat("swapping in block ", id, ": ", status.message()));
      ++b->failed_reads;
      // The operator's sign of a failing disk (the trainer gets the error).
      if (const int64_t held = read_failures_.Admit(absl::Now()); held >= 0) {
        LogWarning("swapper: swapping block %d in failed, its fetch or step fails: %s%s",
                   static_cast<int64_t>(id), status.ToString(), LogLimiter::Held(held));
      }
    }
  }
  --io_running_;
  changed_.SignalAll();
  EraseIfDoneLocked(b);
}

void Swapper::IoThread() {
  HostMemory staging;  // this thread's, for blocks moved through their file
  absl::MutexLock lock(&mu_);
  for (;;) {
    IoTask task;
    std::optional<uint64_t> trace;  // a transfer's (a free has none)
    // The next work that may go: a free, else a transfer the fair queue lets
    // go; one that waits for a trace behind it is looked at again when that
    // wait ends, or at the next Push or Done.
    for (;;) {
      if (!frees_.empty()) {
        task = std::move(frees_.front());
        frees_.pop_front();
        break;
      }
      if (!io_queue_.empty()) {
        const auto now = std::chrono::steady_clock::now();
        auto recheck = std::chrono::steady_clock::time_point::max();
        uint64_t flow;
        std::chrono::steady_clock::duration waited;
        std::optional<IoTask> next = io_queue_.Pop(now, &flow, &recheck, &waited);
        if (next.has_value()) {
          task = *std::move(next);
          trace = flow;
          if (auto it = trace_io_.find(flow); it != trace_io_.end()) {
            it->second.queued_nanos +=
                std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count();
          }
          // One Push may have let several go: the next thread looks too.
          if (!io_queue_.empty()) io_work_.Signal();
          break;
        }
        ++stats_.io_fair_waits;
        io_work_.WaitWithTimeout(&mu_, absl::FromChrono(recheck - now));
        continue;
      }
      if (stopping_) {  // and nothing left to do
        if (staging.size() != 0) space_->RemoveBuffer(staging.data(), staging.size());
        return;
      }
      io_work_.Wait(&mu_);
      if (frees_.empty() && io_queue_.empty() && !stopping_) ++stats_.idle_wakeups;
    }
    ++io_running_;
    const auto started = io_started_.insert(std::chrono::steady_clock::now());
    mu_.Unlock();
    task(staging);  // decrements io_running_ under the lock
    mu_.Lock();
    io_started_.erase(started);
    if (trace.has_value()) {
      io_queue_.Done(*trace, std::chrono::steady_clock::now());
      if (!io_queue_.empty()) io_work_.SignalAll();  // a transfer waiting for it may go
    }
  }
}

void Swapper::MoverThread() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    while (moves_.empty() && prefetches_.empty() && !stopping_) {
      // (Awake now and then to say a stalled transfer: the I/O threads
      // are the ones waiting on it.)
      const bool timed_out = move_work_.WaitWithTimeout(
          &mu_, std::min(absl::Seconds(5), absl::FromChrono(stalled_io_) / 2));
      WarnOfStalledIoLocked();
      if (!timed_out && moves_.empty() && prefetches_.empty() && !stopping_) {
        ++stats_.idle_wakeups;
      }
    }
    if (stopping_) return;
    Move move{0, MoveKind::kPrefetch};
    if (!moves_.empty()) {
      move = moves_.front();
      moves_.pop_front();
    } else {
      uint64_t trace;
      auto never = std::chrono::steady_clock::time_point::max();
      move = *prefetches_.Pop(std::chrono::steady_clock::now(), &trace, &never);
      prefetches_.Done(trace, std::chrono::steady_clock::now());
    }
    // WaitIdle may be satisfied now: a move found with nothing left to do
    // (its block removed, or read in by an Acquire meanwhile) ends below
    // without another signal.
    if (moves_.empty() && prefetches_.empty()) changed_.SignalAll();
    if (move.kind == MoveKind::kTrim) {
      mover_busy_ = true;
      absl::flat_hash_set<BlockId> tried;
      while (UsedAfterFreeingLocked() > pool_->limit()) {
        VictimKind kind = VictimKind::kFarthest;
        Block* victim = ChooseVictimLocked(/*restricted=*/false, 0, kNoTrace, tried, &kind);
        if (victim == nullptr) break;
        tried.insert(victim->id);
        CountVictimLocked(kind);
        EvictLocked(victim);
      }
      while (writes_in_flight_ > 0) {
        changed_.WaitWithTimeout(&mu_, absl::FromChrono(stalled_io_) / 2);
        WarnOfStalledIoLocked();
      }
      mover_busy_ = false;
      changed_.SignalAll();
      continue;
    }
    Block* b = FindLocked(move.id);
    if (b == nullptr) continue;
    --b->moves_queued;
    if (move.kind == MoveKind::kToHost) b->to_host_queued = false;
    if (b->state != BlockState::kOnNvme) continue;
    mover_busy_ = true;
    // Its pages still being freed (evicted a moment ago): once they are.
    while (b != nullptr && b->dropping) {
      changed_.WaitWithTimeout(&mu_, absl::FromChrono(stalled_io_) / 2);
      WarnOfStalledIoLocked();
      b = FindLocked(move.id);
    }
    if (b == nullptr || b->state != BlockState::kOnNvme) {
      mover_busy_ = false;
      changed_.SignalAll();
      continue;
    }
    // Making room may wait (the lock is released): the block may be read in
    // by an Acquire, or removed, meanwhile. It is looked up again after, by
    // id, rather than held with a waiter: a waiter would keep it from being
    // evicted once an Acquire made it resident, and could make a caller's
    // MakeRoom fail for want of a victim.
    const uint64_t bytes = NeedOf(*b);
    absl::Status status;
    if (move.kind == MoveKind::kPrefetch) {
      status = MakeRoomLocked(bytes, /*restricted=*/true, NextUseLocked(*b), b->trace);
    } else {
      status = MakeRoomLocked(bytes, /*restricted=*/false, 0, b->trace);
    }
    b = FindLocked(move.id);
    if (b == nullptr) {
      mover_busy_ = false;
      changed_.SignalAll();
      continue;
    }
    // (FindLocked found it: not removed.)
    if (status.ok() && b->state == BlockState::kOnNvme && !b->dropping) {
      status = pool_->Fits(NeedOf(*b))
                   ? StartReadLocked(b)
                   : absl::ResourceExhaustedError("the room made was taken meanwhile");
      if (status.ok() && move.kind == MoveKind::kPrefetch) {
        b->prefetched = true;
        ++stats_.prefetches;
      }
    }
    if (!status.ok() && move.kind == MoveKind::kToHost) {
      LogWarning("swapper: moving block %d to host memory: %s", static_cast<int64_t>(b->id),
                 status.ToString());
    }
    mover_busy_ = false;
    changed_.SignalAll();
  }
}

}  // namespace offload
