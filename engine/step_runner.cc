#include "engine/step_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "cpu_adam/dtype.h"

namespace offload {
namespace {

// The fewest elements one call of the optimizer updates while partitions
// end inside a group (StepRunner::Execute): 16 tiles of the default size,
// work for every thread of a node's pool.
constexpr uint64_t kMinRunElems = uint64_t{1} << 20;

int64_t NanosSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              start)
      .count();
}

}  // namespace

absl::Status CheckGivenGradStats(uint64_t id, uint64_t numel, bool hand_over,
                                 const GradStats& given) {
  if (!hand_over) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition ", id,
                     ": gradient statistics come with hand_over only (gradients added "
                     "into the accumulator are measured as they are added)"));
  }
  if (given.nonfinite > numel) {
    return absl::InvalidArgumentError(absl::StrCat("partition ", id, ": the statistics count ",
                                                   given.nonfinite, " non-finite values in ",
                                                   numel));
  }
  if (given.sq_norm < 0 || (std::isnan(given.sq_norm) && given.nonfinite == 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition ", id, ": the statistics' squared norm is ", given.sq_norm,
                     given.sq_norm < 0 ? " (negative)" : " with no non-finite value counted"));
  }
  return absl::OkStatus();
}

void StepRunner::SetSyncPointForTesting(std::function<void(StepPoint)> hook) {
  absl::MutexLock lock(&mu_);
  sync_point_ = std::move(hook);
}

void StepRunner::Sync(StepPoint point) {
  std::function<void(StepPoint)> hook;
  {
    absl::MutexLock lock(&mu_);
    hook = sync_point_;
  }
  if (hook) hook(point);
}

absl::Status StepRunner::Accumulate(PartitionStore& set, uint64_t id, uint64_t numel,
                                    DType grad_dtype, bool hand_over,
                                    std::shared_ptr<void> keep_alive,
                                    const std::optional<GradStats>& given) {
  if (given.has_value()) RETURN_IF_ERROR(CheckGivenGradStats(id, numel, hand_over, *given));
  ASSIGN_OR_RETURN(AccumulateItem item, set.BeginAccumulate(id, numel, grad_dtype, hand_over));
  if (item.hand_over && given.has_value()) {
    // The trainer measured them: the buffer waits for the step unread.
    set.EndAccumulate(item, absl::OkStatus(), *given, item.chunks);
    stats_->gradients_returned.fetch_add(1, std::memory_order_relaxed);
    stats_->gradient_stats_given.fetch_add(1, std::memory_order_relaxed);
    return absl::OkStatus();
  }
  if (item.hand_over && keep_alive != nullptr) {
    item.background = true;
    absl::MutexLock lock(&mu_);
    measures_.push_back(Measure{std::move(keep_alive), &set, item});
    return absl::OkStatus();
  }
  return AccumulateChunks(set, item);
}

absl::Status StepRunner::Reclaim(PartitionStore& set, absl::Span<const uint64_t> ids) {
  for (uint64_t id : set.HandedOver(ids)) {
    ASSIGN_OR_RETURN(std::optional<AccumulateItem> item, set.BeginReclaim(id));
    if (item.has_value()) RETURN_IF_ERROR(AccumulateChunks(set, *item));
  }
  return absl::OkStatus();
}

void StepRunner::Measurer() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    mu_.Await(absl::Condition(
        +[](StepRunner* r)
             ABSL_NO_THREAD_SAFETY_ANALYSIS { return !r->measures_.empty() || r->stopping_; },
        this));
    if (measures_.empty()) return;
    Measure m = std::move(measures_.front());
    measures_.pop_front();
    ++running_;
    mu_.Unlock();
    Sync(StepPoint::kMeasuring);
    AccumulateChunks(*m.set, m.item).IgnoreError();  // recorded in the set (GradState::kLost)
    m = Measure{};                                   // the session may go now, outside the lock
    mu_.Lock();
    --running_;
  }
}

absl::Status StepRunner::AccumulateChunks(PartitionStore& set, const AccumulateItem& item) {
  const uint64_t id = item.id;
  GradStats stats;
  absl::Status status;
  uint64_t done = 0;
  // Chunk by chunk: the accumulator may rest on NVMe, and a partition may be
  // larger than the pool can hold twice.
  // A measurement in the background that finds the pool full (its buffer
  // written out meanwhile, the trainer's next holds filling the pool) waits
  // a while for room rather than lose the gradients: the trainer's holds
  // go as its calls end.
  const absl::Time room_deadline = absl::Now() + kBackgroundRoomWait;
  absl::Duration nap = absl::Milliseconds(1);
  for (; done < item.chunks; ++done) {
    absl::StatusOr<AccumulatePins> pins = set.PinAccumulate(item, done);
    while (!pins.ok() && item.background && absl::IsResourceExhausted(pins.status()) &&
           absl::Now() < room_deadline) {
      absl::SleepFor(nap);
      nap = std::min(2 * nap, absl::Milliseconds(50));
      pins = set.PinAccumulate(item, done);
    }
    if (!pins.ok()) {
      status = absl::Status(
          pins.status().code(),
          absl::StrCat("accumulating the gradients of partition ", id, " (chunk ", done, " of ",
                       item.chunks, "): ", pins.status().message(),
                       item.reclaim ? "; the buffer is still handed over: fetch it again"
                       : item.first || done == 0 ? "; nothing was accumulated, return them again"
                                                 : "; the accumulation is lost: skip this step"));
      break;
    }
    AccumulateTask task;
    task.grads = pins->grads.data();
    task.grad_dtype = item.grad_dtype;
    // Handed over: measured only (Optimizer::Accumulate with no accumulator).
    task.acc = item.hand_over ? nullptr : reinterpret_cast<float*>(pins->accum.data());
    task.numel = pins->end - pins->begin;
    task.first = item.first;
    stats += optimizer_->Accumulate(absl::MakeConstSpan(&task, 1));
  }
  set.EndAccumulate(item, status, stats, done);
  if (status.ok() && !item.reclaim) {
    stats_->gradients_returned.fetch_add(1, std::memory_order_relaxed);
  }
  return status;
}

StepRunner::StepRunner(Optimizer* optimizer, const HostPool* pool, Stats* stats)
    : optimizer_(optimizer), pool_(pool), stats_(stats) {
  worker_ = std::thread([this] { Worker(); });
  measurer_ = std::thread([this] { Measurer(); });
}

StepRunner::~StepRunner() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  worker_.join();    // runs the steps already started to their end
  measurer_.join();  // and the measurements
}

void StepRunner::Quiesce() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](StepRunner* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return r->jobs_.empty() && r->measures_.empty() && r->running_ == 0;
      },
      this));
}

void StepRunner::Worker() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    mu_.Await(absl::Condition(
        +[](StepRunner* r)
             ABSL_NO_THREAD_SAFETY_ANALYSIS { return !r->jobs_.empty() || r->stopping_; },
        this));
    if (jobs_.empty()) return;
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    ++running_;
    mu_.Unlock();
    absl::StatusOr<StepSummary> result = Execute(*job.set, job.h, std::move(job.prepared));
    job.done(std::move(result));
    job = Job{};  // the session may go now, outside the lock
    mu_.Lock();
    --running_;
  }
}

absl::StatusOr<StepSummary> StepRunner::Run(PartitionStore& set, const AdamHyperparams& h,
                                            bool skip, absl::Span<const ParamGroup> groups) {
  ASSIGN_OR_RETURN(Prepared prepared, Prepare(set, h, skip, groups));
  if (prepared.done) return prepared.summary;
  return Execute(set, h, std::move(prepared));
}

absl::StatusOr<StepSummary> StepRunner::Start(PartitionStore& set, std::shared_ptr<void> keep_alive,
                                              const AdamHyperparams& h, bool skip,
                                              absl::Span<const ParamGroup> groups, Done done) {
  ASSIGN_OR_RETURN(Prepared prepared, Prepare(set, h, skip, groups));
  StepSummary now = prepared.summary;
  if (prepared.done) {
    done(now);
    return now;
  }
  now.running = true;
  absl::MutexLock lock(&mu_);
  jobs_.push_back(Job{std::move(keep_alive), &set, h, std::move(prepared), std::move(done)});
  return now;
}

absl::StatusOr<StepRunner::Prepared> StepRunner::Prepare(PartitionStore& set,
                                                         const AdamHyperparams& h, bool skip,
                                                         absl::Span<const ParamGroup> groups) {
  if (!skip) RETURN_IF_ERROR(ValidateHyperparams(h));
  Prepared p;
  p.start = std::chrono::steady_clock::now();
  // Checked before anything is pinned: a bad group changes nothing.
  absl::flat_hash_map<uint64_t, size_t> group_of;
  p.group_hyperparams.reserve(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    AdamHyperparams gh = groups[g].hyperparams;
    gh.grad_scale = h.grad_scale;  // global: the clip coefficient and loss scale
    if (!skip) {
      absl::Status valid = ValidateHyperparams(gh);
      if (!valid.ok()) {
        return absl::Status(valid.code(), absl::StrCat("param group ", g, ": ", valid.message()));
      }
    }
    p.group_hyperparams.push_back(gh);
    for (uint64_t id : groups[g].partition_ids) {
      if (!set.Contains(id)) {
        return absl::NotFoundError(
            absl::StrCat("param group ", g, " names partition ", id, ", not in this session"));
      }
      if (!group_of.emplace(id, g).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("partition ", id, " is in more than one param group"));
      }
    }
  }
  ASSIGN_OR_RETURN(p.items, set.BeginStep(/*skipping=*/skip));
  for (StepItem& item : p.items) {
    auto it = group_of.find(item.id);
    if (it != group_of.end()) item.task.hyperparams = &p.group_hyperparams[it->second];
  }
  Sync(StepPoint::kPinned);
  p.outcomes.resize(p.items.size());
  for (size_t i = 0; i < p.items.size(); ++i) p.outcomes[i].next_chunk = p.items[i].first_chunk;
  // Non-finite values were counted when the gradients were accumulated
  // (the accumulator is the daemon's: nothing changes them since).
  uint64_t nonfinite = 0;
  if (optimizer_->check_finite()) {
    for (const StepItem& item : p.items) nonfinite += item.stats.nonfinite;
  }
  if (skip || nonfinite != 0) {
    Sync(StepPoint::kOptimized);
    for (ItemOutcome& o : p.outcomes) o.outcome = StepOutcome::kSkipped;
    set.EndStep(p.items, p.outcomes);
    // (Its own finding; a skip decided by the caller, an overflow or the
    // trainer's, the caller counts.)
    if (!skip) stats_->steps_skipped.fetch_add(1, std::memory_order_relaxed);
    p.done = true;
    p.summary.skipped = true;
    p.summary.nonfinite = nonfinite;
    p.summary.wall_nanos = NanosSince(p.start);
  }
  return p;
}

absl::StatusOr<StepSummary> StepRunner::Execute(PartitionStore& set, const AdamHyperparams& h,
                                                Prepared prepared) {
  const std::vector<StepItem>& items = prepared.items;
  std::vector<ItemOutcome>& outcomes = prepared.outcomes;
  const auto start = prepared.start;
  int64_t wait_nanos = 0, compute_nanos = 0;

  // Units of work: (item, chunk), in order.
  struct Unit {
    size_t item;
    uint64_t chunk;
  };
  std::vector<Unit> units;
  for (size_t i = 0; i < items.size(); ++i) {
    for (uint64_t c = items[i].first_chunk; c < items[i].chunks; ++c) units.push_back({i, c});
  }

  // Small enough to leave the pool's cache to prefetch and write-back (the
  // arena's pages count against the same pool), large enough to keep the
  // optimizer's threads busy.
  const uint64_t group_limit = std::min<uint64_t>(pool_->limit() / 8, uint64_t{256} << 20);
  absl::Status status;
  StepSummary summary;
  size_t next = 0;
  while (next < units.size() && status.ok()) {
    const size_t first = next;
    std::vector<ChunkPins> pins;
    std::vector<AdamTask> tasks;
    // Where a first step's master copy comes from (null: none needed): the
    // working copy the trainer wrote, which the delayed update does not
    // overwrite.
    std::vector<const std::byte*> init_from;
    uint64_t group_bytes = 0;
    const auto pinning = std::chrono::steady_clock::now();
    while (next < units.size()) {
      const StepItem& item = items[units[next].item];
      absl::StatusOr<ChunkPins> got = set.PinChunk(item, units[next].chunk);
      if (!got.ok()) {
        // The pool is full of this group: update it, then try again.
        if (!tasks.empty() && absl::IsResourceExhausted(got.status())) break;
        status =
            absl::Status(got.status().code(),
                         absl::StrCat("step of session ", set.session_id(), " stopped at chunk ",
                                      units[next].chunk, " of partition ", item.id,
                                      " (the next Step resumes there): ", got.status().message()));
        break;
      }
      const uint64_t n = got->end - got->begin;
      AdamTask task = item.task;
      AdamSpan& span = task.span;
      span.grads = got->accum.data();
      span.working = got->params.data();
      span.numel = n;
      span.master = reinterpret_cast<float*>(got->master.data());
      span.exp_avg = reinterpret_cast<float*>(got->exp_avg.data());
      span.exp_avg_sq = reinterpret_cast<float*>(got->exp_avg_sq.data());
      tasks.push_back(task);
      init_from.push_back(!item.init_master                ? nullptr
                          : got->current.data() != nullptr ? got->current.data()
                                                           : got->params.data());
      group_bytes += 3 * got->master.size() + got->params.size() + got->accum.size();
      pins.push_back(*std::move(got));
      ++next;
      if (group_bytes >= group_limit) break;
    }
    wait_nanos += NanosSince(pinning);
    if (tasks.empty()) break;
    Sync(StepPoint::kGroupPinned);
    // The group is updated in runs that end where a partition's last chunk
    // does, or at the group's end (small partitions batched to at least
    // kMinRunElems where the group allows, so that the optimizer's threads
    // still get enough tiles): each partition leaves the step as soon as
    // its own update is done, so an overlapped step's next fetch of it
    // (and, with the delayed update, the next backward's fetch of its
    // gradient buffer) waits for it alone, not for the group.
    size_t run_begin = 0;
    while (run_begin < tasks.size()) {
      size_t run_end = run_begin;
      uint64_t run_elems = 0;
      while (run_end < tasks.size()) {
        const Unit& u = units[first + run_end];
        run_elems += tasks[run_end].span.numel;
        ++run_end;
        if (u.chunk + 1 == items[u.item].chunks && run_elems >= kMinRunElems) break;
      }
      // The optimizer is the node's: this run waits for its session's turn,
      // and holds it for the update only.
      absl::Status updated;
      std::chrono::steady_clock::time_point computing;
      {
        OptimizerShares::Turn turn = shares_.Take(set.session_id(), set.share_weight(), run_elems);
        computing = std::chrono::steady_clock::now();
        for (size_t t = run_begin; t < run_end; ++t) {
          const AdamSpan& span = tasks[t].span;
          if (init_from[t] != nullptr) {
            WidenToFloat(init_from[t], span.working_dtype, span.master, span.numel);
          }
        }
        updated = optimizer_->Update(
            absl::MakeConstSpan(tasks).subspan(run_begin, run_end - run_begin), h);
      }
      compute_nanos += NanosSince(computing);
      if (!updated.ok()) {
        status = updated;  // the runs before stay applied
        break;
      }
      for (size_t t = run_begin; t < run_end; ++t) {
        const size_t i = units[first + t].item;
        outcomes[i].next_chunk = units[first + t].chunk + 1;
        summary.params_updated += tasks[t].span.numel;
        pins[t] = ChunkPins{};  // unpinned before its gradients are dropped
        set.ConsumeGrads(items[i], units[first + t].chunk);
        if (outcomes[i].next_chunk == items[i].chunks) {
          // Done: a fetch of it need not wait for the rest of the step.
          outcomes[i].outcome = StepOutcome::kApplied;
          outcomes[i].ended = true;
          ++summary.partitions_updated;
          set.EndPartition(items[i]);
        }
      }
      run_begin = run_end;
      Sync(StepPoint::kRunDone);
    }
    if (!status.ok()) break;
    Sync(StepPoint::kGroupDone);
  }
  Sync(StepPoint::kOptimized);
  shares_.Idle(set.session_id());
  set.EndStep(items, outcomes);
  stats_->step_state_wait_nanos.fetch_add(wait_nanos, std::memory_order_relaxed);
  stats_->step_compute_nanos.fetch_add(compute_nanos, std::memory_order_relaxed);
  stats_->params_updated.fetch_add(static_cast<int64_t>(summary.params_updated),
                                   std::memory_order_relaxed);
  if (!status.ok()) return status;
  summary.wall_nanos = NanosSince(start);
  summary.state_wait_nanos = wait_nanos;
  summary.compute_nanos = compute_nanos;
  stats_->steps.fetch_add(1, std::memory_order_relaxed);
  stats_->step_nanos.fetch_add(summary.wall_nanos, std::memory_order_relaxed);
  return summary;
}

}  // namespace offload
