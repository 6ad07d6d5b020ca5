#include "cpu_adam/optimizer.h"

#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tbb/blocked_range.h"
#include "tbb/parallel_for.h"
#include "tbb/task_arena.h"

namespace offload {
namespace {

int ResolveThreads(int64_t threads) {
  if (threads > 0) return static_cast<int>(threads);
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

struct Tile {
  const AdamTask* task;
  const AdamStepConstants* constants;
  size_t begin;
  size_t end;
};

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

Optimizer::Optimizer(const OptimizerOptions& options)
    : tile_elems_(options.tile_elems > 0 ? options.tile_elems : 1 << 16) {
  threads_ = ResolveThreads(options.threads);
  arena_ = std::make_unique<tbb::task_arena>(threads_);
}

Optimizer::~Optimizer() = default;

absl::Status Optimizer::SetThreads(int64_t threads) {
  if (threads < 0 || threads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer threads must be in [0, 1024], got ", threads));
  }
  absl::MutexLock lock(&mu_);
  threads_ = ResolveThreads(threads);
  arena_ = std::make_unique<tbb::task_arena>(threads_);
  return absl::OkStatus();
}

absl::Status Optimizer::SetTileElems(int64_t tile_elems) {
  if (tile_elems < 1024 || tile_elems > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer tile_elems must be in [1024, 2^30], got ", tile_elems));
  }
  absl::MutexLock lock(&mu_);
  tile_elems_ = tile_elems;
  return absl::OkStatus();
}

int Optimizer::threads() const {
  absl::ReaderMutexLock lock(&mu_);
  return threads_;
}

absl::Status Optimizer::Step(absl::Span<const AdamTask> tasks, const AdamHyperparams& h) {
  if (absl::Status s = ValidateHyperparams(h); !s.ok()) return s;
  std::vector<AdamStepConstants> constants;
  constants.reserve(tasks.size());
  for (const AdamTask& t : tasks) constants.push_back(ComputeStepConstants(h, t.step));

  // A reader lock: concurrent steps share the arena; SetThreads waits.
  absl::ReaderMutexLock lock(&mu_);
  const size_t tile = static_cast<size_t>(tile_elems_);
  std::vector<Tile> tiles;
  for (size_t i = 0; i < tasks.size(); ++i) {
    for (size_t b = 0; b < tasks[i].span.numel; b += tile) {
      size_t e = std::min(tasks[i].span.numel, b + tile);
      tiles.push_back(Tile{&tasks[i], &constants[i], b, e});
    }
  }
  arena_->execute([&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, tiles.size(), 1),
                      [&](const tbb::blocked_range<size_t>& r) {
                        for (size_t i = r.begin(); i != r.end(); ++i) {
                          const Tile& t = tiles[i];
                          AdamScalar(*t.constants, Slice(t.task->span, t.begin, t.end));
                        }
                      });
  });
  return absl::OkStatus();
}

}  // namespace offload
