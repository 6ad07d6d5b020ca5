// Shares of the node's one optimizer (engine/optimizer_shares.h): sessions
// stepping without pause, each with its own weight, against the same
// sessions' throughput alone in the same run.
//
//   bazel-bin/benches/shares [--params=16M] [--partitions=4] [--seconds=4]
//                            [--weights=2,1]
//                            [--state-on-nvme=DIR [--slow=N [--slow-pause-ms=200]]]
//                            [--neighbour=DIR [--rounds=9]] [--timeline] [--lockstep]
//                            [--tiny]
//
// --state-on-nvme=DIR: the sessions' optimizer state homed on NVMe (swap
// files in DIR), the pool holding a quarter of it: each step swaps its state
// in and out, the disk is what the sessions share, and its bandwidth is
// divided by the same weights (the swapper's I/O queue, Swapper::SetIoWeight).
// Together, the pool's traffic goes by the same weights (a session past its
// share gives room first; printed: how many of the evictions); alone, the
// first session has the pool to itself: the idle sessions' blocks are
// evicted first (printed: how many), and its updates a second are those of
// a session whose state mostly fits, not a quarter.
// --slow=N (with --state-on-nvme): one more session of N parameters, weight
// 1, whose state fits in the pool beside the others' quarter and which
// pauses --slow-pause-ms before each step (a trainer whose GPU computes
// meanwhile): it uses the pool, slowly, so it is the least served of the
// sessions, and the others are all ahead of it. Their shares are printed
// among themselves (its own updates apart): its presence must not stop their
// weights from telling them apart.
//
// --lockstep: the sessions (not --slow's) step together, as the ranks of
// one job do (each waits after its step for the others: ZeRO-3's next
// all-gather); their shares are then those of one job's ranks, and what
// matters is the node's updates.
//
// --timeline: each second of the sessions' run together, each one's
// updates, the pool's room its blocks hold, its disk traffic and its blocks
// evicted (how the shares settle, or do not).
//
// --neighbour=DIR: instead, a session with its state on the host against
// itself alone in the same run (windows of --seconds, 1 by default here,
// alternating --rounds times: this VM's memory bandwidth drifts within
// seconds, so many short windows), while a neighbour whose optimizer state is
// homed on NVMe (swap files in DIR, ext4 for O_DIRECT) steps without pause,
// swapping as fast as the disk allows (the pool holds a quarter of its
// state). Prints the first session's fetch latency (p50, p99) and step time
// both ways and their ratios (issue 31's target: within 10%), and an
// estimate of the limit the cores set: the neighbour's own work (its
// updates, its I/O's checksums and system calls), measured as the process's
// CPU time while it runs alone and scaled to the pace it ran at beside,
// takes that much of the cores from the first session, whose step alone
// keeps them busy; its step beside is then no faster than (its CPU alone) /
// (cores - the neighbour's). An estimate: the pace beside is what the shares
// gave the neighbour, the process's idle CPU is counted on both sides, and
// memory bandwidth taken by the neighbour's transfers is not in it.
//
// Each session is a thread that, again and again, hands a gradient over
// for each of its partitions (held, returned with its statistics,
// released) and steps, as a trainer with state on the host and its
// gradients computed elsewhere (a GPU) does: the daemon's work is the step. Prints each session's
// parameters updated per second and the ratio to its weight's share
// (target: within 10%), and the node's total against one session alone
// (sharing must not cost throughput).
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/host_memory.h"
#include "base/status_macros.h"
#include "benches/bench_engine.h"
#include "benches/bench_util.h"

namespace offload {
namespace {

using bench::BenchEngine;
using bench::Clock;

struct Flags {
  uint64_t params = 16'000'000;
  int partitions = 4;
  double seconds = 0;  // 0: 4, or 1 with --neighbour
  std::vector<int64_t> weights = {2, 1};
  std::string neighbour;  // a swap directory: the neighbour measurement
  std::string state_dir;  // a swap directory: every session's state on NVMe
  int rounds = 9;         // its alone/beside/neighbour-alone windows
  uint64_t slow = 0;      // --slow's parameters (0: no such session)
  int slow_pause_ms = 200;
  bool timeline = false;  // each second's updates, room and disk traffic by session
  bool lockstep = false;  // the sessions step together, as the ranks of one job
};

// The ranks of one job step together: each waits here after its step until
// all have stepped (ZeRO-3's next all-gather), or until `stop`.
class Lockstep {
 public:
  explicit Lockstep(int ranks) : ranks_(ranks) {}
  void Wait(const std::atomic<bool>& stop) {
    absl::MutexLock lock(&mu_);
    const uint64_t round = round_;
    if (++arrived_ == ranks_) {
      arrived_ = 0;
      ++round_;
      all_.SignalAll();
      return;
    }
    while (round_ == round && !stop.load(std::memory_order_relaxed)) {
      all_.WaitWithTimeout(&mu_, absl::Milliseconds(10));
    }
  }

 private:
  absl::Mutex mu_;
  absl::CondVar all_;
  const int ranks_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t round_ ABSL_GUARDED_BY(mu_) = 0;
};

// One session: registered partitions and its arena, mapped.
struct Job {
  SessionKey key;
  HostMemory arena;
  std::vector<PartitionInfo> parts;
  std::atomic<uint64_t> updated{0};
  bool written = false;                // its gradient buffers hold the gradients
  std::chrono::milliseconds pause{0};  // before each step: the trainer's compute
  bool lockstep = false;               // steps with the others so marked (--lockstep)
  // Measured (only the thread training it touches these): each Fetch's and
  // each Step's time, in microseconds.
  bool timed = false;
  std::vector<double> fetch_us, step_us;
};

absl::Status Open(BenchEngine& e, Job* job, const std::string& name, int64_t weight,
                  uint64_t params, int partitions, const PlacementChange& placement = {}) {
  ASSIGN_OR_RETURN(OpenedSession opened, e.sessions->Open(name, placement));
  job->key = opened.key;
  RETURN_IF_ERROR(e.sessions->SetShare(job->key, weight));
  const uint64_t each = params / static_cast<uint64_t>(partitions);
  for (int i = 0; i < partitions; ++i) {
    ASSIGN_OR_RETURN(PartitionInfo p, e.sessions->Register(job->key, {absl::StrCat("p", i), each,
                                                                      DType::kFp32, DType::kFp32}));
    job->parts.push_back(p);
  }
  ASSIGN_OR_RETURN(UniqueFd fd, e.sessions->DupArenaFd(job->key));
  uint64_t end = 0;
  for (const PartitionInfo& p : job->parts) {
    end = std::max({end, p.params.offset + p.params.bytes, p.grads.offset + p.grads.bytes});
  }
  ASSIGN_OR_RETURN(job->arena, HostMemory::MapShared(fd.get(), 0, RoundUpToPage(end)));
  for (const PartitionInfo& p : job->parts) {
    std::memset(job->arena.data() + p.params.offset, 0, p.params.bytes);  // the initial values
  }
  return e.sessions->Release(job->key, {});
}

// Steps `job` until `stop`; after each step, waits at `ranks` if given.
absl::Status Train(BenchEngine& e, Job* job, const std::atomic<bool>& stop,
                   Lockstep* ranks = nullptr) {
  FetchMode grads;
  grads.grads = true;
  while (!stop.load(std::memory_order_relaxed)) {
    for (const PartitionInfo& p : job->parts) {
      // The trainer's gradients (the same every time: its own compute is
      // not what is measured), handed over with their statistics, as
      // offloadd.torch does with one micro-batch a step: the daemon's work
      // for a step is the step.
      const auto fetching = Clock::now();
      RETURN_IF_ERROR(e.sessions->Fetch(job->key, {p.id}, grads).status());
      if (job->timed) job->fetch_us.push_back(1e6 * bench::SecondsSince(fetching));
      if (!job->written) {
        float* g = reinterpret_cast<float*>(job->arena.data() + p.grads.offset);
        std::fill(g, g + p.numel, 1e-3f);
      }
      GradStats stats;
      stats.sq_norm = static_cast<double>(p.numel) * 1e-6;
      RETURN_IF_ERROR(e.sessions->ReturnGradients(job->key, p.id, p.numel, DType::kFp32,
                                                  /*hand_over=*/true, stats));
      RETURN_IF_ERROR(e.sessions->Release(job->key, {p.id}));
    }
    job->written = true;
    if (job->pause.count() > 0) std::this_thread::sleep_for(job->pause);
    const auto stepping = Clock::now();
    ASSIGN_OR_RETURN(StepSummary s, e.sessions->Step(job->key, AdamHyperparams{}));
    if (job->timed) job->step_us.push_back(1e6 * bench::SecondsSince(stepping));
    job->updated.fetch_add(s.params_updated, std::memory_order_relaxed);
    if (ranks != nullptr) ranks->Wait(stop);
  }
  return absl::OkStatus();
}

// Runs `jobs` at once for `seconds`; each one's parameters updated a second.
// `timeline`: prints, each second, each session's updates, the pool's room
// its blocks hold, its disk traffic and its blocks evicted (how the shares
// settle over time).
absl::StatusOr<std::vector<double>> RunTogether(BenchEngine& e, const std::vector<Job*>& jobs,
                                                double seconds, bool timeline = false) {
  std::atomic<bool> stop{false};
  std::vector<absl::Status> status(jobs.size());
  std::vector<uint64_t> before;
  for (Job* j : jobs) before.push_back(j->updated.load());
  std::vector<std::thread> threads;
  Lockstep ranks(static_cast<int>(
      std::count_if(jobs.begin(), jobs.end(), [](const Job* j) { return j->lockstep; })));
  const auto start = Clock::now();
  for (size_t i = 0; i < jobs.size(); ++i) {
    threads.emplace_back(
        [&, i] { status[i] = Train(e, jobs[i], stop, jobs[i]->lockstep ? &ranks : nullptr); });
  }
  if (timeline) {
    std::vector<uint64_t> updated = before, moved(jobs.size()), evicted(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      const Swapper::TraceIo io = e.swapper->IoOf(jobs[i]->key.id);
      moved[i] = io.bytes_in + io.bytes_out;
      evicted[i] = io.evictions;
    }
    for (int second = 1; second <= static_cast<int>(seconds); ++second) {
      std::this_thread::sleep_until(start + std::chrono::seconds(second));
      std::string line = absl::StrFormat("  t=%2ds", second);
      for (size_t i = 0; i < jobs.size(); ++i) {
        const uint64_t u = jobs[i]->updated.load();
        const Swapper::TraceIo io = e.swapper->IoOf(jobs[i]->key.id);
        absl::StrAppendFormat(
            &line, "  job%zu %6.1f Mparam/s, room %4.0f MiB, disk %4.0f MiB/s, evicted %3llu", i,
            static_cast<double>(u - updated[i]) / 1e6, static_cast<double>(io.room) / (1 << 20),
            static_cast<double>(io.bytes_in + io.bytes_out - moved[i]) / (1 << 20),
            static_cast<unsigned long long>(io.evictions - evicted[i]));
        updated[i] = u;
        moved[i] = io.bytes_in + io.bytes_out;
        evicted[i] = io.evictions;
      }
      std::printf("%s\n", line.c_str());
    }
  }
  std::this_thread::sleep_until(
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds)));
  stop = true;
  for (auto& t : threads) t.join();
  const double took = bench::SecondsSince(start);
  std::vector<double> rates;
  for (size_t i = 0; i < jobs.size(); ++i) {
    RETURN_IF_ERROR(status[i]);
    rates.push_back(static_cast<double>(jobs[i]->updated.load() - before[i]) / took);
  }
  return rates;
}

// The process's CPU time so far (user and system, all its threads: the
// optimizer's, the swapper's, io_uring's workers), in seconds.
double ProcessCpuSeconds() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * t.tv_usec; };
  return seconds(u.ru_utime) + seconds(u.ru_stime);
}

// --neighbour: see the top of this file.
int Neighbour(const Flags& f) {
  const uint64_t each = f.params / static_cast<uint64_t>(f.partitions);
  const uint64_t params = each * static_cast<uint64_t>(f.partitions);
  // Host bytes: what the two sessions place on the host (28 B a parameter:
  // parameters and gradients, fp32, of both, the first's moments, the
  // gradients' accumulators), what the trainers and a step hold at once (a
  // partition's parameters and gradients each, 7 B a parameter in all at 4
  // partitions), and a quarter of the neighbour's moments (2 B).
  bench::BenchEngineOptions o;
  o.nvme.dirs = f.neighbour;
  o.nvme.bytes_per_dir = static_cast<int64_t>(RoundUpToPage(4 * 8 * params + (64 << 20)));
  o.pool_bytes = 37 * params;
  auto made = bench::MakeBenchEngine(o);
  if (!made.ok()) {
    std::fprintf(stderr, "engine: %s\n", made.status().ToString().c_str());
    return 1;
  }
  BenchEngine& e = **made;
  Job mine, neighbour;
  PlacementChange on_nvme;
  on_nvme[DataKind::kOptimizerState] = 0;
  for (auto [job, name, placement] :
       {std::tuple<Job*, const char*, PlacementChange>{&mine, "host", {}},
        {&neighbour, "nvme", on_nvme}}) {
    if (absl::Status s = Open(e, job, name, 1, params, f.partitions, placement); !s.ok()) {
      std::fprintf(stderr, "opening %s: %s\n", name, s.ToString().c_str());
      return 1;
    }
  }
  std::printf(
      "== neighbour: a session of %llu fp32 parameters (state on the host) alone and beside "
      "one of the same size whose optimizer state is homed on NVMe in %s (the pool holds a "
      "quarter of it), both stepping without pause; optimizer on %lld threads\n",
      static_cast<unsigned long long>(params), f.neighbour.c_str(),
      static_cast<long long>(e.optimizer->threads()));
  // Warm-up: both touched, the neighbour's state written out once.
  if (auto r = RunTogether(e, {&mine, &neighbour}, std::min(1.0, f.seconds / 2)); !r.ok()) {
    std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
    return 1;
  }
  struct Figures {
    double fetch50, fetch99, step50;
  };
  // A window's load, each a wall second: the process's CPU seconds, and the
  // neighbour's parameters updated and bytes swapped in.
  struct Load {
    double cpu = 0, nb_updated = 0, nb_swapped = 0;
  };
  // Runs `jobs` for f.seconds; `figures`: mine's (it is one of them).
  auto measure = [&](const std::vector<Job*>& jobs, Load* load,
                     Figures* figures = nullptr) -> absl::Status {
    mine.fetch_us.clear();
    mine.step_us.clear();
    mine.timed = figures != nullptr;
    const double cpu = ProcessCpuSeconds();
    const uint64_t swapped = e.swapper->Stats().bytes_in;
    const uint64_t updated = neighbour.updated.load();
    const auto start = Clock::now();
    absl::StatusOr<std::vector<double>> r = RunTogether(e, jobs, f.seconds);
    const double wall = bench::SecondsSince(start);
    mine.timed = false;
    RETURN_IF_ERROR(r.status());
    load->cpu = (ProcessCpuSeconds() - cpu) / wall;
    load->nb_updated = static_cast<double>(neighbour.updated.load() - updated) / wall;
    load->nb_swapped = static_cast<double>(e.swapper->Stats().bytes_in - swapped) / wall;
    if (figures != nullptr) {
      *figures = {bench::Quantile(mine.fetch_us, 0.5), bench::Quantile(mine.fetch_us, 0.99),
                  bench::Quantile(mine.step_us, 0.5)};
    }
    return absl::OkStatus();
  };
  // Mine alone, beside the neighbour, and the neighbour alone, in
  // alternation, `rounds` times (drift hits all alike); each figure the
  // median over its rounds.
  std::vector<Figures> alone_runs(f.rounds), beside_runs(f.rounds);
  std::vector<Load> mine_load(f.rounds), beside_load(f.rounds), nb_load(f.rounds);
  for (int r = 0; r < f.rounds; ++r) {
    absl::Status s = measure({&mine}, &mine_load[r], &alone_runs[r]);
    if (s.ok()) s = measure({&mine, &neighbour}, &beside_load[r], &beside_runs[r]);
    if (s.ok()) s = measure({&neighbour}, &nb_load[r]);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
  }
  auto median = [](const auto& runs, auto field) {
    std::vector<double> v;
    for (const auto& x : runs) v.push_back(x.*field);
    return bench::Quantile(v, 0.5);
  };
  const Figures alone_f{median(alone_runs, &Figures::fetch50),
                        median(alone_runs, &Figures::fetch99),
                        median(alone_runs, &Figures::step50)};
  const Figures beside_f{median(beside_runs, &Figures::fetch50),
                         median(beside_runs, &Figures::fetch99),
                         median(beside_runs, &Figures::step50)};
  const Figures* alone = &alone_f;
  const Figures* beside = &beside_f;
  // The limit: the neighbour's CPU at its pace beside, out of the cores
  // mine's step keeps busy alone.
  const double cores = static_cast<double>(sysconf(_SC_NPROCESSORS_ONLN));
  const double mine_cpu = median(mine_load, &Load::cpu);
  const double nb_cpu_alone = median(nb_load, &Load::cpu);
  const double nb_pace =
      median(beside_load, &Load::nb_updated) / median(nb_load, &Load::nb_updated);
  const double nb_cpu = nb_cpu_alone * nb_pace;
  // (<= 0: the neighbour's work alone would fill the cores; no estimate.)
  const double floor = mine_cpu + nb_cpu <= cores ? 1.0
                       : nb_cpu < cores           ? mine_cpu / (cores - nb_cpu)
                                                  : -1;
  std::printf(
      "neighbour alone: swapped in %.0f MiB/s, updated %.1f Mparam/s, the process busy %.2f of "
      "%.0f cores\n",
      median(nb_load, &Load::nb_swapped) / (1 << 20), median(nb_load, &Load::nb_updated) / 1e6,
      nb_cpu_alone, cores);
  std::printf(
      "beside: the neighbour swapped in %.0f MiB/s, at %.2f of its pace alone: its own work "
      "about %.2f cores; mine's step alone keeps %.2f busy: beside, by that estimate, no faster "
      "than %s alone (the limit)\n",
      median(beside_load, &Load::nb_swapped) / (1 << 20), nb_pace, nb_cpu, mine_cpu,
      floor > 0 ? absl::StrFormat("%.3fx", floor).c_str() : "(none: its work fills the cores)");
  std::printf("medians of %d alternating rounds\n", f.rounds);
  std::printf("%-28s %10s %10s %10s %10s\n", "", "alone", "beside", "ratio", "to limit");
  std::printf("%-28s %10.1f %10.1f %10.3f %10s\n", "fetch p50 (us)", alone->fetch50,
              beside->fetch50, beside->fetch50 / alone->fetch50, "");
  std::printf("%-28s %10.1f %10.1f %10.3f %10s\n", "fetch p99 (us)", alone->fetch99,
              beside->fetch99, beside->fetch99 / alone->fetch99, "");
  std::printf(
      "%-28s %10.2f %10.2f %10.3f %10s\n", "step median (ms)", alone->step50 / 1e3,
      beside->step50 / 1e3, beside->step50 / alone->step50,
      floor > 0 ? absl::StrFormat("%.3f", beside->step50 / alone->step50 / floor).c_str() : "-");
  const double worst = std::max(beside->fetch99 / alone->fetch99, beside->step50 / alone->step50);
  std::printf("worst of fetch p99 and step: %.3fx alone (target <= 1.1x: %s)\n", worst,
              worst <= 1.1 ? "MET" : "NOT MET");
  return 0;
}

int Main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* v;
    if ((v = bench::FlagValue(argv[i], "params"))) {
      f.params = bench::CountOrExit(v);
    } else if ((v = bench::FlagValue(argv[i], "partitions"))) {
      f.partitions = std::max(1, std::atoi(v));
    } else if ((v = bench::FlagValue(argv[i], "seconds"))) {
      f.seconds = std::max(0.2, std::atof(v));
    } else if ((v = bench::FlagValue(argv[i], "weights"))) {
      f.weights.clear();
      for (absl::string_view w : absl::StrSplit(v, ',')) {
        int64_t x;
        if (!absl::SimpleAtoi(w, &x) || x < 1 || x > 1000) {
          std::fprintf(stderr, "--weights: integers in [1, 1000], not '%s'\n", v);
          return 2;
        }
        f.weights.push_back(x);
      }
    } else if ((v = bench::FlagValue(argv[i], "neighbour"))) {
      f.neighbour = v;
    } else if ((v = bench::FlagValue(argv[i], "state-on-nvme"))) {
      f.state_dir = v;
    } else if ((v = bench::FlagValue(argv[i], "slow"))) {
      f.slow = bench::CountOrExit(v);
    } else if ((v = bench::FlagValue(argv[i], "slow-pause-ms"))) {
      f.slow_pause_ms = std::max(0, std::atoi(v));
    } else if ((v = bench::FlagValue(argv[i], "rounds"))) {
      f.rounds = std::max(1, std::atoi(v));
    } else if (a == "--timeline") {
      f.timeline = true;
    } else if (a == "--lockstep") {
      f.lockstep = true;
    } else if (a == "--tiny") {
      f.params = 400'000;
      f.seconds = 0.5;
      f.rounds = 1;
    } else {
      std::fprintf(stderr, "unknown flag %s (see benches/shares_bench.cc)\n", a.c_str());
      return 2;
    }
  }
  if (f.seconds == 0) f.seconds = f.neighbour.empty() ? 4 : 1;
  bench::PrintMachine(!f.neighbour.empty()   ? f.neighbour
                      : !f.state_dir.empty() ? f.state_dir
                                             : "/tmp");
  if (!f.neighbour.empty()) return Neighbour(f);
  bench::BenchEngineOptions o;
  PlacementChange placement;
  if (!f.state_dir.empty()) {
    // Host bytes: every session's parameters and gradients (fp32, 8 B a
    // parameter), what the trainers and a step hold at once (7 B a
    // parameter at 4 partitions), a quarter of every session's moments and
    // master weights (3 B).
    const uint64_t n = f.weights.size();
    o.nvme.dirs = f.state_dir;
    o.nvme.bytes_per_dir = static_cast<int64_t>(RoundUpToPage(n * 4 * 8 * f.params + (64 << 20)));
    o.pool_bytes = (11 * n + 7) * f.params + (64 << 20);
    // The slow session's all: parameters, gradients, state, its holds.
    o.pool_bytes += 31 * f.slow;
    placement[DataKind::kOptimizerState] = 0;
  } else if (f.slow > 0) {
    std::fprintf(stderr, "--slow needs --state-on-nvme\n");
    return 2;
  }
  auto made = bench::MakeBenchEngine(o);
  if (!made.ok()) {
    std::fprintf(stderr, "engine: %s\n", made.status().ToString().c_str());
    return 1;
  }
  BenchEngine& e = **made;
  std::vector<std::unique_ptr<Job>> jobs;
  std::vector<Job*> all;
  int64_t weight_sum = 0;
  for (size_t i = 0; i < f.weights.size(); ++i) {
    jobs.push_back(std::make_unique<Job>());
    if (absl::Status s = Open(e, jobs.back().get(), absl::StrCat("job", i), f.weights[i], f.params,
                              f.partitions, placement);
        !s.ok()) {
      std::fprintf(stderr, "opening job %zu: %s\n", i, s.ToString().c_str());
      return 1;
    }
    jobs.back()->lockstep = f.lockstep;
    all.push_back(jobs.back().get());
    weight_sum += f.weights[i];
  }
  std::unique_ptr<Job> slow;
  if (f.slow > 0) {
    slow = std::make_unique<Job>();
    slow->pause = std::chrono::milliseconds(f.slow_pause_ms);
    if (absl::Status s = Open(e, slow.get(), "slow", 1, f.slow, f.partitions, placement); !s.ok()) {
      std::fprintf(stderr, "opening the slow session: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  // Every session that steps together: the slow one too, its updates apart.
  std::vector<Job*> stepping = all;
  if (slow) stepping.push_back(slow.get());
  std::printf(
      "== shares: %zu sessions of %llu fp32 parameters in %d partitions, stepping without pause; "
      "optimizer on %lld threads; optimizer state %s\n",
      jobs.size(), static_cast<unsigned long long>(f.params), f.partitions,
      static_cast<long long>(e.optimizer->threads()),
      f.state_dir.empty()
          ? "on the host"
          : absl::StrCat("homed on NVMe in ", f.state_dir, " (the pool holds a quarter of it)")
                .c_str());
  // Warm-up (first steps touch the state), then one session alone.
  if (auto r = RunTogether(e, stepping, std::min(1.0, f.seconds / 2)); !r.ok()) {
    std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
    return 1;
  }
  const SwapperStats before_alone = e.swapper->Stats();
  auto alone = RunTogether(e, {all[0]}, f.seconds);
  const SwapperStats during_alone = e.swapper->Stats().Since(before_alone);
  auto moved = [&](const Job& j) {
    const Swapper::TraceIo io = e.swapper->IoOf(j.key.id);
    return static_cast<double>(io.bytes_in + io.bytes_out);
  };
  std::vector<double> moved_before;
  for (const Job* j : all) moved_before.push_back(moved(*j));
  const SwapperStats before_together = e.swapper->Stats();
  if (f.timeline) std::printf("together, second by second:\n");
  auto together = alone.ok() ? RunTogether(e, stepping, f.seconds, f.timeline) : alone.status();
  const SwapperStats during_together = e.swapper->Stats().Since(before_together);
  if (!together.ok()) {
    std::fprintf(stderr, "%s\n", together.status().ToString().c_str());
    return 1;
  }
  double total = 0;
  for (size_t i = 0; i < all.size(); ++i) total += (*together)[i];
  if (slow) {
    std::printf(
        "slow: %llu parameters, weight 1, state fitting, %d ms before each step: %.1f Mparam/s "
        "(not in the shares below)\n",
        static_cast<unsigned long long>(f.slow), f.slow_pause_ms, (*together)[all.size()] / 1e6);
  }
  double worst = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const double want = static_cast<double>(f.weights[i]) / static_cast<double>(weight_sum);
    const double got = (*together)[i] / total;
    worst = std::max(worst, std::abs(got / want - 1));
    std::printf(
        "job%zu weight %lld: %.1f Mparam/s = %.1f%% of the node's updates (its share "
        "%.1f%%: ratio %.3f)\n",
        i, static_cast<long long>(f.weights[i]), (*together)[i] / 1e6, 100 * got, 100 * want,
        got / want);
  }
  if (!f.state_dir.empty()) {
    std::printf(
        "together: %llu blocks evicted, %llu of them a session's giving room by the shares (out "
        "of turn, past its share); %llu turns\n",
        static_cast<unsigned long long>(during_together.swap_outs + during_together.clean_drops),
        static_cast<unsigned long long>(during_together.share_evictions),
        static_cast<unsigned long long>(during_together.turns));
    double disk = 0;
    for (size_t i = 0; i < all.size(); ++i) disk += moved(*all[i]) - moved_before[i];
    // Not a share to meet: a session with more of the pool's room moves
    // fewer bytes an update.
    for (size_t i = 0; i < all.size(); ++i) {
      const double mine = moved(*all[i]) - moved_before[i];
      std::printf(
          "job%zu: its blocks moved %.0f MiB/s in and out = %.1f%% of the disk's traffic, %.1f B "
          "an update\n",
          i, mine / f.seconds / (1 << 20), 100 * mine / disk, mine / f.seconds / (*together)[i]);
    }
  }
  for (size_t i = 0; i < all.size(); ++i) {
    const OptimizerShares::Usage u = e.steps->shares().UsageOf(all[i]->key.id);
    std::printf("job%zu: its updates waited %.2f s for others', held the optimizer %.2f s\n", i,
                static_cast<double>(u.queued_nanos) / 1e9,
                static_cast<double>(u.running_nanos) / 1e9);
  }
  std::printf("worst share off by %.1f%% (target: within 10%%)\n", 100 * worst);
  std::printf("node total %.1f Mparam/s together vs %.1f alone: %.3fx\n", total / 1e6,
              (*alone)[0] / 1e6, total / (*alone)[0]);
  if (!f.state_dir.empty()) {
    // Alone, the idle sessions' share of the pool is job0's (Swapper: an
    // idle trace's blocks are evicted first).
    std::printf(
        "job0 alone: %llu blocks evicted, %llu of them the idle sessions' (their room now "
        "job0's); %.0f MiB/s in and out\n",
        static_cast<unsigned long long>(during_alone.swap_outs + during_alone.clean_drops),
        static_cast<unsigned long long>(during_alone.idle_evictions),
        static_cast<double>(during_alone.bytes_in + during_alone.bytes_out) / f.seconds /
            (1 << 20));
  }
  return 0;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) { return offload::Main(argc, argv); }
