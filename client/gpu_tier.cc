#include "client/gpu_tier.h"

#include <algorithm>
#include <iterator>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "cpu_adam/dtype.h"

namespace offload {
namespace {
// The most partitions one Fetch or Release may name.
constexpr size_t kMaxIdsPerCall = 4096;
}  // namespace

GpuTier::DaemonCall::~DaemonCall() {
  const int64_t us = absl::ToInt64Microseconds(absl::Now() - start_);
  absl::MutexLock lock(&tier_->mu_);
  ++tier_->daemon_calls_;
  tier_->daemon_us_ += static_cast<uint64_t>(std::max<int64_t>(us, 0));
}

absl::Status GpuTier::ReleaseIds(absl::Span<const uint64_t> ids) {
  absl::Status first;
  for (size_t i = 0; i < ids.size(); i += kMaxIdsPerCall) {
    DaemonCall call(this);
    absl::Status s = session_->Release(ids.subspan(i, kMaxIdsPerCall));
    if (first.ok()) first = s;
  }
  return first;
}

absl::StatusOr<std::unique_ptr<GpuTier>> GpuTier::Create(Session* session, gpu::Device* device,
                                                         const GpuTierOptions& options,
                                                         gpu::DeviceMemory slab) {
  if (session == nullptr || device == nullptr) {
    return absl::InvalidArgumentError("GpuTier needs a session and a device");
  }
  std::unique_ptr<GpuTier> tier(new GpuTier(session, device, options));
  if (options.register_arena) RETURN_IF_ERROR(session->EnableDma(device));
  ASSIGN_OR_RETURN(tier->drain_,
                   gpu::GradientDrain::Create(device, tier.get(), options.gradient_staging_bytes));
  ASSIGN_OR_RETURN(tier->params_,
                   gpu::ParamCache::Create(device, tier.get(), options.params, std::move(slab)));
  return tier;
}

GpuTier::~GpuTier() {
  if (getpid() != owner_) {
    (void)params_.release();
    (void)drain_.release();
    return;
  }
  params_.reset();
  drain_.reset();  // waits for its copies
  std::vector<uint64_t> ids;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, count] : holds_) ids.push_back(id);
    for (const auto& [id, view] : held_all_) {
      if (!holds_.contains(id)) ids.push_back(id);
    }
    holds_.clear();
    held_all_.clear();
    grads_held_.clear();
  }
  ReleaseIds(ids).IgnoreError();
  attached_->fetch_sub(1);  // (the count outlives a Session gone first)
}

void GpuTier::AddHolds(absl::Span<const uint64_t> ids) {
  absl::MutexLock lock(&mu_);
  for (uint64_t id : ids) ++holds_[id];
}

std::vector<uint64_t> GpuTier::Unhold(absl::Span<const uint64_t> ids) {
  std::vector<uint64_t> free;
  absl::MutexLock lock(&mu_);
  for (uint64_t id : ids) {
    auto it = holds_.find(id);
    if (it == holds_.end()) continue;
    if (--it->second == 0) {
      holds_.erase(it);
      // The iteration's hold stays until EndIteration.
      if (!held_all_.contains(id)) free.push_back(id);
    }
  }
  return free;
}

absl::Status GpuTier::HoldAll(bool grads) {
  std::vector<uint64_t> ids = params_->Keys();
  std::vector<PartitionView> views;
  for (size_t i = 0; i < ids.size(); i += kMaxIdsPerCall) {
    absl::StatusOr<std::vector<PartitionView>> part;
    {
      DaemonCall call(this);
      part = session_->Fetch(absl::Span<const uint64_t>(ids).subspan(i, kMaxIdsPerCall),
                             {.grads = grads});
    }
    if (!part.ok()) {
      // Nothing held for the iteration unless all of it is.
      if (!views.empty() && !grads) {
        std::vector<uint64_t> got;
        for (const auto& v : views) got.push_back(v.id);
        ReleaseIds(got).IgnoreError();
      }
      return part.status();
    }
    views.insert(views.end(), part->begin(), part->end());
  }
  absl::MutexLock lock(&mu_);
  for (PartitionView& v : views) held_all_[v.id] = std::move(v);
  if (grads) grads_held_all_ = true;
  return absl::OkStatus();
}

absl::StatusOr<bool> GpuTier::HoldAllGradsIfReady() {
  std::vector<uint64_t> ids = params_->Keys();
  // (One call: a refusal holds nothing.)
  if (ids.size() > kMaxIdsPerCall || !session_->FetchesIfReady(ids.size())) return false;
  absl::StatusOr<std::vector<PartitionView>> views;
  {
    DaemonCall call(this);
    views = session_->Fetch(ids, {.grads = true, .if_ready = true});
  }
  if (IsNotReady(views.status()) || absl::IsResourceExhausted(views.status())) return false;
  RETURN_IF_ERROR(views.status());
  absl::MutexLock lock(&mu_);
  for (PartitionView& v : *views) held_all_[v.id] = std::move(v);
  grads_held_all_ = true;
  return true;
}

absl::Status GpuTier::HoldForTheIteration() {
  if (!hold_per_iteration_) return absl::OkStatus();
  bool held;
  {
    absl::MutexLock lock(&mu_);
    held = !held_all_.empty();
  }
  return held ? absl::OkStatus() : HoldAll(/*grads=*/false);
}

absl::Status GpuTier::BeginIteration() {
  RETURN_IF_ERROR(HoldForTheIteration());
  params_->BeginIteration();
  return absl::OkStatus();
}

absl::Status GpuTier::PrefetchUnits(absl::Span<const int> units) {
  RETURN_IF_ERROR(HoldForTheIteration());
  return params_->PrefetchUnits(units);
}

absl::Status GpuTier::EndIteration() {
  {
    // Refused before the copies' outcome is taken: a copy that failed
    // after its use is reported once (Synchronize), to the call that ends
    // the iteration, not lost to one refused.
    absl::MutexLock lock(&mu_);
    if (!grads_held_.empty()) {
      return absl::FailedPreconditionError(
          absl::StrFormat("%d gradients are still on their way to the daemon: return them first",
                          grads_held_.size()));
    }
  }
  absl::Status copies = params_->Synchronize();
  std::vector<uint64_t> ids;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, view] : held_all_) {
      if (!holds_.contains(id)) ids.push_back(id);
    }
    held_all_.clear();
    grads_held_all_ = false;
    grads_tried_all_ = false;
  }
  absl::Status released = ReleaseIds(ids);
  MaybeReport();
  RETURN_IF_ERROR(copies);
  return released;
}

void GpuTier::SetPrefetch(int depth, uint64_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    own_depth_ = depth;
    own_bytes_ = bytes;
  }
  ApplyPrefetch();
}

std::pair<int, uint64_t> GpuTier::PrefetchInEffect() const {
  return {node_.prefetch_depth >= 0 ? static_cast<int>(node_.prefetch_depth) : own_depth_,
          node_.prefetch_bytes >= 0 ? static_cast<uint64_t>(node_.prefetch_bytes) : own_bytes_};
}

void GpuTier::ApplyPrefetch() {
  // One at a time, so that the last settings read are the ones applied;
  // not under mu_: the cache calls this object's Hold under its own lock.
  absl::MutexLock applying(&apply_mu_);
  std::pair<int, uint64_t> p;
  {
    absl::MutexLock lock(&mu_);
    p = PrefetchInEffect();
  }
  params_->SetPrefetch(p.first, p.second);
}

void GpuTier::MaybeReport() {
  {
    absl::MutexLock lock(&mu_);
    if (!reporting_ || absl::Now() - last_report_ < report_interval_) return;
    last_report_ = absl::Now();
  }
  const GpuTierStats s = stats();
  GpuTierCounters c;
  c.h2d_bytes = s.params.h2d_bytes;
  c.h2d_staged_bytes = s.params.staged_bytes;
  c.d2h_bytes = s.gradients.d2h_bytes;
  c.tensor_uses = s.params.tensor_uses;
  c.resident_hits = s.params.resident_hits;
  c.prefetch_hits = s.params.prefetch_hits;
  c.host_waits = s.gradients.host_waits;
  c.evictions = s.params.evictions;
  c.resident_bytes = s.params.resident_bytes;
  c.budget_bytes = s.params.budget_bytes;
  c.dma_bytes = s.dma.bytes;
  c.prefetch_depth = static_cast<uint64_t>(std::max(0, s.prefetch_depth));
  c.prefetch_bytes = s.prefetch_bytes;
  absl::StatusOr<GpuTierNodeSettings> node = session_->ReportGpuTier(c);
  bool changed = false;
  {
    absl::MutexLock lock(&mu_);
    if (!node.ok()) {
      // An older daemon: stop asking. Anything else: try again later.
      if (absl::IsUnimplemented(node.status())) reporting_ = false;
      if (!report_failed_) {
        report_failed_ = true;
        LogWarning(
            "GPU tier: reporting to offloadd failed (%s); training goes on, the "
            "daemon's stats lack this tier and its gpu.* settings do not reach it",
            node.status().ToString());
      }
      return;
    }
    ++reports_;
    changed = node->prefetch_depth != node_.prefetch_depth ||
              node->prefetch_bytes != node_.prefetch_bytes;
    node_ = *node;
  }
  if (changed) ApplyPrefetch();
}

namespace {

// The bytes of a held partition's working copy.
uint64_t ParamBytes(const PartitionView& v) { return v.numel * DTypeSize(v.param_dtype); }

}  // namespace

absl::StatusOr<std::vector<gpu::HostSource::Span>> GpuTier::Hold(absl::Span<const uint64_t> keys) {
  {
    absl::MutexLock lock(&mu_);
    if (!held_all_.empty()) {
      std::vector<gpu::HostSource::Span> spans;
      for (uint64_t k : keys) {
        auto it = held_all_.find(k);
        if (it == held_all_.end()) break;
        spans.push_back({it->second.params, it->second.dma, ParamBytes(it->second)});
      }
      if (spans.size() == keys.size()) return spans;  // held for the iteration
    }
  }
  ASSIGN_OR_RETURN(std::vector<PartitionView> views, FetchAndHold(keys, {}));
  std::vector<gpu::HostSource::Span> spans;
  spans.reserve(views.size());
  for (const PartitionView& v : views) spans.push_back({v.params, v.dma, ParamBytes(v)});
  return spans;
}

absl::StatusOr<std::vector<PartitionView>> GpuTier::FetchAndHold(absl::Span<const uint64_t> ids,
                                                                 const FetchOptions& options) {
  std::vector<PartitionView> views;
  views.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); i += kMaxIdsPerCall) {
    const absl::Span<const uint64_t> part = ids.subspan(i, kMaxIdsPerCall);
    absl::StatusOr<std::vector<PartitionView>> got;
    {
      DaemonCall call(this);
      got = session_->Fetch(part, options);
    }
    if (!got.ok()) {
      // Nothing held unless all of it is (others' holds stay).
      ReleaseIds(Unhold(ids.subspan(0, i))).IgnoreError();
      return got.status();
    }
    AddHolds(part);
    views.insert(views.end(), std::make_move_iterator(got->begin()),
                 std::make_move_iterator(got->end()));
  }
  return views;
}

absl::Status GpuTier::Release(absl::Span<const uint64_t> keys) { return ReleaseIds(Unhold(keys)); }

absl::StatusOr<std::vector<gpu::GradientSink::Span>> GpuTier::HoldBuffers(
    absl::Span<const uint64_t> keys) {
  bool need_all, try_all;
  {
    absl::MutexLock lock(&mu_);
    absl::flat_hash_set<uint64_t> named;
    for (uint64_t key : keys) {
      if (grads_held_.contains(key) || !named.insert(key).second) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "partition %d's gradient is already on its way to the host: return it first", key));
      }
    }
    const bool first = hold_per_iteration_ && !grads_held_all_ && !held_all_.empty();
    need_all = first && !gradients_per_batch_;
    try_all = first && gradients_per_batch_ && !grads_tried_all_;
    if (try_all) grads_tried_all_ = true;
  }
  // The iteration's first gradients: every gradient buffer at once (one
  // call). While a step runs that may still read them (the delayed
  // update's), only if it has read them all by now (asked without
  // waiting: on a node with cores to spare it usually has, before the
  // forward is over); else each batch's own, which the step, going in the
  // order gradients were returned, gives back first.
  if (need_all) RETURN_IF_ERROR(HoldAll(/*grads=*/true));
  if (try_all) RETURN_IF_ERROR(HoldAllGradsIfReady().status());
  std::vector<uint64_t> missing;
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t key : keys) {
      if (!grads_held_all_ || !held_all_.contains(key)) missing.push_back(key);
    }
  }
  ASSIGN_OR_RETURN(std::vector<PartitionView> views, FetchAndHold(missing, {.grads = true}));
  absl::flat_hash_map<uint64_t, PartitionView> fetched;
  for (PartitionView& v : views) fetched[v.id] = std::move(v);
  std::vector<gpu::GradientSink::Span> spans;
  spans.reserve(keys.size());
  absl::MutexLock lock(&mu_);
  for (uint64_t key : keys) {
    auto it = fetched.find(key);
    const PartitionView& v = it != fetched.end() ? it->second : held_all_.at(key);
    grads_held_[key] = v;
    spans.push_back({v.grads, v.numel * DTypeSize(v.grad_dtype), v.dma});
  }
  return spans;
}

void GpuTier::SetGradientsPerBatch(bool per_batch) {
  absl::MutexLock lock(&mu_);
  gradients_per_batch_ = per_batch;
}

absl::Status GpuTier::AddGradient(uint64_t partition_id, const void* src, uint64_t bytes,
                                  const gpu::Stream& producer) {
  return drain_->Add(partition_id, src, bytes, producer);
}

absl::Status GpuTier::AddGradients(absl::Span<const gpu::GradientDrain::Item> items,
                                   const gpu::Stream& producer) {
  return drain_->Add(items, producer);
}

absl::Status GpuTier::DropGradients() {
  std::vector<uint64_t> ids;
  {
    std::vector<gpu::GradientDrain::Done> done = drain_->Completed(/*wait=*/true);
    absl::MutexLock lock(&mu_);
    for (const auto& d : done) {
      if (grads_held_.erase(d.key) > 0) ids.push_back(d.key);
    }
  }
  return ReleaseIds(Unhold(ids));
}

absl::StatusOr<std::vector<uint64_t>> GpuTier::ReturnGradients(
    bool wait, bool hand_over, const absl::flat_hash_map<uint64_t, GradientStats>& stats,
    const std::function<absl::Status()>& verify) {
  std::vector<gpu::GradientDrain::Done> done = drain_->Completed(wait);
  if (verify && !done.empty()) {
    // What the copies copied is not to be used: each is a failed copy.
    if (absl::Status bad = verify(); !bad.ok()) {
      for (auto& d : done) {
        if (d.status.ok()) d.status = bad;
      }
    }
  }
  std::vector<PartitionView> good;
  std::vector<uint64_t> ids, failed;
  absl::Status first_error;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& d : done) {
      auto it = grads_held_.find(d.key);
      if (it == grads_held_.end()) continue;  // (dropped meanwhile: nothing held)
      if (d.status.ok()) {
        good.push_back(it->second);
        ids.push_back(d.key);
      } else {
        failed.push_back(d.key);
        ++gradient_failures_;
        if (first_error.ok()) first_error = d.status;
      }
      grads_held_.erase(it);
    }
  }
  bool with_stats = hand_over && !good.empty();
  std::vector<GradientStats> given;
  for (const PartitionView& v : good) {
    auto it = stats.find(v.id);
    if (it == stats.end()) {
      with_stats = false;
      break;
    }
    given.push_back(it->second);
  }
  absl::Status returned;
  for (size_t i = 0; i < good.size() && returned.ok(); i += kMaxIdsPerCall) {
    const size_t n = std::min(kMaxIdsPerCall, good.size() - i);
    absl::Span<const PartitionView> part(good.data() + i, n);
    DaemonCall call(this);
    returned = with_stats ? session_->HandOverGradients(
                                part, absl::Span<const GradientStats>(given.data() + i, n), false)
                          : session_->ReturnGradients(part, /*release=*/false, hand_over);
  }
  // Released where the parameter side does not hold them too.
  std::vector<uint64_t> all = ids;
  all.insert(all.end(), failed.begin(), failed.end());
  absl::Status released = ReleaseIds(Unhold(all));
  if (returned.ok()) returned = released;
  RETURN_IF_ERROR(returned);
  RETURN_IF_ERROR(first_error);
  absl::MutexLock lock(&mu_);
  gradients_returned_ += ids.size();
  return ids;
}

GpuTierStats GpuTier::stats() const {
  GpuTierStats s;
  s.params = params_->stats();
  s.gradients = drain_->stats();
  s.dma = session_->dma_stats();
  absl::MutexLock lock(&mu_);
  s.gradients_returned = gradients_returned_;
  s.gradient_failures = gradient_failures_;
  s.daemon_calls = daemon_calls_;
  s.daemon_us = daemon_us_;
  s.reports = reports_;
  std::tie(s.prefetch_depth, s.prefetch_bytes) = PrefetchInEffect();
  return s;
}

}  // namespace offload
