// benches/out_of_core_step: an optimizer step whose state lives on NVMe and
// is several times the host memory it may use, through the daemon's real
// engine path, against the I/O bound (fio on the same directory, same
// request size, measured in the same run) and the compute bound (the same
// step with everything in memory).
//
//   bazel build -c opt //benches:out_of_core_step
//   bazel-bin/benches/out_of_core_step [--dir=/var/tmp/offloadd-bench]
//       [--params=400M] [--partition_params=25M] [--cache=1GiB] [--chunk=16MiB]
//       [--steps=5] [--swapper.prefetch_depth=8] [--swapper.prefetch_bytes=256MiB]
//       [--swapper.io_threads=4] [--nvme.checksum=true|false] [--nvme.request_bytes=1MiB]
//       [--nvme.queue_depth=32] [--nvme.rings=2] [--nvme.stripe_bytes=1MiB]
//       (any nvme.* or swapper.* tunable, as offloadd spells it)
//       [--compute_reps=3] [--no-fio] [--no-compute] [--hand_over]
//       [--arena_pages=huge|small] [--tiny]
//
// What runs (one process, in this order):
//   1. Compute bound: Optimizer::Step (the daemon's optimizer, default
//      options: all cores, NaN/Inf pre-scan on) over the same partitions with
//      everything in memory: bf16 working copy, bf16 gradients, fp32 master,
//      exp_avg, exp_avg_sq. Best of --compute_reps after a warm-up. Its
//      memory is freed before the engine starts; it runs again at the end
//      (the machine is shared) and the better of the two counts.
//   2. A file of the state's size for fio in --dir, written once (so every
//      timed write is an overwrite).
//   3. The engine, assembled in-process as engine/out_of_core_test.cc does:
//      HostPool (limit = the session arena's charge + --cache), Swapper over
//      SwapSpace over MakeIoBackend, PartitionStoreFactory, StepRunner,
//      SessionManager. One session with all optimizer state homed on NVMe
//      and params and gradients on the host, the partitions registered with
//      bf16 params and bf16 gradients (written into the arena through the
//      memfd while held, so the arena is mapped once in this process, as in
//      the daemon). Then --steps steps, each after every partition was held
//      with its gradient buffer, its gradients written, returned and
//      released (outside the timing). With --hand_over the gradients are
//      returned as offloadd.torch returns them when a step has one
//      micro-batch (ReturnGradients with hand_over): measured, not
//      accumulated, and the step reads them from the arena, so the fp32
//      accumulator on NVMe is never read or written. The first step
//      learns the access order (and finds its state never written:
//      zero-filled, no reads); later steps are the steady state.
//      After every step, once the swapper is idle, one fio round on the same
//      directory (this virtual disk's speed drifts by tens of percent within
//      minutes, so each steady step is compared with the rounds just before
//      and just after it). A round: sequential write, sequential read (bs =
//      the engine's request size, iodepth = its queue depth per job,
//      io_uring, O_DIRECT), one rw=rw job (50/50) moving the state's size
//      each way, and a read job and a write job at once, each moving the
//      state's size. I/O that the swapper does between steps (the prefetch
//      of the next step's first chunks, issued when a step ends, and the
//      write-outs that make room for it) finishes before the round starts
//      and is not counted in either step's bytes or time.
//      Peak RSS: /proc/self/clear_refs is reset (5) after setup, VmHWM read
//      after the steps; a sampler thread records the largest VmRSS, RssAnon
//      and RssShmem seen, and the pool's largest use, every 10 ms.
//
// Bounds, for each steady step, for the bytes it actually moved (the
// swapper's counters; Belady keeps a little state resident across steps):
//   read+write: bytes read / fio's read speed + bytes written / its write
//       speed (the sequential runs);
//   concurrent: the read job + write job run's time, scaled to those bytes
//       (by the larger of bytes read and written over the state's size);
//   rw=rw: the mixed job's time, scaled the same way.
//   A round's I/O bound is the fastest of the three; the step's is the
//   faster of the rounds before and after it. Also printed: the bound against
//   the mean of the two rounds, and all state read then written.
//   Compute bound = the in-memory step's best time.
//   Target: mean over steady steps of step / max(I/O bound, compute bound)
//   <= 1.1.
// Files go under --dir and are deleted at the end.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/config_registry.h"
#include "base/env.h"
#include "base/host_memory.h"
#include "base/status_macros.h"
#include "base/unique_fd.h"
#include "benches/bench_engine.h"
#include "benches/bench_util.h"
#include "cpu_adam/adam.h"
#include "cpu_adam/dtype.h"
#include "cpu_adam/optimizer.h"
#include "engine/partition_store.h"
#include "engine/session_manager.h"
#include "engine/shm_arena.h"
#include "engine/stats.h"
#include "engine/step_runner.h"
#include "nvme/io_backend.h"
#include "nvme/nvme_options.h"
#include "nvme/swap_space.h"
#include "swapper/host_pool.h"
#include "swapper/swapper.h"
#include "swapper/swapper_options.h"

namespace offload {
namespace {

using ::offload::bench::BenchEngine;
using ::offload::bench::BenchEngineOptions;
using ::offload::bench::Clock;
using ::offload::bench::MakeBenchEngine;
using ::offload::bench::PrintMachine;
using ::offload::bench::ProcStatus;
using ::offload::bench::ResetPeakRss;
using ::offload::bench::SecondsSince;
constexpr double kGiB = 1024.0 * 1024 * 1024;
constexpr double kMiB = 1024.0 * 1024;

struct Flags {
  std::string dir = "/var/tmp/offloadd-bench";
  uint64_t params = 400'000'000;
  uint64_t partition_params = 25'000'000;
  uint64_t cache = uint64_t{1} << 30;
  uint64_t chunk_bytes = 16 << 20;  // per kind
  // --arena_pages=huge|small: the arena's large partitions on huge pages
  // (the daemon's default where the kernel gives shared memory huge pages).
  bool arena_huge = SharedHugePageBytes() != 0;
  int steps = 5;
  // The NVMe tier's and the swapper's settings, as offloadd's tunables
  // (--nvme.*, --swapper.*: bench::TunableFlag); offloadd's defaults.
  NvmeOptions nvme;
  SwapperOptions swapper;
  int compute_reps = 3;
  bool fio = true;
  bool compute = true;
  bool hand_over = false;
};

// "400M", "25000000", "1.5G": decimal multiples (a count of parameters).
// fio's result for one run: bytes moved and bandwidth in each direction.
struct FioRun {
  bool ok = false;
  double read_bytes = 0, read_bw = 0, write_bytes = 0, write_bw = 0;
  // Time the run's I/O took (the slower direction's bytes / bandwidth).
  double seconds() const {
    double t = 0;
    if (read_bw > 0) t = std::max(t, read_bytes / read_bw);
    if (write_bw > 0) t = std::max(t, write_bytes / write_bw);
    return t;
  }
};

// The number after `"key" : ` following `from` in fio's JSON, or -1.
double JsonNumber(const std::string& json, size_t from, const char* key) {
  const std::string k = absl::StrCat("\"", key, "\" : ");
  size_t at = json.find(k, from);
  if (at == std::string::npos) return -1;
  at += k.size();
  double v;
  if (!absl::SimpleAtod(json.substr(at, json.find_first_of(",\n", at) - at), &v)) return -1;
  return v;
}

// Runs one fio job per entry of `rws` (fio's --rw: write, read, or rw =
// 50/50 mixed), all at once, on `file`. `io_size` 0: `size`. Empty on
// failure.
std::vector<FioRun> RunFio(const std::string& file, const std::vector<std::string>& rws,
                           uint64_t bs, int64_t depth, uint64_t size, uint64_t io_size) {
  std::string cmd = absl::StrCat(
      "fio --filename=", file, " --ioengine=io_uring --direct=1 --bs=", bs, " --iodepth=", depth,
      " --size=", size, io_size != 0 ? absl::StrCat(" --io_size=", io_size) : "",
      " --fixedbufs --registerfiles --thread --output-format=json");
  for (size_t k = 0; k < rws.size(); ++k) {
    absl::StrAppend(&cmd, " --name=j", k, " --rw=", rws[k],
                    rws[k] == "rw" ? " --rwmixread=50" : "");
  }
  absl::StrAppend(&cmd, " 2>/dev/null");
  std::vector<FioRun> runs;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return runs;
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  if (pclose(pipe) != 0) return runs;
  for (size_t k = 0; k < rws.size(); ++k) {
    // Each job's object holds its "read" then its "write" section.
    const size_t job = out.find(absl::StrCat("\"jobname\" : \"j", k, "\""));
    if (job == std::string::npos) return {};
    const size_t rd = out.find("\"read\" : {", job);
    const size_t wr = out.find("\"write\" : {", job);
    if (rd == std::string::npos || wr == std::string::npos) return {};
    FioRun r;
    r.read_bytes = JsonNumber(out, rd, "io_bytes");
    r.read_bw = JsonNumber(out, rd, "bw_bytes");
    r.write_bytes = JsonNumber(out, wr, "io_bytes");
    r.write_bw = JsonNumber(out, wr, "bw_bytes");
    r.ok = r.read_bytes >= 0 && r.read_bw >= 0 && r.write_bytes >= 0 && r.write_bw >= 0;
    if (!r.ok) return {};
    runs.push_back(r);
  }
  return runs;
}

struct FioRound {
  double write_bw = -1, read_bw = -1;
  // Seconds to read `bytes` and write `bytes`: one job with rw=rw, and two
  // jobs (one reading, one writing) at the same time.
  double mixed_seconds = -1, concurrent_seconds = -1;
};

// One round on `file` (`bytes` long): sequential write, sequential read, a
// mixed job, and a reading job with a writing job at once.
FioRound FioRoundOn(const std::string& file, uint64_t bytes, const Flags& f) {
  FioRound out;
  const uint64_t bs = static_cast<uint64_t>(std::min(f.nvme.io.request_bytes, f.nvme.stripe_bytes));
  std::vector<FioRun> w = RunFio(file, {"write"}, bs, f.nvme.io.queue_depth, bytes, 0);
  std::vector<FioRun> r = RunFio(file, {"read"}, bs, f.nvme.io.queue_depth, bytes, 0);
  std::vector<FioRun> m = RunFio(file, {"rw"}, bs, f.nvme.io.queue_depth, bytes, 2 * bytes);
  std::vector<FioRun> c = RunFio(file, {"read", "write"}, bs, f.nvme.io.queue_depth, bytes, 0);
  if (!w.empty()) out.write_bw = w[0].write_bw;
  if (!r.empty()) out.read_bw = r[0].read_bw;
  if (!m.empty()) out.mixed_seconds = m[0].seconds();
  if (c.size() == 2) out.concurrent_seconds = std::max(c[0].seconds(), c[1].seconds());
  return out;
}

void PrintFioRound(const char* label, const FioRound& r, uint64_t bytes) {
  std::printf(
      "fio %-15s write %6.3f GB/s, read %6.3f GB/s; reading and writing %.2f GB each: "
      "one rw=rw job %.3f s, a read job and a write job at once %.3f s\n",
      label, r.write_bw / 1e9, r.read_bw / 1e9, static_cast<double>(bytes) / 1e9, r.mixed_seconds,
      r.concurrent_seconds);
}

// A pattern of `n` bf16 values.
std::vector<uint16_t> Bf16Pattern(size_t n, bool gradients) {
  std::mt19937 rng(gradients ? 2 : 1);
  std::uniform_real_distribution<float> params(-1.f, 1.f);
  std::normal_distribution<float> grads(0.f, 0.01f);
  std::vector<uint16_t> out(n);
  for (uint16_t& v : out) v = FloatToBf16(gradients ? grads(rng) : params(rng));
  return out;
}

AdamHyperparams Hyper() {
  AdamHyperparams h;
  h.lr = 1e-3;
  h.weight_decay = 0.01;
  return h;
}

// The in-memory step over partitions of `sizes`: best and median seconds.
struct ComputeResult {
  double best = -1, median = -1;
  int threads = 0;
  std::string kernel;
};

absl::StatusOr<ComputeResult> ComputeBound(const std::vector<uint64_t>& sizes, int reps) {
  uint64_t total = 0;
  for (uint64_t n : sizes) total += n;
  ASSIGN_OR_RETURN(HostMemory master, HostMemory::Allocate(total * 4));
  ASSIGN_OR_RETURN(HostMemory m, HostMemory::Allocate(total * 4));
  ASSIGN_OR_RETURN(HostMemory v, HostMemory::Allocate(total * 4));
  ASSIGN_OR_RETURN(HostMemory working, HostMemory::Allocate(total * 2));
  ASSIGN_OR_RETURN(HostMemory grads, HostMemory::Allocate(total * 2));
  const std::vector<uint16_t> pw = Bf16Pattern(1 << 20, false), pg = Bf16Pattern(1 << 20, true);
  for (uint64_t i = 0; i < total; i += pw.size()) {
    const uint64_t n = std::min<uint64_t>(pw.size(), total - i);
    std::memcpy(working.as<uint16_t>() + i, pw.data(), n * 2);
    std::memcpy(grads.as<uint16_t>() + i, pg.data(), n * 2);
    WidenToFloat(pw.data(), DType::kBf16, master.as<float>() + i, n);
  }
  std::memset(m.data(), 0, total * 4);
  std::memset(v.data(), 0, total * 4);
  std::vector<AdamTask> tasks;
  uint64_t off = 0;
  for (uint64_t n : sizes) {
    AdamTask t;
    t.span.master = master.as<float>() + off;
    t.span.exp_avg = m.as<float>() + off;
    t.span.exp_avg_sq = v.as<float>() + off;
    t.span.grads = grads.as<uint16_t>() + off;
    t.span.grad_dtype = DType::kBf16;
    t.span.working = working.as<uint16_t>() + off;
    t.span.working_dtype = DType::kBf16;
    t.span.numel = n;
    tasks.push_back(t);
    off += n;
  }
  Optimizer opt{OptimizerOptions{}};
  ComputeResult out;
  out.threads = opt.threads();
  out.kernel = opt.kernel_name();
  std::vector<double> times;
  for (int r = 0; r <= reps; ++r) {  // r == 0: warm-up
    for (AdamTask& t : tasks) t.step = static_cast<uint64_t>(r) + 1;
    const auto start = Clock::now();
    absl::StatusOr<StepReport> report = opt.Step(tasks, Hyper());
    const double t = SecondsSince(start);
    if (!report.ok()) return report.status();
    if (report->skipped) return absl::InternalError("in-memory step skipped: non-finite gradients");
    if (r > 0) times.push_back(t);
  }
  std::sort(times.begin(), times.end());
  out.best = times.front();
  out.median = times[times.size() / 2];
  return out;
}

struct StepRow {
  double seconds = 0;
  SwapperStats d;  // counters over the step
  double wait = 0, compute = 0;
  bool skipped = false;
  uint64_t params = 0;
};

// Largest values seen by the sampler thread.
struct Peaks {
  std::atomic<uint64_t> rss{0}, anon{0}, shmem{0}, pool{0};
};

void Raise(std::atomic<uint64_t>& a, uint64_t v) {
  uint64_t cur = a.load();
  while (v > cur && !a.compare_exchange_weak(cur, v)) {
  }
}

// The flags into `f`: 0, or the exit status for flags it refuses.
int ParseFlags(int argc, char** argv, Flags* out) {
  Flags& f = *out;
  ConfigRegistry tunables;
  BindNvmeTunables(&f.nvme, &tunables);
  BindSwapperTunables(&f.swapper, &tunables);
  bool tiny = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) { return bench::FlagValue(argv[i], name); };
    auto bytes = bench::ByteSizeOrExit;
    auto count = bench::CountOrExit;
    const char* v;
    if ((v = value("dir"))) {
      f.dir = v;
    } else if ((v = value("params"))) {
      f.params = count(v);
    } else if ((v = value("partition_params"))) {
      f.partition_params = count(v);
    } else if ((v = value("cache"))) {
      f.cache = static_cast<uint64_t>(bytes(v));
    } else if ((v = value("chunk"))) {
      f.chunk_bytes = static_cast<uint64_t>(bytes(v));
    } else if ((v = value("steps"))) {
      f.steps = std::max(2, std::atoi(v));
    } else if (bench::TunableFlag(tunables, argv[i])) {
    } else if ((v = value("compute_reps"))) {
      f.compute_reps = std::max(1, std::atoi(v));
    } else if (a == "--no-fio") {
      f.fio = false;
    } else if (a == "--no-compute") {
      f.compute = false;
    } else if (a == "--hand_over") {
      f.hand_over = true;
    } else if (a == "--arena_pages=huge" || a == "--arena_pages=small") {
      f.arena_huge = a == "--arena_pages=huge";
    } else if (a == "--tiny") {
      tiny = true;
    } else {
      std::fprintf(stderr, "unknown flag %s (see benches/out_of_core_step_bench.cc)\n", a.c_str());
      return 2;
    }
  }
  if (tiny) {  // the smoke test: seconds, under 100 MB of disk
    f.params = 2'000'000;
    f.partition_params = 600'000;
    f.cache = 4 << 20;
    f.chunk_bytes = 256 << 10;
    f.steps = 3;
    f.compute_reps = 1;
  }
  return 0;
}

// What the flags make: the partitions' sizes, the arena's charge, the
// state's bytes and the pool's limit.
struct Plan {
  uint64_t chunk_elems = 0;
  std::vector<uint64_t> sizes;
  uint64_t huge = 0;
  uint64_t arena_charge = 0, blocks = 0;
  uint64_t state = 0;  // master, exp_avg, exp_avg_sq and the fp32 gradient accumulator
  uint64_t pool_limit = 0;
};

Plan MakePlan(const Flags& f) {
  Plan p;
  p.chunk_elems = std::max<uint64_t>(f.chunk_bytes / sizeof(float), 1024);
  for (uint64_t left = f.params; left > 0;) {
    p.sizes.push_back(std::min(left, f.partition_params));
    left -= p.sizes.back();
  }
  p.huge = f.arena_huge ? HugePageAlignment() : 0;
  for (uint64_t n : p.sizes) {
    // bf16 params + bf16 grads, each region in whole pages of its layout.
    const uint64_t page =
        ArenaLayoutPageBytes(n, DType::kBf16, DType::kBf16, false, p.chunk_elems, p.huge);
    p.arena_charge += 2 * RoundUp(n * 2, page);
    p.blocks += 4 * ((n + p.chunk_elems - 1) / p.chunk_elems);
  }
  // Master, exp_avg, exp_avg_sq and the fp32 gradient accumulator.
  p.state = f.params * 16;
  p.pool_limit = p.arena_charge + f.cache;
  return p;
}

// What the run will do, printed before it starts.
void PrintPlan(const Flags& f, const Plan& p) {
  std::printf(
      "== out_of_core_step: %llu params in %zu partitions of <= %llu; bf16 working copy + bf16 "
      "gradients in the session arena, fp32 master + exp_avg + exp_avg_sq + gradient accumulator "
      "homed on NVMe (optimizer_state_host_percent 0)\n",
      static_cast<unsigned long long>(f.params), p.sizes.size(),
      static_cast<unsigned long long>(f.partition_params));
  std::printf(
      "state %.3f GB (%.3f GiB, 16 B/param); arena %.3f GB (%.3f GiB, 4 B/param, %s) "
      "charged to the pool; state cache %.3f GiB\n",
      p.state / 1e9, p.state / kGiB, p.arena_charge / 1e9, p.arena_charge / kGiB,
      !f.arena_huge                ? "small pages"
      : SharedHugePageBytes() != 0 ? "large partitions on huge pages"
                                   : "laid out for huge pages, the kernel gives small ones",
      f.cache / kGiB);
  std::printf(
      "pool limit = arena + cache = %.3f GiB; state / cache = %.2fx; state / whole pool = "
      "%.2fx\n",
      p.pool_limit / kGiB, static_cast<double>(p.state) / f.cache,
      static_cast<double>(p.state) / p.pool_limit);
  if (f.hand_over) {
    std::printf(
        "gradients handed over (ReturnGradients with hand_over): the accumulator's 4 "
        "B/param are never read or written\n");
  }
  std::printf(
      "chunks of %llu elems (%s per kind): %llu blocks; group limit (pool/4) %.0f MiB; %s\n",
      static_cast<unsigned long long>(p.chunk_elems),
      FormatByteSize(static_cast<int64_t>(p.chunk_elems * 4)).c_str(),
      static_cast<unsigned long long>(p.blocks), p.pool_limit / 4 / kMiB,
      bench::DescribeSwapSettings(f.nvme, f.swapper).c_str());
}

// The in-memory Optimizer::Step over the same partitions: the compute
// bound, the best of before and after into `compute`. False if it failed.
bool MeasureCompute(const char* when, const Flags& f, const Plan& p, ComputeResult* compute) {
  std::printf(
      "\ncompute bound %s: Optimizer::Step over the same partitions in memory "
      "(%.2f GB)...\n",
      when, static_cast<double>(f.params) * 16 / 1e9);
  absl::StatusOr<ComputeResult> c = ComputeBound(p.sizes, f.compute_reps);
  if (!c.ok()) {
    std::fprintf(stderr, "compute bound: %s\n", c.status().ToString().c_str());
    return false;
  }
  std::printf(
      "compute %s: best %.3f s, median %.3f s of %d (%d threads, kernel %s): %.3f "
      "Gparam/s\n",
      when, c->best, c->median, f.compute_reps, c->threads, c->kernel.c_str(),
      f.params / c->best / 1e9);
  if (compute->best < 0 || c->best < compute->best) *compute = *c;
  return true;
}

// The engine's run: the steps, each with a fio round after it (with
// --fio), and what the process's memory did meanwhile.
struct Run {
  std::vector<StepRow> rows;
  std::vector<FioRound> fio_rounds;  // [k]: after step k + 1
  uint64_t rss_before_engine = 0, rss_after_setup = 0, hwm = 0, nvme_home = 0;
  Peaks peaks;
};

// 0, or the exit status of a failure (said on stderr).
int RunSteps(const Flags& f, const Plan& p, const std::string& fio_file, Run* out) {
  Run& run = *out;
  run.rss_before_engine = ProcStatus()["VmRSS"];
  {
    BenchEngineOptions eo;
    eo.nvme = f.nvme;  // every nvme.* flag, then where and how much
    eo.nvme.dirs = f.dir;
    // Room for copy-on-write rewrites in flight.
    const uint64_t slack = std::max<uint64_t>(
        p.state / 16, 4 * static_cast<uint64_t>(f.swapper.io_threads) * p.chunk_elems * 4);
    eo.nvme.bytes_per_dir = static_cast<int64_t>((p.state + slack + 4095) / 4096 * 4096);
    eo.pool_bytes = p.pool_limit;
    eo.swapper = f.swapper;
    eo.arena_bytes = 2 * p.arena_charge + (4 << 20);
    eo.chunk_elems = p.chunk_elems;
    eo.huge_page_bytes = p.huge;
    absl::StatusOr<std::unique_ptr<BenchEngine>> made = MakeBenchEngine(eo);
    if (!made.ok()) {
      std::fprintf(stderr, "%s\n", made.status().ToString().c_str());
      return 1;
    }
    BenchEngine& e = **made;
    const SwapStats ss = e.space->Stats();
    std::printf("\nengine: swap file %s (%s, %.2f GB)\n", ss.dirs[0].path.c_str(),
                ss.dirs[0].direct ? "O_DIRECT" : "buffered: no O_DIRECT here", ss.capacity / 1e9);

    // Optimizer p.state on NVMe; parameters and gradients in the arena, on the
    // host.
    PlacementChange placement;
    placement[DataKind::kOptimizerState] = 0;
    absl::StatusOr<OpenedSession> opened = e.sessions->Open("bench", placement);
    if (!opened.ok()) {
      std::fprintf(stderr, "%s\n", opened.status().ToString().c_str());
      return 1;
    }
    const SessionKey key = opened->key;
    std::vector<PartitionInfo> parts;
    for (size_t i = 0; i < p.sizes.size(); ++i) {
      absl::StatusOr<PartitionInfo> part =
          e.sessions->Register(key, {absl::StrCat("p", i), p.sizes[i], DType::kBf16, DType::kBf16});
      if (!part.ok()) {
        std::fprintf(stderr, "register: %s\n", part.status().ToString().c_str());
        return 1;
      }
      parts.push_back(*part);
    }
    // The trainer's side: working copy and gradients written through the
    // memfd (not a second mapping, which would count the pages twice in
    // this process's RSS), while held, as the residency contract asks. The
    // working copy once (then released); the same gradients before every
    // step (a step leaves the buffers zeros).
    absl::StatusOr<UniqueFd> fd = e.sessions->DupArenaFd(key);
    if (!fd.ok()) {
      std::fprintf(stderr, "%s\n", fd.status().ToString().c_str());
      return 1;
    }
    const std::vector<uint16_t> pw = Bf16Pattern(1 << 20, false), pg = Bf16Pattern(1 << 20, true);
    auto write_region = [&](const ArenaRegion& region, const std::vector<uint16_t>& src) {
      for (uint64_t done = 0; done < region.bytes;) {
        const uint64_t len = std::min<uint64_t>(src.size() * 2, region.bytes - done);
        const ssize_t w =
            pwrite(fd->get(), src.data(), len, static_cast<off_t>(region.offset + done));
        if (w <= 0) {
          std::fprintf(stderr, "writing the arena: %s\n", std::strerror(errno));
          return false;
        }
        done += static_cast<uint64_t>(w);
      }
      return true;
    };
    for (const PartitionInfo& part : parts) {
      if (!write_region(part.params, pw)) return 1;
    }
    if (absl::Status s = e.sessions->Release(key, {}); !s.ok()) {
      std::fprintf(stderr, "release: %s\n", s.ToString().c_str());
      return 1;
    }
    std::atomic<bool> stop{false};
    std::thread sampler([&] {
      while (!stop.load()) {
        std::map<std::string, uint64_t> s = ProcStatus();
        Raise(run.peaks.rss, s["VmRSS"]);
        Raise(run.peaks.anon, s["RssAnon"]);
        Raise(run.peaks.shmem, s["RssShmem"]);
        Raise(run.peaks.pool, e.pool->used());
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    });
    // With the sampler running, so that its stack counts as fixed overhead.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    run.rss_after_setup = ProcStatus()["VmRSS"];
    if (!ResetPeakRss()) std::printf("(could not reset VmHWM: /proc/self/clear_refs)\n");
    int failed = 0;
    for (int step = 1; step <= f.steps && failed == 0; ++step) {
      FetchMode backward;
      backward.grads = true;
      for (const PartitionInfo& part : parts) {
        absl::Status s = e.sessions->Fetch(key, {part.id}, backward).status();
        if (s.ok() && !write_region(part.grads, pg)) s = absl::DataLossError("arena write");
        if (s.ok()) {
          s = e.sessions->ReturnGradients(key, part.id, part.numel, DType::kBf16, f.hand_over);
        }
        if (s.ok()) s = e.sessions->Release(key, {part.id});
        if (!s.ok()) {
          std::fprintf(stderr, "return gradients: %s\n", s.ToString().c_str());
          failed = 1;
        }
      }
      const SwapperStats s0 = e.swapper->Stats();
      const int64_t w0 = e.stats.step_state_wait_nanos.load(),
                    c0 = e.stats.step_compute_nanos.load();
      const auto start = Clock::now();
      absl::StatusOr<StepSummary> summary = e.sessions->Step(key, Hyper());
      StepRow row;
      row.seconds = SecondsSince(start);
      if (!summary.ok()) {
        std::fprintf(stderr, "step %d: %s\n", step, summary.status().ToString().c_str());
        failed = 1;
        break;
      }
      row.d = e.swapper->Stats().Since(s0);
      row.wait = static_cast<double>(e.stats.step_state_wait_nanos.load() - w0) / 1e9;
      row.compute = static_cast<double>(e.stats.step_compute_nanos.load() - c0) / 1e9;
      row.skipped = summary->skipped;
      row.params = summary->params_updated;
      run.rows.push_back(row);
      std::printf("step %d: %.3f s (%llu params updated%s)\n", step, row.seconds,
                  static_cast<unsigned long long>(row.params), row.skipped ? ", SKIPPED" : "");
      if (f.fio) {
        e.swapper->WaitIdle();  // the prefetch for the next step, and its write-outs
        run.fio_rounds.push_back(FioRoundOn(fio_file, p.state, f));
        PrintFioRound(absl::StrCat("after step ", step, ":").c_str(), run.fio_rounds.back(),
                      p.state);
      }
    }
    stop.store(true);
    sampler.join();
    run.hwm = ProcStatus()["VmHWM"];
    run.nvme_home = e.swapper->Stats().nvme_home_bytes;
    if (failed != 0) return 1;
    // ~Engine: sessions (their p.blocks), swapper, pool, swap space (the swap
    // file is removed).
  }
  return 0;
}

// Every step's time and swapper counters; the steady steps' mean (every
// step after the first, which learns the order), returned.
double PrintSteps(const Plan& p, const Run& run) {
  std::printf("\n%-9s %8s %8s %8s %8s %7s %7s %7s %7s %7s %7s %6s %6s %9s %9s\n", "step", "wall s",
              "read GB", "write GB", "r+w GB/s", "acq", "hits", "waited", "misses", "prefet",
              "used", "wasted", "zero", "pinwait s", "update s");
  for (size_t i = 0; i < run.rows.size(); ++i) {
    const StepRow& r = run.rows[i];
    const SwapperStats& d = r.d;
    std::printf(
        "%-9s %8.3f %8.3f %8.3f %8.3f %7llu %7llu %7llu %7llu %7llu %7llu %6llu %6llu "
        "%9.3f %9.3f\n",
        i == 0 ? "1 (learn)" : std::to_string(i + 1).c_str(), r.seconds, d.bytes_in / 1e9,
        d.bytes_out / 1e9, (d.bytes_in + d.bytes_out) / 1e9 / r.seconds,
        static_cast<unsigned long long>(d.acquires), static_cast<unsigned long long>(d.hits),
        static_cast<unsigned long long>(d.waited_reads), static_cast<unsigned long long>(d.misses),
        static_cast<unsigned long long>(d.prefetches),
        static_cast<unsigned long long>(d.prefetch_used),
        static_cast<unsigned long long>(d.prefetch_wasted),
        static_cast<unsigned long long>(d.zero_fills), r.wait, r.compute);
  }
  // Steady p.state: every step after the first.
  double steady = 0, worst = 0, best = 1e30, in = 0, out = 0, rd_ns = 0, wr_ns = 0;
  const size_t ns = run.rows.size() - 1;
  for (size_t i = 1; i < run.rows.size(); ++i) {
    steady += run.rows[i].seconds / ns;
    worst = std::max(worst, run.rows[i].seconds);
    best = std::min(best, run.rows[i].seconds);
    in += static_cast<double>(run.rows[i].d.bytes_in) / ns;
    out += static_cast<double>(run.rows[i].d.bytes_out) / ns;
    rd_ns += static_cast<double>(run.rows[i].d.read_nanos) / ns;
    wr_ns += static_cast<double>(run.rows[i].d.write_nanos) / ns;
  }
  std::printf(
      "steady steps (2..%zu): mean %.3f s, best %.3f s, worst %.3f s; per step read %.3f GB "
      "+ written %.3f GB (state %.3f GB); I/O threads' busy time: reads %.2f s, writes %.2f s\n",
      run.rows.size(), steady, best, worst, in / 1e9, out / 1e9, p.state / 1e9, rd_ns / 1e9,
      wr_ns / 1e9);
  if (run.nvme_home != p.state) {
    std::printf("NOTE: %llu bytes homed on NVMe, not the state's %llu\n",
                static_cast<unsigned long long>(run.nvme_home),
                static_cast<unsigned long long>(p.state));
  }
  return steady;
}

// Each steady step against the fio rounds just before and after it, and
// against the compute bound.
void PrintBounds(const Flags& f, const Plan& p, const Run& run, const ComputeResult& compute,
                 double steady) {
  const size_t ns = run.rows.size() - 1;  // the steady steps
  // Bounds: each steady step against the fio rounds just before and after it.
  std::printf("\n== bounds\n");
  auto round_ok = [](const FioRound& r) {
    return r.read_bw > 0 && r.write_bw > 0 && r.mixed_seconds > 0 && r.concurrent_seconds > 0;
  };
  // The fastest way round `r` moves `in` read and `out` written bytes.
  auto round_io = [&](const FioRound& r, double in_bytes, double out_bytes) {
    // The joint runs moved the p.state's size each way; a step reads and
    // writes about as much (steady p.state), so scale by the larger side.
    const double scale = std::max(in_bytes, out_bytes) / static_cast<double>(p.state);
    return std::min({in_bytes / r.read_bw + out_bytes / r.write_bw, r.concurrent_seconds * scale,
                     r.mixed_seconds * scale});
  };
  double mean_ratio = -1, mean_ratio_avg = -1, worst_ratio = 0, learn_ratio = -1;
  if (f.fio && run.fio_rounds.size() == run.rows.size() &&
      std::all_of(run.fio_rounds.begin(), run.fio_rounds.end(), round_ok)) {
    std::printf(
        "fio rounds (seconds for the state's size, %.3f GB, each way):\n%-12s %10s %10s "
        "%12s %12s %12s\n",
        p.state / 1e9, "after step", "read GB/s", "write GB/s", "read+write", "concurrent",
        "rw=rw");
    for (size_t k = 0; k < run.fio_rounds.size(); ++k) {
      const FioRound& r = run.fio_rounds[k];
      std::printf("%-12zu %10.3f %10.3f %11.3fs %11.3fs %11.3fs\n", k + 1, r.read_bw / 1e9,
                  r.write_bw / 1e9, p.state / r.read_bw + p.state / r.write_bw,
                  r.concurrent_seconds, r.mixed_seconds);
    }
    std::printf("\n%-6s %8s %8s %8s %10s %10s %9s %9s %8s %9s\n", "step", "wall s", "read GB",
                "write GB", "I/O before", "I/O after", "compute", "bound", "ratio", "vs mean");
    mean_ratio = mean_ratio_avg = 0;
    for (size_t i = 1; i < run.rows.size(); ++i) {
      const double in_b = static_cast<double>(run.rows[i].d.bytes_in);
      const double out_b = static_cast<double>(run.rows[i].d.bytes_out);
      const double io_before = round_io(run.fio_rounds[i - 1], in_b, out_b);
      const double io_after = round_io(run.fio_rounds[i], in_b, out_b);
      const double bound = std::max({std::min(io_before, io_after), compute.best, 0.0});
      const double bound_avg = std::max({(io_before + io_after) / 2, compute.best, 0.0});
      const double ratio = run.rows[i].seconds / bound;
      mean_ratio += ratio / static_cast<double>(ns);
      mean_ratio_avg += run.rows[i].seconds / bound_avg / static_cast<double>(ns);
      worst_ratio = std::max(worst_ratio, ratio);
      std::printf("%-6zu %8.3f %8.3f %8.3f %9.3fs %9.3fs %8.3fs %8.3fs %7.3fx %8.3fx\n", i + 1,
                  run.rows[i].seconds, in_b / 1e9, out_b / 1e9, io_before, io_after, compute.best,
                  bound, ratio, run.rows[i].seconds / bound_avg);
    }
    // The learning step only writes: against the sequential speeds of the
    // round after it.
    learn_ratio =
        run.rows[0].seconds /
        std::max(static_cast<double>(run.rows[0].d.bytes_in) / run.fio_rounds[0].read_bw +
                     static_cast<double>(run.rows[0].d.bytes_out) / run.fio_rounds[0].write_bw,
                 compute.best);
    std::printf(
        "I/O before/after: the fastest of read+write, concurrent and rw=rw (scaled to the "
        "step's bytes) in the round before / after the step; bound = max(the faster of "
        "the two, compute); ratio = wall / bound; vs mean: against the mean of the two "
        "rounds\n");
  } else if (f.fio) {
    std::printf("fio failed in some round: no I/O bound\n");
  }
  if (compute.best > 0) {
    std::printf(
        "compute bound (in-memory Optimizer::Step, best before/after): %.3f s; steady mean "
        "/ compute: %.2fx\n",
        compute.best, steady / compute.best);
  }
  if (mean_ratio > 0) {
    std::printf(
        "steady step / bound: mean %.3fx (%.3fx against the mean of the adjacent rounds), "
        "worst %.3fx; first step (learning, writes only) %.3fx; target <= 1.10x: %s\n",
        mean_ratio, mean_ratio_avg, worst_ratio, learn_ratio,
        mean_ratio <= 1.10 ? "MET" : "NOT MET");
  }
}

// The process's memory against the pool's limit and its fixed overhead.
void PrintMemory(const Flags& f, const Plan& p, const Run& run) {
  // Memory. The fixed overhead is VmRSS after setup: the binary, libraries,
  // the engine's threads and rings, before any arena page is mapped here or
  // any p.state block is leased.
  std::printf("\n== memory (pool limit %.3f GiB = arena %.3f GiB + cache %.3f GiB)\n",
              p.pool_limit / kGiB, p.arena_charge / kGiB, f.cache / kGiB);
  std::printf(
      "VmRSS before the engine %.1f MiB; after setup (engine built, partitions registered, "
      "nothing mapped or leased yet: the fixed overhead) %.1f MiB\n",
      run.rss_before_engine / kMiB, run.rss_after_setup / kMiB);
  std::printf(
      "peak over the steps: VmHWM %.3f GiB; sampled max VmRSS %.3f GiB, RssAnon %.3f GiB, "
      "RssShmem (arena) %.3f GiB; pool used max %.3f GiB\n",
      run.hwm / kGiB, run.peaks.rss.load() / kGiB, run.peaks.anon.load() / kGiB,
      run.peaks.shmem.load() / kGiB, run.peaks.pool.load() / kGiB);
  std::printf("VmHWM - pool limit = %+.1f MiB against a fixed overhead of %.1f MiB: %s\n",
              (static_cast<double>(run.hwm) - static_cast<double>(p.pool_limit)) / kMiB,
              run.rss_after_setup / kMiB,
              run.hwm <= p.pool_limit + run.rss_after_setup ? "within pool + fixed overhead"
                                                            : "ABOVE pool + fixed overhead");
}

int Main(int argc, char** argv) {
  Flags f;
  if (int refused = ParseFlags(argc, argv, &f); refused != 0) return refused;
  const Plan p = MakePlan(f);
  if (mkdir(f.dir.c_str(), 0700) != 0 && errno != EEXIST) {
    std::fprintf(stderr, "mkdir %s: %s\n", f.dir.c_str(), std::strerror(errno));
    return 1;
  }
  PrintMachine(f.dir);
  PrintPlan(f, p);

  // 1. Compute bound (again after the engine: the machine is shared).
  ComputeResult compute;
  if (f.compute && !MeasureCompute("before", f, p, &compute)) return 1;

  // 2. The fio file.
  const std::string fio_file = f.dir + "/fio_bench.dat";
  std::vector<FioRound> fio_rounds;  // [k]: after step k + 1
  if (f.fio) {
    std::printf(
        "\nfio: io_uring, O_DIRECT, bs %s, iodepth %lld per job, on %s (%.2f GB), one "
        "round after each step\n",
        FormatByteSize(std::min(f.nvme.io.request_bytes, f.nvme.stripe_bytes)).c_str(),
        static_cast<long long>(f.nvme.io.queue_depth), fio_file.c_str(), p.state / 1e9);
    if (RunFio(fio_file, {"write"}, 16 << 20, 16, p.state, 0).empty()) {
      std::printf("fio failed (is it installed?): no I/O bound\n");
      f.fio = false;
    }
  }

  // 3. The engine.
  Run run;
  if (int failed = RunSteps(f, p, fio_file, &run); failed != 0) return failed;
  unlink(fio_file.c_str());
  rmdir(f.dir.c_str());  // only if empty (we may not have created it)
  if (f.compute && !MeasureCompute("after", f, p, &compute)) return 1;

  const double steady = PrintSteps(p, run);
  PrintBounds(f, p, run, compute, steady);
  PrintMemory(f, p, run);
  return 0;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // progress shows as it goes
  return offload::Main(argc, argv);
}
