// The swapper: moves blocks of bytes between the node's host pool and the
// NVMe tier, prefetches along the learned access order, and evicts by
// Belady's choice within the traces' shares of the pool. It knows nothing of sessions or
// partitions: the partition store names blocks by id, says where each rests (its home tier) and
// which access trace its uses belong to (an opaque id; the store passes the session). It owns its
// I/O threads; the host memory comes from the pool (host_pool.h), which bounds it.
//
// Memory: a block's bytes are a lease from the pool (Add), or memory the
// caller maps from a shared file, such as a session arena that a trainer
// maps too (AddExternal): the swapper then charges the pool for its pages
// while resident, writes them out from where they are, frees them
// (MADV_REMOVE) and reads them back into the same addresses. Shared memory
// on the system's small pages is moved through its file instead (pread and
// pwrite), via a staging buffer on huge pages per I/O thread (4 MiB, or one
// stripe where stripes are larger; registered with io_uring as a fixed
// buffer where RLIMIT_MEMLOCK allows), where the kernel gives such writes
// small pages too (SharedFileWritesMayGetLargePages): direct I/O into fresh
// 4 KiB shared pages maps each one, which costs far more than the copy
// (benches/RESULTS.md, trace_replay).
//
// Placement: a block homed on the host is always resident and never
// evicted. A block homed on NVMe rests there and is cached in the pool while
// in use: brought in when acquired (or prefetched), written out when room is
// needed, dropped without I/O when its NVMe copy is still current.
//
// Each block is in one of four states; any number of callers may pin it:
//   1. kResident:   its bytes are in host memory (a pool lease).
//   2. kWritingOut: an eviction writes it to NVMe. The host copy stays valid:
//                   an Acquire pins it, and the block then stays resident
//                   (the write only refreshes the NVMe copy); but one given
//                   for the turn's holder (eviction, 2 below) goes: an
//                   Acquire waits for the write and reads it back.
//   3. kOnNvme:     only the NVMe copy exists (or none yet: a block never
//                   written is zeros); it holds no host memory.
//   4. kReadingIn:  a swap-in reads it into a fresh lease. Every Acquire
//                   (and CopyOut) of the block waits for this one read;
//                   nobody sees half-read bytes. A failed read frees the lease, goes back
//                   to kOnNvme with the NVMe copy intact, and fails the
//                   waiting Acquires (DATA_LOSS for checksum or EIO).
// Eviction: only unpinned, resident, NVMe-homed blocks. Trace distances
// count each trace's own uses, so between traces they say little; the
// victim is, in this order (pool_shares.h says when a trace is idle, when
// turns are taken and when a trace is ahead):
//   1. an idle trace's block (none of its blocks held or waited for, none
//      acquired for a second or two of its iterations): its uses are not
//      coming soon, however near in its own order; its room goes to the
//      traces at work;
//   2. where traces take turns (two or more at work at once want more
//      room than they hold), a block of a trace whose turn it is not: the
//      pool goes to one of them at a time, the least served, for a few of
//      its iterations, rather than part of it to each, which lets every one
//      stream from NVMe at the disk's pace (or one take back at once what
//      it gives). A block so given for the holder is gone for good: its
//      trace's Acquire during its write-out waits and reads it back;
//   3. a block of a trace whose NVMe-homed blocks hold more of the pool
//      than three quarters, or than its weight's share and half the rest,
//      whichever is more (a slow trace, never ahead of its share of the
//      traffic, must not take all of it; the turn's holder may, for its
//      turn);
//   4. a block of a trace ahead of its share of the pool's traffic (the
//      bytes of NVMe-homed blocks it acquired over its weight, SetIoWeight,
//      more than PoolShares::Slack() past the least of the traces using the
//      pool; of several, the farthest ahead first): traces that want more
//      than the pool holds get its traffic, and the updates it serves, by
//      weight;
//   5. the block whose next use by its trace is farthest (Belady); blocks
//      whose trace is not being followed count as never used again, least
//      recently used first.
// The choice looks at each trace's first candidate in an index kept per
// trace (victim_index.h: its blocks by next use, its holds and room, told of
// every change of a block's holds, state, home, removal or last use), not
// at every block in the pool.
// A failed write-out (ENOSPC, EIO) leaves the block resident, and its older
// NVMe copy intact (copy-on-write rewrites); the next victim is tried.
// Prefetch: after each Acquire in order (Use), the next prefetch_depth blocks
// along the trace that are not resident (at most prefetch_bytes) are read in
// by the mover thread, evicting only blocks of traces that give more room
// than the prefetching one (idle, out of turn, over, farther ahead, in that
// order), or its own and its equals' needed later than the one prefetched;
// never of traces that give less. Only uses of NVMe-homed blocks enter a
// trace: the others are never read in nor evicted, and may vary between
// iterations where these do not (their Acquires still refill the prefetch
// window).
// I/O order: the I/O threads free external pages first, then take swap-ins
// and write-outs by their blocks' traces' weights (SetIoWeight,
// fair_queue.h); the mover's prefetches go in the same order.
// Memory: the pool's limit is never exceeded. Asking to pin more than the
// pool holds at once is RESOURCE_EXHAUSTED with the numbers.
//
// Thread-safety: all methods are safe from any thread. One lock (mu_)
// guards the block table; I/O runs on the I/O threads without it. A Pin must
// not outlive the swapper.
// Without the lock: a block homed on the host, resident, of a trace with no
// block homed on NVMe (a session whose state is all on the host) is pinned,
// released and discarded without mu_ (a reader lock on the table and its
// own counter): such a session's fetches and steps never wait for another
// session's swapping, which holds mu_ to choose victims, start and finish
// its transfers and wait for room. Its uses predict nothing and it has
// nothing to prefetch: it takes no part in the learned orders, the LRU or
// the pool's shares (as a block homed on the host already took none but
// the prefetch window's refill, which such a trace does not have).
#ifndef OFFLOADD_SWAPPER_SWAPPER_H_
#define OFFLOADD_SWAPPER_SWAPPER_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "base/host_memory.h"
#include "base/log.h"
#include "nvme/swap_space.h"
#include "swapper/access_trace.h"
#include "swapper/fair_queue.h"
#include "swapper/host_pool.h"
#include "swapper/pool_shares.h"
#include "swapper/swapper_options.h"
#include "swapper/victim_index.h"

namespace offload {

enum class Tier { kHost, kNvme };
const char* TierName(Tier tier);

enum class BlockState { kResident, kWritingOut, kOnNvme, kReadingIn };
const char* BlockStateName(BlockState state);

// Memory the caller maps from a shared file (a memfd), for AddExternal.
struct ExternalMemory {
  std::byte* data = nullptr;  // the shared mapping
  // The size of the pages the caller laid the memory out for: 0 for the
  // system's page, or the huge page size where the mapping asks for huge
  // pages.
  uint64_t page_bytes = 0;
  // The file `data` maps (open until Remove returns) and where `data`
  // lies in it, or -1: then every transfer goes through the mapping.
  int fd = -1;
  uint64_t file_offset = 0;
};

struct SwapperStats {
  uint64_t blocks = 0;
  uint64_t traces = 0;          // access orders kept (one per trace: a session)
  uint64_t resident_bytes = 0;  // blocks with host memory (any state but kOnNvme)
  uint64_t pinned_bytes = 0;
  uint64_t host_home_bytes = 0;  // blocks homed on the host
  // What the pool charges for them (pages rounded up: an arena block's
  // whole huge pages), where resident.
  uint64_t host_home_charged_bytes = 0;
  uint64_t nvme_home_bytes = 0;  // blocks homed on NVMe
  uint64_t acquires = 0;
  uint64_t unlocked_pins = 0;     // of them, taken without the lock (a session all on the host)
  uint64_t hits = 0;              // resident when acquired
  uint64_t waited_reads = 0;      // found a swap-in (usually a prefetch) in flight
  uint64_t misses = 0;            // had to start a swap-in
  uint64_t prefetches = 0;        // swap-ins started by prefetch
  uint64_t prefetch_used = 0;     // ... and acquired before being evicted
  uint64_t prefetch_wasted = 0;   // ... evicted unused
  uint64_t prefetch_pending = 0;  // ... resident, not acquired yet
  uint64_t swap_ins = 0, swap_outs = 0, clean_drops = 0, zero_fills = 0;
  uint64_t bytes_in = 0, bytes_out = 0;
  uint64_t read_nanos = 0, write_nanos = 0;  // summed over I/O threads
  uint64_t io_errors = 0;
  uint64_t io_queue = 0;                            // I/O tasks queued or running
  uint64_t io_oldest_running_seconds = 0;           // how long the oldest running one has run
  uint64_t relearned = 0;                           // trace orders re-learned
  uint64_t order_passes = 0;                        // passes without a step (AccessTrace)
  uint64_t discards = 0;                            // blocks whose bytes were dropped as dead
  uint64_t copy_outs = 0;                           // CopyOut calls served from the NVMe copy
  uint64_t copy_out_bytes = 0, copy_out_nanos = 0;  // ... their reads (not in bytes_in)
  uint64_t staged_bytes = 0;  // of bytes_in and bytes_out, moved through staging
  uint64_t idle_wakeups = 0;  // an idle I/O thread or the mover woken with nothing to do
  // A caller waiting in the swapper (for room, for a read or a write-out in
  // flight) woken to look again: each wake counted.
  uint64_t waiter_wakeups = 0;
  // An I/O thread waited with transfers queued: each waits for a trace
  // behind it by its weight (SetIoWeight) that is still using the disk.
  uint64_t io_fair_waits = 0;
  uint64_t idle_evictions = 0;  // victims chosen: of an idle trace (before any other)
  // ... of a trace that gives room by the shares: out of turn, over its room
  // or ahead (2 to 4 above)
  uint64_t share_evictions = 0;
  uint64_t turns = 0;    // the pool's turns begun (PoolShares::Turn)
  uint64_t repages = 0;  // blocks moved home to the host, copied to a lease of its pages

  // What happened since `earlier` (a snapshot from the same swapper): the
  // counters' differences; the gauges (blocks, bytes resident, pinned and
  // placed, pending prefetches, the I/O queue) as they are now.
  SwapperStats Since(const SwapperStats& earlier) const;
};

class Swapper {
 private:
  struct Block;

 public:
  using BlockId = uint64_t;

  // A pinned, resident block. Movable; unpins on destruction.
  class Pin {
   public:
    Pin() = default;
    Pin(Pin&& other) noexcept
        : swapper_(std::exchange(other.swapper_, nullptr)),
          id_(other.id_),
          data_(std::exchange(other.data_, nullptr)),
          size_(std::exchange(other.size_, 0)),
          fast_(std::exchange(other.fast_, nullptr)) {}
    Pin& operator=(Pin&& other) noexcept;
    Pin(const Pin&) = delete;
    Pin& operator=(const Pin&) = delete;
    ~Pin() { Reset(); }

    std::byte* data() const { return data_; }
    uint64_t size() const { return size_; }
    BlockId id() const { return id_; }
    void Reset();

   private:
    friend class Swapper;
    Pin(Swapper* s, BlockId id, std::byte* data, uint64_t size, Block* fast = nullptr)
        : swapper_(s), id_(id), data_(data), size_(size), fast_(fast) {}
    Swapper* swapper_ = nullptr;
    BlockId id_ = 0;
    std::byte* data_ = nullptr;
    uint64_t size_ = 0;
    Block* fast_ = nullptr;  // taken without the lock: its block (kept by the pin)
  };

  // `pool` must outlive the swapper; `space` too, or be null (no NVMe tier:
  // every block must then be homed on the host).
  static absl::StatusOr<std::unique_ptr<Swapper>> Create(const SwapperOptions& options,
                                                         HostPool* pool, SwapSpace* space);
  // Finishes queued I/O, stops the threads, frees every block.
  ~Swapper();
  Swapper(const Swapper&) = delete;
  Swapper& operator=(const Swapper&) = delete;

  // Add of a block whose bytes a kept session left in the pool's file at
  // `offset` (HostPool::Claim): resident with them, nothing copied; homed
  // on NVMe, it is written there when evicted. The pool's errors.
  absl::Status AddKept(BlockId id, uint64_t bytes, Tier home, uint64_t trace, uint64_t offset)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A new block of `bytes` zeros homed at `home`, its uses traced in
  // `trace`. ALREADY_EXISTS, INVALID_ARGUMENT (0 bytes), FAILED_PRECONDITION
  // (NVMe home without an NVMe tier), RESOURCE_EXHAUSTED (host home that the
  // pool cannot hold).
  absl::Status Add(BlockId id, uint64_t bytes, Tier home, uint64_t trace) ABSL_LOCKS_EXCLUDED(mu_);
  // As Add, but the bytes are the caller's: `memory.data` is a shared
  // mapping of a file (a memfd) that stays mapped until Remove(id) returns.
  // Its pages are freed now: the block starts as zeros, like one from Add.
  // `data` is aligned to `memory.page_bytes`, the block spans `bytes`
  // rounded up to it, and that span is what the pool is charged while the
  // block is resident and what is freed when it leaves (a huge page is held
  // and freed whole, so the caller puts nothing else in a page a block ends
  // in). With `memory.fd` and small pages, transfers go through the file
  // (see this file's opening comment). INVALID_ARGUMENT for unaligned or
  // private memory, or a page size that is not a power-of-two multiple of
  // the system's.
  absl::Status AddExternal(BlockId id, const ExternalMemory& memory, uint64_t bytes, Tier home,
                           uint64_t trace) ABSL_LOCKS_EXCLUDED(mu_);

  // Frees the block wherever it lives; a pinned block or one in flight as
  // soon as that ends. An external block's pages are freed, and Remove
  // returns only once no I/O can touch its memory any more (it must not be
  // pinned). Unknown ids are ignored.
  void Remove(BlockId id) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes every block of `ids` as Remove does (the missing ones are no
  // change), for a caller that frees its external blocks' memory itself, at
  // once (a session's whole arena): their pages are not freed block by
  // block (each an I/O thread's round trip, two context switches: 73 us a
  // block measured), and their pool charges move to `charges`, for the
  // caller to give back with ReleaseCharges once that memory is gone
  // (counted as being freed meanwhile, so that making room waits for them
  // rather than evicting others). The lock is let go between batches, and
  // the pool blocks' leases are given back after each batch without it.
  void RemoveAll(absl::Span<const BlockId> ids, std::vector<PoolCharge>* charges)
      ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseCharges(std::vector<PoolCharge>* charges) ABSL_LOCKS_EXCLUDED(mu_);

  // The block's bytes are dead (consumed gradients): its NVMe copy is
  // freed and, if homed on NVMe, its host memory given back, with no I/O;
  // it next reads as zeros. A block homed on the host keeps its memory and
  // whatever bytes it holds. FAILED_PRECONDITION (and nothing changes)
  // while it is pinned or in flight; NOT_FOUND for an unknown id.
  absl::Status Discard(BlockId id) ABSL_LOCKS_EXCLUDED(mu_);

  // What a use is to its trace's iteration (Acquire): whether it enters
  // the learned order, and how it counts in the trace's share of the pool's
  // traffic (pool_shares.h).
  enum class Use {
    // The iteration's work, in its order: recorded in the trace (a block
    // homed on NVMe only), prefetch ahead; counted once an iteration.
    kInOrder,
    // The iteration's work out of its order (gradients measured in the
    // background, which interleave differently every iteration: recorded,
    // they would make the order look changed and stop prefetch for the
    // iteration): not recorded; counted once an iteration, as in order.
    kBackground,
    // Work beside the iteration's (a checkpoint's reads): not recorded;
    // counted each time (a burst is paid for in room until the others
    // catch up).
    kExtra,
  };
  // Makes the block resident and pins it until the Pin goes. With
  // `for_write` the caller will change its bytes (the NVMe copy stops being
  // current). `use`: above.
  absl::StatusOr<Pin> Acquire(BlockId id, bool for_write, Use use = Use::kInOrder)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Copies the block's bytes as they are when it begins into `dst` and
  // returns how many there are, taking no pool
  // memory and leaving the block where it is: from host memory if it is
  // resident (or being written out), else straight from its NVMe copy
  // (checksum verified; zeros if it has none), waiting for a swap-in in
  // flight. For a reader that must not depend on room in the pool (a
  // checkpoint of a session whose pool is full of held blocks). While it
  // runs the block is not evicted, discarded or freed. Not traced. `dst`
  // must be aligned to the NVMe tier's alignment and span the block's bytes
  // rounded up to it (CopyOutBytes), else INVALID_ARGUMENT; NOT_FOUND for an
  // unknown or removed block; a failed read's code (DATA_LOSS for EIO or a
  // checksum mismatch) naming the block.
  absl::StatusOr<uint64_t> CopyOut(BlockId id, absl::Span<std::byte> dst) ABSL_LOCKS_EXCLUDED(mu_);
  // The bytes a CopyOut buffer for a block of `bytes` must span.
  uint64_t CopyOutBytes(uint64_t bytes) const;

  // The end of one iteration of `trace` (the optimizer step).
  void EndIteration(uint64_t trace) ABSL_LOCKS_EXCLUDED(mu_);
  // `trace`'s blocks are all removed and none will come: its learned
  // access order goes (a session's, when the session goes; kept, they add
  // up on a daemon that serves many sessions).
  void ForgetTrace(uint64_t trace) ABSL_LOCKS_EXCLUDED(mu_);
  // The weight of `trace`'s blocks' I/O (>= 1; 1 unless set) when blocks of
  // several traces wait for the I/O threads: they take the threads, and so
  // the disk, in proportion to their traces' weights (fair_queue.h), the
  // bytes of each swap-in and write-out counted to its block's trace.
  // The mover's prefetches go by the same weights. ForgetTrace forgets it.
  void SetIoWeight(uint64_t trace, int64_t weight) ABSL_LOCKS_EXCLUDED(mu_);
  // What `trace`'s blocks moved so far (until ForgetTrace).
  struct TraceIo {
    uint64_t bytes_in = 0, bytes_out = 0;  // swapped in, written out
    int64_t queued_nanos = 0;              // their transfers' time queued for an I/O thread
    uint64_t evictions = 0;                // its blocks evicted (written out or dropped)
    uint64_t room = 0;                     // the pool's room its blocks hold now
  };
  TraceIo IoOf(uint64_t trace) const ABSL_LOCKS_EXCLUDED(mu_);

  // Changes where the block rests; returns at once, the swapper moves it in
  // the background (to the host: read in and kept; to NVMe: written out when
  // room is needed). A block moved to the host while in memory, on a lease
  // asking for other pages than SwapperOptions::host_home_pages, is copied
  // to a lease of those once nothing uses it (at the last Pin's release;
  // stats `repages`).
  absl::Status SetHome(BlockId id, Tier home) ABSL_LOCKS_EXCLUDED(mu_);

  bool has_nvme() const { return space_ != nullptr; }
  // Bytes the NVMe tier can still take as blocks homed there (0 without
  // one); a snapshot.
  uint64_t NvmeRoom() const ABSL_LOCKS_EXCLUDED(mu_);
  const HostPool& pool() const { return *pool_; }

  void SetPrefetch(int64_t depth, int64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  // After the pool's limit was lowered below its use: evicts unpinned
  // NVMe-homed blocks in the background until use is within the limit again
  // (or nothing more can go). Returns at once.
  void Trim() ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<BlockState> State(BlockId id) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<Tier> Home(BlockId id) const ABSL_LOCKS_EXCLUDED(mu_);
  SwapperStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

  // Waits until no move, prefetch or I/O is queued or running. Tests and
  // benchmarks only.
  void WaitIdle() ABSL_LOCKS_EXCLUDED(mu_);

  // Runs before each I/O the I/O threads perform, outside the lock (tests:
  // injected delays make races deterministic). `is_write` tells the kind.
  void SetIoHookForTesting(std::function<void(BlockId, bool is_write)> hook)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The clock that tells idle traces and shares (PoolShares); I/O timing
  // keeps the real one. Called under the swapper's lock: it must not call
  // back into the swapper.
  void SetClockForTesting(std::function<std::chrono::steady_clock::time_point()> clock)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Where eviction's index (VictimIndex) disagrees with the blocks: none
  // unless a change of a block's holds, state, home, removal or last use
  // forgot to tell it (tests check it).
  std::vector<std::string> IndexErrorsForTesting() const ABSL_LOCKS_EXCLUDED(mu_);
  // From here on every choice of a victim is checked (slow): the index
  // agrees with the blocks, and the victim ranks (VictimKey) as the one a
  // walk over every block (the choice without the index) would have chosen
  // (among equals, either may go). VictimMismatchForTesting: how
  // many choices failed either, and how the first did ("" if none).
  void CheckVictimsForTesting() ABSL_LOCKS_EXCLUDED(mu_);
  std::string VictimMismatchForTesting() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  enum class MoveKind { kPrefetch, kToHost, kTrim };
  struct Move {
    BlockId id;
    MoveKind kind;
  };

  Swapper(const SwapperOptions& options, HostPool* pool, SwapSpace* space);

  // Add, AddExternal and (with `kept`, the offset in the pool's file)
  // AddKept.
  absl::Status AddBlock(BlockId id, uint64_t bytes, const ExternalMemory& external, uint64_t span,
                        Tier home, uint64_t trace, std::optional<uint64_t> kept = std::nullopt)
      ABSL_LOCKS_EXCLUDED(mu_);
  Block* FindLocked(BlockId id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static std::byte* DataOf(const Block& b);
  // The pool memory the block needs while resident (an external block's
  // whole pages).
  static uint64_t NeedOf(const Block& b);
  static uint64_t ChargedOf(const Block& b);
  // Gives the block host memory (a lease, or the charge for its external
  // pages) from the pool, which must fit it. Its bytes are zeros unless
  // `contents`: kOverwritten where a read from NVMe fills the whole lease
  // (a spare's pages will do: HostPool).
  absl::Status TakeHostLocked(Block* b, HostPool::Contents contents = HostPool::Contents::kZeroed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives the block's host memory back. External pages are freed by an I/O
  // thread, outside the lock (the block is `dropping` until then);
  // DropHostNowLocked frees them at once.
  void DropHostLocked(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropHostNowLocked(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishDrop(BlockId id) ABSL_LOCKS_EXCLUDED(mu_);
  // Pinned or waited for.
  static bool Held(const Block& b);
  // Homed on NVMe and in the pool (resident or being read in): room that
  // eviction can give.
  static bool HoldsRoom(const Block& b);
  bool BusyLocked(const Block& b) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The pool's use less what is being freed (freeing_bytes_), never below
  // zero.
  uint64_t UsedAfterFreeingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseIfDoneLocked(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleasePin(BlockId id) ABSL_LOCKS_EXCLUDED(mu_);
  // After a pin of `b` went (under the lock, or the last one without it):
  // tells the index, repages, erases a removed block, wakes who waits for
  // room where the block may be evicted now.
  void ReleasedLocked(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A block homed on the host whose lease asked for other pages than
  // host_home_pages_ (moved home while in memory), resident and used by no
  // one: copied to a lease of those (where the pool has room for the copy).
  void RepageIfIdleLocked(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A caller's wait for the swapper's state to change (changed_), counted.
  void WaitForChangeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Pins without the lock (see the top): pins `id` into `*pin` and returns
  // true where its block may be pinned so now, else false (then Acquire
  // goes through the lock).
  bool TryAcquireFast(BlockId id, Pin* pin) ABSL_LOCKS_EXCLUDED(mu_, table_mu_);
  // A pin taken without the lock goes; the last one of a block that may no
  // longer be pinned so does what ReleasePin does, under the lock.
  void ReleaseFastPin(Block* b, BlockId id) ABSL_LOCKS_EXCLUDED(mu_, table_mu_);
  // Discard without the lock, where the block may be pinned so (its bytes
  // are all it has: nothing to free); nullopt: through the lock.
  std::optional<absl::Status> TryDiscardFast(BlockId id) ABSL_LOCKS_EXCLUDED(mu_, table_mu_);
  // Discard's refusal of a block pinned or in flight.
  static absl::Status BusyDiscardError(BlockId id);
  // Whether `b` may be pinned without the lock now; set where that may
  // have changed. Cleared (before anything that needs the block unpinned
  // looks at its pins) where it stops being so: clearing it takes the
  // count of the pins so taken in the same step (Block::fast).
  void UpdateFastLocked(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A block homed on the host, resident, that nothing may read from NVMe
  // (no waiter: a CopyOut reading its copy holds one) keeps no NVMe copy:
  // the tier's room was given back when it moved home, and a block without
  // one may be pinned without the lock.
  void DropNvmeCopyLocked(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // DropNvmeCopyLocked, then UpdateFastLocked: where a block may have come
  // home to the host, or the last reader of its NVMe copy gone.
  void SettleOnHostLocked(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks homed on NVMe of `trace`, counted by `delta`: its blocks on the
  // host may be pinned without the lock only while it has none.
  void CountNvmeHomeLocked(uint64_t trace, int delta) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pins of every kind (taken under the lock and without it).
  static int PinsOf(const Block& b);
  // Inserts or erases a block of the table (readers without mu_ hold
  // table_mu_).
  void InsertLocked(std::unique_ptr<Block> b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseLocked(BlockId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Until `bytes` more fit in the pool: evicts victims (only ones next used
  // later than `farther_than` uses from now when `restricted`), waiting for
  // I/O in flight (write-outs free memory; swap-ins, and CopyOuts ending,
  // make new victims).
  // Nothing more to evict: the failed write-out's error if one failed in
  // this call, else RESOURCE_EXHAUSTED with the numbers; UNAVAILABLE when
  // `restricted` finds no victim.
  // `for_trace`: whose block the room is for (kNoTrace: nobody's, a trim).
  absl::Status MakeRoomLocked(uint64_t bytes, bool restricted, uint64_t farther_than,
                              uint64_t for_trace) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static constexpr uint64_t kNoTrace = ~uint64_t{0};
  // Why a victim was chosen (the order at the top of this file).
  enum class VictimKind { kIdle, kOutOfTurn, kAhead, kFarthest };
  // The next victim (null: none), its kind in *kind. Excludes `tried`
  // (victims this MakeRoom already wrote out: one whose write failed is not
  // tried again).
  Block* ChooseVictimLocked(bool restricted, uint64_t farther_than, uint64_t for_trace,
                            const absl::flat_hash_set<BlockId>& tried, VictimKind* kind)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why one victim goes before another: (idle, out of turn, over its room,
  // lead, next use, ~last use), the greatest first (ChooseVictimLocked).
  using VictimKey = std::tuple<bool, bool, bool, uint64_t, uint64_t, uint64_t>;
  // The same choice by a walk over every block (CheckVictimsForTesting).
  std::optional<VictimKey> WalkForVictimLocked(bool restricted, uint64_t farther_than,
                                               uint64_t for_trace,
                                               const absl::flat_hash_set<BlockId>& tried,
                                               PoolShares::Clock::time_point now,
                                               uint64_t holder) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::string> IndexErrorsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What eviction sees of the block now (VictimIndex).
  static VictimIndex::Standing StandingOf(const Block& b);
  const AccessTrace* OrderOfLocked(uint64_t trace) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the index the block's standing: after every change of its pins,
  // waiters, state, home, removal or last use, before the lock is let go
  // (or waited on).
  void RelistLocked(const Block& b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CountVictimLocked(VictimKind kind) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  uint64_t NextUseLocked(const Block& b) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EvictLocked(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Precondition: kOnNvme and the pool fits it. Leases memory, then fills it
  // with zeros (no NVMe copy yet) or queues the read.
  absl::Status StartReadLocked(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SchedulePrefetchLocked(uint64_t trace) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RoomError(uint64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // An I/O thread's work; `staging` is the thread's staging buffer (empty
  // until first needed).
  using IoTask = std::function<void(HostMemory& staging)>;
  // Queues `b`'s swap-in or write-out (RunIo), its bytes counted to its
  // trace (a write-out never waits for a heavier trace: that trace may be
  // waiting for the room it makes).
  void QueueIoLocked(const Block& b, bool is_write) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunIo(BlockId id, bool is_write, HostMemory& staging) ABSL_LOCKS_EXCLUDED(mu_);
  // The block's bytes to or from NVMe through `staging` and its file.
  absl::Status StagedIo(BlockId id, int fd, uint64_t file_offset, uint64_t bytes, uint64_t* extent,
                        bool is_write, HostMemory& staging);
  void IoThread() ABSL_LOCKS_EXCLUDED(mu_);
  void MoverThread() ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  HostPool* const pool_;
  SwapSpace* const space_;
  // What the NVMe tier can hold, and what blocks homed there take of it
  // (each rounded to the tier's alignment): a block the tier could not hold
  // is refused when it is homed there (AddBlock, SetHome), not when its
  // write-out fails steps later.
  const uint64_t nvme_capacity_;
  uint64_t nvme_homed_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t NvmeFootprint(uint64_t bytes) const;
  // Counts `bytes` more homed on NVMe, or RESOURCE_EXHAUSTED naming the
  // tier's room.
  absl::Status HomeOnNvmeLocked(BlockId id, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Each I/O thread's staging buffer (whole stripes; allocated on first use).
  const uint64_t staging_bytes_;
  const Pages host_home_pages_;  // SwapperOptions::host_home_pages

  mutable absl::Mutex mu_;
  // Signalled on every change of a block's state, of the queues, of room:
  // what callers (and the mover, mid-move) wait for.
  absl::CondVar changed_;
  // What the idle I/O threads and the idle mover wait for: work in their
  // queue, or the end. Apart from changed_ because a change of a block's
  // state happens on every pin and unpin, tens of thousands of times a
  // second under ZeRO-3 fetches, and waking every idle worker for each
  // (they find nothing to do) took both cores of a small node, a wake-up
  // at a time, from the very calls being served.
  absl::CondVar io_work_;
  absl::CondVar move_work_;
  // Changed under mu_ and table_mu_ both; read under either (the paths
  // without the lock read it under table_mu_, as readers).
  absl::flat_hash_map<BlockId, std::unique_ptr<Block>> blocks_;
  mutable absl::Mutex table_mu_ ABSL_ACQUIRED_AFTER(mu_);
  // Blocks homed on NVMe by trace (CountNvmeHomeLocked).
  absl::flat_hash_map<uint64_t, uint64_t> nvme_blocks_ ABSL_GUARDED_BY(mu_);
  // Counted without the lock, added to the stats.
  std::atomic<uint64_t> fast_hits_{0};
  std::atomic<uint64_t> fast_discards_{0};
  // Eviction's view of the blocks: which are held, the room each trace's
  // blocks hold, the candidates by next use (RelistLocked keeps it).
  VictimIndex victims_ ABSL_GUARDED_BY(mu_);
  // ChooseVictimLocked's scratch (kept so that an eviction does not
  // allocate).
  std::vector<uint64_t> victim_traces_ ABSL_GUARDED_BY(mu_);
  bool check_victims_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t victim_mismatches_ ABSL_GUARDED_BY(mu_) = 0;
  std::string first_victim_mismatch_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, AccessTrace> traces_ ABSL_GUARDED_BY(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;          // LRU time, one tick per Acquire
  uint64_t freeing_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // charged to write-outs in flight
  uint64_t writes_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reads_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  // CopyOut reads: their blocks cannot be evicted until they end.
  uint64_t copy_outs_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t failed_writes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status last_write_error_ ABSL_GUARDED_BY(mu_);
  int64_t prefetch_depth_ ABSL_GUARDED_BY(mu_);
  int64_t prefetch_bytes_ ABSL_GUARDED_BY(mu_);
  // The mover's work: moves to the host and trims in order, first; then
  // prefetches, in the order of their traces' weights (SetIoWeight; the
  // mover is one thread: a prefetch waiting for room still holds up those
  // behind it).
  std::deque<Move> moves_ ABSL_GUARDED_BY(mu_);
  FairQueue<Move> prefetches_ ABSL_GUARDED_BY(mu_){/*anticipate=*/false};
  bool mover_busy_ ABSL_GUARDED_BY(mu_) = false;
  // The I/O threads' work: first the frees of external pages (no I/O, and
  // they make room), then the transfers, by their traces' weights.
  std::deque<IoTask> frees_ ABSL_GUARDED_BY(mu_);
  FairQueue<IoTask> io_queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, TraceIo> trace_io_ ABSL_GUARDED_BY(mu_);
  // Which traces are at work, and how far ahead of its share of the pool
  // each is (eviction).
  PoolShares pool_shares_ ABSL_GUARDED_BY(mu_);
  std::function<std::chrono::steady_clock::time_point()> clock_for_testing_ ABSL_GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point SharesNowLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t io_running_ ABSL_GUARDED_BY(mu_) = 0;
  // When each running I/O task began (the oldest first).
  std::multiset<std::chrono::steady_clock::time_point> io_started_ ABSL_GUARDED_BY(mu_);
  const std::chrono::seconds stalled_io_;  // SwapperOptions::stalled_io_seconds
  // Says a transfer running longer than stalled_io_ (checked by whoever
  // waits: the mover, a fetch waiting for a block).
  void WarnOfStalledIoLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The log lines a failing or stalled disk repeats, each at most so often.
  LogLimiter write_failures_{absl::Seconds(10)};
  LogLimiter read_failures_{absl::Seconds(10)};
  LogLimiter stalled_{absl::Minutes(1)};
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void(BlockId, bool)> io_hook_ ABSL_GUARDED_BY(mu_);
  SwapperStats stats_ ABSL_GUARDED_BY(mu_);

  std::vector<std::thread> io_threads_;
  std::thread mover_;
};

}  // namespace offload

#endif  // OFFLOADD_SWAPPER_SWAPPER_H_
