// The partition store: one session's partitions, the one owner of their
// buffers (PartitionStoreFactory makes one per session, with the node's
// defaults).
//
// It keeps the session's shared arena (shm_arena.h), out of which each
// partition's working parameters and gradient buffer are carved (the trainer
// maps them), and each partition's daemon-private fp32 master weights and
// Adam moments. Every kind of data of
// every partition is cut into chunks of at most `state_chunk_elems`
// elements, and every chunk is one block of the swapper (swapper/swapper.h):
// parameters and gradients as external blocks over the arena's pages, the
// optimizer state as blocks the swapper allocates. The swapper keeps each
// in the node's one host pool or on NVMe, so that whatever the sessions'
// sizes, offloadd's memory stays within the pool; a step streams pieces
// much smaller than the pool (Adam is elementwise: updating chunk by chunk
// is bit-identical).
//
// Placement: per kind (parameters, gradients, optimizer state) a session
// keeps a percentage of its bytes homed on the host (always resident), the
// rest on NVMe (cached in the pool while in use). A partition's data of a
// kind goes to the host while that keeps the kind's host share at or under
// the percentage, in registration order; a change re-homes partitions the
// same way and the swapper moves them in the background.
//
// Residency contract with the trainer: a partition's parameters are in the
// arena, readable at the offsets PartitionInfo names, only while the
// trainer holds them. Register and Fetch hold them (Fetch with `grads` also
// holds the gradient buffer, for writing); Release lets them go;
// ReturnGradients hands the gradient buffer back. Held data is never
// evicted; released data may be, and its pages then leave the arena (they
// read as zeros in the trainer's mapping) until the next hold brings them
// back. Parameters change only in a step (or through a `writable` hold).
// After a step consumed them, gradient buffers hold no defined values
// (dropped without being written anywhere where they rest on NVMe; left as
// they were on the host): the trainer writes every element before
// returning gradients. A session that ends releases all.
//
// Partition life cycle (per partition, under its store's lock): three
// states, each an enum with its transitions drawn at its definition below
// (PartitionStore::MasterState, GradState, StepState):
//   registered -> ReturnGradients -> gradients ready -> BeginStep -> in a
//   step -> EndStep -> registered (step count advanced if the step applied).
// A partition in a step belongs to the optimizer, which runs outside every
// lock; Fetch and ReturnGradients of it wait until EndStep. One step per store
// runs at a time; a second BeginStep waits for the first to end.
//
// Errors: NOT_FOUND for a partition this store does not hold,
// INVALID_ARGUMENT for malformed specs and gradients that do not match the
// registration, ALREADY_EXISTS for a duplicate name, FAILED_PRECONDITION for
// a step with no gradients or gradients returned without holding the
// buffer, RESOURCE_EXHAUSTED when the pool cannot hold what is asked to be
// held at once (with the numbers), DATA_LOSS when a swap-in fails its
// checksum or reads an I/O error. A failed call changes nothing and holds
// nothing.
//
// Thread-safety: all methods are safe from any thread. Lock order: a store's
// lock (mu_) is a leaf; no other engine lock, nor the swapper's, is taken
// while it is held (calls into the swapper happen outside it, and pins are
// dropped outside it), and it is never taken while another engine lock is
// held (ABSL_LOCKS_EXCLUDED below). Register and SetPlacement hold the
// store's placement_mu_ (before mu_) across their swapper calls, so they see
// each other whole.
#ifndef OFFLOADD_ENGINE_PARTITION_STORE_H_
#define OFFLOADD_ENGINE_PARTITION_STORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
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
#include "cpu_adam/accumulate.h"
#include "cpu_adam/dtype.h"
#include "cpu_adam/optimizer.h"
#include "engine/checkpoint_image.h"
#include "engine/chunk_capture.h"
#include "engine/partition_info.h"
#include "engine/placement.h"
#include "engine/shm_arena.h"
#include "engine/stats.h"
#include "engine/step_protocol.h"
#include "swapper/swapper.h"

namespace offload {

// How Fetch holds partitions.
struct FetchMode {
  // Also hold the gradient buffers, to write gradients into.
  bool grads = false;
  // The trainer will change the parameters (loading a checkpoint): they are
  // written back when evicted. Otherwise they are read-only until a step.
  bool writable = false;
  // The trainer loads new values (torch's load_state_dict): writable, and at
  // the release the master weights take them: from fp32 values written
  // into the region PartitionInfo::master_init names, where the partition
  // has one (registered with fp32 initial values: a 16-bit working copy,
  // then rounded from them), else from the working copy. Moments and step
  // counts stay, as torch's optimizer state does. FAILED_PRECONDITION with
  // the delayed update on.
  bool load = false;
  // With grads: ABORTED at once (ring::kNotReadyWords), holding and taking
  // back nothing, where a gradient buffer is still the step's (handed over
  // and not yet read: measured, or in a step), instead of waiting.
  bool if_ready = false;
};

struct PartitionSpec {
  std::string name;
  uint64_t numel = 0;
  DType param_dtype = DType::kFp32;
  DType grad_dtype = DType::kFp32;
  // The trainer gives the initial values in fp32 (PartitionInfo::
  // master_init), so that master weights do not start from rounded values;
  // the first Release commits them (and derives the working copy).
  bool fp32_master = false;
  // The tensor this partition is a slice of (for checkpoints: restoring
  // into another slicing, and exporting whole tensors): elements
  // [tensor_offset, tensor_offset + numel) of its flattened values, the
  // last slice possibly padded past its end. Empty `tensor`: the partition
  // is a tensor of its own, named as it is, of shape {numel}.
  std::string tensor{};
  std::vector<uint64_t> shape{};
  uint64_t tensor_offset = 0;
};

// The page size a partition of `numel` elements is laid out for in a
// session arena whose chunks are `chunk_elems` and whose huge pages are
// `huge_page_bytes` (0: none): huge pages where every kind's chunk fills
// whole ones (a huge page is charged and freed whole, so no two swapper
// blocks may share one) and rounding its regions (params, grads, with
// `fp32_init` the fp32 initial values, the delayed update's second buffer)
// up to them wastes at most an eighth; else 4 KiB. Each region then starts
// on such a page and fills whole ones.
uint64_t ArenaLayoutPageBytes(uint64_t numel, DType param_dtype, DType grad_dtype, bool fp32_init,
                              uint64_t chunk_elems, uint64_t huge_page_bytes);

// INVALID_ARGUMENT unless `name` is 1 (0 with `may_be_empty`) to 256 bytes
// without control characters (a newline would forge rows in offloadctl's
// tables). The message names `what` but never echoes the name itself.
absl::Status CheckName(absl::string_view name, absl::string_view what, bool may_be_empty);

// INVALID_ARGUMENT, naming what is wrong, unless `spec` is one a partition
// may have: its names (CheckName), numel in [1, 2^40], a shape of at most
// 16 dimensions and 2^40 elements, an offset of at most 2^40. Registration
// checks it first, before anything is reserved for the partition.
absl::Status CheckPartitionSpec(const PartitionSpec& spec);

class PartitionStoreFactory;

// One session's partitions. Created by PartitionStoreFactory::CreateStore.
class PartitionStore {
 public:
  ~PartitionStore();
  PartitionStore(const PartitionStore&) = delete;
  PartitionStore& operator=(const PartitionStore&) = delete;

  // Largest partition accepted (elements): keeps byte counts far from
  // overflow and catches garbage sizes.
  static constexpr uint64_t kMaxNumel = uint64_t{1} << 40;
  // Kinds of swapper blocks of one chunk of a partition.
  // The accumulator is placed with the optimizer state.
  enum BlockKind {
    kMaster = 0,
    kExpAvg = 1,
    kExpAvgSq = 2,
    kParamsBlock = 3,
    kGradsBlock = 4,
    kAccumBlock = 5,
    kInitBlock = 6,    // fp32 initial values, from registration to the first release
    kShadowBlock = 7,  // the working copy's second buffer (the delayed update)
  };
  static constexpr int kBlockKinds = 8;
  // The swapper's block id of one kind of one chunk of a partition.
  static uint64_t BlockOf(uint64_t partition_id, uint64_t chunk, int kind) {
    return partition_id << 32 | chunk << 3 | static_cast<uint64_t>(kind);
  }
  // Chunks are a multiple of this many elements, so that every chunk of a
  // 16-bit kind starts on a page (the swapper frees and reads whole pages).
  static constexpr uint64_t kChunkQuantum = 2048;

  // Registers partition `id` (chosen by the caller, unique daemon-wide),
  // its parameters zeros and held (writable) for the trainer to fill; with
  // `restored`, its state and parameters from a checkpoint instead (the
  // fp32 initial values are then not asked for).
  absl::StatusOr<PartitionInfo> Register(uint64_t id, const PartitionSpec& spec,
                                         const RestoredState* restored = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Lets every hold go without committing anything (a registration's fp32
  // initial values stay pending; a load is undone: the master weights stay
  // as they were, and a working copy it wrote over is written again from
  // them, reading them in from NVMe where they rest): the trainer that held
  // them died mid-write.
  void DropHolds() ABSL_LOCKS_EXCLUDED(mu_);
  // A session restoring a checkpoint, before its first registration: the
  // steps it applied and its delayed update.
  absl::Status RestoreSetState(uint64_t steps, bool delayed) ABSL_LOCKS_EXCLUDED(mu_);

  // Checkpoints, copy-on-write. BeginCheckpoint waits for a running step
  // and accumulations to end (a step boundary) and returns the store's image
  // then; from that moment every chunk of every partition in it is given
  // to `sink` exactly once, as it was then: by CaptureChunk (the writer
  // walks every chunk), or by a call about to change a chunk not captured
  // yet (a step's update, an accumulation, a writable fetch, a skipped
  // step's discard), which captures it first. Training goes on meanwhile;
  // a change to a chunk waits at most for that chunk's capture. A capture
  // needs no room in the host pool: a block the pool cannot take in (it is
  // full of held or pinned blocks, this session's or others') is copied
  // straight from its NVMe copy through the checkpoint's staging buffer,
  // one block of at most a state chunk's fp32 bytes, outside the pool
  // (Swapper::CopyOut), allocated when first needed. SetDelayedUpdate waits for EndCheckpoint.
  // FAILED_PRECONDITION while another checkpoint runs, for a partition whose fp32 initial values
  // are not committed, a partition held for writing (release it first), or a step that stopped
  // midway or lost its gradients.
  absl::StatusOr<SetImage> BeginCheckpoint(ChunkSink* sink) ABSL_LOCKS_EXCLUDED(mu_);
  // Captures chunk `chunk` of partition `id` unless done (waiting if
  // another thread is at it). The first failure of any capture is what
  // EndCheckpoint returns.
  void CaptureChunk(uint64_t id, uint64_t chunk) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends copy-on-write, once no capture is running.
  absl::Status EndCheckpoint() ABSL_LOCKS_EXCLUDED(mu_);
  // Makes the partitions' parameters resident and holds them (see the
  // residency contract above); holding one already held is no change. An
  // empty `ids` means every partition, in registration order. Waits for the
  // requested partitions to leave a running step.
  // With grads and if_ready: ABORTED (in ring::kNotReadyWords) where one of
  // `ids` (empty: every partition) has its gradient buffer still the
  // step's, before anything is taken back or held (SessionManager::Fetch
  // asks it first).
  absl::Status RefuseGradsNotReady(absl::Span<const uint64_t> ids) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::vector<PartitionInfo>> Fetch(absl::Span<const uint64_t> ids,
                                                   FetchMode mode = {}) ABSL_LOCKS_EXCLUDED(mu_);
  // Lets the partitions' holds go (parameters and gradient buffers). An
  // empty `ids` means every held partition. FAILED_PRECONDITION (and
  // nothing released) if one is not held. A partition registered with
  // fp32_master first takes its master weights from the fp32 initial values
  // and its working copy from them, rounded (the swapper's errors if that
  // fails: nothing is released then).
  absl::Status Release(absl::Span<const uint64_t> ids) ABSL_LOCKS_EXCLUDED(mu_);
  // Returning gradients, in three calls (the step runner computes between
  // them): BeginAccumulate checks the call (`numel` and `grad_dtype`
  // describe what the trainer wrote into the held gradient buffer) and
  // marks the partition accumulating (a second return of it, or a step,
  // waits); PinAccumulate pins one chunk's gradients and accumulator;
  // EndAccumulate records the outcome: on success the partition has
  // gradients for the next step, the gradient buffer is handed back (its
  // bytes dropped) and `stats` are the accumulated values'. A failure
  // while adding to earlier micro-batches loses the accumulation (the
  // next step must be skipped); a failure on the first changes nothing.
  //
  // `hand_over` (on a step's first micro-batch; ignored on later ones):
  // the gradients stay in the buffer, only measured (or, given the
  // trainer's statistics, not even that: StepRunner::Accumulate), and the
  // step reads them there, which saves writing and reading an fp32 copy.
  // The buffer is the daemon's until the partition's update has read it:
  // a fetch with grads waits while it is measured or in a running update;
  // before the step, StepRunner::Reclaim takes it back (so a fetch here
  // that finds it still handed over is FAILED_PRECONDITION, changing
  // nothing, as is a checkpoint). Use it for the last (or only)
  // micro-batch.
  absl::StatusOr<AccumulateItem> BeginAccumulate(uint64_t id, uint64_t numel, DType grad_dtype,
                                                 bool hand_over = false) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<AccumulatePins> PinAccumulate(const AccumulateItem& item, uint64_t chunk)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Taking a handed-over buffer back before the step: of `ids` (empty: all),
  // those whose buffer is handed over and not in a step; for each,
  // BeginReclaim (after a measurement under way ends) gives an item that
  // copies the gradients into the accumulator as a first accumulation would
  // (PinAccumulate, EndAccumulate: the statistics stay, the buffer is the
  // trainer's again, its bytes dropped), or nothing if there is no longer
  // anything to take back. A failure leaves the gradients in the buffer.
  std::vector<uint64_t> HandedOver(absl::Span<const uint64_t> ids) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::optional<AccumulateItem>> BeginReclaim(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  void EndAccumulate(const AccumulateItem& item, const absl::Status& outcome,
                     const GradStats& stats, uint64_t chunks_done) ABSL_LOCKS_EXCLUDED(mu_);
  // What the gradients returned since the last step add up to (once the
  // accumulations and measurements under way have ended).
  PendingGradients Pending() const ABSL_LOCKS_EXCLUDED(mu_);

  // Pins every partition with gradients ready for one step (waiting for a
  // step in progress, and accumulations, to end first), in the order the
  // next iteration will wait for them, which repeats this one's: the order
  // the trainer first fetched them (its fetches wait for their partition's
  // update); with the delayed update, whose fetches do not wait, the order
  // it first returned their gradients (the next iteration's accumulation
  // of a partition waits until the update has consumed its accumulator; in
  // fetch order, ZeRO-3's backward pass, which returns the last layer
  // first, would wait for the whole update). Partitions not in that order
  // come after, in registration order. FAILED_PRECONDITION
  // if there is none, or (unless `skipping`) if an accumulation was lost.
  // Must be followed by exactly one EndStep with the same items.
  absl::StatusOr<std::vector<StepItem>> BeginStep(bool skipping = false) ABSL_LOCKS_EXCLUDED(mu_);
  // Pins chunk `chunk` of partition `id` (one of a running step's): its
  // optimizer state, parameters and accumulated gradients, reading in what
  // is on NVMe. The swapper's errors (DATA_LOSS for a failed read,
  // RESOURCE_EXHAUSTED when the pool cannot hold it).
  absl::StatusOr<ChunkPins> PinChunk(const StepItem& item, uint64_t chunk) ABSL_LOCKS_EXCLUDED(mu_);

  // The delayed parameter update (DPU, from ZeRO-Offload), on or off for
  // this store's next steps. On: every partition gets a second working-copy
  // buffer (swapper blocks placed like the parameters: twice the working
  // copy's memory); a step writes the new working copy there while fetches
  // go on reading the current one at once (never a mix: each fetch sees one
  // buffer, whole), and the next step's commit makes it current. So the
  // trainer's iteration i+1 reads the parameters of step i-1: exactly one
  // step stale. Off: drains: the newest buffers become current now, and the
  // second buffers go. Waits for a running step. FAILED_PRECONDITION if a
  // partition whose newer buffer must become current is held by the
  // trainer (release it first).
  absl::Status SetDelayedUpdate(bool on) ABSL_LOCKS_EXCLUDED(mu_);
  bool delayed_update() const ABSL_LOCKS_EXCLUDED(mu_);
  // The step is done with the accumulated gradients of chunk `chunk`:
  // their bytes are dropped.
  void ConsumeGrads(const StepItem& item, uint64_t chunk) ABSL_LOCKS_EXCLUDED(mu_);
  // One item of a running step is done (applied): the partition leaves the
  // step at once, so that a fetch of it waits no longer than its own update.
  void EndPartition(const StepItem& item) ABSL_LOCKS_EXCLUDED(mu_);
  // `outcomes[i]` is what happened to `items[i]` (those `ended` were handed
  // back by EndPartition already).
  void EndStep(absl::Span<const StepItem> items, absl::Span<const ItemOutcome> outcomes)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Partition `id`'s Adam state as torch's AdamW keeps it: its step count
  // and, for elements [begin, begin + count), its moments (fp32, `count`
  // floats each; any pointer may be null; ReadMoments' `master`: the fp32
  // master weights, read only: of a partition never stepped, its working
  // copy widened; FAILED_PRECONDITION while its fp32 initial values are
  // the trainer's), copied out by ReadMoments or
  // in by WriteMoments (which sets the step count too), wherever their
  // blocks are (swapped in as a step would). A step of the partition
  // running ends first; a checkpoint being written captures the chunks
  // first. Between the trainer's own steps, like Fetch. INVALID_ARGUMENT
  // past the partition's end; WriteMoments with the delayed update on is
  // FAILED_PRECONDITION (the step in flight would overwrite them).
  absl::StatusOr<uint64_t> ReadMoments(uint64_t id, uint64_t begin, uint64_t count, float* exp_avg,
                                       float* exp_avg_sq, float* master = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status WriteMoments(uint64_t id, uint64_t step, uint64_t begin, uint64_t count,
                            const float* exp_avg, const float* exp_avg_sq) ABSL_LOCKS_EXCLUDED(mu_);

  // Changes the share of this store's bytes of some kinds homed on the host
  // and re-homes its partitions as at registration (greedily, in
  // registration order). Returns at once: the swapper moves the blocks in
  // the background (to the host: read in and kept resident; to NVMe:
  // written out when the pool needs the room). INVALID_ARGUMENT outside
  // [0, 100]; FAILED_PRECONDITION below 100 without an NVMe tier.
  absl::Status SetPlacement(const PlacementChange& change) ABSL_LOCKS_EXCLUDED(mu_);

  // A region of the arena outside every partition (the request ring),
  // allocated and mapped: its offset and the mapping.
  absl::StatusOr<std::pair<uint64_t, HostMemory>> MapExtra(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  uint64_t session_id() const { return session_id_; }
  int arena_fd() const { return arena_->fd(); }
  uint64_t arena_capacity() const { return arena_->capacity(); }
  uint64_t arena_bytes() const { return arena_->size(); }
  size_t partitions() const ABSL_LOCKS_EXCLUDED(mu_);
  bool Contains(uint64_t id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes of `kind` homed on `home`.
  uint64_t bytes(DataKind kind, Tier home) const ABSL_LOCKS_EXCLUDED(mu_);
  // Partitions the trainer holds now.
  size_t held() const ABSL_LOCKS_EXCLUDED(mu_);
  // Each partition's tensor and elements of it ([offset, offset + numel)),
  // as its checkpoint records them.
  struct TensorSlice {
    std::string tensor;
    uint64_t offset = 0;
    uint64_t numel = 0;
  };
  std::vector<TensorSlice> TensorSlices() const ABSL_LOCKS_EXCLUDED(mu_);
  // Steps applied so far (a step that stopped midway counts once the Step
  // that resumes it ends).
  uint64_t steps() const ABSL_LOCKS_EXCLUDED(mu_);
  // Whether a step stopped midway: the next Step finishes it.
  bool stopped_midway() const ABSL_LOCKS_EXCLUDED(mu_);
  // The session's weight in the node's optimizer when several sessions step
  // at once (engine/optimizer_shares.h), and in the swapper's I/O when
  // several sessions' blocks wait for it (Swapper::SetIoWeight): 1 unless
  // set.
  int64_t share_weight() const { return share_weight_.load(std::memory_order_relaxed); }
  void SetShareWeight(int64_t weight) ABSL_LOCKS_EXCLUDED(mu_);
  // Its blocks' NVMe traffic so far (Swapper::IoOf).
  Swapper::TraceIo Io() const { return swapper_->IoOf(session_id_); }

 private:
  friend class PartitionStoreFactory;

  // A partition's master weights and moments:
  //
  //   Register ──> kUnset ──────(a step applied)──────────────┐
  //      │  (fp32_master)                                     v
  //      └───> kInitPending ──(Release commits)──> kInitialized
  //   Register restoring a checkpoint with them ──> kInitialized
  //
  // kUnset: never written; the first step initialises them from the
  // working copy. kInitPending: the trainer writes fp32 initial values
  // into the arena; a step or a checkpoint of it is refused until the
  // first Release makes them the master weights.
  enum class MasterState { kUnset, kInitPending, kInitialized };

  // The gradients for the next step:
  //
  //   kNone        -- ReturnGradients ------------------> kAccumulated (the fp32 accumulator)
  //   kNone        -- ReturnGradients with hand_over ---> kHandedOver (left in the gradient
  //                   buffer, the daemon's until its step has read them)
  //   kAccumulated -- ReturnGradients ------------------> kAccumulated (one more micro-batch)
  //   kHandedOver  -- Reclaim ---------------------------> kAccumulated (copied over)
  //   kAccumulated -- an addition that fails midway -----> kLost (the next step must skip)
  //   kHandedOver  -- its measurement in the background fails --> kLost
  //   any but kNone -- the step that consumes them (applied or skipped) --> kNone
  //
  // `accumulating` marks each arrow's transient phase (one at a time per
  // partition; steps, checkpoints, Pending and other returns of it wait
  // for it to end). hand_over enters kHandedOver when it begins (the
  // buffer is the daemon's from then on). A first micro-batch that fails
  // goes back to kNone; a later one that fails before changing anything
  // stays kAccumulated; a reclaim that fails stays kHandedOver.
  enum class GradState { kNone, kAccumulated, kHandedOver, kLost };

  // The partition in a step: BeginStep moves every partition with
  // gradients (not kNone) in; EndPartition or EndStep moves it out (a
  // failed step keeps its gradients and resumes at the chunk it stopped).
  // kInDelayed: a delayed-update step, which writes the other working-copy
  // buffer, so fetches of the current one need not wait.
  enum class StepState { kOut, kIn, kInDelayed };

  struct Partition;

  PartitionStore(uint64_t session_id, std::unique_ptr<ShmArena> arena, Swapper* swapper,
                 Stats* stats, const Placement& placement, uint64_t state_chunk_elems,
                 uint64_t huge_page_bytes);

  // Waits until none of `partitions` is in a step (with `delayed_ok`, a
  // delayed-update step, which leaves the current working copy alone, does
  // not count).
  void AwaitOutOfStep(absl::Span<Partition* const> partitions, bool delayed_ok = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for a step boundary: no step running, no gradients being added.
  void AwaitStepBoundaryLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool StoppedMidwayLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The block kind of the working-copy buffer the trainer reads now (or,
  // with `next`, the other one).
  static int ParamsKind(const Partition& p, bool next);
  // The block kind a step item's gradients are read from.
  static int GradsKind(const StepItem& item);
  // The partitions `ids` names (empty: every one, in registration order);
  // NOT_FOUND naming one that is not the session's.
  absl::StatusOr<std::vector<Partition*>> WantedLocked(absl::Span<const uint64_t> ids) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A gradient buffer of `wanted` handed over and not yet read by its step
  // (being measured, or in a step).
  bool GradsBusyLocked(absl::Span<Partition* const> wanted) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The if_ready fetch's refusal (counted).
  absl::Status NotReadyLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION if one of `wanted` has its gradient buffer handed
  // over (a fetch with grads that raced with a return).
  absl::Status RefuseHandedOverLocked(absl::Span<Partition* const> wanted) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A partition's step is over: its gradients are consumed, and, if the
  // update was applied, its step count advances.
  void LeaveStepLocked(Partition* p, const StepItem& item, bool applied)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION if a partition whose newer working-copy buffer must
  // become current is held by the trainer; CommitSwapsLocked makes them so.
  absl::Status CheckSwapsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CommitSwapsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Partition* Find(uint64_t id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ReadMoments and WriteMoments: copies [begin, begin + count) (checked by
  // them) of the two moments (and, reading, the master) out of or into their
  // blocks, chunk by chunk.
  absl::Status CopyMoments(uint64_t id, uint64_t begin, uint64_t count, float* exp_avg,
                           float* exp_avg_sq, float* master, bool write) ABSL_LOCKS_EXCLUDED(mu_);
  // Chunks of a partition of `numel` elements.
  uint64_t ChunksOf(uint64_t numel) const;
  // Pins every chunk of `p`'s parameters (or gradients): the caller's
  // hold. Without the store's lock (`p` stays valid: partitions go only with
  // the store).
  // `kind`: kGradsBlock, or the parameters' (ParamsKind, read under the
  // lock by the caller).
  absl::StatusOr<std::vector<Swapper::Pin>> Hold(const Partition& p, int kind, bool for_write)
      ABSL_LOCKS_EXCLUDED(mu_);
  // `use`: see Swapper::Acquire.
  absl::StatusOr<Swapper::Pin> PinBlock(uint64_t id, uint64_t chunk, int block_kind, bool for_write,
                                        Swapper::Use use = Swapper::Use::kInOrder)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Adds chunk `chunk`'s gradient accumulator (made when first needed; an
  // existing one is fine), placed with the optimizer state. `registering`:
  // the partition, while Register fills it before it is published; else it
  // is looked up under the lock.
  absl::Status AddAccumulator(uint64_t id, uint64_t chunk, const Partition* registering)
      ABSL_LOCKS_EXCLUDED(mu_) ABSL_NO_THREAD_SAFETY_ANALYSIS;
  // Master weights from the fp32 initial values, and the working copy from
  // them (rounded), chunk by chunk. `p` is held by the trainer.
  absl::Status CommitMasterInit(const Partition& p) ABSL_LOCKS_EXCLUDED(mu_);
  // A load without fp32 values: the master weights from the working copy.
  absl::Status MasterFromWorking(const Partition& p) ABSL_LOCKS_EXCLUDED(mu_);
  // The other way (a load undone): the working copy from the master weights.
  absl::Status WorkingFromMaster(const Partition& p) ABSL_LOCKS_EXCLUDED(mu_);
  // A load its trainer never released (`loading`), undone: what must then
  // go or be written again is added to the lists, for FinishUndo (outside
  // the lock, after the holds' pins went).
  void UndoLoadLocked(Partition& p, std::vector<Partition*>* unloaded,
                      std::vector<Partition*>* rewritten) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishUndo(const std::vector<Partition*>& unloaded, const std::vector<Partition*>& rewritten)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Elements [begin, begin + count) of the working copy, widened to fp32
  // into `out` (the master weights of a partition never stepped).
  absl::Status WidenWorking(const Partition& p, uint64_t begin, uint64_t count, float* out)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The fp32 values' blocks of a load (over the region registration laid
  // out), and their removal when the load fails.
  absl::Status AddInitBlocks(const Partition& p) ABSL_LOCKS_EXCLUDED(mu_);
  void RemoveInitBlocks(const Partition& p) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<Partition*> FindOrNotFound(uint64_t id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes a restored partition's saved state into its blocks (held by the
  // caller, not yet in partitions_).
  absl::Status FillRestored(const Partition& p, const RestoredState& restored, bool with_shadow,
                            const absl::flat_hash_set<uint64_t>& adopted) ABSL_LOCKS_EXCLUDED(mu_);
  // Every chunk of the partitions, before they change (a writable fetch).
  void CaptureAll(absl::Span<Partition* const> partitions) ABSL_LOCKS_EXCLUDED(mu_);
  // A checkpoint's ChunkCapture::ReadBlock: one block of a chunk to `sink`,
  // under a read pin, or, when the pool has no room to bring it in, copied
  // out of where it rests through `staging`.
  absl::Status CaptureBlock(uint64_t id, uint64_t chunk, int block_kind, ChunkSink* sink,
                            ChunkCapture::Staging* staging);

  // Constant after construction.
  const uint64_t session_id_;
  const std::unique_ptr<ShmArena> arena_;
  Swapper* const swapper_;
  Stats* const stats_;
  const uint64_t state_chunk_elems_;
  const uint64_t huge_page_bytes_;  // 0: the arena has none

  // Serialises Register, SetPlacement, SetDelayedUpdate and the lazy
  // accumulator (AddAccumulator) of this store, across their calls into the
  // swapper. Lock order: placement_mu_, then mu_ (briefly,
  // never across a swapper call), then the swapper's own.
  absl::Mutex placement_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  // Signalled when a step ends.
  mutable absl::CondVar step_ended_;  // also: an accumulation ended
  // Ordered by id, so that steps and fetch-all visit partitions in
  // registration order.
  std::map<uint64_t, std::unique_ptr<Partition>> partitions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> names_ ABSL_GUARDED_BY(mu_);
  bool stepping_ ABSL_GUARDED_BY(mu_) = false;
  // WriteMoments calls under way: a step or a checkpoint's image waits for
  // them (AwaitStepBoundaryLocked), so that neither sees half the moments
  // written under the step count before.
  int moments_writing_ ABSL_GUARDED_BY(mu_) = 0;
  // The step under way (stopped midway, to be resumed) updated some
  // partition already: steps_ counts it once it is finished.
  bool step_applied_ ABSL_GUARDED_BY(mu_) = false;
  // The order in which the trainer first held each partition since the
  // last step began, and first returned its gradients: BeginStep orders a
  // step by one of them (see there).
  std::vector<uint64_t> fetch_order_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<uint64_t> fetched_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> return_order_ ABSL_GUARDED_BY(mu_);
  bool delayed_ ABSL_GUARDED_BY(mu_) = false;  // SetDelayedUpdate
  // A checkpoint being written: its copy-on-write, notified before a chunk
  // changes (CaptureChunk). Shared with the captures running.
  std::shared_ptr<ChunkCapture> capture_ ABSL_GUARDED_BY(mu_);
  absl::CondVar captured_;  // a checkpoint ended (capture_ reset)
  uint64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int64_t> share_weight_{1};
  uint64_t bytes_[kDataKinds][2] ABSL_GUARDED_BY(mu_) = {};  // by kind, Tier
  Placement placement_ ABSL_GUARDED_BY(mu_);
};

class PartitionStoreFactory {
 public:
  // `env`, `swapper` and `stats` must outlive the store and every store it
  // made. `placement` is the node default for new sessions;
  // `state_chunk_elems` the size of a chunk (rounded down to kChunkQuantum,
  // at least that). `huge_page_bytes`: the huge page size the kernel gives
  // shared memory that asks (SharedHugePageBytes()), for the arenas to lay
  // large partitions out for; 0 lays everything out for small pages.
  PartitionStoreFactory(Env* env, Swapper* swapper, Stats* stats, uint64_t arena_capacity,
                        const Placement& placement, uint64_t state_chunk_elems,
                        uint64_t huge_page_bytes = 0);

  // A new, empty store for session `session_id` with an arena of the current
  // capacity, placed as the node default changed by `placement`; its
  // partitions' span mappings counted in `span_mappings` while they live
  // (ShmArena::Create). INVALID_ARGUMENT outside [0, 100];
  // FAILED_PRECONDITION below 100 without an NVMe tier.
  absl::StatusOr<std::unique_ptr<PartitionStore>> CreateStore(
      uint64_t session_id, const PlacementChange& placement = {},
      std::shared_ptr<std::atomic<int64_t>> span_mappings = nullptr);

  // INVALID_ARGUMENT outside [0, 100], FAILED_PRECONDITION below 100
  // without an NVMe tier.
  static absl::Status CheckPlacement(DataKind kind, int percent, bool has_nvme);

  // Applies to stores created afterwards (rounded down to the arena's
  // alignment).
  void SetArenaCapacity(uint64_t bytes);
  uint64_t arena_capacity() const { return arena_capacity_.load(std::memory_order_relaxed); }
  uint64_t state_chunk_elems() const { return state_chunk_elems_; }
  // Applies to sessions opened afterwards.
  void SetDefaultPlacement(DataKind kind, int percent) {
    default_percent_[static_cast<int>(kind)].store(percent, std::memory_order_relaxed);
  }

 private:
  // Constant after construction.
  Env* const env_;
  Swapper* const swapper_;
  Stats* const stats_;

  const uint64_t state_chunk_elems_;
  const uint64_t huge_page_bytes_;
  std::atomic<uint64_t> arena_capacity_;
  std::atomic<int> default_percent_[kDataKinds];
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_PARTITION_STORE_H_
