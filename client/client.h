// The C++ client library for trainers and tools.
//
//   auto client = offload::Client::Connect({});            // default socket
//   auto session = (*client)->OpenSession("rank0");        // closes itself
//   auto w = (*session)->Register("w", n, DType::kBf16, DType::kBf16);
//   ... write initial params into w->params ...
//   (*session)->Release(*w);
//   ... each iteration, for each layer, forward:
//   auto p = (*session)->Fetch(w->id);     // held: read p->params
//   (*session)->Release(*p);
//   ... backward:
//   auto g = (*session)->Fetch(w->id, {.grads = true});
//   ... write gradients into g->grads ...
//   (*session)->ReturnGradients(*g);       // hands the gradient buffer back
//   (*session)->Release(*g);
//   ... then:
//   (*session)->Step(hyperparams);
//
// Tensor data never crosses gRPC: a session maps the daemon's shared arena
// once, and PartitionView points straight into it.
//
// Residency contract: the daemon keeps a partition's bytes in the arena only
// while this session holds it; released data may move to NVMe (when placed
// there and the host pool needs the room), and its pages leave the arena.
// Register and Fetch hold a partition's parameters (Fetch with grads also
// its gradient buffer); Release lets them go; ReturnGradients hands the
// gradient buffer back. Read a partition's parameters, and write its
// gradients, only while holding them: outside a hold, reads may see zeros
// and writes may be lost. Parameters change only during Step (hold them
// `writable` to change them yourself). After a Step, gradient buffers hold
// no defined values: write every element before returning. Everything held is released when the
// session ends (Close, or this process's death). Holding more at once than the daemon's host pool
// can hold is RESOURCE_EXHAUSTED, with the numbers.
//
// Thread-safety: Client and Session are safe to use from several threads;
// calls on one session are applied by the daemon in arrival order.
#ifndef OFFLOADD_CLIENT_CLIENT_H_
#define OFFLOADD_CLIENT_CLIENT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "cpu_adam/dtype.h"
#include "cpu_adam/types.h"
#include "gpu/device.h"

namespace offload {
namespace v1 {
class OpenSessionResponse;
}  // namespace v1

struct ClientOptions {
  // "unix:/path/offloadd.sock" or "127.0.0.1:PORT" (tools only: sessions
  // need the Unix socket's arena channel on the same machine). Empty means
  // $OFFLOADD_ADDRESS, else the daemon's default socket.
  std::string address;
  // How long Connect waits for the daemon to answer.
  absl::Duration connect_timeout = absl::Seconds(5);
  // Deadline of each call. Step on a large model takes longest.
  // absl::InfiniteDuration(): none (either timeout).
  absl::Duration call_timeout = absl::Minutes(10);
  // Over TCP, offloadd serves read-only status unless calls carry the token
  // it wrote to <data_dir>/tcp_token. Empty means $OFFLOADD_TOKEN, if set.
  // Not needed on the Unix socket.
  std::string token{};
  // Fetch, release and return gradients of up to 512 partitions, and the
  // step's GetPendingGradients, Step and WaitStep, through the session's
  // shared-memory request ring (futex wake-ups) instead of gRPC, when the
  // daemon offers one (the last two where it serves them). Off: everything
  // over gRPC.
  bool request_ring = true;
  // How long a call through the ring spins for its answer before sleeping:
  // lower it where trainers outnumber cores.
  absl::Duration request_ring_spin = absl::Microseconds(100);
  // While a session is open, a thread calls offloadd every quarter of its
  // idle lease (server.idle_lease_seconds, which it tells the session at
  // open), so that a trainer quiet for longer (its own checkpoint, a
  // barrier) keeps its session; a frozen or stopped process's lapses. Off:
  // the trainer's own calls must come often enough.
  bool keepalive = true;
};

// Where a session's data rests: per kind, the percentage of its bytes kept
// in the daemon's host memory; the rest rests on its NVMe tier and is
// brought into memory while in use (training is bit-for-bit the same, only
// slower). Unset: the daemon's default (placement.<kind>_host_percent) when
// opening, unchanged in SetPlacement. Below 100 needs an NVMe tier.
struct Placement {
  std::optional<int> params_host_percent;           // working parameters
  std::optional<int> grads_host_percent;            // gradient buffers
  std::optional<int> optimizer_state_host_percent;  // fp32 master, Adam moments
};

// Dynamic loss scaling for fp16 training, kept by the daemon (see
// offload.proto's LossScaling for the rule). Unset fields: the defaults.
struct LossScaling {
  std::optional<double> initial_scale;     // 65536
  std::optional<int64_t> growth_interval;  // 1000
  std::optional<double> growth_factor;     // 2
  std::optional<double> backoff_factor;    // 0.5
  std::optional<int64_t> hysteresis;       // 2
  std::optional<double> min_scale;         // 1
};

// How a session wants its data kept, and its loss scaled.
struct SessionOptions {
  Placement placement;
  // Set for fp16 training: multiply the loss by PendingGradients' (and
  // Step's) loss_scale; the daemon unscales, skips overflowing steps and
  // adjusts the scale.
  std::optional<LossScaling> loss_scaling;
  // Set: the delayed parameter update switches itself on after this many
  // steps (0: from the first; ZeRO-Offload used 40). See SetDelayedUpdate.
  std::optional<uint64_t> delayed_update_after_steps;
  // An absolute directory a checkpoint was written into (Session::
  // Checkpoint): the session restores it. Its steps, loss scale, delayed
  // update and (unless set above) placement come from it, and each
  // partition registered takes its saved state (PartitionView::restored)
  // from whichever checkpointed sessions held its tensor's elements.
  std::string restore_from;
  // With restore_from empty: restore the newest automatic checkpoint a
  // session of the same name left when an earlier offloadd died (none: a
  // new session; Session::restored_from says which).
  bool resume_lost = false;
  // With restore_from or resume_lost: the checkpoint taken after this many
  // steps (an automatic checkpoint keeps the one before it); unset: the
  // latest.
  std::optional<uint64_t> restore_steps;
  // Its automatic checkpoints stay when it goes unfinished (this process
  // dies, or destroys the Session without Close()): a restarted job finds
  // them with resume_lost. Close() (the job ended) removes them.
  bool keep_for_resume = false;
  // The session's weight in the node's optimizer when several sessions
  // step at once (0: 1; at most 1000). Client::SetShare changes it.
  uint32_t share_weight = 0;
};

// Which slice of which tensor a partition is: elements [offset, offset +
// numel) of the tensor's flattened values (the last slice may run past its
// end: padding). Checkpoints restore by tensor elements, so a job may come
// back with another number of ranks, and export whole tensors.
struct TensorSlice {
  std::string tensor;
  std::vector<uint64_t> shape;
  uint64_t offset = 0;
};

// A checkpoint written (or, `running`, being written in the background).
struct CheckpointResult {
  std::string manifest;  // its path, once written
  uint64_t partitions = 0;
  uint64_t bytes = 0;     // of the data file
  uint64_t steps = 0;     // the session's, at the checkpoint
  uint64_t pause_us = 0;  // what training waited: reaching the step boundary
  uint64_t wall_us = 0;
  bool running = false;
};

// A gradient buffer's squared norm and non-finite count as the trainer
// computed them (offload.proto's GradientStats): of the values as written
// (with loss scaling, scaled); sq_norm in any order and precision, not
// negative, NaN only with nonfinite > 0.
struct GradientStats {
  double sq_norm = 0;
  uint64_t nonfinite = 0;
};

// What the gradients returned since the last step add up to (see
// Session::PendingGradients).
struct PendingGradients {
  // Unscaled; the partitions' (as measured, or as the trainer gave them)
  // summed in double.
  double sq_norm = 0;
  uint64_t nonfinite = 0;
  uint64_t partitions = 0;
  uint64_t micro_batches = 0;
  double loss_scale = 1;
  // The session's delayed update is on now: the parameters fetched may be
  // a step older than its last step's; SetDelayedUpdate(false) drains it.
  bool delayed_update = false;
  // The session's automatic checkpoint is due (offloadd's clock or step
  // count): a job of several ranks agrees on it (any rank's: all) and
  // passes it to every rank's Step (StepOptions::auto_checkpoint), so that
  // their checkpoints are of the same step.
  bool auto_checkpoint_due = false;
};

// How Step commits after the trainer's global decisions.
struct StepOptions {
  bool skip = false;      // consume the gradients, change nothing
  bool overflow = false;  // some rank overflowed: skip and lower the loss scale
  // Return once decided; the update overlaps the next forward pass (a fetch
  // waits only for its own partition's update). WaitStep gives the outcome.
  bool overlap = false;
  // Partitions whose hyperparameters differ from the step's (torch's param
  // groups); grad_scale is always the step's.
  struct Group {
    std::vector<uint64_t> partition_ids;
    AdamHyperparams hyperparams;
  };
  std::vector<Group> groups;
  // The automatic checkpoint at this step: unset, as offloadd decides for
  // this session alone; true/false, as the job decided (every rank alike).
  std::optional<bool> auto_checkpoint;
};

// How Fetch holds partitions.
struct FetchOptions {
  // Also hold the gradient buffers, to write gradients into (backward).
  bool grads = false;
  // The trainer will change the parameters itself (loading a checkpoint).
  bool writable = false;
  // The trainer loads new values (load_state_dict): writable, and the
  // release makes them the master weights: write fp32 values into
  // PartitionView::master_init where it is set (a 16-bit working copy is
  // then rounded from them), else into params. Moments and steps stay.
  bool load = false;
  // With grads: where a gradient buffer asked for is still the step's (the
  // delayed update's, an overlapped step's, or being measured), ABORTED at
  // once (IsNotReady), holding nothing, instead of waiting until the step
  // has read it. Answered so where Session::FetchesIfReady says; an
  // offloadd from before it waits as without it.
  bool if_ready = false;
};

// A partition as the trainer sees it: pointers into the mapped arena, whose
// bytes are there while the session holds the partition.
struct PartitionView {
  uint64_t id = 0;
  std::string name;
  uint64_t numel = 0;
  DType param_dtype = DType::kFp32;
  DType grad_dtype = DType::kFp32;
  uint64_t step = 0;  // optimizer steps applied so far
  void* params = nullptr;
  void* grads = nullptr;
  // Registered with fp32_master, until released: the fp32 initial values
  // to write (numel floats). Null otherwise.
  float* master_init = nullptr;
  // Registered by a session restoring a checkpoint: its parameters and
  // optimizer state are the saved ones; release it without writing.
  bool restored = false;
  // Its params and grads are registered for DMA with the device given to
  // Session::EnableDma: copies to and from them run at the link's speed
  // without blocking the host.
  bool dma = false;
  // The mapping the pointers above are in. Holding it keeps them mapped
  // after the Session closes or goes (its bytes stale then, never a fault):
  // for views that may outlive their Session (the Python binding's).
  std::shared_ptr<const void> memory;

  // Typed access; the element type must match the dtype's size.
  template <typename T>
  absl::Span<T> params_as() const {
    return absl::Span<T>(static_cast<T*>(params), numel);
  }
  template <typename T>
  absl::Span<T> grads_as() const {
    return absl::Span<T>(static_cast<T*>(grads), numel);
  }
};

struct StepResult {
  uint64_t partitions_updated = 0;
  uint64_t params_updated = 0;
  // Non-finite gradients: nothing changed; return fresh gradients (for
  // example after lowering the loss scale) and step again.
  bool skipped = false;
  uint64_t nonfinite_gradients = 0;
  // Where the step's time went in the daemon (microseconds): in all, waiting
  // for optimizer state placed on NVMe, updating.
  uint64_t wall_us = 0;
  uint64_t state_wait_us = 0;
  uint64_t compute_us = 0;
  // The loss scale for the next iteration (1 without loss scaling).
  double loss_scale = 1;
  // An overlapped step still running (the figures are the decision's).
  bool running = false;
  // The session's delayed update was on: until the next step the parameters
  // fetched are one step older than this step's (SetDelayedUpdate(false)
  // makes the newest current).
  bool delayed_update = false;
};

struct Tunable {
  std::string name, type, value, default_value, unit, description;
  bool dynamic = false;
};

// What a GPU tier did since it began (totals), as it reports it to the
// daemon (Session::ReportGpuTier) and GetStats shows it per session.
struct GpuTierCounters {
  uint64_t h2d_bytes = 0, h2d_staged_bytes = 0, d2h_bytes = 0;
  uint64_t tensor_uses = 0, resident_hits = 0, prefetch_hits = 0;
  uint64_t host_waits = 0, evictions = 0;
  uint64_t resident_bytes = 0, budget_bytes = 0, dma_bytes = 0;
  uint64_t prefetch_depth = 0, prefetch_bytes = 0;  // in effect
};

// The node's settings for GPU tiers (offloadctl set gpu.*); -1: the
// trainer's own.
struct GpuTierNodeSettings {
  int64_t prefetch_depth = -1;
  int64_t prefetch_bytes = -1;
};

struct DaemonStats {
  struct Counter {
    std::string name;
    int64_t value;
    std::string unit;
  };
  struct Tier {
    std::string name;
    uint64_t used_bytes, budget_bytes;
  };
  struct Session {
    uint64_t id = 0;
    std::string name;
    uint64_t partitions = 0, arena_bytes = 0, steps = 0;
    uint64_t held = 0;  // partitions held now
    // Bytes placed by kind and tier.
    uint64_t params_host_bytes = 0, params_nvme_bytes = 0;
    uint64_t grads_host_bytes = 0, grads_nvme_bytes = 0;
    uint64_t state_host_bytes = 0, state_nvme_bytes = 0;
    std::optional<GpuTierCounters> gpu;  // its GPU tier's last report
    // Its steps' time so far (ended steps), nanoseconds: in all, waiting for
    // optimizer state to be brought in, in the update.
    int64_t step_wall_nanos = 0, step_wait_nanos = 0, step_compute_nanos = 0;
    // Its weight in the node's optimizer, parameters updated, and the time
    // its updates waited for other sessions'.
    int64_t share_weight = 1;
    uint64_t optimizer_params = 0;
    int64_t optimizer_queued_nanos = 0;
    // Its blocks' NVMe traffic, and the time their transfers waited for the
    // daemon's I/O threads.
    uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0;
    int64_t io_queued_nanos = 0;
    // The host pool's room its NVMe-homed blocks hold, its blocks evicted.
    uint64_t pool_room_bytes = 0, pool_evictions = 0;
    // Seconds since its trainer went away without closing it (kept for a
    // trainer to resume); -1 while one is attached or none attached yet.
    int64_t detached_seconds = -1;
  };
  std::string version;
  uint32_t pid = 0;
  int64_t uptime_ms = 0;
  std::vector<std::string> listening;
  std::string optimizer;
  std::vector<Tier> tiers;
  std::vector<Counter> counters;
  std::vector<Session> sessions;
};

class Client;

// Whether `s` is a Fetch with FetchOptions::if_ready refused because a
// gradient buffer is still the step's (nothing was held), not another
// ABORTED (a request ring reset, whose call may or may not have happened).
bool IsNotReady(const absl::Status& s);

class Session {
 public:
  // Close()s if still open, ignoring errors; not if the offloadd it attached
  // to is gone (a restarted one may keep the session for ResumeSession).
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  uint64_t id() const;
  // The session's secret (raw bytes): with id(), what ResumeSession needs.
  // Keep it where only this user can read it.
  const std::string& token() const;
  // Where offloadd writes this session's automatic checkpoints (empty: they
  // are off). After a crash of offloadd (calls answer NOT_FOUND: the
  // session is from before its restart), open a session with
  // SessionOptions::restore_from this directory to go on from the last.
  const std::string& auto_checkpoint_dir() const;
  // The checkpoint directory it restored (SessionOptions::restore_from, or
  // the one resume_lost found; empty if none), and the steps of its
  // checkpoints there: the latest first, then the kept previous one.
  const std::string& restored_from() const;
  const std::vector<uint64_t>& restorable_steps() const;
  // Whether a Fetch of that many partitions with FetchOptions::if_ready is
  // answered at once (through the request ring, by an offloadd that knows
  // it).
  bool FetchesIfReady(size_t partitions) const;

  // Registers a partition, zeros, and holds it (writable) for the initial
  // values to be written.
  // With `fp32_master`, write the initial values in fp32 into
  // master_init instead of params: the release makes them the master
  // weights exactly and the working copy rounded.
  // `slice`: which tensor's elements it holds (unset: a tensor of its own).
  absl::StatusOr<PartitionView> Register(const std::string& name, uint64_t numel, DType param_dtype,
                                         DType grad_dtype, bool fp32_master = false,
                                         const std::optional<TensorSlice>& slice = std::nullopt);
  // Holds partitions (see the residency contract above). An empty list
  // fetches every partition of the session.
  absl::StatusOr<PartitionView> Fetch(uint64_t partition_id, const FetchOptions& options = {});
  absl::StatusOr<std::vector<PartitionView>> Fetch(absl::Span<const uint64_t> partition_ids,
                                                   const FetchOptions& options = {});
  // Lets holds go. An empty list releases everything this session holds.
  absl::Status Release(const PartitionView& p);
  absl::Status Release(absl::Span<const uint64_t> partition_ids);
  // Tells the daemon the gradients in `p.grads` (held: Fetch with grads)
  // are complete: it adds them into the partition's fp32 accumulator (call
  // once per micro-batch) and takes the buffer back at once.
  absl::Status ReturnGradients(const PartitionView& p);
  // Several in one call, in order; an error stops at the partition it
  // names (those before were returned, the message says how many). With
  // `release`, the holds of all of them then go (as Release). At most
  // 4096 partitions. With `hand_over` (for a step's last micro-batch), the
  // buffers are handed over instead of back: on a step's only micro-batch
  // the daemon measures the gradients (in the background: the call does
  // not wait for it) and its step reads them in place, and until that
  // partition's update has read them the buffer is the daemon's: do not
  // write it; a Fetch with grads of it waits while it is measured or
  // updated, and before the step takes it back (the daemon copies the
  // gradients into the accumulator first, so another micro-batch adds).
  absl::Status ReturnGradients(absl::Span<const PartitionView> parts, bool release = false,
                               bool hand_over = false);
  // ReturnGradients with hand_over, each buffer with the trainer's own
  // statistics of it (`stats[i]` of `parts[i]`), computed where the
  // gradients were made: on a GPU, before the copy to the host, they cost
  // next to nothing, and the daemon's measuring pass (a read of every
  // buffer, beside the running update) is saved. On a step's only
  // micro-batch the daemon takes them as measured and reads no buffer
  // before the step; on a later micro-batch it ignores them and measures
  // the sum as usual. Statistics that do not describe the buffer are the
  // trainer's error and are not detected (the step's non-finite check and
  // the clipping use them). INVALID_ARGUMENT if the sizes differ or a
  // statistic is out of range.
  absl::Status HandOverGradients(absl::Span<const PartitionView> parts,
                                 absl::Span<const GradientStats> stats, bool release = false);
  // The squared norm and overflow of what was returned since the last
  // step. Across ranks: all-reduce sq_norm (sum) and nonfinite (max), take
  // clip_coef = min(1, max_norm / (sqrt(total) + 1e-6)) as
  // torch.nn.utils.clip_grad_norm_ does, then Step with
  // grad_scale = clip_coef and overflow = any rank's nonfinite > 0.
  absl::StatusOr<PendingGradients> GetPendingGradients();
  // Updates every partition with accumulated gradients (or, with
  // options.skip/overflow, consumes them and changes nothing).
  absl::StatusOr<StepResult> Step(const AdamHyperparams& h, const StepOptions& options = {});
  // The outcome of the last overlapped step, once it has ended.
  absl::StatusOr<StepResult> WaitStep();
  // The delayed parameter update on or off now (offload.proto's
  // SetDelayedUpdateRequest): fetches during a step are served at once with
  // the parameters one step older; release every partition before Step.
  // Off drains: the newest parameters become current. With DMA enabled,
  // the working copies' registrations go (the daemon adds or removes a
  // buffer's pages): call it with no copy in flight from them.
  absl::Status SetDelayedUpdate(bool enabled);
  // Partition `id`'s Adam state as torch's AdamW keeps it (offload.proto's
  // GetMomentsRequest): its step count and elements [begin, begin + count)
  // of its two moments; WriteMoments sets them (both spans the same size).
  // Between this session's steps. Any size: split into calls of at most
  // 4M elements (reads; 2/3 of that with the master) or 384K (writes: the
  // daemon receives at most 4 MiB).
  // With `with_master`, the fp32 master weights of those elements too (the
  // newest, also with the delayed update on).
  struct Moments {
    uint64_t step = 0;
    std::vector<float> exp_avg, exp_avg_sq;
    std::vector<float> master;  // with_master only
  };
  absl::StatusOr<Moments> ReadMoments(uint64_t id, uint64_t begin, uint64_t count,
                                      bool with_master = false);
  absl::Status WriteMoments(uint64_t id, uint64_t step, uint64_t begin,
                            absl::Span<const float> exp_avg, absl::Span<const float> exp_avg_sq);
  // Tells the daemon what this session's GPU tier did (GetStats shows it;
  // the node's gpu_* counters add it up) and answers the node's settings
  // for it. GpuTier calls it about once a second.
  absl::StatusOr<GpuTierNodeSettings> ReportGpuTier(const GpuTierCounters& counters);
  // Changes where this session's data rests while it trains (unset kinds
  // keep theirs); returns at once, the daemon moves the data in the
  // background. FAILED_PRECONDITION below 100% on the host for params or
  // grads while DMA is enabled.
  absl::Status SetPlacement(const Placement& placement);
  // From now on, registers with `device` for DMA the regions the daemon
  // names in Fetch and Register answers: each partition's working copy and
  // gradient buffer, each once (the delayed update's second buffer when it
  // is first named, after the daemon made it); they are unregistered
  // before they are unmapped, when the Session goes. Only for a session
  // whose params and grads rest wholly on the host (placement 100%): the
  // daemon then never removes their pages, which a registration pins
  // (pages removed under it would leave the device copying stale memory).
  // A region the device refuses (RLIMIT_MEMLOCK, say) stays unregistered:
  // PartitionView::dma is false for it, one warning is logged, and
  // DmaStats counts it. `device` must outlive the Session.
  absl::Status EnableDma(gpu::Device* device);
  struct DmaStats {
    uint64_t regions = 0, bytes = 0;  // registered now
    uint64_t failed_regions = 0;
    uint64_t register_us = 0;  // time spent registering
  };
  DmaStats dma_stats() const;
  // Writes this session's checkpoint into `directory` (absolute; created
  // if missing) at the next step boundary, atomically; training waits only
  // for the step boundary (pause_us). With `background`, returns then and
  // WaitCheckpoint gives the outcome. Checkpoint every rank into the same
  // directory at the same step; restore with SessionOptions::restore_from.
  absl::StatusOr<CheckpointResult> Checkpoint(const std::string& directory,
                                              bool background = false);
  absl::StatusOr<CheckpointResult> WaitCheckpoint();
  // Closes the session in the daemon and unmaps its partitions (every
  // PartitionView of it is invalid afterwards; copies from them must have
  // ended). The job ended: automatic checkpoints kept for a resume go (a
  // Session destroyed without Close() leaves them). FAILED_PRECONDITION,
  // nothing closed, while a GpuTier of it lives (its copies read and write
  // the session's memory): destroy the tier first.
  absl::Status Close() { return Close(/*finished=*/true); }
  // `finished` false: the job did not end (a failure unwinding): automatic
  // checkpoints kept for a resume stay.
  absl::Status Close(bool finished);

 private:
  friend class Client;
  friend class GpuTier;  // counts itself attached (Close refuses meanwhile)
  struct Impl;
  explicit Session(std::unique_ptr<Impl> impl);
  // The count of GpuTiers attached, shared with them.
  std::shared_ptr<std::atomic<int>> TierCount() const;
  // `stats`: empty, or one per partition.
  absl::Status ReturnGradients(absl::Span<const PartitionView> parts, bool release, bool hand_over,
                               absl::Span<const GradientStats> stats);
  std::unique_ptr<Impl> impl_;
};

class Client {
 public:
  // UNAVAILABLE if no daemon answers at the address in time.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const std::string& address() const;

  // Opens a session and maps its arena. The Session may outlive the Client.
  absl::StatusOr<std::unique_ptr<Session>> OpenSession(const std::string& name,
                                                       const SessionOptions& options = {});
  // Takes back the session `session_id` (with its `token`, Session::token)
  // that a trainer which went away without closing it held: offloadd keeps
  // such a session, its holds released, for server.reconnect_lease_seconds
  // (0 by default: it is closed at once). Its partitions, optimizer state
  // and steps are as they were; their ids are the ones the old trainer had
  // (Fetch of none lists them). offloadd stopped with SIGTERM keeps its
  // sessions across its restart for that lease too. FAILED_PRECONDITION if
  // the session was closed (its lease ran out), NOT_FOUND if offloadd
  // restarted since without keeping it.
  absl::StatusOr<std::unique_ptr<Session>> ResumeSession(uint64_t session_id,
                                                         const std::string& token);
  // Session `session_id`'s weight in the node's optimizer (offloadctl
  // share): with several sessions stepping at once, each gets updates in
  // proportion. As the operator (no session token).
  absl::Status SetShare(uint64_t session_id, uint32_t weight);
  // Ends session `session_id` now, as the operator (offloadctl close): one
  // whose trainer went away (the reconnect lease keeps it), whose memory and
  // NVMe space would otherwise stay until the lease runs out; as the
  // lease's end, its automatic checkpoints stay only where it was opened for
  // a resume. One with a trainer attached, none yet, or being resumed:
  // FAILED_PRECONDITION.
  absl::Status CloseUnattachedSession(uint64_t session_id);

  absl::StatusOr<std::vector<Tunable>> ListTunables();
  absl::StatusOr<Tunable> GetTunable(const std::string& name);
  absl::StatusOr<Tunable> SetTunable(const std::string& name, const std::string& value);
  absl::StatusOr<DaemonStats> GetStats();
  // As Session::Checkpoint, for any session of the daemon, by id (an
  // operator's call: offloadctl checkpoint).
  absl::StatusOr<CheckpointResult> CheckpointSession(uint64_t session_id,
                                                     const std::string& directory);

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  // Attaches to the arena of the session OpenSession or ResumeSession named.
  absl::StatusOr<std::unique_ptr<Session>> Attach(const v1::OpenSessionResponse& resp,
                                                  bool close_on_failure);
  std::unique_ptr<Impl> impl_;
};

}  // namespace offload

#endif  // OFFLOADD_CLIENT_CLIENT_H_
