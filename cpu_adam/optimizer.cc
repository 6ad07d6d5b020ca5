#include "cpu_adam/optimizer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "cpu_adam/dtype.h"
#include "cpu_adam/kernel_select.h"
#include "tbb/blocked_range.h"
#include "tbb/parallel_for.h"

namespace offload {
namespace {

int ResolveThreads(int64_t threads) {
  if (threads > 0) return static_cast<int>(threads);
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

AdamSpan Slice(const AdamSpan& s, size_t begin, size_t end) {
  AdamSpan out = s;
  out.master += begin;
  out.exp_avg += begin;
  out.exp_avg_sq += begin;
  out.grads = static_cast<const char*>(s.grads) + begin * DTypeSize(s.grad_dtype);
  if (s.working != nullptr) {
    out.working = static_cast<char*>(s.working) + begin * DTypeSize(s.working_dtype);
  }
  out.numel = end - begin;
  return out;
}

}  // namespace

// Tiles handed out by an atomic counter to the accumulating thread and to
// any update thread that looks in at a tile boundary. A helper counts
// itself in and out under urgent_mu_; the accumulating thread, once the
// counter is past the end, withdraws the job and waits for its helpers, so
// that every tile is done (and visible: the mutex orders it) when it reads
// the results.
struct Optimizer::UrgentJob {
  size_t tiles = 0;
  std::function<void(size_t)> run;  // one tile
  std::atomic<size_t> next{0};
  int helpers = 0;  // guarded by urgent_mu_

  // Runs tiles until none is left; returns how many it ran.
  size_t Drain() {
    size_t ran = 0;
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < tiles; ++ran) run(i);
    return ran;
  }
};

Optimizer::Optimizer(const OptimizerOptions& options)
    : tile_elems_(kOptimizerTileElemsRange.Contains(options.tile_elems)
                      ? options.tile_elems
                      : OptimizerOptions().tile_elems),
      check_finite_(options.check_finite) {
  threads_ = ResolveThreads(options.threads);
  absl::MutexLock lock(&mu_);  // for the analysis: nothing else sees it yet
  MakeArenasLocked();
  absl::StatusOr<const AdamKernels*> k = SelectAdamKernels(options.kernel);
  kernels_ = k.ok() ? *k : *SelectAdamKernels("auto");
}

Optimizer::~Optimizer() = default;

absl::Status Optimizer::SetThreads(int64_t threads) {
  RETURN_IF_ERROR(kOptimizerThreadsRange.Check("optimizer threads", threads));
  absl::MutexLock lock(&mu_);
  threads_ = ResolveThreads(threads);
  MakeArenasLocked();
  return absl::OkStatus();
}

absl::Status Optimizer::SetTileElems(int64_t tile_elems) {
  RETURN_IF_ERROR(kOptimizerTileElemsRange.Check("optimizer tile_elems", tile_elems));
  absl::MutexLock lock(&mu_);
  tile_elems_ = tile_elems;
  return absl::OkStatus();
}

absl::Status Optimizer::SetKernel(const std::string& name) {
  absl::StatusOr<const AdamKernels*> k = SelectAdamKernels(name);
  if (!k.ok()) return k.status();
  absl::MutexLock lock(&mu_);
  kernels_ = *k;
  return absl::OkStatus();
}

void Optimizer::SetCheckFinite(bool check) {
  absl::MutexLock lock(&mu_);
  check_finite_ = check;
}

bool Optimizer::check_finite() const {
  absl::ReaderMutexLock lock(&mu_);
  return check_finite_;
}

uint64_t Optimizer::tiles_helped() const { return tiles_helped_.load(std::memory_order_relaxed); }

int Optimizer::threads() const {
  absl::ReaderMutexLock lock(&mu_);
  return threads_;
}

std::string Optimizer::kernel_name() const {
  absl::ReaderMutexLock lock(&mu_);
  return kernels_->name;
}

std::vector<Optimizer::Tile> Optimizer::MakeTiles(absl::Span<const AdamTask> tasks) const {
  std::vector<uint64_t> numels;
  numels.reserve(tasks.size());
  for (const AdamTask& t : tasks) numels.push_back(t.span.numel);
  return MakeTilesOf(numels);
}

std::vector<Optimizer::Tile> Optimizer::MakeTilesOf(absl::Span<const uint64_t> numels) const {
  // (On whole cache lines of fp32 and 16-bit arrays: optimizer_options.h.)
  const size_t tile = static_cast<size_t>(tile_elems_) / 32 * 32;
  std::vector<Tile> tiles;
  for (size_t i = 0; i < numels.size(); ++i) {
    for (size_t b = 0; b < numels[i]; b += tile) {
      tiles.push_back(Tile{i, b, std::min<size_t>(numels[i], b + tile)});
    }
  }
  return tiles;
}

void Optimizer::MakeArenasLocked() {
  arena_ = std::make_unique<tbb::task_arena>(threads_);
  urgent_arena_ = std::make_unique<tbb::task_arena>(threads_, 1, tbb::task_arena::priority::high);
}

template <typename Fn>
void Optimizer::ParallelTiles(tbb::task_arena& arena, const std::vector<Tile>& tiles, Fn&& fn) {
  if (tiles.size() == 1) {
    // One tile (a small partition's accumulation, a fetch-sized call): on
    // this thread. Entering the arena would wake a pool thread that finds
    // nothing to do and spins, taking a core from the trainer's next call.
    fn(tiles[0]);
    return;
  }
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, tiles.size(), 1),
                      [&](const tbb::blocked_range<size_t>& r) {
                        for (size_t i = r.begin(); i != r.end(); ++i) fn(tiles[i]);
                      });
  });
}

uint64_t Optimizer::CountNonFiniteLocked(absl::Span<const AdamTask> tasks,
                                         const std::vector<Tile>& tiles) {
  if (!check_finite_) return 0;
  const AdamKernels& k = *kernels_;
  std::atomic<uint64_t> nonfinite{0};
  ParallelTiles(*arena_, tiles, [&](const Tile& t) {
    const AdamSpan s = Slice(tasks[t.task].span, t.begin, t.end);
    if (uint64_t n = k.count_nonfinite(s.grads, s.grad_dtype, s.numel); n != 0) {
      nonfinite.fetch_add(n, std::memory_order_relaxed);
    }
  });
  return nonfinite.load();
}

void Optimizer::UpdateLocked(absl::Span<const AdamTask> tasks, const AdamHyperparams& h,
                             const std::vector<Tile>& tiles) {
  std::vector<AdamStepConstants> constants;
  constants.reserve(tasks.size());
  for (const AdamTask& t : tasks) {
    constants.push_back(
        ComputeStepConstants(t.hyperparams != nullptr ? *t.hyperparams : h, t.step));
  }
  const AdamKernels& k = *kernels_;
  updates_running_.fetch_add(1, std::memory_order_relaxed);
  ParallelTiles(*arena_, tiles, [&](const Tile& t) {
    if (urgent_offered_.load(std::memory_order_relaxed) != 0) HelpUrgent();
    k.adam(constants[t.task], Slice(tasks[t.task].span, t.begin, t.end));
  });
  updates_running_.fetch_sub(1, std::memory_order_relaxed);
}

void Optimizer::HelpUrgent() {
  absl::MutexLock lock(&urgent_mu_);
  for (;;) {
    UrgentJob* job = nullptr;
    for (UrgentJob* j : urgent_jobs_) {
      if (j->next.load(std::memory_order_relaxed) < j->tiles) {
        job = j;
        break;
      }
    }
    if (job == nullptr) return;
    ++job->helpers;  // the job stays until its helpers are out
    urgent_mu_.Unlock();
    const size_t ran = job->Drain();
    urgent_mu_.Lock();
    --job->helpers;
    tiles_helped_.fetch_add(ran, std::memory_order_relaxed);
  }
}

absl::StatusOr<StepReport> Optimizer::Step(absl::Span<const AdamTask> tasks,
                                           const AdamHyperparams& h) {
  if (absl::Status s = ValidateHyperparams(h); !s.ok()) return s;
  for (const AdamTask& t : tasks) {
    if (t.hyperparams == nullptr) continue;
    if (absl::Status s = ValidateHyperparams(*t.hyperparams); !s.ok()) return s;
  }
  // A reader lock: concurrent steps share the arena; the setters wait.
  absl::ReaderMutexLock lock(&mu_);
  const std::vector<Tile> tiles = MakeTiles(tasks);
  StepReport report;
  report.nonfinite = CountNonFiniteLocked(tasks, tiles);
  if (report.nonfinite != 0) {
    report.skipped = true;
    return report;
  }
  UpdateLocked(tasks, h, tiles);
  return report;
}

uint64_t Optimizer::CountNonFinite(absl::Span<const AdamTask> tasks) {
  absl::ReaderMutexLock lock(&mu_);
  return CountNonFiniteLocked(tasks, MakeTiles(tasks));
}

GradStats Optimizer::Accumulate(absl::Span<const AccumulateTask> tasks) {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<uint64_t> numels;
  numels.reserve(tasks.size());
  for (const AccumulateTask& t : tasks) numels.push_back(t.numel);
  const std::vector<Tile> tiles = MakeTilesOf(numels);
  std::vector<GradStats> per_tile(tiles.size());
  const AdamKernels& kernels = *kernels_;
  // Measuring only (gradients handed over): nobody waits for it but the
  // step that will read them, so it takes its turn in the update's arena
  // (enqueued if the update fills it) instead of adding the measuring
  // thread to the update's threads on the same cores.
  bool measure_only = true;
  for (const AccumulateTask& t : tasks) measure_only = measure_only && t.acc == nullptr;
  auto run = [&](const Tile& t) {
    const AccumulateTask& task = tasks[t.task];
    const size_t elem = DTypeSize(task.grad_dtype);
    const auto* grads = static_cast<const std::byte*>(task.grads);
    // Without an accumulator (handed over) the kernel only measures, as a
    // first accumulation would: the memory traffic is the gradients' read.
    per_tile[static_cast<size_t>(&t - tiles.data())] = kernels.accumulate(
        grads + t.begin * elem, task.grad_dtype, task.acc != nullptr ? task.acc + t.begin : nullptr,
        t.end - t.begin, task.first);
  };
  if (!measure_only && tiles.size() > 1 && updates_running_.load(std::memory_order_relaxed) != 0) {
    // An update fills the pool: its threads take tiles beside this one
    // (the pool's thread would move over only once the update's run ends).
    UrgentJob job;
    job.tiles = tiles.size();
    job.run = [&](size_t i) { run(tiles[i]); };
    {
      absl::MutexLock offer(&urgent_mu_);
      urgent_jobs_.push_back(&job);
      urgent_offered_.store(static_cast<int>(urgent_jobs_.size()), std::memory_order_relaxed);
    }
    // Drained in the high-priority arena too: the pool's threads join it
    // once the update ends (or its run does), as they would without helping.
    const int drainers = static_cast<int>(std::min<size_t>(tiles.size(), threads_));
    urgent_arena_->execute([&] { tbb::parallel_for(0, drainers, [&](int) { job.Drain(); }); });
    absl::MutexLock withdraw(&urgent_mu_);
    urgent_jobs_.erase(std::find(urgent_jobs_.begin(), urgent_jobs_.end(), &job));
    urgent_offered_.store(static_cast<int>(urgent_jobs_.size()), std::memory_order_relaxed);
    // Helpers still inside finish their tiles; then every tile is done.
    urgent_mu_.Await(absl::Condition(
        +[](UrgentJob* j) { return j->helpers == 0; }, &job));
  } else {
    ParallelTiles(measure_only ? *arena_ : *urgent_arena_, tiles, run);
  }
  GradStats total;
  for (const GradStats& s : per_tile) total += s;
  return total;
}

absl::Status Optimizer::Update(absl::Span<const AdamTask> tasks, const AdamHyperparams& h) {
  if (absl::Status s = ValidateHyperparams(h); !s.ok()) return s;
  for (const AdamTask& t : tasks) {
    if (t.hyperparams == nullptr) continue;
    if (absl::Status s = ValidateHyperparams(*t.hyperparams); !s.ok()) return s;
  }
  absl::ReaderMutexLock lock(&mu_);
  UpdateLocked(tasks, h, MakeTiles(tasks));
  return absl::OkStatus();
}

}  // namespace offload
