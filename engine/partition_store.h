// The partition store: the one owner of partition buffers.
//
// For each session it keeps a PartitionSet: the session's shared arena
// (shm_arena.h), out of which each partition's working parameters and
// gradient buffer are carved (the trainer maps it), and each partition's
// daemon-private fp32 master weights and Adam moments: three blocks in the
// swapper (swapper/swapper.h), which keeps them in the node's host pool or
// on NVMe. Every byte of host memory is charged to the one host pool (the
// arena's pages through Swapper::ReserveHost, which evicts cached state to
// make room) and given back when the set is destroyed.
//
// Placement of optimizer state: a session keeps `state_host_percent` of its
// optimizer-state bytes homed on the host (always resident), the rest on
// NVMe (brought in for the step, written back after it). A partition's state
// goes to the host while that keeps the host share at or under the
// percentage, in registration order. Each kind of state is cut into chunks
// of at most `state_chunk_elems` elements, one swapper block each, so that a
// step streams pieces much smaller than the pool, whatever the partitions'
// sizes (Adam is elementwise: updating chunk by chunk is bit-identical).
//
// Partition life cycle (per partition, under its set's lock):
//   registered -> ReturnGradients -> gradients ready -> BeginStep -> in a
//   step -> EndStep -> registered (step count advanced if the step applied).
// A partition in a step belongs to the optimizer, which runs outside every
// lock; Fetch and ReturnGradients of it wait until EndStep. One step per set
// runs at a time; a second BeginStep waits for the first to end.
//
// Errors: NOT_FOUND for a partition this set does not hold,
// INVALID_ARGUMENT for malformed specs and gradients that do not match the
// registration, ALREADY_EXISTS for a duplicate name, FAILED_PRECONDITION for
// a step with no gradients, RESOURCE_EXHAUSTED for the budget or the arena.
// A failed call changes nothing and holds no budget.
//
// Thread-safety: all methods are safe from any thread. Lock order: a set's
// lock (mu_) is a leaf; no other engine lock, nor the swapper's, is taken
// while it is held (calls into the swapper happen outside it), and it is
// never taken while another engine lock is held (ABSL_LOCKS_EXCLUDED
// below). Register and SetStateHostPercent hold the set's placement_mu_
// (before mu_) across their swapper calls, so they see each other whole.
#ifndef OFFLOADD_ENGINE_PARTITION_STORE_H_
#define OFFLOADD_ENGINE_PARTITION_STORE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "base/env.h"
#include "base/host_memory.h"
#include "cpu_adam/dtype.h"
#include "cpu_adam/optimizer.h"
#include "engine/shm_arena.h"
#include "engine/stats.h"
#include "swapper/swapper.h"

namespace offload {

struct PartitionSpec {
  std::string name;
  uint64_t numel = 0;
  DType param_dtype = DType::kFp32;
  DType grad_dtype = DType::kFp32;
};

struct ArenaRegion {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct PartitionInfo {
  uint64_t id = 0;
  std::string name;
  uint64_t numel = 0;
  DType param_dtype = DType::kFp32;
  DType grad_dtype = DType::kFp32;
  ArenaRegion params;
  ArenaRegion grads;
  uint64_t step = 0;
};

// One partition of a step, as BeginStep hands it to the step runner. The
// task's gradient and working-copy pointers are set; the optimizer-state
// pointers come from PinState.
struct StepItem {
  uint64_t id = 0;
  AdamTask task;
  // The master copy has never been written: initialise it from the working
  // copy before the update.
  bool init_master = false;
  // The first state chunk to update: not 0 when this step resumes one that
  // failed midway through this partition.
  uint64_t first_chunk = 0;
};

// One chunk of a partition's optimizer state, pinned in host memory for one
// update: elements [begin, end) of the partition.
struct StatePins {
  uint64_t begin = 0, end = 0;
  Swapper::Pin master, exp_avg, exp_avg_sq;
};

enum class StepOutcome {
  kApplied,  // the update happened: gradients consumed, step counts advance
  kSkipped,  // non-finite gradients: gradients consumed, nothing else changes
  kFailed,   // stopped before its end: gradients stay ready, and the next
             // step resumes at `next_chunk`
};

struct ItemOutcome {
  StepOutcome outcome = StepOutcome::kFailed;
  uint64_t next_chunk = 0;  // kFailed: chunks before it were updated
};

// INVALID_ARGUMENT unless `name` is 1 (0 with `may_be_empty`) to 256 bytes
// without control characters (a newline would forge rows in offloadctl's
// tables). The message names `what` but never echoes the name itself.
absl::Status CheckName(absl::string_view name, absl::string_view what, bool may_be_empty);

class PartitionStore;

// One session's partitions. Created by PartitionStore::CreateSet.
class PartitionSet {
 public:
  ~PartitionSet();
  PartitionSet(const PartitionSet&) = delete;
  PartitionSet& operator=(const PartitionSet&) = delete;

  // Registers partition `id` (chosen by the caller, unique daemon-wide).
  absl::StatusOr<PartitionInfo> Register(uint64_t id, const PartitionSpec& spec)
      ABSL_LOCKS_EXCLUDED(mu_);
  // An empty `ids` means every partition, in registration order. Waits for
  // the requested partitions to leave a running step.
  absl::StatusOr<std::vector<PartitionInfo>> Fetch(absl::Span<const uint64_t> ids)
      ABSL_LOCKS_EXCLUDED(mu_);
  // `numel` and `grad_dtype` describe what the trainer wrote.
  absl::Status ReturnGradients(uint64_t id, uint64_t numel, DType grad_dtype)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Pins every partition with gradients ready for one step (waiting for a
  // step in progress to end first). FAILED_PRECONDITION if there is none.
  // Must be followed by exactly one EndStep with the same items.
  absl::StatusOr<std::vector<StepItem>> BeginStep() ABSL_LOCKS_EXCLUDED(mu_);
  // Chunks of partition `id`'s optimizer state.
  uint64_t StateChunks(uint64_t id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Pins chunk `chunk` of the optimizer state of partition `id` (one of a
  // running step's), reading it in from NVMe if it is there. The swapper's
  // errors (DATA_LOSS for a failed read, RESOURCE_EXHAUSTED when the pool
  // cannot hold it).
  absl::StatusOr<StatePins> PinState(uint64_t id, uint64_t chunk) ABSL_LOCKS_EXCLUDED(mu_);
  // `outcomes[i]` is what happened to `items[i]`.
  void EndStep(absl::Span<const StepItem> items, absl::Span<const ItemOutcome> outcomes)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Changes the share of this set's optimizer state homed on the host and
  // re-homes its partitions as at registration (greedily, in registration
  // order). Returns at once: the swapper moves the blocks in the background
  // (to the host: read in and kept resident; to NVMe: written out when the
  // pool needs the room). INVALID_ARGUMENT outside [0, 100];
  // FAILED_PRECONDITION below 100 without an NVMe tier.
  absl::Status SetStateHostPercent(int percent) ABSL_LOCKS_EXCLUDED(mu_);

  uint64_t session_id() const { return session_id_; }
  int arena_fd() const { return arena_->fd(); }
  uint64_t arena_capacity() const { return arena_->capacity(); }
  uint64_t arena_bytes() const { return arena_->size(); }
  size_t partitions() const ABSL_LOCKS_EXCLUDED(mu_);
  // Optimizer-state bytes homed on the host and on NVMe.
  uint64_t state_bytes(Tier home) const ABSL_LOCKS_EXCLUDED(mu_);
  // Steps applied so far.
  uint64_t steps() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class PartitionStore;
  struct Partition;

  PartitionSet(uint64_t session_id, std::unique_ptr<ShmArena> arena, Swapper* swapper,
               Stats* stats, int state_host_percent, uint64_t state_chunk_elems);
  // Waits until none of `partitions` is in a step.
  void AwaitOutOfStep(absl::Span<Partition* const> partitions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Partition* Find(uint64_t id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // State chunks of a partition of `numel` elements.
  uint64_t ChunksOf(uint64_t numel) const;
  absl::StatusOr<Partition*> FindOrNotFound(uint64_t id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const uint64_t session_id_;
  const std::unique_ptr<ShmArena> arena_;
  Swapper* const swapper_;
  Stats* const stats_;
  const uint64_t state_chunk_elems_;

  // Serialises Register and SetStateHostPercent of this set, across their
  // calls into the swapper. Lock order: placement_mu_, then mu_ (briefly,
  // never across a swapper call), then the swapper's own.
  absl::Mutex placement_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  // Signalled when a step ends.
  absl::CondVar step_ended_;
  // Ordered by id, so that steps and fetch-all visit partitions in
  // registration order.
  std::map<uint64_t, std::unique_ptr<Partition>> partitions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> names_ ABSL_GUARDED_BY(mu_);
  bool stepping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t state_bytes_[2] ABSL_GUARDED_BY(mu_) = {0, 0};  // by Tier
  int state_host_percent_ ABSL_GUARDED_BY(mu_);
};

class PartitionStore {
 public:
  // Largest partition accepted (elements): keeps byte counts far from
  // overflow and catches garbage sizes.
  static constexpr uint64_t kMaxNumel = uint64_t{1} << 40;
  // The swapper's block id of one kind (0 master, 1 exp_avg, 2 exp_avg_sq)
  // of one chunk of a partition's optimizer state.
  static uint64_t StateBlock(uint64_t partition_id, uint64_t chunk, int kind) {
    return partition_id << 32 | chunk << 2 | static_cast<uint64_t>(kind);
  }

  // `env`, `swapper` and `stats` must outlive the store and every set it
  // made. `state_host_percent` is the node default for new sessions;
  // `state_chunk_elems` the size of a state chunk (at least 1024).
  PartitionStore(Env* env, Swapper* swapper, Stats* stats, uint64_t arena_capacity,
                 int state_host_percent, uint64_t state_chunk_elems);

  // A new, empty set for session `session_id` with an arena of the current
  // capacity, keeping `state_host_percent` (else the node default) of its
  // optimizer state on the host. INVALID_ARGUMENT outside [0, 100];
  // FAILED_PRECONDITION below 100 without an NVMe tier.
  absl::StatusOr<std::unique_ptr<PartitionSet>> CreateSet(
      uint64_t session_id, std::optional<int> state_host_percent = std::nullopt);

  // INVALID_ARGUMENT outside [0, 100], FAILED_PRECONDITION below 100
  // without an NVMe tier.
  static absl::Status CheckPlacement(int percent, bool has_nvme);

  // Applies to sets created afterwards (rounded down to the arena's
  // alignment).
  void SetArenaCapacity(uint64_t bytes);
  uint64_t arena_capacity() const { return arena_capacity_.load(std::memory_order_relaxed); }
  // Applies to sessions opened afterwards.
  void SetStateHostPercent(int percent) {
    state_host_percent_.store(percent, std::memory_order_relaxed);
  }

 private:
  // Constant after construction.
  Env* const env_;
  Swapper* const swapper_;
  Stats* const stats_;

  const uint64_t state_chunk_elems_;
  std::atomic<uint64_t> arena_capacity_;
  std::atomic<int> state_host_percent_;
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_PARTITION_STORE_H_
