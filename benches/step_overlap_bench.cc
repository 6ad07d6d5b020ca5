// benches/step_overlap: a training loop whose forward and backward take a
// fixed time T on the trainer's side (a sleep, as a GPU kernel leaves the
// CPU free), with the real optimizer over enough parameters to take about
// T, run with the synchronous step (iteration about T + T_opt) and with the
// overlapped step (Step returns once decided; the update runs while the
// next forward pass fetches, each fetch waiting only for its own layer).
//
//   bazel build -c opt //benches:step_overlap
//   bazel-bin/benches/step_overlap [--params=100M] [--layers=16]
//       [--iterations=24|6] [--t=auto|250ms] [--nvme] [--params_nvme] [--pool=1GiB]
//       [--dir=/var/tmp/offloadd-bench] [--threads=N] [--arena_pages=huge|small]
//       [--host_home_pages=auto|huge|small] [--per_iteration] [--tiny]
//
// The engine is assembled in-process as engine/out_of_core_test.cc does
// (pool, swapper, store, step runner, session manager). One session,
// --layers partitions of bf16 parameters and gradients; with --nvme the
// optimizer state (master, moments, gradient accumulator) rests on NVMe in
// a --pool host pool; with --params_nvme the working copy (and the delayed
// update's second buffer) too. An iteration: forward, each layer held, T/3
// / layers asleep, released; backward in reverse, each layer held with its
// gradient buffer, 2T/3 / layers asleep, gradients returned, released; then
// Step. (The gradient values are whatever the buffers hold, zeros until the
// last phase writes them: Adam's cost does not depend on them; the daemon's
// accumulation pass runs on every return.)
//
// T_opt is measured first: the median wall time of synchronous Steps alone
// (after two warm-ups). With --t=auto, T = T_opt. T_alone: the trainer's
// sleeps alone, timed (see Sleep). Bound = max(T_alone, T_opt) (what the
// delayed parameter update, DPU, can reach; the third mode: overlapped
// steps with DPU on); the overlapped step's own limit is max(T/3, T_opt) +
// 2T/3, since each layer's forward needs its updated parameters. The first
// iteration of each phase (each mode but the last two, which share one) is
// not counted. Each mode's ratio is given for its mean iteration and for
// its median one (T_opt is a median too; single steps on a noisy host take
// 1.5-3x at random). Per mode the table also gives the time inside the
// trainer's sleeps (more than T_alone when its wake-ups wait for a core),
// inside Fetch (waiting for an update) and inside ReturnGradients (the
// accumulation pass, which the trainer waits for; slower while an update
// shares the cores and the memory bus), and per step the daemon's update,
// start to end, and of that the optimizer's compute (Stats: more than T_opt
// when the update shares the cores). The fourth mode, "DPU, handed": DPU
// with the gradients handed over (ReturnGradients with hand_over: the
// return only measures them, the update reads the bf16 buffer; 2 + 28 bytes
// per parameter through memory instead of 10 + 30). The fifth, "DPU, stats
// given": handed over with the trainer's own statistics of each buffer
// (ReturnGradients with stats), as a GPU trainer computes them on the
// device before the copy, inside its T: the daemon reads no buffer before
// the update (28 bytes per parameter). The two run in one phase, taking
// turns, and before each turn T_opt is measured again (one synchronous
// step alone, its gradients handed over with their statistics: the update
// these modes run, which reads 2 bytes of gradient per parameter where the
// first measurement's reads the 4-byte accumulator): their ratios are also
// given against a bound from their own phase's T_opt (the median of
// those), which the host's drift between the first measurement and this
// phase (-42% to +69% here) does not move.
// Before the phase the trainer writes its gradient buffers once (fixed
// nonzero values) and takes their statistics, outside the timing; after it
// they are checked unchanged. --host_home_pages: the pages of the state
// homed on the host, as offloadd's memory.host_home_pages. --threads: the
// optimizer's (default one per CPU); fewer leave the trainer a core.
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "base/config_registry.h"
#include "base/env.h"
#include "base/host_memory.h"
#include "base/status_macros.h"
#include "benches/bench_engine.h"
#include "benches/bench_util.h"
#include "cpu_adam/dtype.h"
#include "cpu_adam/optimizer.h"
#include "daemon/daemon_options.h"

namespace offload::bench {
namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

struct Flags {
  uint64_t params = 100'000'000;
  int layers = 16;
  int iterations = -1;  // unset: 24 in memory, 6 with --nvme (an iteration takes 10-20x longer)
  double t = -1;        // seconds; < 0: T_opt
  bool nvme = false;
  bool params_nvme = false;  // --params_nvme: the working copy on NVMe too
  uint64_t pool = uint64_t{1} << 30;
  std::string dir = "/var/tmp/offloadd-bench";
  int threads = 0;  // the optimizer's; 0: one per CPU (the daemon's default)
  // --arena_pages=huge|small: large partitions laid out for huge pages in the
  // arena (the daemon's default where the kernel gives shared memory huge
  // pages) or small pages only.
  bool arena_huge = SharedHugePageBytes() != 0;
  // --host_home_pages: the pages of state homed on the host, as the daemon's
  // memory.host_home_pages (auto: small where DAMON monitors this node).
  std::string host_home_pages = "auto";
  bool per_iteration = false;  // --per_iteration: print every iteration's time
};

// The trainer's simulated compute is a sleep, and a sleep overshoots by the
// timer slack and the wake-up (about 0.1 ms on a virtual machine, against a
// layer's sleep of a few ms), 32 times an iteration: without correcting,
// the simulated forward and backward take 5-10% more than T, and the bound
// below would not be the trainer's real time. So the trainer thread asks
// for no slack, each sleep is shortened by the overshoot measured first
// (`MeasureOvershoot`), and the schedule alone is timed too (T_alone).
double g_overshoot = 0;
double g_slept = 0;  // seconds inside Sleep, in all

void Sleep(double seconds) {
  const auto start = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(std::max(0.0, seconds - g_overshoot)));
  g_slept += SecondsSince(start);
}

// The mean overshoot of `n` sleeps of `seconds` on this thread.
double MeasureOvershoot(double seconds, int n) {
  double over = 0;
  for (int i = 0; i < n; ++i) {
    const auto s = Clock::now();
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    over += SecondsSince(s) - seconds;
  }
  return std::max(0.0, over / n);
}

// The median of `v`, sorted (the mean of the middle two of an even count).
double MedianOfSorted(const std::vector<double>& v) {
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// The verdict on a ratio to the delayed update's bound (target: 1.10x).
const char* Verdict(double ratio) { return ratio <= 1.10 ? "MET" : "NOT MET"; }

int Fail(const absl::Status& s, const char* what) {
  std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
  return 1;
}

// The flags into `f`: 0, or the exit status for flags it refuses.
int ParseFlags(int argc, char** argv, Flags* out) {
  Flags& f = *out;
  bool tiny = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) { return FlagValue(argv[i], name); };
    const char* v;
    if ((v = value("params"))) {
      f.params = CountOrExit(v);  // 100M, 1G
    } else if ((v = value("layers"))) {
      f.layers = std::atoi(v);
    } else if ((v = value("iterations"))) {
      f.iterations = std::atoi(v);
    } else if ((v = value("t"))) {
      double ms;
      f.t = std::string(v) == "auto"                            ? -1
            : absl::SimpleAtod(absl::StripSuffix(v, "ms"), &ms) ? ms / 1000
                                                                : -2;
    } else if ((v = value("pool"))) {
      f.pool = static_cast<uint64_t>(ByteSizeOrExit(v));
    } else if ((v = value("dir"))) {
      f.dir = v;
    } else if ((v = value("threads"))) {
      f.threads = std::atoi(v);
    } else if (a == "--nvme") {
      f.nvme = true;
    } else if (a == "--params_nvme") {
      f.nvme = f.params_nvme = true;
    } else if (a == "--arena_pages=huge" || a == "--arena_pages=small") {
      f.arena_huge = a == "--arena_pages=huge";
    } else if ((v = value("host_home_pages"))) {
      f.host_home_pages = v;
    } else if (a == "--per_iteration") {
      f.per_iteration = true;
    } else if (a == "--tiny") {
      tiny = true;
    } else {
      std::fprintf(stderr, "unknown flag %s (see benches/step_overlap_bench.cc)\n", a.c_str());
      return 2;
    }
  }
  if (tiny) {
    f.params = 1 << 20;
    f.layers = 4;
    f.iterations = 3;
    f.pool = 12 << 20;  // the delayed update adds a second working copy
  }
  if (f.iterations == -1) f.iterations = f.nvme ? 6 : 24;
  if (f.params == 0 || f.layers < 1 || f.iterations < 2 || f.t < -1 || f.threads < 0) {
    std::fprintf(stderr, "bad flags\n");
    return 2;
  }
  if (f.iterations % 2 != 0 && f.iterations % 3 != 0) {
    std::fprintf(stderr,
                 "--iterations=%d: must be a multiple of 2 or 3 (the hand-over modes take "
                 "turns of 4, 3 or 2 iterations)\n",
                 f.iterations);
    return 2;
  }
  return 0;
}

// The engine's step counters, read between iterations.
struct Counters {
  int64_t steps, nanos, compute;
};

// The trainer: one session of --layers partitions of bf16 parameters and
// gradients, its forward and backward passes sleeps between the calls a
// trainer makes.
class Trainer {
 public:
  static absl::StatusOr<std::unique_ptr<Trainer>> Start(const Flags& f, Pages host_home) {
    auto tr = std::unique_ptr<Trainer>(new Trainer(f));
    BenchEngineOptions eo;
    if (f.nvme) {
      eo.nvme.dirs = f.dir;
      // The state's 16 bytes a parameter (and the two working-copy
      // buffers'), with a quarter to spare.
      eo.nvme.bytes_per_dir =
          static_cast<int64_t>(f.params * (f.params_nvme ? 20 : 16) * 5 / 4 + (64 << 20));
      eo.pool_bytes = f.pool;
    }
    eo.optimizer.threads = f.threads;
    eo.swapper.host_home_pages = host_home;
    eo.huge_page_bytes = f.arena_huge ? HugePageAlignment() : 0;
    ASSIGN_OR_RETURN(tr->engine_, MakeBenchEngine(eo));
    PlacementChange placement;
    if (f.nvme) placement[DataKind::kOptimizerState] = 0;
    if (f.nvme && f.params_nvme) placement[DataKind::kParams] = 0;
    ASSIGN_OR_RETURN(OpenedSession opened, tr->engine_->sessions->Open("bench", placement));
    tr->key_ = opened.key;
    for (int l = 0; l < f.layers; ++l) {
      ASSIGN_OR_RETURN(PartitionInfo p, tr->engine_->sessions->Register(
                                            tr->key_, {absl::StrCat("layer", l), tr->per_layer_,
                                                       DType::kBf16, DType::kBf16}));
      tr->ids_.push_back(p.id);
    }
    RETURN_IF_ERROR(tr->engine_->sessions->Release(tr->key_, {}));
    return tr;
  }

  BenchEngine& engine() { return *engine_; }
  SessionManager& sessions() { return *engine_->sessions; }
  const SessionKey& key() const { return key_; }
  uint64_t per_layer() const { return per_layer_; }

  // One iteration; returns its wall time. `step` commits the gradients.
  absl::StatusOr<double> Iteration(double t, bool overlap, double* step_call) {
    const auto start = Clock::now();
    for (int l = 0; l < f_.layers; ++l) {
      const auto q = Clock::now();
      RETURN_IF_ERROR(sessions().Fetch(key_, {ids_[l]}).status());
      fetching += SecondsSince(q);
      Sleep(t / 3 / f_.layers);
      RETURN_IF_ERROR(sessions().Release(key_, {ids_[l]}));
    }
    FetchMode backward;
    backward.grads = true;
    for (int l = f_.layers - 1; l >= 0; --l) {
      const auto q = Clock::now();
      RETURN_IF_ERROR(sessions().Fetch(key_, {ids_[l]}, backward).status());
      fetching += SecondsSince(q);
      Sleep(2 * t / 3 / f_.layers);
      const auto r = Clock::now();
      RETURN_IF_ERROR(sessions().ReturnGradients(
          key_, ids_[l], per_layer_, DType::kBf16, hand_over,
          give_stats ? std::optional<GradStats>(given[l]) : std::nullopt));
      returning += SecondsSince(r);
      RETURN_IF_ERROR(sessions().Release(key_, {ids_[l]}));
    }
    const auto stepping = Clock::now();
    StepControl control;
    control.overlap = overlap;
    AdamHyperparams h;
    h.lr = 1e-4;
    RETURN_IF_ERROR(sessions().Step(key_, h, control).status());
    *step_call = SecondsSince(stepping);
    return SecondsSince(start);
  }

  // The trainer's schedule alone: the same sleeps, no calls.
  double ScheduleAlone(double t) const {
    const auto start = Clock::now();
    for (int l = 0; l < f_.layers; ++l) Sleep(t / 3 / f_.layers);
    for (int l = 0; l < f_.layers; ++l) Sleep(2 * t / 3 / f_.layers);
    return SecondsSince(start);
  }

  // T_opt: synchronous steps alone (gradients returned without sleeping),
  // the median of kOptRuns after kOptWarmups (the first steps touch the
  // optimizer state's fresh pages and initialise the master copies; a mean
  // would also take in a step the host slowed, and overstate T_opt).
  static constexpr int kOptWarmups = 2, kOptRuns = 7;
  absl::StatusOr<double> MeasureTOpt() {
    std::vector<double> steps;
    double step_call = 0;
    for (int r = 0; r < kOptWarmups + kOptRuns; ++r) {
      RETURN_IF_ERROR(Iteration(0, false, &step_call).status());
      if (r >= kOptWarmups) steps.push_back(step_call);
    }
    std::sort(steps.begin(), steps.end());
    return MedianOfSorted(steps);
  }

  // The statistics of every layer's gradient buffer as it is now, read
  // where the arena maps it, the buffer held; with `fill`, first written
  // with fixed nonzero gradients (the trainer's backward, once), so that a
  // change to them during the phase shows.
  absl::StatusOr<std::vector<GradStats>> BufferStats(bool fill) {
    ASSIGN_OR_RETURN(UniqueFd fd, sessions().DupArenaFd(key_));
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    FetchMode backward;
    backward.grads = true;
    std::vector<GradStats> out;
    for (uint64_t id : ids_) {
      ASSIGN_OR_RETURN(std::vector<PartitionInfo> held, sessions().Fetch(key_, {id}, backward));
      const ArenaRegion g = held[0].grads;
      const uint64_t begin = g.offset / page * page;
      ASSIGN_OR_RETURN(HostMemory map,
                       HostMemory::MapShared(fd.get(), begin, g.offset + g.bytes - begin));
      auto* v = reinterpret_cast<uint16_t*>(map.data() + (g.offset - begin));
      for (uint64_t j = 0; fill && j < held[0].numel; ++j) {
        v[j] = FloatToBf16(1e-4f * static_cast<float>(static_cast<int>(j % 201) - 100));
      }
      // Measured as the daemon measures handed-over gradients (no
      // accumulator).
      AccumulateTask measure;
      measure.grads = v;
      measure.grad_dtype = DType::kBf16;
      measure.numel = held[0].numel;
      measure.first = true;
      out.push_back(engine_->optimizer->Accumulate(absl::MakeConstSpan(&measure, 1)));
      RETURN_IF_ERROR(sessions().Release(key_, {id}));
    }
    return out;
  }

  Counters counters() const {
    return Counters{engine_->stats.steps.load(), engine_->stats.step_nanos.load(),
                    engine_->stats.step_compute_nanos.load()};
  }

  // What the iterations spent, summed since last reset by the caller.
  double returning = 0;  // inside ReturnGradients (the accumulation pass)
  double fetching = 0;   // inside Fetch (waiting for updates, swap-ins)
  // How gradients go back: with hand_over (the fourth and fifth modes), and
  // with each layer's statistics `given` (the fifth).
  bool hand_over = false;
  bool give_stats = false;
  std::vector<GradStats> given;

 private:
  explicit Trainer(const Flags& f)
      : f_(f), per_layer_(f.params / static_cast<uint64_t>(f.layers)) {}
  const Flags f_;
  const uint64_t per_layer_;
  std::unique_ptr<BenchEngine> engine_;
  SessionKey key_;
  std::vector<uint64_t> ids_;
};

struct Row {
  const char* mode;
  // Sums over the counted iterations: in the Step call, in Fetch, in
  // ReturnGradients, and in the trainer's sleeps (T_alone if nothing
  // delayed their wake-ups).
  double step_call = 0, fetch = 0, ret = 0, sleep = 0;
  // Sums over the mode's steps (Stats): the daemon's step, start to end,
  // and of that the optimizer's compute.
  int64_t steps = 0, update_nanos = 0, compute_nanos = 0;
  std::vector<double> iterations;  // counted, sorted once all are in
  double per_iteration(double sum) const { return sum / iterations.size(); }
  double mean() const {
    double total = 0;
    for (double i : iterations) total += i;
    return per_iteration(total);
  }
  double update() const { return steps > 0 ? update_nanos / 1e9 / steps : 0; }
  double compute() const { return steps > 0 ? compute_nanos / 1e9 / steps : 0; }
  double best() const { return iterations.front(); }
  double worst() const { return iterations.back(); }
  // The median iteration: this VM's host slows single steps 1.5-3x at
  // random (in every mode, and in T_opt's own measurement, hence its
  // median), which the mean takes in.
  double median() const { return MedianOfSorted(iterations); }
};

absl::Status In(const absl::Status& s, absl::string_view what) {
  return s.ok() ? s : absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

// Every mode, --iterations each, with T the trainer's time: the counted
// iterations into `rows` (by mode: synchronous, overlapped, DPU, DPU
// handed, DPU stats given), and the hand-over phase's own T_opt samples
// into `t_opt_between`.
//
// Each phase runs --iterations iterations per mode. The two modes that hand
// the gradients over take turns in one phase, so that the host's drift
// (this VM slows steps 1.5-3x at random for seconds at a time) falls on
// both alike: turns of 4, 3 or 2 iterations, the first of these that
// divides --iterations (so that each mode gets as many; other counts are
// refused by ParseFlags). Before each turn T_opt is measured again (one
// synchronous step alone, after the last update ended), so that the
// hand-over modes also have a bound from their own seconds of the host's
// time; the turn's first iteration, which starts with no update running
// beside it, is not counted.
absl::Status RunModes(Trainer& tr, const Flags& f, double t, std::vector<Row>* rows_out,
                      std::vector<double>* t_opt_between) {
  std::vector<Row>& rows = *rows_out;
  SessionManager& sessions = tr.sessions();
  const SessionKey& key = tr.key();
  int turn = 0;
  for (int k : {4, 3, 2}) {
    if (f.iterations % k == 0) {
      turn = k;
      break;
    }
  }
  double step_call = 0;
  const std::vector<std::vector<int>> phases = {{0}, {1}, {2}, {3, 4}};
  for (const std::vector<int>& modes : phases) {
    const int first = modes[0];
    const bool overlap = first > 0;
    if (first == 2) {
      RETURN_IF_ERROR(In(sessions.WaitStep(key).status(), "wait"));
      RETURN_IF_ERROR(In(sessions.SetDelayedUpdate(key, true), "dpu"));
    }
    if (first == 3) {
      // The buffers are the daemon's until the last update has read them.
      RETURN_IF_ERROR(In(sessions.WaitStep(key).status(), "wait"));
      absl::StatusOr<std::vector<GradStats>> measured = tr.BufferStats(/*fill=*/true);
      RETURN_IF_ERROR(In(measured.status(), "gradient statistics"));
      tr.given = *std::move(measured);
    }
    // Not counted: the phase's first iteration (the switch from the previous
    // one) and, when the delayed update is switched on, the second, whose
    // update writes the second working copy for the first time (its pages'
    // first touch: 0.4-0.5 s for 100M bf16 parameters on a VM's 4 KiB
    // pages).
    const int skip = first == 2 ? 2 : 1;
    const int total = f.iterations * static_cast<int>(modes.size());
    // The mode whose step runs now: the synchronous step ends inside its
    // iteration; an overlapped one (the gradients of iteration i) ends
    // during iteration i + 1 (the next Step waits for it), or in the
    // WaitStep after the last. -1: a skipped iteration's, not counted.
    int stepping = -1;
    Counters before = tr.counters();
    auto count_steps = [&] {
      const Counters now = tr.counters();
      if (stepping >= 0) {
        rows[stepping].steps += now.steps - before.steps;
        rows[stepping].update_nanos += now.nanos - before.nanos;
        rows[stepping].compute_nanos += now.compute - before.compute;
      }
      before = now;
    };
    for (int i = 0; i < total; ++i) {
      const int mode = modes[(i / turn) % modes.size()];
      const bool measures_t_opt = first == 3 && i % turn == 0;
      if (measures_t_opt) {
        // The previous turn's last update ends (counted to its mode), then
        // one synchronous step alone (not counted), its gradients handed
        // over with their statistics: the update these modes run, reading
        // the blocks they read in the order they do (through the
        // accumulator instead, it upset the order the swapper learned for
        // state on NVMe, and every step of the phase waited for reads).
        RETURN_IF_ERROR(In(sessions.WaitStep(key).status(), "wait"));
        count_steps();
        stepping = -1;
        tr.hand_over = tr.give_stats = true;
        RETURN_IF_ERROR(In(tr.Iteration(0, false, &step_call).status(), "T_opt"));
        t_opt_between->push_back(step_call);
        count_steps();
      }
      tr.hand_over = mode >= 3;
      tr.give_stats = mode == 4;
      if (!overlap) stepping = mode;
      const double fetched = tr.fetching, returned = tr.returning, slept0 = g_slept;
      const int64_t nanos0 = before.nanos;
      absl::StatusOr<double> it = tr.Iteration(t, overlap, &step_call);
      RETURN_IF_ERROR(In(it.status(), rows[mode].mode));
      const bool skipped = (i < skip || measures_t_opt) && i + 1 < total;
      if (skipped) stepping = -1;
      count_steps();
      if (f.per_iteration) {  // with the daemon's update time of the steps ended in it
        std::printf("  %-16s iteration %2d: %.3f s, fetch %.3f s, update %.3f s%s\n",
                    rows[mode].mode, i, *it, tr.fetching - fetched, (before.nanos - nanos0) / 1e9,
                    skipped ? " (not counted)" : "");
      }
      if (skipped) {
        if (first == 2) std::printf("DPU switched on: iteration %d took %.3f s\n", i, *it);
        continue;
      }
      if (overlap) stepping = mode;
      Row& row = rows[mode];
      row.fetch += tr.fetching - fetched;
      row.sleep += g_slept - slept0;
      row.ret += tr.returning - returned;
      row.iterations.push_back(*it);
      row.step_call += step_call;
    }
    if (overlap) {
      RETURN_IF_ERROR(In(sessions.WaitStep(key).status(), "wait"));
      count_steps();
    }
    if (first == 3) {
      // The statistics given were the buffers' own all along.
      absl::StatusOr<std::vector<GradStats>> after = tr.BufferStats(/*fill=*/false);
      RETURN_IF_ERROR(In(after.status(), "gradient statistics after"));
      for (size_t l = 0; l < tr.given.size(); ++l) {
        if ((*after)[l].sq_norm != tr.given[l].sq_norm ||
            (*after)[l].nonfinite != tr.given[l].nonfinite) {
          return absl::InternalError(
              absl::StrCat("layer ", l, "'s gradient buffer changed during the mode"));
        }
      }
    }
  }
  for (Row& r : rows) std::sort(r.iterations.begin(), r.iterations.end());
  return absl::OkStatus();
}

// Per iteration: in the trainer's sleeps (longer than T_alone when its
// wake-ups wait for a core), in Fetch (waiting for an update or a swap-in),
// in ReturnGradients (the accumulation pass, slower while an update shares
// the cores and the memory bus). Per step: the daemon's update, start to
// end, and of that in the optimizer (Stats). The ratio is the mean
// iteration's to the bound; "median x" the median iteration's.
void PrintRows(const std::vector<Row>& rows, double bound) {
  std::printf("\n%-16s %8s %8s %8s %8s %11s %8s %8s %8s %8s %9s %8s %8s %8s\n", "mode", "iter s",
              "median s", "best s", "worst s", "Step call s", "sleep s", "fetch s", "return s",
              "update s", "compute s", "bound s", "ratio", "median x");
  for (const Row& r : rows) {
    if (r.iterations.empty()) {  // too few --iterations
      std::printf("%-16s no iteration counted\n", r.mode);
      continue;
    }
    std::printf(
        "%-16s %8.3f %8.3f %8.3f %8.3f %11.3f %8.3f %8.3f %8.3f %8.3f %9.3f %8.3f %7.3fx %7.3fx\n",
        r.mode, r.mean(), r.median(), r.best(), r.worst(), r.per_iteration(r.step_call),
        r.per_iteration(r.sleep), r.per_iteration(r.fetch), r.per_iteration(r.ret), r.update(),
        r.compute(), bound, r.mean() / bound, r.median() / bound);
  }
}

// Each mode against its limit: T_opt again (the host's drift), T_acc, the
// synchronous and overlapped limits, the delayed update's bound, and the
// hand-over modes against their phase's own T_opt.
void PrintVerdicts(const std::vector<Row>& rows, double t, double t_opt, double t_opt_after,
                   double t_alone, double bound, std::vector<double> t_opt_between) {
  std::printf(
      "T_opt measured again after the modes (delayed update on: the same work): %.3f s, "
      "%+.0f%% (the host's drift during the run)\n",
      t_opt_after, 100 * (t_opt_after / t_opt - 1));
  // T_acc: the accumulation pass with no update beside it.
  const double t_acc = rows[0].per_iteration(rows[0].ret);
  std::printf(
      "T_acc (ReturnGradients in synchronous mode: the daemon's accumulation pass, in "
      "the backward pass, alone): %.3f s per iteration\n",
      t_acc);
  std::printf("synchronous: about T + T_acc + T_opt = %.3f s; measured %.3fx that\n",
              t + t_acc + t_opt, rows[0].mean() / (t + t_acc + t_opt));
  // Without DPU a layer's forward needs its updated parameters, so the
  // update can hide behind the forward pass only: its limit is
  // max(T_forward, T_opt) + T_backward.
  const double overlap_limit = std::max(t / 3, t_opt) + 2 * t / 3 + t_acc;
  std::printf(
      "overlapped: limit max(T/3, T_opt) + 2T/3 + T_acc = %.3f s; measured %.3fx that, "
      "%.3fx the synchronous iteration\n",
      overlap_limit, rows[1].mean() / overlap_limit, rows[1].mean() / rows[0].mean());
  // With the delayed update the fetches do not wait for the update at all:
  // the trainer's time and the optimizer's overlap whole. The trainer's
  // time includes the daemon's accumulation pass.
  const double dpu_bound = std::max(t + t_acc, t_opt);
  for (int r : {2, 3, 4}) {
    if (rows[r].iterations.empty()) continue;
    const double dpu_ratio = rows[r].mean() / bound, median_ratio = rows[r].median() / bound;
    std::printf(
        "%s: mean iteration %.3fx max(T_alone, T_opt) (target <= 1.10x: %s), median "
        "iteration %.3fx (%s); %.3fx max(T + T_acc, T_opt) = %.3f s\n",
        rows[r].mode, dpu_ratio, Verdict(dpu_ratio), median_ratio, Verdict(median_ratio),
        rows[r].mean() / dpu_bound, dpu_bound);
  }
  // The hand-over modes against T_opt of their own phase: the median of
  // the steps alone measured between their turns.
  if (t_opt_between.empty()) return;
  std::sort(t_opt_between.begin(), t_opt_between.end());
  const double t_opt_phase = MedianOfSorted(t_opt_between);
  const double phase_bound = std::max(t_alone, t_opt_phase);
  std::printf(
      "T_opt between the hand-over turns (synchronous steps alone, handed over with "
      "statistics): median %.3f s of %zu (%.3f-%.3f s), %+.0f%% against T_opt before "
      "the modes (the host's drift, and other work: that one through the fp32 "
      "accumulator, the delayed update off); bound max(T_alone, that) = %.3f s\n",
      t_opt_phase, t_opt_between.size(), t_opt_between.front(), t_opt_between.back(),
      100 * (t_opt_phase / t_opt - 1), phase_bound);
  for (int r : {3, 4}) {
    if (rows[r].iterations.empty()) continue;
    const double mean_ratio = rows[r].mean() / phase_bound,
                 median_ratio = rows[r].median() / phase_bound;
    std::printf(
        "%s, against its phase's bound: mean iteration %.3fx (target <= 1.10x: %s), "
        "median iteration %.3fx (%s)\n",
        rows[r].mode, mean_ratio, Verdict(mean_ratio), median_ratio, Verdict(median_ratio));
  }
}

int Main(int argc, char** argv) {
  Flags f;
  if (int refused = ParseFlags(argc, argv, &f); refused != 0) return refused;
  auto host_home = ResolveHostHomePages(f.host_home_pages, DamonMonitors());
  if (!host_home.ok()) return Fail(host_home.status(), "flags");
  mkdir(f.dir.c_str(), 0700);
  PrintMachine(f.dir);
  absl::StatusOr<std::unique_ptr<Trainer>> started = Trainer::Start(f, host_home->pages);
  if (!started.ok()) return Fail(started.status(), "engine");
  Trainer& tr = **started;
  std::printf(
      "== step_overlap: %llu params in %d layers (bf16 params and gradients, arena on "
      "%s pages), optimizer state %s; optimizer %s on %d threads\n",
      static_cast<unsigned long long>(tr.per_layer() * f.layers), f.layers,
      f.arena_huge ? (SharedHugePageBytes() != 0 ? "huge" : "small (laid out for huge)") : "small",
      f.nvme ? absl::StrCat("on NVMe (", f.dir, ")", f.params_nvme ? ", the working copy too" : "",
                            ", pool ", absl::StrFormat("%.2f GiB", f.pool / kGiB))
                   .c_str()
             : "in memory",
      tr.engine().optimizer->kernel_name().c_str(), tr.engine().optimizer->threads());
  std::printf("state homed on the host on %s pages (%s)\n",
              host_home->pages == Pages::kSmall ? "4 KiB" : "2 MiB", host_home->why.c_str());

  // T_opt, then T (the trainer's time; T_opt unless --t), measured again
  // after the modes, to show how far the host drifted.
  const absl::StatusOr<double> measured_t_opt = tr.MeasureTOpt();
  if (!measured_t_opt.ok()) return Fail(measured_t_opt.status(), "calibration");
  const double t_opt = *measured_t_opt;
  const double t = f.t < 0 ? t_opt : f.t;
  prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
  g_overshoot = MeasureOvershoot(t / 3 / f.layers, 4 * f.layers);
  double t_alone = 0;
  for (int r = 0; r < 3; ++r) t_alone += tr.ScheduleAlone(t) / 3;
  // The trainer's time is what its sleeps take, as measured, whether longer
  // or shorter than asked.
  const double bound = std::max(t_alone, t_opt);
  std::printf(
      "T_opt (synchronous Step alone, median of %d after %d warm-ups): %.3f s; T (forward + "
      "backward asleep): %.3f s asked, T_alone %.3f s measured (each of its %d sleeps "
      "shortened by %.0f us, their overshoot); bound max(T_alone, T_opt) = %.3f s\n",
      Trainer::kOptRuns, Trainer::kOptWarmups, t_opt, t, t_alone, 2 * f.layers, g_overshoot * 1e6,
      bound);
  tr.returning = 0;

  std::vector<Row> rows(5);
  rows[0].mode = "synchronous";
  rows[1].mode = "overlapped";
  rows[2].mode = "DPU";
  rows[3].mode = "DPU, handed";
  rows[4].mode = "DPU, stats given";
  std::vector<double> t_opt_between;
  if (absl::Status ran = RunModes(tr, f, t, &rows, &t_opt_between); !ran.ok()) {
    std::fprintf(stderr, "%s\n", ran.ToString().c_str());
    return 1;
  }
  PrintRows(rows, bound);
  tr.hand_over = tr.give_stats = false;
  const absl::StatusOr<double> t_opt_after = tr.MeasureTOpt();
  if (!t_opt_after.ok()) return Fail(t_opt_after.status(), "calibration after");
  if (auto done = tr.sessions().WaitStep(tr.key()); !done.ok()) {
    return Fail(done.status(), "wait");
  }
  PrintVerdicts(rows, t, t_opt, *t_opt_after, t_alone, bound, std::move(t_opt_between));
  return 0;
}

}  // namespace
}  // namespace offload::bench

int main(int argc, char** argv) { return offload::bench::Main(argc, argv); }
