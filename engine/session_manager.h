// Sessions: ids, tokens, which session owns which partition, and their life
// cycle. An orchestrator in the manner of LevelDB's DBImpl: it checks who is
// asking and delegates the work to the component that owns it:
//   partition buffers and their states -> PartitionStoreFactory / PartitionStore
//   the optimizer step                 -> StepRunner
// Engine types only; the gRPC layer converts (service.h).
//
// A session is one trainer process's connection. It owns a PartitionStore (its
// shared arena, which the trainer maps, and its partitions' private state).
// Calls in flight hold a reference to the session: closing it removes it at
// once, and its memory is freed when the last such call returns.
//
// Session ids carry this daemon's incarnation (a random 31-bit number) in
// their high 32 bits and a counter in the low ones. An id of another
// incarnation is NOT_FOUND saying that offloadd restarted (a trainer whose
// daemon came back must open a new session); within this incarnation, an id
// below the next one that is not open was open once (or its opening
// failed): "closed", FAILED_PRECONDITION; one never handed out is NOT_FOUND.
//
// Errors: NOT_FOUND for a session or partition that never existed,
// FAILED_PRECONDITION for a closed session or a call out of order,
// PERMISSION_DENIED for a wrong token or another session's partition,
// INVALID_ARGUMENT for malformed requests, RESOURCE_EXHAUSTED for budgets.
// A failed call changes nothing.
//
// Thread-safety: all methods are safe from any thread. Calls on different
// sessions proceed in parallel. Lock order: mu_ is a leaf: it is held only
// to read or change the maps below, never while a set's lock, the optimizer's
// or anything else is taken, and no method is called with it held
// (ABSL_LOCKS_EXCLUDED). Sessions are destroyed after mu_ is released.
#ifndef OFFLOADD_ENGINE_SESSION_MANAGER_H_
#define OFFLOADD_ENGINE_SESSION_MANAGER_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/env.h"
#include "base/unique_fd.h"
#include "cpu_adam/adam.h"
#include "cpu_adam/dtype.h"
#include "engine/checkpoint.h"
#include "engine/loss_scaler.h"
#include "engine/partition_store.h"
#include "engine/request_ring_server.h"
#include "engine/stats.h"
#include "engine/step_runner.h"

namespace offload {

// What a caller presents to act on a session: its id and secret token.
struct SessionKey {
  uint64_t id = 0;
  std::string token;
};

struct OpenedSession {
  SessionKey key;
  uint64_t arena_capacity = 0;
  // The session's request ring (ipc/request_ring.h) in its arena.
  ArenaRegion ring;
  // The checkpoint directory it restores (RestoreFrom), empty if none, and
  // the steps of the checkpoints of its name there (the latest first, then
  // a kept previous one: what another Open of it may ask for).
  std::string restored_from;
  std::vector<uint64_t> restorable_steps;
};

// Where a session's state comes from (Open): nowhere (a new session), a
// checkpoint directory, or what an earlier offloadd that died left of a
// session of the same name.
struct RestoreFrom {
  RestoreFrom() = default;
  RestoreFrom(std::string dir) : dir(std::move(dir)) {}  // NOLINT: a directory is one
  RestoreFrom(const char* dir) : dir(dir) {}             // NOLINT
  // An absolute directory holding a checkpoint (Checkpoint), else empty.
  std::string dir;
  // With `dir` empty: the newest automatic checkpoint a session of the
  // same name left when an earlier offloadd died and no open session
  // restores (none: a new session). The answer's restorable_steps are those
  // of every such directory of the name.
  bool lost = false;
  // The checkpoint taken after this many steps (an automatic checkpoint
  // keeps the one before it too); unset: the latest. With `lost`, it is the
  // final choice (a job's ranks agreed on it): the newest directory holding
  // that step is restored and the name's other lost ones go; 0: none is
  // restored (a new session) and all go.
  std::optional<uint64_t> steps;
  // The session's own automatic checkpoints (and one it restored) stay when
  // it goes unfinished (its trainer went away or hung, or it was closed
  // without Close's `finished`), as when offloadd dies: a restarted job
  // finds them by name (`lost`). A finished Close removes them.
  bool keep_for_resume = false;
};

// One partition of a gradient return naming several.
struct GradientReturn {
  uint64_t partition_id = 0;
  uint64_t numel = 0;
  // An error: the wire item is malformed (no dtype it names, unknown
  // flags): the whole return is refused, nothing of it returned.
  absl::StatusOr<DType> grad_dtype;
  // The trainer's statistics of the buffer (StepRunner::Accumulate's
  // `given`).
  std::optional<GradStats> stats;
};

// What a trainer's GPU tier reported (ReportGpuTier): totals since it
// began (offload.proto's GpuTierCounters).
struct GpuTierReport {
  uint64_t h2d_bytes = 0, h2d_staged_bytes = 0, d2h_bytes = 0;
  uint64_t tensor_uses = 0, resident_hits = 0, prefetch_hits = 0;
  uint64_t host_waits = 0, evictions = 0;
  uint64_t resident_bytes = 0, budget_bytes = 0, dma_bytes = 0;
  uint64_t prefetch_depth = 0, prefetch_bytes = 0;
};

// The node's settings for the trainers' GPU tiers (tunables gpu.*); -1:
// each trainer's own.
struct GpuTierSettings {
  int64_t prefetch_depth = -1;
  int64_t prefetch_bytes = -1;
};

struct SessionSummary {
  uint64_t id = 0;
  std::string name;
  uint64_t partitions = 0;
  uint64_t arena_bytes = 0;
  uint64_t steps = 0;
  uint64_t held = 0;  // partitions the trainer holds
  // Bytes of each kind (DataKind) placed on the host and on NVMe.
  uint64_t host_bytes[kDataKinds] = {};
  uint64_t nvme_bytes[kDataKinds] = {};
  std::optional<GpuTierReport> gpu;  // its GPU tier's last report
  // Its steps' time so far (nanoseconds, steps that ended): in all, waiting
  // for optimizer state to be brought in (swap-ins), and in the update.
  int64_t step_wall_nanos = 0;
  int64_t step_wait_nanos = 0;
  int64_t step_compute_nanos = 0;
  // Its weight in the node's optimizer, and what it got: parameters
  // updated, and the time its updates waited for other sessions'.
  int64_t share_weight = 1;
  uint64_t optimizer_params = 0;
  int64_t optimizer_queued_nanos = 0;
  // Its blocks' NVMe traffic (swapped in, written out) and the time their
  // transfers waited for an I/O thread (Swapper::IoOf): the disk's share
  // it got by the same weight.
  uint64_t nvme_read_bytes = 0;
  uint64_t nvme_write_bytes = 0;
  int64_t io_queued_nanos = 0;
  // The host pool's room its NVMe-homed blocks hold now, and its blocks
  // evicted so far: the pool's share it gets.
  uint64_t pool_room_bytes = 0;
  uint64_t pool_evictions = 0;
  // Seconds since its trainer went away without closing it (kept for the
  // reconnect lease, or across a restart, for a trainer to resume); -1
  // while a trainer is attached (or none attached yet).
  int64_t detached_seconds = -1;
};

// How the trainer commits a step after its global decisions.
struct StepControl {
  // Consume the gradients and change nothing (the loss scale neither).
  bool skip = false;
  // Some rank's gradients overflowed: with loss scaling, skip and lower the
  // scale; without, the same as skip.
  bool overflow = false;
  // Return once decided; the update overlaps what the trainer does next
  // (StepRunner::Start). WaitStep gives its outcome.
  bool overlap = false;
  // Partitions whose hyperparameters differ from the step's.
  std::vector<ParamGroup> groups;
  // The automatic checkpoint at this step: unset, as the session's own
  // clock or step count says; set, as the job decided (every rank alike):
  // true now (waiting for one still being written), false not.
  std::optional<bool> auto_checkpoint;
};

class SessionManager {
 public:
  static constexpr size_t kTokenBytes = 16;
  // A closed session's automatic checkpoint directory is renamed to
  // <dir><kClosingSuffix><id> at once and removed once the session is gone;
  // a crash in between leaves it for the next start to remove.
  static constexpr char kClosingSuffix[] = ".closing.";
  // Most partition ids one Fetch may name (a reply stays far below gRPC's
  // 4 MiB message limit; a trainer fetches a layer's few at a time).
  static constexpr size_t kMaxFetchIds = 4096;

  // Performs the calls that come through the sessions' request rings: the
  // daemon's ring service (daemon/ring_service.h) decodes them into this
  // manager's Fetch, Release, ReturnGradients, Pending, Step and WaitStep, as the
  // gRPC service decodes its messages. Called from every ring's thread at once.
  class RingCalls {
   public:
    virtual ~RingCalls() = default;
    virtual RingAnswer Serve(const SessionKey& key, const RingRequest& request) = 0;
  };

  // Everything passed in must outlive the manager. `env` makes the session
  // tokens.
  SessionManager(Env* env, PartitionStoreFactory* store, StepRunner* steps, Stats* stats);
  ~SessionManager();

  // Where the sessions' request rings send their calls: set once, before
  // the first session opens (Reopen's too); `calls` must outlive
  // the manager. Without it a ring's calls are UNIMPLEMENTED.
  void SetRingCalls(RingCalls* calls) { ring_calls_.store(calls, std::memory_order_release); }

  // How long a session's request-ring thread polls for the next call after
  // one ends before it sleeps (server.ring_spin_us; RingServer). Applies to
  // every session, open or opened later. Zero (always sleep) until set.
  void SetRingSpin(absl::Duration spin) ABSL_LOCKS_EXCLUDED(mu_);

  // `placement`: changes to the node default for this session (see
  // PartitionStoreFactory::CreateStore); `loss_scaling`: dynamic loss scaling for
  // fp16 training (loss_scaler.h), INVALID_ARGUMENT for options it cannot
  // use.
  // `delayed_update_after`: switch the delayed parameter update on once
  // this many steps were applied (0: from the first); unset: off until
  // SetDelayedUpdate.
  // `user`: the Unix user who asked, where its sessions are bounded
  // (SetMaxSessionsPerUser: a user other than offloadd's own); unset: not
  // counted.
  absl::StatusOr<OpenedSession> Open(
      absl::string_view name, const PlacementChange& placement = {},
      const std::optional<LossScalingOptions>& loss_scaling = std::nullopt,
      std::optional<uint64_t> delayed_update_after = std::nullopt,
      const RestoreFrom& restore_from = {}, std::optional<uid_t> user = std::nullopt)
      ABSL_LOCKS_EXCLUDED(mu_);
  // `restore_from` (RestoreFrom): the session restores the checkpoint there (engine/checkpoint.h):
  // its steps, loss scaler (options from `loss_scaling` if given), delayed update and placement
  // (kinds `placement` leaves unset), and, at each Register, the partition's state.

  // Writes the session's checkpoint into `dir` (CheckpointWriter); with
  // `background`, returns once the image is taken (running set) and the
  // writing goes on in a thread of its own (WaitCheckpoint). An empty
  // token acts as the operator (the caller passed the AccessGuard).
  // FAILED_PRECONDITION while one is being written.
  struct CheckpointOutcome {
    CheckpointSummary summary;
    bool running = false;
  };
  absl::StatusOr<CheckpointOutcome> Checkpoint(const SessionKey& key, const std::string& dir,
                                               bool background) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<CheckpointOutcome> WaitCheckpoint(const SessionKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  // Checkpoint (as the operator, written before it returns) for keeping the
  // session across a restart: with `file` (the pool's, linked as
  // `memory_file`), chunks in it are named there instead of written
  // (SessionCheckpointState::by_reference).
  absl::StatusOr<CheckpointOutcome> CheckpointForKeeping(uint64_t id, const std::string& dir,
                                                         PoolFile* file,
                                                         const std::string& memory_file)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Automatic checkpoints (checkpoint.auto_*): after a step, a session's
  // state is checkpointed in the background into <dir>/<session id> once
  // `every_steps` steps (0: not by steps) or `interval` (zero: not by time)
  // passed since its last one (or since it opened), so that a crash of
  // offloadd loses at most that much training: a session opened with
  // restore_from that directory goes on from there. One due while the
  // previous is still written waits for the next step. With overlapped
  // steps it is taken at the start of the next Step (not after one still
  // running, which it would wait for). Each one replaces the
  // session's previous one atomically (a failed one leaves it: logged,
  // counted); it waits for a step running in the background (an
  // overlapped one) to end, and a checkpoint the trainer asks for waits
  // for it. A session that closes removes its directory; one opened to
  // restore an automatic checkpoint of <dir> removes that directory too
  // when it closes. An empty `dir`, or neither trigger: off (directories
  // of sessions that close are still removed). Applies from the next step.
  struct AutoCheckpointOptions {
    std::string dir;
    uint64_t every_steps = 0;
    absl::Duration interval = absl::ZeroDuration();
    bool on() const { return !dir.empty() && (every_steps > 0 || interval > absl::ZeroDuration()); }
  };
  void SetAutoCheckpoint(const AutoCheckpointOptions& options) ABSL_LOCKS_EXCLUDED(mu_);
  // Where sessions kept across a restart are (<data_dir>/preserved): like
  // the automatic checkpoints' directory, offloadd's, and refused to a
  // trainer's Checkpoint (it would replace a kept session's state).
  void SetKeptDirectory(std::string dir) ABSL_LOCKS_EXCLUDED(mu_);
  // The directory of session `id`'s automatic checkpoints; empty while they
  // are off.
  std::string AutoCheckpointDir(uint64_t id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Whether an open session restored the automatic checkpoints in `dir` (a
  // lost session's) and removes them once it has its own.
  bool RestoresAutomaticCheckpoint(const std::string& dir) const ABSL_LOCKS_EXCLUDED(mu_);

  // Switches the session's delayed parameter update (PartitionStore::
  // SetDelayedUpdate) on or off now; it also cancels a pending automatic
  // switch-on.
  absl::Status SetDelayedUpdate(const SessionKey& key, bool on) ABSL_LOCKS_EXCLUDED(mu_);
  // The session's weight in the node's optimizer (OptimizerShares): with
  // several sessions stepping at once, each gets updates in proportion to
  // it. INVALID_ARGUMENT outside [1, 1000]. An empty token acts as the
  // operator (offloadctl share).
  static constexpr int64_t kMaxShareWeight = 1000;
  static absl::Status CheckShareWeight(int64_t weight);
  absl::Status SetShare(const SessionKey& key, int64_t weight) ABSL_LOCKS_EXCLUDED(mu_);
  // A partition's Adam state (PartitionStore::ReadMoments, WriteMoments);
  // `master` (may be null): its fp32 master weights.
  absl::StatusOr<uint64_t> ReadMoments(const SessionKey& key, uint64_t partition_id, uint64_t begin,
                                       uint64_t count, float* exp_avg, float* exp_avg_sq,
                                       float* master = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status WriteMoments(const SessionKey& key, uint64_t partition_id, uint64_t step,
                            uint64_t begin, uint64_t count, const float* exp_avg,
                            const float* exp_avg_sq) ABSL_LOCKS_EXCLUDED(mu_);
  // Keeps the session's GPU-tier report (its summary shows it; what it
  // added since the previous one goes into the node's gpu_* counters) and
  // answers the node's settings for it.
  absl::StatusOr<GpuTierSettings> ReportGpuTier(const SessionKey& key, const GpuTierReport& report)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The node's settings, for every trainer's next report (tunables gpu.*).
  void SetGpuTierSettings(const GpuTierSettings& settings) ABSL_LOCKS_EXCLUDED(mu_);
  // Most memory mappings the daemon may hold (HostMemory::LiveMappings):
  // a Register that could take it past is RESOURCE_EXHAUSTED, naming the
  // budget and the session with the most partitions, before anything is
  // mapped (so that threads, the allocator and other sessions' calls keep
  // the rest of vm.max_map_count). 0: no budget.
  void SetMappingBudget(int64_t mappings) { mapping_budget_.store(mappings); }
  int64_t mapping_budget() const { return mapping_budget_.load(); }
  // Chunks a checkpoint written while a caller waits (not in the
  // background: Checkpoint without `background`, keeping sessions at a
  // stop, FinalCheckpoint) captures at once (SessionCheckpointState).
  void SetCaptureThreads(int threads) { capture_threads_.store(std::max(1, threads)); }
  // `finished` false: the job did not end (a trainer closing on its way
  // out after a failure): a session opened with RestoreFrom::keep_for_resume
  // leaves its automatic checkpoints for a restart.
  absl::Status Close(const SessionKey& key, bool finished = true) ABSL_LOCKS_EXCLUDED(mu_);
  // The operator's close, by id (no token): a session whose trainer went
  // away (the reconnect lease keeps it, or offloadd kept it across a
  // restart) ends now, as if its lease had run out: its automatic
  // checkpoints stay only where it was kept for a resume (keep_for_resume).
  // A session with a trainer attached, none attached yet, or being resumed
  // (for kResumeAttachWait): FAILED_PRECONDITION naming it. Returns its
  // name and how long it was detached.
  struct ClosedByOperator {
    std::string name;
    int64_t detached_seconds = -1;
  };
  absl::StatusOr<ClosedByOperator> CloseUnattached(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<PartitionInfo> Register(const SessionKey& key, const PartitionSpec& spec)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Holds the partitions (PartitionStore::Fetch). An empty `ids` fetches
  // every partition of the session.
  absl::StatusOr<std::vector<PartitionInfo>> Fetch(const SessionKey& key,
                                                   absl::Span<const uint64_t> ids,
                                                   FetchMode mode = {}) ABSL_LOCKS_EXCLUDED(mu_);
  // Lets holds go (PartitionStore::Release); an empty `ids`, every one.
  absl::Status Release(const SessionKey& key, absl::Span<const uint64_t> ids)
      ABSL_LOCKS_EXCLUDED(mu_);
  // `numel` and `grad_dtype` describe what the trainer wrote; they must match
  // the registration. `hand_over`: the step reads the gradients where they
  // are (PartitionStore::BeginAccumulate); `stats`, the trainer's statistics
  // of them (StepRunner::Accumulate's `given`).
  absl::Status ReturnGradients(const SessionKey& key, uint64_t partition_id, uint64_t numel,
                               DType grad_dtype, bool hand_over = false,
                               const std::optional<GradStats>& stats = std::nullopt)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Several, in order (at most kMaxFetchIds); an error stops at the
  // partition it names (the message says how many went before, which were
  // returned) and releases nothing. The trainer's statistics are checked
  // for all first: a refusal of one returns none. With `release`, then
  // lets them all go.
  absl::Status ReturnGradients(const SessionKey& key, absl::Span<const GradientReturn> items,
                               bool release, bool hand_over = false) ABSL_LOCKS_EXCLUDED(mu_);
  // What the gradients returned since the last step add up to: the squared
  // norm and non-finite count of the accumulated values, for the trainer's
  // global clipping and overflow decision across ranks. With loss scaling,
  // the norm is the unscaled gradient's, and the current scale is given.
  absl::StatusOr<PendingGradients> Pending(const SessionKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  // FAILED_PRECONDITION if no partition returned gradients since last step.
  // Either way the returned gradients are consumed: a skipped step (see
  // StepSummary; `skip` asks for one) also needs new ones. A Step after one
  // that stopped midway (its error said "resumes there") finishes that one
  // as it was decided: its hyperparameters, groups, gradient scale and
  // overflow decision, not this call's.
  absl::StatusOr<StepSummary> Step(const SessionKey& key, const AdamHyperparams& h,
                                   const StepControl& control = {}) ABSL_LOCKS_EXCLUDED(mu_);

  // The outcome of the session's last overlapped step, once it has ended
  // (waiting for it). FAILED_PRECONDITION if none was started.
  absl::StatusOr<StepSummary> WaitStep(const SessionKey& key) ABSL_LOCKS_EXCLUDED(mu_);

  // Changes where the session's data rests (see PartitionStore::SetPlacement);
  // returns at once.
  absl::Status SetPlacement(const SessionKey& key, const PlacementChange& change)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A duplicate of the session's arena descriptor, for the arena channel.
  absl::StatusOr<UniqueFd> DupArenaFd(const SessionKey& key) ABSL_LOCKS_EXCLUDED(mu_);

  // What closing a session leaves to do once no call can find it: freeing
  // its memory and partitions, joining its ring's thread, removing its
  // files (a large session's take seconds). A caller that passes a
  // Teardowns to a close gets these to run where they delay no one (the
  // arena channel's teardown threads); else the close runs them itself. A
  // Teardowns destroyed unrun runs them. They may call into this manager
  // (a session kept for a resume writes its last step: FinalCheckpoint),
  // so they run before it is destroyed.
  class Teardowns {
   public:
    Teardowns() = default;
    Teardowns(Teardowns&&) = default;
    Teardowns& operator=(Teardowns&&) = delete;  // (would drop work unrun)
    ~Teardowns() { Run(); }
    void Add(std::function<void()> f) { work_.push_back(std::move(f)); }
    void Run() {
      for (auto& f : std::exchange(work_, {})) f();
    }
    // Each teardown, one per closed session, to run elsewhere (and in any
    // order: they are independent).
    std::vector<std::function<void()>> Take() { return std::exchange(work_, {}); }
    bool empty() const { return work_.empty(); }

   private:
    std::vector<std::function<void()>> work_;
  };

  // Closes session `key` if no trainer ever attached to it, none is
  // resuming it and it was not kept across a restart (an attach refused:
  // unattached, it would only wait for its attach lease), unfinished, its
  // teardown left in `later`. False otherwise, or for a wrong token.
  bool CloseNeverAttached(const SessionKey& key, Teardowns* later) ABSL_LOCKS_EXCLUDED(mu_);
  // Closes session `id` because its trainer went away (no token: the arena
  // channel saw the trainer's connection close). False if it was not open.
  // With `later`, its teardown is left there (see Teardowns).
  bool Abandon(uint64_t id, Teardowns* later = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // Its trainer went away but may come back (a positive reconnect lease):
  // the session's holds are released (as a dead trainer's are) and it stays
  // open, detached, until a trainer attaches again (ResumeSession, then the
  // arena channel) or CloseExpired closes it. False if it was not open.
  bool Detach(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  // What a trainer resuming session `key` needs (its token proves it may):
  // as OpenSession answers. NOT_FOUND / FAILED_PRECONDITION as for any
  // call (a daemon restarted since; the session closed, its lease over).
  absl::StatusOr<OpenedSession> Resume(const SessionKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  // Closes the sessions opened more than `attach_lease` before `now` that
  // no trainer ever attached to (DupArenaFd); with a positive `idle_lease`,
  // those no call found for longer than it and with no call in flight (a
  // trainer that hangs while attached); and those detached for longer than
  // `reconnect_lease` (counted as abandoned). Returns them.
  struct Expired {
    enum Why { kNeverAttached, kIdle, kNotResumed };
    uint64_t id;
    std::string name;
    Why why;
  };
  using SteadyTime = std::chrono::steady_clock::time_point;
  // From now on CloseExpired closes nothing: offloadd is stopping to keep
  // its sessions, and its trainers' calls, refused meanwhile, no longer
  // renew their leases (one closed as idle while sessions ahead of it are
  // written would be lost instead of kept).
  void PauseLeases() ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<Expired> CloseExpired(SteadyTime now, absl::Duration attach_lease,
                                    absl::Duration idle_lease,
                                    absl::Duration reconnect_lease = absl::ZeroDuration(),
                                    Teardowns* later = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // The arena channel handed session `id`'s arena to a trainer (after the
  // reply went out); false if the session is closed.
  bool MarkAttached(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);

  std::vector<SessionSummary> Sessions() const ABSL_LOCKS_EXCLUDED(mu_);
  // Open (and reopening a kept session) past `max` sessions is
  // RESOURCE_EXHAUSTED (server.max_sessions); 0: no cap.
  void SetMaxSessions(int64_t max) ABSL_LOCKS_EXCLUDED(mu_);
  // Open with a `user` that has `max` sessions open (attached or not) is
  // RESOURCE_EXHAUSTED (server.max_sessions_per_user); 0: no bound.
  void SetMaxSessionsPerUser(int64_t max) ABSL_LOCKS_EXCLUDED(mu_);

  // Keeping sessions across a restart of offloadd: what engine/kept_sessions
  // (which writes and reads them) asks of the sessions.
  //
  // What reopening a session needs besides its checkpoint.
  struct KeptSession {
    SessionKey key;
    std::string name;
    std::string restore_from;               // the checkpoint it was opened to restore, if any
    std::vector<uint64_t> partition_ids;    // ascending: its checkpoint manifest's order
    bool keep_for_resume = false;           // RestoreFrom::keep_for_resume
    std::optional<uint64_t> restore_steps;  // RestoreFrom::steps, with restore_from
    std::optional<uid_t> user;              // Open's `user`: still counted once reopened
    int64_t share_weight = 0;               // its weight (SetShare); 0: the default
  };
  // Closes every session's request ring between calls (one posted is served
  // and answered first; RingServer::Drain), so that what a trainer saw
  // answered is in what is kept and what it saw refused is not.
  void DrainRings(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<uint64_t> SessionIds() const ABSL_LOCKS_EXCLUDED(mu_);
  // Session `id` ready to be checkpointed for keeping: a background
  // checkpoint being written ends first, what its trainer held is dropped
  // (a partition held for writing would stop the checkpoint; the trainer
  // fetches again once it resumed). NOT_FOUND if it closed (nothing to
  // keep); a stopped step that cannot be finished, that error.
  absl::StatusOr<KeptSession> QuiesceForKeeping(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  // The reopened session `id` no longer has its kept copy (its kept memory
  // was taken: engine/kept_sessions.h): nothing is left there to fall back on.
  void ForgetKeptCopy(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  // True if session `id` is open, reopened from `dir` and not resumed since.
  bool ReopenedFrom(uint64_t id, const std::string& dir) const ABSL_LOCKS_EXCLUDED(mu_);
  // Reopens `kept` with its id, token, partitions (their ids too) and state
  // from the checkpoint in `dir`, detached as a trainer that went away:
  // ResumeSession takes it back. `dir` is removed once a trainer resumed it
  // or it closed; until then a crash leaves it for the next offloadd. An
  // error leaves nothing open.
  absl::Status Reopen(const KeptSession& kept, const std::string& dir) ABSL_LOCKS_EXCLUDED(mu_);
  // The reconnect lease of the reopened sessions `ids` starts now.
  void StartReconnectLeases(absl::Span<const uint64_t> ids) ABSL_LOCKS_EXCLUDED(mu_);
  // Session `id` of the offloadd before was not kept across its stop, or
  // could not be reopened (`why`, a phrase: "offloadd kept it ... but"):
  // its trainer's calls are answered as after a crash (NOT_FOUND, with why
  // and its automatic checkpoint), so that it goes on from that.
  void NotReopened(uint64_t id, std::string why) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // A skip decided before the step ran, counted: an overflow (here or on
  // another rank: steps_skipped) or the trainer's (steps_dropped).
  void CountDecidedSkip(bool skip, bool overflow);
  struct Session;

  // Open with the id and token of a session kept across a restart
  // (`reuse`), else new ones.
  absl::StatusOr<OpenedSession> OpenAs(absl::string_view name, const PlacementChange& placement,
                                       const std::optional<LossScalingOptions>& loss_scaling,
                                       std::optional<uint64_t> delayed_update_after,
                                       const RestoreFrom& restore_from, const SessionKey* reuse,
                                       std::optional<uid_t> user = std::nullopt)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The automatic checkpoint directories of lost sessions called `name`
  // (RestoreFrom::lost): `dir`, the newest (with `steps`, the newest holding
  // that step; empty if none, NOT_FOUND if `steps` > 0 was asked for), the
  // steps all of them hold (descending), and the others.
  struct LostCheckpoints {
    std::string dir;
    std::vector<uint64_t> steps;
    std::vector<std::string> others;
  };
  // Only those `user` opened (Manifest.opened_by; nullopt: offloadd's own).
  absl::StatusOr<LostCheckpoints> FindLost(absl::string_view name, std::optional<uint64_t> steps,
                                           std::optional<uid_t> user) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Register with partition id `reuse_id` (a kept session's), else a new one.
  absl::StatusOr<PartitionInfo> RegisterAs(const SessionKey& key, const PartitionSpec& spec,
                                           std::optional<uint64_t> reuse_id)
      ABSL_LOCKS_EXCLUDED(mu_);

  // NOT_FOUND for an id of an earlier offloadd's, naming the automatic
  // checkpoint that offloadd left of it, if any.
  absl::Status FromBeforeARestart(uint64_t id) const ABSL_LOCKS_EXCLUDED(mu_);
  // An id no session of this offloadd has (a new session's, or a final
  // checkpoint's directory).
  uint64_t NewSessionId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the sessions called `name` kept for a resume whose trainers went
  // away (detached, waiting on their reconnect lease: a trainer that died,
  // or a session kept across a restart of offloadd; not one a trainer is
  // resuming) as not resumed, so that a new session of the name kept for
  // a resume too (the job restarted) has their memory and finds what they
  // held by name (FinalCheckpoint). Only those `user` opened (Open's
  // `user`; unset: offloadd's own user's and root's): no user closes
  // another's by naming it.
  void TakeOverDetached(absl::string_view name, std::optional<uid_t> user) ABSL_LOCKS_EXCLUDED(mu_);
  // A session kept for a resume that goes unfinished, once no call can find
  // it (calls that found it before, and a running step, are waited for, up
  // to kFinalCheckpointWait): its state at its last step boundary becomes
  // a checkpoint in a directory of its own under the automatic ones (a lost
  // session's, as FindLost sees them; its own automatic pair stays),
  // unless its automatic checkpoints or the one it restored hold that step
  // already, or it is not whole (it never stepped since it opened, and
  // was not `reopened` from a kept directory). Gradients returned since
  // that step are dropped first: a restarted job redoes the iteration. One
  // it cannot write (a step stopped midway, initial values not committed)
  // is logged and false returned; its automatic checkpoints stay.
  // A step of `session` that stopped midway, finished as it was decided
  // (without its trainer: to keep the session, or its last state); OK if
  // none stopped.
  absl::Status FinishStoppedStep(Session& session) ABSL_LOCKS_EXCLUDED(mu_);
  bool FinalCheckpoint(const std::shared_ptr<Session>& session, bool reopened)
      ABSL_LOCKS_EXCLUDED(mu_);
  static constexpr absl::Duration kFinalCheckpointWait = absl::Seconds(60);
  // How long FindLost waits for a FinalCheckpoint of its name (several
  // may queue for the arena channel's teardown threads, each writing a
  // whole session) before UNAVAILABLE ("retry": offloadd.torch does);
  // under the clients' call timeout (10 minutes).
  static constexpr absl::Duration kFindLostWait = absl::Minutes(8);
  // How long a session a trainer resumed (ResumeSession) is left alone by
  // takeovers while its trainer attaches.
  static constexpr absl::Duration kResumeAttachWait = absl::Seconds(60);
  // Step and Checkpoint once the session is found (Step has waited for
  // the previous overlapped step to end).
  absl::StatusOr<StepSummary> DecideStep(const std::shared_ptr<Session>& session,
                                         const AdamHyperparams& h, const StepControl& control)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Whose checkpoint StartCheckpoint writes: the trainer's (never into
  // offloadd's own directories: CheckOutsideManaged), an automatic one, the
  // last of a session that went unfinished (into its automatic ones'
  // directory), a session's kept across a restart.
  enum class CheckpointFor { kTrainer, kAutomatic, kFinal, kKeeping };
  absl::StatusOr<CheckpointOutcome> StartCheckpoint(const std::shared_ptr<Session>& session,
                                                    const std::string& dir, bool background,
                                                    CheckpointFor whose,
                                                    PoolFile* by_reference = nullptr,
                                                    const std::string& memory_file = "")
      ABSL_LOCKS_EXCLUDED(mu_);
  // INVALID_ARGUMENT if `dir` is or lies inside the automatic checkpoints'
  // directory or the kept sessions': a trainer's checkpoint written there
  // would replace what a lost session resumes from, or a kept session's
  // state.
  absl::Status CheckOutsideManaged(const std::string& dir) const ABSL_LOCKS_EXCLUDED(mu_);
  // The operator's checkpoint into `dir` where another job's checkpoint
  // holds elements of the same tensors: FAILED_PRECONDITION (a restore of
  // the directory would refuse it).
  absl::Status CheckNoOtherJobsCheckpoint(const Session& session, const std::string& dir) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // After a step: an automatic checkpoint if one is due (SetAutoCheckpoint),
  // or, `decided` (the job's ranks agreed: StepControl::auto_checkpoint),
  // if true.
  void MaybeAutoCheckpoint(const std::shared_ptr<Session>& session,
                           std::optional<bool> decided = std::nullopt) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether `s`'s automatic checkpoint is due at `steps` and `now` (the
  // interval or the step count since its last one); `s.checkpoint_mu` held.
  static bool AutoCheckpointDue(const AutoCheckpointOptions& options, const Session& s,
                                uint64_t steps, SteadyTime now);
  // With `operator_call`, an empty token is accepted (see Checkpoint).
  absl::StatusOr<std::shared_ptr<Session>> Find(const SessionKey& key,
                                                bool operator_call = false) const
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CheckOwnerLocked(const Session& session, uint64_t partition_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Finds the session and checks it owns every partition in `ids`.
  absl::StatusOr<std::shared_ptr<Session>> FindOwning(const SessionKey& key,
                                                      absl::Span<const uint64_t> ids) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // With `only_unattached`, not if a trainer attached to it; with
  // `only_idle_since`, not if a call found it after that time or one is in
  // flight. `why` (a Stats counter: abandoned, expired), if given, counts
  // the close as sessions_closed does, in the same step that takes the
  // session out of Sessions(): a caller that sees it gone sees it counted.
  // `finished` false (a trainer gone, a lease over, a Close not finished):
  // a session kept for a resume leaves its automatic checkpoints.
  // `only_if`, if given, is checked under mu_ with the session found.
  bool CloseById(uint64_t id, bool only_unattached = false,
                 std::optional<SteadyTime> only_idle_since = std::nullopt,
                 std::atomic<int64_t>* why = nullptr, Teardowns* later = nullptr,
                 bool finished = true, const std::function<bool(const Session&)>& only_if = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  Env* const env_;
  PartitionStoreFactory* const store_;
  StepRunner* const steps_;
  Stats* const stats_;
  const uint64_t incarnation_;  // the high 32 bits of this daemon's session ids

  mutable absl::Mutex mu_;
  uint64_t next_session_id_ ABSL_GUARDED_BY(mu_);
  uint64_t next_partition_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool leases_paused_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  // Ids of sessions an earlier offloadd kept and this one reopened (their
  // incarnation is not this daemon's): once closed, they are said to be
  // closed, not unknown.
  absl::flat_hash_set<uint64_t> kept_ids_ ABSL_GUARDED_BY(mu_);
  // Kept sessions that could not be reopened, and why (NotReopened).
  absl::flat_hash_map<uint64_t, std::string> not_reopened_ ABSL_GUARDED_BY(mu_);
  // partition id -> owning session id, for telling "not yours" from "no such".
  absl::flat_hash_map<uint64_t, uint64_t> partition_owner_ ABSL_GUARDED_BY(mu_);
  absl::Duration ring_spin_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  int64_t max_sessions_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t max_sessions_per_user_ ABSL_GUARDED_BY(mu_) = 0;
  // RESOURCE_EXHAUSTED if `user` holds max_sessions_per_user_ sessions.
  absl::Status CheckRoomForUserLocked(std::optional<uid_t> user) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  AutoCheckpointOptions auto_checkpoint_ ABSL_GUARDED_BY(mu_);
  std::string kept_dir_ ABSL_GUARDED_BY(mu_);  // SetKeptDirectory
  // Names (and the users who opened them) of closed sessions whose
  // FinalCheckpoint is being written: FindLost waits for its user's (what it
  // finds must not change under a job's agreement on a step), not another
  // user's of the same name, which it would not find.
  using NameOfUser = std::pair<std::string, std::optional<uid_t>>;
  absl::flat_hash_map<NameOfUser, int> finalizing_ ABSL_GUARDED_BY(mu_);
  mutable absl::CondVar finalized_;
  std::atomic<RingCalls*> ring_calls_{nullptr};
  // Reserves the mappings registering `spec` may take, now or later, in
  // the node's total and the session's (released when the session goes, or
  // by Unreserve if the registration fails), with room for its span;
  // RESOURCE_EXHAUSTED if that or what is mapped now could pass the budget.
  struct Reservation {
    int64_t mappings = 0;   // for what it maps later (Unreserve if registering fails)
    int64_t span_room = 0;  // for its span, given back once registered
    // Its small chunks' tickets (small_chunks_): [ticket, ticket + ticket_chunks).
    uint64_t ticket = 0;
    uint64_t ticket_chunks = 0;
  };
  absl::StatusOr<Reservation> ReserveMappings(Session& session, const PartitionSpec& spec)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Gives back what ReserveMappings reserved for a registration that did
  // not go through: a refused one, asked again, is refused again.
  void Unreserve(Session& session, const Reservation& r);
  // Every live session's reservations and its arena's span mappings, as
  // they are mapped (shared with them and their arenas: a session may be
  // destroyed after the manager's last call).
  const std::shared_ptr<std::atomic<int64_t>> committed_mappings_ =
      std::make_shared<std::atomic<int64_t>>(0);
  GpuTierSettings gpu_settings_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> mapping_budget_{0};
  std::atomic<int> capture_threads_{4};  // SetCaptureThreads
  // Tickets of chunks with slab-sized blocks (ReserveMappings), ever.
  std::atomic<uint64_t> small_chunks_{0};
  const std::shared_ptr<PollBudget> ring_pollers_ =
      std::make_shared<PollBudget>(PollBudget::DefaultMax());
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_SESSION_MANAGER_H_
