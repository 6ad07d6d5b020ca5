// benches/checkpoint: what a checkpoint of a session costs, against the
// disk's own bandwidth measured in the same run.
//
//   bazel build -c opt //benches:checkpoint
//   bazel-bin/benches/checkpoint [--params=100M] [--layers=16] [--nvme]
//       [--pool=1GiB] [--steps=4] [--dir=/var/tmp/offloadd-bench]
//       [--auto_interval=600] [--tiny]
//
// The engine is assembled in-process (bench_engine.h). One session,
// --layers partitions of bf16 parameters with fp32 master weights and Adam
// moments, trained two steps first so that nothing is zeros; a checkpoint
// holds 14 bytes per parameter (master, two moments, the bf16 working
// copy). With --nvme the optimizer state rests on NVMe behind a --pool host
// pool, and the checkpoint reads it back through the swapper (or, when the
// pool has no room, straight from the swap file).
//
// Measured, in this order:
//  1. fio (io_uring, O_DIRECT, 16 MiB requests or fewer, depth 16) writing and then
//     reading the checkpoint's bytes in --dir: the disk's limit here.
//  2. A foreground checkpoint: its wall time and bandwidth (the ratio to
//     fio's write), and its pause (what training would wait: reaching a
//     step boundary and taking the image).
//  3. Training steps alone (fetch with gradients, return, release per
//     layer, then a synchronous Step: no simulated compute), then the same
//     steps while a background checkpoint is written: the step's slowdown,
//     and that checkpoint's bandwidth; from them, what automatic
//     checkpoints every --auto_interval seconds cost (the training time the
//     slowdown takes, per interval) and the most a crash then loses.
//  4. Restore: the session closed, a new one restoring the directory (its
//     files' pages dropped from the page cache first, so that they are read
//     from the disk) and registering every partition: wall time and
//     bandwidth against fio's read.
// The checkpoint writes through the page cache and fsyncs at the end, so
// its figure includes the writeback; fio's does not use the page cache.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/config_registry.h"
#include "base/directory.h"
#include "base/host_memory.h"
#include "base/status_macros.h"
#include "base/unique_fd.h"
#include "benches/bench_engine.h"
#include "benches/bench_util.h"

namespace offload::bench {
namespace {

struct Flags {
  uint64_t params = 100'000'000;
  int layers = 16;
  int steps = 4;  // of training alone, to compare against
  bool nvme = false;
  uint64_t pool = uint64_t{1} << 30;  // with --nvme; the working copy and gradients need 0.4 GB
  std::string dir = "/var/tmp/offloadd-bench";
  int auto_interval_s = 600;  // checkpoint.auto_interval_seconds's default
};

int Fail(const absl::Status& s, const char* what) {
  std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
  return 1;
}

// Drops the clean pages of every file in `dir` from the page cache (the
// checkpoint fsynced them, so they are clean).
void DropCachedPages(const std::string& dir) {
  for (const std::string& name : ListDirectory(dir)) {
    UniqueFd fd(open(absl::StrCat(dir, "/", name).c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() >= 0) posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
  }
}

double Ratio(double value, double bound) { return bound > 0 ? value / bound : 0; }

int Main(int argc, char** argv) {
  Flags f;
  bool tiny = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) { return FlagValue(argv[i], name); };
    const char* v;
    if ((v = value("params"))) {
      f.params = CountOrExit(v);
    } else if ((v = value("layers"))) {
      f.layers = std::atoi(v);
    } else if ((v = value("steps"))) {
      f.steps = std::atoi(v);
    } else if ((v = value("pool"))) {
      f.pool = static_cast<uint64_t>(ByteSizeOrExit(v));
    } else if ((v = value("dir"))) {
      f.dir = v;
    } else if ((v = value("auto_interval"))) {
      f.auto_interval_s = std::atoi(v);
    } else if (a == "--nvme") {
      f.nvme = true;
    } else if (a == "--tiny") {
      tiny = true;
    } else {
      std::fprintf(stderr, "unknown flag %s (see benches/checkpoint_bench.cc)\n", a.c_str());
      return 2;
    }
  }
  if (tiny) {
    f.params = 1 << 20;
    f.layers = 4;
    f.steps = 2;
    f.pool = 8 << 20;
  }
  if (f.params == 0 || f.layers < 1 || f.steps < 1 || f.auto_interval_s < 1) {
    std::fprintf(stderr, "bad flags\n");
    return 2;
  }
  mkdir(f.dir.c_str(), 0700);
  PrintMachine(f.dir);
  const uint64_t per_layer = f.params / static_cast<uint64_t>(f.layers);
  const uint64_t params = per_layer * static_cast<uint64_t>(f.layers);
  const uint64_t bytes = params * 14;  // master, m, v (fp32) and the bf16 working copy
  const std::string ckpt = f.dir + "/checkpoint";
  mkdir(ckpt.c_str(), 0700);

  // 1. The disk's limit, over the checkpoint's bytes.
  const std::string fio_file = f.dir + "/checkpoint-fio";
  const uint64_t fio_bs = std::min<uint64_t>(16 << 20, RoundUp(bytes, 1 << 20));
  const uint64_t fio_size = RoundUp(bytes, fio_bs);
  const double fio_write = FioBandwidth(fio_file, /*write=*/true, fio_bs, 16, fio_size);
  const double fio_read = FioBandwidth(fio_file, /*write=*/false, fio_bs, 16, fio_size);
  unlink(fio_file.c_str());
  if (fio_write > 0 && fio_read > 0) {
    std::printf(
        "fio (io_uring, O_DIRECT, %llu MiB requests, depth 16) over %.2f GB in %s: "
        "write %.2f GB/s, read %.2f GB/s\n",
        static_cast<unsigned long long>(fio_bs >> 20), fio_size / 1e9, f.dir.c_str(),
        fio_write / 1e9, fio_read / 1e9);
  } else {
    std::printf("fio failed (is it installed?): no bound\n");
  }

  BenchEngineOptions eo;
  if (f.nvme) {
    eo.nvme.dirs = f.dir;
    eo.nvme.bytes_per_dir = static_cast<int64_t>(params * 12 * 5 / 4 + (64 << 20));
    eo.pool_bytes = f.pool;
  }
  eo.huge_page_bytes = SharedHugePageBytes() != 0 ? HugePageAlignment() : 0;
  auto made = MakeBenchEngine(eo);
  if (!made.ok()) return Fail(made.status(), "engine");
  BenchEngine& e = **made;
  PlacementChange placement;
  if (f.nvme) placement[DataKind::kOptimizerState] = 0;
  auto register_all = [&](const SessionKey& key) -> absl::StatusOr<std::vector<uint64_t>> {
    std::vector<uint64_t> ids;
    for (int l = 0; l < f.layers; ++l) {
      ASSIGN_OR_RETURN(PartitionInfo p,
                       e.sessions->Register(
                           key, {absl::StrCat("layer", l), per_layer, DType::kBf16, DType::kBf16}));
      ids.push_back(p.id);
    }
    RETURN_IF_ERROR(e.sessions->Release(key, {}));
    return ids;
  };
  auto opened = e.sessions->Open("bench", placement);
  if (!opened.ok()) return Fail(opened.status(), "open");
  const SessionKey key = opened->key;
  auto ids = register_all(key);
  if (!ids.ok()) return Fail(ids.status(), "register");
  std::printf(
      "== checkpoint: %llu params in %d layers (bf16 working copy, fp32 master and "
      "moments: %.2f GB per checkpoint), optimizer state %s; optimizer %s on %d threads\n",
      static_cast<unsigned long long>(params), f.layers, bytes / 1e9,
      f.nvme ? absl::StrCat("on NVMe, pool ", f.pool >> 20, " MiB").c_str() : "in memory",
      e.optimizer->kernel_name().c_str(), e.optimizer->threads());

  FetchMode backward;
  backward.grads = true;
  AdamHyperparams h;
  h.lr = 1e-4;
  // One training step; its wall time.
  auto step = [&]() -> absl::StatusOr<double> {
    const auto start = Clock::now();
    for (int l = f.layers - 1; l >= 0; --l) {
      RETURN_IF_ERROR(e.sessions->Fetch(key, {(*ids)[l]}, backward).status());
      RETURN_IF_ERROR(e.sessions->ReturnGradients(key, (*ids)[l], per_layer, DType::kBf16));
      RETURN_IF_ERROR(e.sessions->Release(key, {(*ids)[l]}));
    }
    RETURN_IF_ERROR(e.sessions->Step(key, h, StepControl{}).status());
    return SecondsSince(start);
  };
  for (int s = 0; s < 2; ++s) {
    if (auto t = step(); !t.ok()) return Fail(t.status(), "warm-up step");
  }

  // 2. A foreground checkpoint.
  auto written = e.sessions->Checkpoint(key, ckpt, /*background=*/false);
  if (!written.ok()) return Fail(written.status(), "checkpoint");
  const CheckpointSummary& fg = written->summary;
  std::printf(
      "foreground checkpoint: %.3f s for %.2f GB, %.2f GB/s = %.2fx fio's write; pause "
      "%.3f ms\n",
      fg.wall_us / 1e6, fg.bytes / 1e9, fg.bytes / (fg.wall_us / 1e6) / 1e9,
      Ratio(fg.bytes / (fg.wall_us / 1e6), fio_write), fg.pause_us / 1e3);

  // 3. Steps alone, then steps while a background checkpoint is written.
  double alone = 0;
  for (int s = 0; s < f.steps; ++s) {
    auto t = step();
    if (!t.ok()) return Fail(t.status(), "step");
    alone += *t / f.steps;
  }
  const auto begun = Clock::now();
  auto started = e.sessions->Checkpoint(key, ckpt, /*background=*/true);
  if (!started.ok()) return Fail(started.status(), "background checkpoint");
  std::atomic<bool> done{false};
  absl::StatusOr<SessionManager::CheckpointOutcome> finished;
  std::thread waiter([&] {
    finished = e.sessions->WaitCheckpoint(key);
    done = true;
  });
  double during = 0;
  int steps_during = 0;
  while (!done.load() || steps_during == 0) {
    auto t = step();
    if (!t.ok()) {
      waiter.join();
      return Fail(t.status(), "step during the checkpoint");
    }
    during += *t;
    ++steps_during;
  }
  waiter.join();
  if (!finished.ok()) return Fail(finished.status(), "background checkpoint");
  const double bg_wall =
      finished->summary.wall_us > 0 ? finished->summary.wall_us / 1e6 : SecondsSince(begun);
  const double bg_rate = finished->summary.bytes / bg_wall;
  std::printf("training alone: %.3f s per step (mean of %d)\n", alone, f.steps);
  std::printf(
      "while a background checkpoint is written: %.3f s per step (mean of %d, %.2fx "
      "alone); the checkpoint %.3f s, %.2f GB/s = %.2fx fio's write; pause %.3f ms\n",
      during / steps_during, steps_during, Ratio(during / steps_during, alone), bg_wall,
      bg_rate / 1e9, Ratio(bg_rate, fio_write), started->summary.pause_us / 1e3);
  // What automatic checkpoints (checkpoint.auto_interval_seconds) cost: the
  // training time the slowdown takes per checkpoint, over the interval.
  const double cost = std::max(0.0, during - steps_during * alone);
  std::printf(
      "automatic checkpoints every %d s (the default): each costs %.3f s of training = %.2f%% "
      "of the interval; a crash of offloadd loses at most %.0f s of training\n",
      f.auto_interval_s, cost, 100.0 * cost / f.auto_interval_s, f.auto_interval_s + bg_wall);

  // 4. Restore into a new session, its files read from the disk.
  if (auto closed = e.sessions->Close(key); !closed.ok()) return Fail(closed, "close");
  DropCachedPages(ckpt);
  const auto restoring = Clock::now();
  auto restored = e.sessions->Open("bench", placement, std::nullopt, std::nullopt, ckpt);
  if (!restored.ok()) return Fail(restored.status(), "restore");
  const SessionKey rkey = restored->key;
  if (auto r = register_all(rkey); !r.ok()) return Fail(r.status(), "restore");
  const double restore_wall = SecondsSince(restoring);
  const double restore_rate = finished->summary.bytes / restore_wall;
  std::printf("restore (page cache dropped): %.3f s, %.2f GB/s = %.2fx fio's read\n", restore_wall,
              restore_rate / 1e9, Ratio(restore_rate, fio_read));
  if (auto closed = e.sessions->Close(rkey); !closed.ok()) return Fail(closed, "close");
  return 0;
}

}  // namespace
}  // namespace offload::bench

int main(int argc, char** argv) { return offload::bench::Main(argc, argv); }
