// The GPU tier of a trainer's session: gpu::ParamCache and
// gpu::GradientDrain over a client Session, so that a trainer (C++, or
// Python through the binding) gets its working parameters on the device
// ahead of use and its gradients back into the daemon's buffers while
// backward runs.
//
//   auto device = gpu::OpenCudaDevice(0);
//   auto tier = GpuTier::Create(session.get(), device->get(), {});
//   int unit = *(*tier)->params().AddUnit({{w.id, w.numel * 2}});
//   each iteration:
//     (*tier)->params().BeginIteration();
//     offsets = (*tier)->params().Use(unit, compute);  ... Done(unit, compute)
//     (*tier)->AddGradient(w.id, device_grad, bytes, compute);
//     (*tier)->ReturnGradients(/*wait=*/true, /*hand_over=*/true, stats);
//     session->Step(...); (*tier)->params().Invalidate(compute);
//
// Host side: the tier holds a partition's parameters (Fetch) only while
// their copy to the device runs, and its gradient buffer (Fetch with
// grads) from AddGradient until ReturnGradients hands it back; a partition
// held for both is released when neither needs it. With
// register_arena the session's arena is registered for DMA
// (Session::EnableDma): only for sessions whose params and grads rest
// wholly on the host; otherwise copies go through pinned staging buffers.
//
// Thread-safety: as the cache and the drain; the Session must outlive it, and
// the device the Session (with register_arena the Session holds DMA
// registrations of it until it closes).
#ifndef OFFLOADD_CLIENT_GPU_TIER_H_
#define OFFLOADD_CLIENT_GPU_TIER_H_

#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "gpu/device.h"
#include "gpu/gradient_drain.h"
#include "gpu/param_cache.h"

namespace offload {

struct GpuTierOptions {
  gpu::ParamCacheOptions params;
  // Pinned memory for gradients copied into unregistered host memory.
  uint64_t gradient_staging_bytes = 16ull << 20;
  // Register the session's arena for DMA (see Session::EnableDma).
  bool register_arena = true;
  // Hold every partition from BeginIteration to EndIteration (parameters
  // and, from the first gradient on, gradient buffers; with
  // SetGradientsPerBatch, each batch's gradient buffers as it comes)
  // instead of each while its copy runs: two calls to the daemon an
  // iteration instead of two per copy. Right where the holds cost no memory
  // (params and grads on the host) and a fetch of parameters does not wait
  // for a running step (not with the overlapped step).
  bool hold_per_iteration = false;
  // EndIteration reports to the daemon (Session::ReportGpuTier) when this
  // long passed since the last report, and applies the node's prefetch
  // settings it answers (offloadctl set gpu.prefetch_depth, ...). Zero:
  // every iteration; infinite: never.
  absl::Duration report_interval = absl::Seconds(1);
};

struct GpuTierStats {
  gpu::ParamCacheStats params;
  gpu::GradientDrainStats gradients;
  Session::DmaStats dma;
  uint64_t gradients_returned = 0;
  uint64_t gradient_failures = 0;
  // Holds, releases and gradient returns asked of the daemon, and the
  // calling threads' time in them (the trainer's, mostly).
  uint64_t daemon_calls = 0;
  uint64_t daemon_us = 0;
  uint64_t reports = 0;  // to the daemon (ReportGpuTier)
  // The prefetch in effect: the node's setting where it has one, else the
  // trainer's own.
  int prefetch_depth = 0;
  uint64_t prefetch_bytes = 0;
};

class GpuTier final : private gpu::HostSource, private gpu::GradientSink {
 public:
  // `slab`: the parameters' device memory, if the caller has it (a
  // framework's allocation); otherwise the cache allocates its budget.
  static absl::StatusOr<std::unique_ptr<GpuTier>> Create(Session* session, gpu::Device* device,
                                                         const GpuTierOptions& options,
                                                         gpu::DeviceMemory slab = {});
  // Waits for copies in flight; gradient buffers still held are released
  // unreturned. In a process forked from the one that made it (a data
  // loader's worker), it is its parent's: left alone, not even destroyed
  // (its copies' threads are not in the child; its holds are the parent's).
  // Better not deleted there at all (see forked_copy).
  ~GpuTier() override;
  // Whether this is a copy in a process forked from the one that made it:
  // deleting it there destroys its locks, which a thread of the parent may
  // have held when it forked (absl's deadlock graph's: the child then
  // waits for ever); leave it (the Python binding does).
  bool forked_copy() const { return getpid() != owner_; }

  gpu::ParamCache& params() { return *params_; }

  // An iteration (forward and backward) starts: with hold_per_iteration,
  // every partition the cache knows is held at once (one call; their
  // places in the arena are fixed until released), so that copies ask the
  // daemon nothing; then ParamCache::BeginIteration.
  absl::Status BeginIteration();
  // Before an iteration starts (after the optimizer step and Invalidate):
  // with hold_per_iteration, the iteration's holds taken now (BeginIteration
  // then finds them), and the units' copies issued
  // (ParamCache::PrefetchUnits), so that they run while the trainer
  // prepares the iteration instead of after its first Use. EndIteration (a
  // checkpoint, a drain of the delayed update) lets the holds go as ever;
  // the copies done stay on the device until Invalidate.
  absl::Status PrefetchUnits(absl::Span<const int> units);
  // The iteration's copies are done (ParamCache::Synchronize's outcome)
  // and every hold this tier has is let go, in one call: call it before
  // Session::Step (the delayed update needs every partition released).
  absl::Status EndIteration();

  // Copies the gradient of `partition_id` (`bytes` at device address
  // `src`, written by the work issued so far on `producer`) into its
  // buffer in the arena. `src` must stay valid until ReturnGradients
  // reports the partition.
  absl::Status AddGradient(uint64_t partition_id, const void* src, uint64_t bytes,
                           const gpu::Stream& producer);
  // Several at once (keys are partition ids): one wait on `producer` and
  // one completion event for them all (see GradientDrain::Add).
  absl::Status AddGradients(absl::Span<const gpu::GradientDrain::Item> items,
                            const gpu::Stream& producer);
  // Returns the gradients whose copies completed (every one added, with
  // `wait`) to the daemon, releasing their holds, with `stats` for each
  // if `stats` has every one of them (Session::HandOverGradients).
  // Returns their ids. A failed copy's buffer is released unreturned and
  // its error returned after the others went (nothing half-written is
  // returned).
  // `verify`, if given, is asked once the copies are done and before any
  // goes: an error (a collective that wrote the gradients failed) releases
  // every one of them unreturned and is returned.
  absl::StatusOr<std::vector<uint64_t>> ReturnGradients(
      bool wait, bool hand_over, const absl::flat_hash_map<uint64_t, GradientStats>& stats = {},
      const std::function<absl::Status()>& verify = nullptr);
  size_t gradients_pending() const { return drain_->pending(); }
  // Of them, those whose copies have not completed (never blocks).
  size_t gradients_in_flight() { return drain_->InFlight(); }
  // How the host waits for the tier's copies (both ways; see
  // gpu::HostWait), set by `owner` (a Zero3); ClearHostWait by the same
  // owner puts the device's Synchronize back (another's stays).
  void SetHostWait(const gpu::HostWait& wait, const void* owner) {
    absl::MutexLock lock(&host_wait_mu_);
    host_wait_owner_ = owner;
    drain_->SetHostWait(wait);
    params_->SetHostWait(wait);
  }
  void ClearHostWait(const void* owner) {
    absl::MutexLock lock(&host_wait_mu_);
    if (host_wait_owner_ != owner) return;
    host_wait_owner_ = nullptr;
    drain_->SetHostWait(nullptr);
    params_->SetHostWait(nullptr);
  }
  // Waits for the gradient copies in flight and releases their buffers
  // unreturned (an iteration given up): their sources may be freed after.
  absl::Status DropGradients();

  // With hold_per_iteration: whether the iteration's gradient buffers are
  // held each batch's own as gradients come (true: while the step before
  // may still read them, the delayed update's, so that a batch waits only
  // for its own partitions' updates) or all at the first (one call; the
  // default). Per batch, the first batch still holds all of them in one
  // call where the step has read them all by then (asked if ready: the
  // daemon says at once when it has not, and the batches hold their own).
  void SetGradientsPerBatch(bool per_batch) ABSL_LOCKS_EXCLUDED(mu_);

  // The trainer's own prefetch (ParamCache::SetPrefetch); the node's
  // settings, where it has them, win while they are set.
  void SetPrefetch(int depth, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  GpuTierStats stats() const;

 private:
  GpuTier(Session* session, gpu::Device* device, const GpuTierOptions& options)
      : session_(session),
        device_(device),
        hold_per_iteration_(options.hold_per_iteration),
        report_interval_(options.report_interval),
        own_depth_(options.params.prefetch_depth),
        own_bytes_(options.params.prefetch_bytes),
        attached_(session->TierCount()),
        owner_(getpid()) {
    attached_->fetch_add(1);
  }
  // Reports to the daemon if report_interval passed, and applies what it
  // answers. A failure is logged once and training goes on.
  void MaybeReport() ABSL_LOCKS_EXCLUDED(mu_);
  // The prefetch in effect: the node's settings where set, else the own.
  std::pair<int, uint64_t> PrefetchInEffect() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives the cache the prefetch in effect.
  void ApplyPrefetch() ABSL_LOCKS_EXCLUDED(mu_);
  // Holds every known partition (with grads: their gradient buffers too).
  absl::Status HoldAll(bool grads) ABSL_LOCKS_EXCLUDED(mu_);
  // Every known partition's gradient buffer held in one call, if the step
  // has read them all (FetchOptions::if_ready): false where it has not, the
  // pool has no room for them all at once, or the daemon cannot be asked
  // so (then nothing is held).
  absl::StatusOr<bool> HoldAllGradsIfReady() ABSL_LOCKS_EXCLUDED(mu_);
  // With hold_per_iteration: every partition's parameters held for the
  // iteration, unless they are already.
  absl::Status HoldForTheIteration() ABSL_LOCKS_EXCLUDED(mu_);

  // gpu::HostSource: the partitions' parameters.
  absl::StatusOr<std::vector<gpu::HostSource::Span>> Hold(absl::Span<const uint64_t> keys) override;
  absl::Status Release(absl::Span<const uint64_t> keys) override;
  // gpu::GradientSink: partitions' gradient buffers.
  absl::StatusOr<std::vector<gpu::GradientSink::Span>> HoldBuffers(
      absl::Span<const uint64_t> keys) override;

  Session* const session_;
  gpu::Device* const device_;
  const bool hold_per_iteration_;
  const absl::Duration report_interval_;
  absl::Mutex apply_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // ApplyPrefetch, one at a time
  mutable absl::Mutex mu_;
  int own_depth_ ABSL_GUARDED_BY(mu_);
  uint64_t own_bytes_ ABSL_GUARDED_BY(mu_);
  // The session's count of tiers attached (Session::Close refuses while it
  // is above 0); held here, as the Session may go first.
  const std::shared_ptr<std::atomic<int>> attached_;
  const pid_t owner_;  // the process that made it
  // (Not mu_: the cache and drain take it under their own locks.)
  absl::Mutex host_wait_mu_;
  const void* host_wait_owner_ ABSL_GUARDED_BY(host_wait_mu_) = nullptr;
  GpuTierNodeSettings node_ ABSL_GUARDED_BY(mu_);
  absl::Time last_report_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t reports_ ABSL_GUARDED_BY(mu_) = 0;
  bool report_failed_ ABSL_GUARDED_BY(mu_) = false;  // warned once
  bool reporting_ ABSL_GUARDED_BY(mu_) = true;       // off where the daemon has no ReportGpuTier
  // hold_per_iteration: the partitions the cache knows, and what the
  // iteration's holds gave (params; grads once the first gradient came).
  std::vector<uint64_t> all_ids_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, PartitionView> held_all_ ABSL_GUARDED_BY(mu_);
  bool grads_held_all_ ABSL_GUARDED_BY(mu_) = false;
  bool gradients_per_batch_ ABSL_GUARDED_BY(mu_) = false;
  // Per batch: the iteration's one try at every buffer at once was made.
  bool grads_tried_all_ ABSL_GUARDED_BY(mu_) = false;
  // Gradient buffers held, by partition.
  absl::flat_hash_map<uint64_t, PartitionView> grads_held_ ABSL_GUARDED_BY(mu_);
  // The daemon's holds are not counted (one Release lets every hold of a
  // partition go): the cache's and the drain's are counted here, and a
  // partition is released when neither holds it.
  absl::flat_hash_map<uint64_t, int> holds_ ABSL_GUARDED_BY(mu_);
  // Counts one hold more of each; those whose count reached zero are
  // released (returned, for Unhold).
  void AddHolds(absl::Span<const uint64_t> ids) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<uint64_t> Unhold(absl::Span<const uint64_t> ids) ABSL_LOCKS_EXCLUDED(mu_);
  // Session::Fetch of `ids` in calls of at most 4096, counted, each call's
  // partitions counted as held by this tier (AddHolds); on an error nothing
  // these calls took stays held (others' holds stay).
  absl::StatusOr<std::vector<PartitionView>> FetchAndHold(absl::Span<const uint64_t> ids,
                                                          const FetchOptions& options)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Session::Release in calls of at most 4096, counted; the first error.
  absl::Status ReleaseIds(absl::Span<const uint64_t> ids) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t gradients_returned_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t gradient_failures_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t daemon_calls_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t daemon_us_ ABSL_GUARDED_BY(mu_) = 0;
  // Counts a call to the daemon and the time until it goes out of scope.
  class DaemonCall {
   public:
    explicit DaemonCall(GpuTier* tier) : tier_(tier), start_(absl::Now()) {}
    ~DaemonCall();
    DaemonCall(const DaemonCall&) = delete;
    DaemonCall& operator=(const DaemonCall&) = delete;

   private:
    GpuTier* const tier_;
    const absl::Time start_;
  };
  // Last: they call back into this object until destroyed.
  std::unique_ptr<gpu::GradientDrain> drain_;
  std::unique_ptr<gpu::ParamCache> params_;
};

}  // namespace offload

#endif  // OFFLOADD_CLIENT_GPU_TIER_H_
