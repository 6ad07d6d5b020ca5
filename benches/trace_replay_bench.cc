// benches/trace_replay: a replayed ZeRO-3 parameter access pattern through
// the swapper, with and without prefetch, against the compute bound and the
// I/O bound (fio on the same directory, measured in the same run).
//
//   bazel build -c opt //benches:trace_replay
//   bazel-bin/benches/trace_replay [--dir=/var/tmp/offloadd-bench]
//       [--layers=48] [--pool=1GiB] [--params=3GiB] [--delays=10ms,25ms,50ms]
//       [--iterations=4] [--swapper.prefetch_depth=8] [--swapper.prefetch_bytes=256MiB]
//       [--swapper.io_threads=4] [--nvme.checksum=true|false] [--nvme.request_bytes=1MiB]
//       [--nvme.queue_depth=32] [--nvme.rings=2] [--nvme.stripe_bytes=1MiB] [--busy]
//       (any nvme.* or swapper.* tunable, as offloadd spells it)
//       [--memory=arena|pool] [--arena_pages=huge|small] [--arena_io=file|mapping]
//       [--no-fio] [--eval=PASSES] [--tiny]
//
// The model: --layers layers, each one parameter partition of
// --params / --layers bytes, one swapper block homed on NVMe (all of them
// together --params, default 3x the host pool). With --memory=arena (the
// default) each block is external memory over a shared memfd, as the daemon
// keeps working parameters (shmem pages, freed when evicted): laid out for
// and asking for huge pages where the kernel gives shared memory huge pages
// (offloadd's memory.arena_huge_pages; --arena_pages=small: 4 KiB pages); with
// --memory=pool the swapper allocates it (transparent huge pages), as it
// does optimizer state. On 4 KiB pages the swapper moves the arena's bytes
// through the memfd and a staging buffer on huge pages, as offloadd does
// (--arena_io=mapping: direct I/O into the mapped pages instead, as before).
// Setup writes every block once (so each has an NVMe copy) and ends that
// iteration. One iteration is ZeRO-3's
// order: forward, Acquire(layer, read-only) for layers 0..L-1 in order,
// then backward, L-1..0 in reverse; each use holds its pin for the compute
// delay (a sleep, like a GPU kernel that leaves the CPU free; --busy spins
// instead), then releases it; EndIteration ends it. The first iteration after
// setup re-learns the order (setup's differed) and is reported apart.
//
// For each delay, two configurations on the same swapper, prefetch on
// (--swapper.prefetch_depth / --swapper.prefetch_bytes) then off (depth 0): one iteration
// that is not measured (the first overall is the learning one), then
// --iterations - 1 measured ones.
//
// Hit rate = hits / acquires over the measured iterations (Swapper::Stats:
// a hit finds the block resident; an Acquire that finds a prefetch still
// reading, "waited", is not a hit). Compute bound = layers x 2 x delay. I/O
// bound = the bytes the swapper actually moved per iteration (read in,
// written out) at fio's sequential speeds (io_uring, O_DIRECT, bs = the
// engine's request size, iodepth = its queue depth) on a file of --params
// bytes in the same directory, measured in a round after setup and after
// each configuration (once the swapper is idle): the faster of the rounds
// just before and just after the configuration counts. Targets with
// prefetch: hits >= 90% and iteration <= 1.1 x max(compute, I/O bound).
// Files go under --dir and are deleted at the end.
//
// --eval=PASSES: then evaluation, as a training loop runs it every so often:
// after a training iteration, PASSES forward passes (layers 0..L-1) with no
// EndIteration between them (no step), prefetch on then off, at the first
// delay. Reported: the second half of the passes (the first half learns),
// each pass's time against the compute bound (layers x delay), hits, and
// the passes the swapper counted (swap_order_passes).
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/config_registry.h"
#include "base/env.h"
#include "base/host_memory.h"
#include "base/unique_fd.h"
#include "benches/bench_engine.h"
#include "benches/bench_util.h"
#include "engine/engine.h"
#include "nvme/io_backend.h"
#include "nvme/io_backend_factory.h"
#include "nvme/nvme_options.h"
#include "nvme/swap_space.h"
#include "swapper/host_pool.h"
#include "swapper/swapper.h"
#include "swapper/swapper_options.h"

namespace offload {
namespace {

using ::offload::bench::Clock;
using ::offload::bench::FioBandwidth;
using ::offload::bench::PrintMachine;
using ::offload::bench::ProcStatus;
using ::offload::bench::SecondsSince;
constexpr double kGiB = 1024.0 * 1024 * 1024;
constexpr double kMiB = 1024.0 * 1024;
constexpr uint64_t kTrace = 1;

struct Flags {
  std::string dir = "/var/tmp/offloadd-bench";
  int layers = 48;
  uint64_t pool = uint64_t{1} << 30;
  uint64_t params = 0;  // 0: 3 x pool
  std::vector<double> delays = {0.010, 0.025, 0.050};
  int iterations = 4;
  // The NVMe tier's and the swapper's settings, as offloadd's tunables
  // (--nvme.*, --swapper.*: bench::TunableFlag); offloadd's defaults.
  NvmeOptions nvme;
  SwapperOptions swapper;
  bool busy = false;
  bool fio = true;
  bool arena = true;  // --memory=arena: external blocks over a memfd
  // --arena_pages=huge|small: the arena laid out for, and asking for, huge
  // pages (offloadd's default where the kernel gives shared memory huge
  // pages) or 4 KiB ones.
  bool arena_huge = SharedHugePageBytes() != 0;
  // --arena_io=file|mapping: the swapper told the arena's file (it stages
  // transfers of 4 KiB pages through it) or only the mapping.
  bool arena_file = true;
  int eval = 0;  // --eval: forward passes without a step after training
};

// "10ms", "0.5s", "250us".
bool ParseDuration(absl::string_view text, double* seconds) {
  double scale = 1;
  std::string t(text);
  if (absl::EndsWith(t, "ms")) {
    scale = 1e-3;
    t.resize(t.size() - 2);
  } else if (absl::EndsWith(t, "us")) {
    scale = 1e-6;
    t.resize(t.size() - 2);
  } else if (absl::EndsWith(t, "s")) {
    t.resize(t.size() - 1);
  }
  double v;
  if (!absl::SimpleAtod(t, &v) || v < 0) return false;
  *seconds = v * scale;
  return true;
}

struct Iteration {
  double seconds = 0;
  double stalled = 0;   // inside Acquire
  double computed = 0;  // inside the delay
  double released = 0;  // inside the pin's release
  SwapperStats d;
};

// One forward + backward pass and EndIteration (`forward_only`: the forward
// pass alone, no EndIteration: evaluation). Returns false (after printing)
// on an error or wrong bytes.
bool RunIteration(Swapper& s, const Flags& f, double delay, Iteration* it,
                  bool forward_only = false) {
  const SwapperStats before = s.Stats();
  const auto start = Clock::now();
  bool ok = true;
  auto use = [&](int layer) {
    const auto a = Clock::now();
    absl::StatusOr<Swapper::Pin> pin = s.Acquire(static_cast<uint64_t>(layer), false);
    it->stalled += SecondsSince(a);
    if (!pin.ok()) {
      std::fprintf(stderr, "acquire layer %d: %s\n", layer, pin.status().ToString().c_str());
      ok = false;
      return;
    }
    const auto want = static_cast<std::byte>(layer + 1);
    if (pin->data()[0] != want || pin->data()[pin->size() - 1] != want) {
      std::fprintf(stderr, "layer %d: wrong bytes after swap-in\n", layer);
      ok = false;
    }
    const auto c = Clock::now();
    const auto until =
        c + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(delay));
    if (f.busy) {
      while (Clock::now() < until) {
      }
    } else {
      std::this_thread::sleep_until(until);
    }
    it->computed += SecondsSince(c);
    const auto r = Clock::now();
    pin->Reset();
    it->released += SecondsSince(r);
  };
  for (int l = 0; l < f.layers && ok; ++l) use(l);
  if (!forward_only) {
    for (int l = f.layers - 1; l >= 0 && ok; --l) use(l);
    s.EndIteration(kTrace);
  }
  it->seconds = SecondsSince(start);
  it->d = s.Stats().Since(before);
  return ok;
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
    const char* v;
    if ((v = value("dir"))) {
      f.dir = v;
    } else if ((v = value("layers"))) {
      f.layers = std::max(1, std::atoi(v));
    } else if ((v = value("pool"))) {
      f.pool = static_cast<uint64_t>(bytes(v));
    } else if ((v = value("params"))) {
      f.params = static_cast<uint64_t>(bytes(v));
    } else if ((v = value("delays"))) {
      f.delays.clear();
      for (absl::string_view d : absl::StrSplit(v, ',')) {
        double s;
        if (!ParseDuration(d, &s)) {
          std::fprintf(stderr, "bad duration '%s'\n", std::string(d).c_str());
          return 2;
        }
        f.delays.push_back(s);
      }
    } else if ((v = value("iterations"))) {
      f.iterations = std::max(2, std::atoi(v));
    } else if (bench::TunableFlag(tunables, argv[i])) {
    } else if (a == "--busy") {
      f.busy = true;
    } else if (a == "--memory=arena" || a == "--memory=pool") {
      f.arena = a == "--memory=arena";
    } else if (a == "--arena_pages=huge" || a == "--arena_pages=small") {
      f.arena_huge = a == "--arena_pages=huge";
    } else if (a == "--arena_io=file" || a == "--arena_io=mapping") {
      f.arena_file = a == "--arena_io=file";
    } else if ((v = value("eval"))) {
      f.eval = std::max(2, std::atoi(v));
    } else if (a == "--no-fio") {
      f.fio = false;
    } else if (a == "--tiny") {
      tiny = true;
    } else {
      std::fprintf(stderr, "unknown flag %s (see benches/trace_replay_bench.cc)\n", a.c_str());
      return 2;
    }
  }
  if (tiny) {  // the smoke test: seconds, under 100 MB of disk
    f.layers = 12;
    f.pool = 6 << 20;
    f.params = 18 << 20;
    f.delays = {0.001};
    f.iterations = 3;
    if (f.eval > 0) f.eval = 6;
  }
  if (f.params == 0) f.params = 3 * f.pool;
  return 0;
}

// fio: one round after setup and one after each configuration, so each
// configuration is compared with the disk's speed just before and after it
// (this virtual disk drifts by tens of percent within minutes).
struct FioRound {
  double read = -1, write = -1;
};
struct FioRounds {
  const Flags& f;
  std::string file;
  uint64_t total;  // the file's bytes
  std::vector<FioRound> rounds;

  uint64_t bs() const {
    return static_cast<uint64_t>(std::min(f.nvme.io.request_bytes, f.nvme.stripe_bytes));
  }
  void Round(const std::string& when) {
    if (!f.fio) return;
    if (rounds.empty()) FioBandwidth(file, true, 16 << 20, 16, total);  // timed writes overwrite
    FioRound r;
    r.write = FioBandwidth(file, true, bs(), f.nvme.io.queue_depth, total);
    r.read = FioBandwidth(file, false, bs(), f.nvme.io.queue_depth, total);
    std::printf("fio %-28s write %.3f GB/s, read %.3f GB/s\n", when.c_str(), r.write / 1e9,
                r.read / 1e9);
    rounds.push_back(r);
  }
};

// One configuration's measured iterations.
struct Result {
  double delay = 0;
  bool prefetch = false;
  std::vector<Iteration> its;
};

// What the replay measured.
struct Replayed {
  std::vector<Result> results;
  std::vector<Result> eval;  // --eval: the measured forward passes
  Iteration learning;
  uint64_t hwm = 0, pool_max = 0, resident_max = 0;
};

// The layout and the iterations it runs, printed before they start.
void PrintPlan(const Flags& f, uint64_t layer_bytes, uint64_t total) {
  std::string shmem_enabled;
  std::getline(std::ifstream("/sys/kernel/mm/transparent_hugepage/shmem_enabled"), shmem_enabled);
  const std::string memory =
      !f.arena ? "pool memory, huge pages"
               : absl::StrCat("a shared memfd arena, ",
                              f.arena_huge   ? "laid out for and asking for huge pages"
                              : f.arena_file ? "4 KiB pages, moved through the memfd"
                                             : "4 KiB pages, direct I/O into the mapping",
                              " (shmem_enabled: ", shmem_enabled, ")");
  std::printf(
      "== trace_replay: %d layers of %.1f MiB (%.3f GiB of parameters, one block each, "
      "homed on NVMe, in %s); host pool %.3f GiB: parameters / pool = %.2fx (%.1f layers "
      "fit)\n",
      f.layers, layer_bytes / kMiB, total / kGiB, memory.c_str(), f.pool / kGiB,
      static_cast<double>(total) / f.pool, static_cast<double>(f.pool) / layer_bytes);
  std::printf("iteration: forward 0..%d then backward %d..0, read-only pins, a %s per use; %s\n",
              f.layers - 1, f.layers - 1, f.busy ? "busy-wait" : "sleep",
              bench::DescribeSwapSettings(f.nvme, f.swapper).c_str());
}

// The swap space, the arena and the swapper; every layer written once, then
// each configuration (delay x prefetch on/off) for --iterations, with a fio
// round after each. 0, or the exit status of a failure (said on stderr).
int Replay(const Flags& f, uint64_t layer_bytes, uint64_t total, FioRounds* fio, Replayed* out) {
  {
    absl::StatusOr<std::unique_ptr<IoBackend>> backend = MakeIoBackend(f.nvme.io);
    if (!backend.ok()) {
      std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
      return 1;
    }
    NvmeOptions n = f.nvme;  // every nvme.* flag, then where and how much
    n.dirs = f.dir;
    n.bytes_per_dir = static_cast<int64_t>(
        total + std::max<uint64_t>(total / 16,
                                   4 * static_cast<uint64_t>(f.swapper.io_threads) * layer_bytes));
    // The arena: one memfd, mapped once, a region per layer on whole pages
    // of the layout's size, as offloadd lays large partitions out (before
    // the engine: it must outlive the swapper's I/O).
    const uint64_t page =
        f.arena_huge ? std::max<uint64_t>(SharedHugePageBytes(), 2 << 20) : PageSize();
    const uint64_t region = RoundUp(layer_bytes, page);
    UniqueFd arena_fd;
    HostMemory arena;
    if (f.arena) {
      absl::StatusOr<UniqueFd> fd = Env::Default()->CreateMemfd("trace-replay");
      absl::Status sized =
          fd.ok() ? Env::Default()->ResizeFile(fd->get(), region * f.layers) : fd.status();
      absl::StatusOr<HostMemory> mapped =
          sized.ok() ? HostMemory::MapShared(fd->get(), 0, region * f.layers,
                                             f.arena_huge ? Pages::kHuge : Pages::kSmall)
                     : absl::StatusOr<HostMemory>(sized);
      if (!mapped.ok()) {
        std::fprintf(stderr, "arena: %s\n", mapped.status().ToString().c_str());
        return 1;
      }
      arena_fd = std::move(*fd);
      arena = std::move(*mapped);
    }
    // The engine's pool, swap space and swapper (its sessions and optimizer
    // stay idle: this replays the swapper alone).
    EngineOptions o;
    o.host_budget_bytes = f.pool;
    o.nvme = n;
    o.swapper = f.swapper;
    absl::StatusOr<std::unique_ptr<Engine>> engine =
        Engine::Create(o, Env::Default(), backend->get());
    if (!engine.ok()) {
      std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
      return 1;
    }
    HostPool& pool = (*engine)->pool();
    Swapper& s = (*engine)->swapper();
    for (int l = 0; l < f.layers; ++l) {
      const uint64_t id = static_cast<uint64_t>(l);
      absl::Status added =
          f.arena ? s.AddExternal(id,
                                  ExternalMemory{arena.data() + id * region, page,
                                                 f.arena_file ? arena_fd.get() : -1, id * region},
                                  layer_bytes, Tier::kNvme, kTrace)
                  : s.Add(id, layer_bytes, Tier::kNvme, kTrace);
      if (!added.ok()) {
        std::fprintf(stderr, "%s\n", added.ToString().c_str());
        return 1;
      }
    }
    // Setup: every layer written once (evictions write them to NVMe).
    const auto setup = Clock::now();
    for (int l = 0; l < f.layers; ++l) {
      absl::StatusOr<Swapper::Pin> pin = s.Acquire(static_cast<uint64_t>(l), true);
      if (!pin.ok()) {
        std::fprintf(stderr, "setup, layer %d: %s\n", l, pin.status().ToString().c_str());
        return 1;
      }
      std::memset(pin->data(), l + 1, pin->size());
    }
    s.EndIteration(kTrace);
    s.WaitIdle();
    std::printf("\nsetup: %d layers written in %.2f s\n", f.layers, SecondsSince(setup));
    fio->Round("after setup:");

    std::ofstream("/proc/self/clear_refs") << "5";
    std::atomic<bool> stop{false};
    std::atomic<uint64_t> pool_peak{0}, resident_peak{0};
    std::thread sampler([&] {
      while (!stop.load()) {
        const uint64_t u = pool.used();
        if (u > pool_peak.load()) pool_peak.store(u);
        // Pages put into the arena through its file are in no mapping of
        // this process until touched, so VmHWM misses them: count them.
        uint64_t resident = ProcStatus()["RssAnon"];
        struct stat st;
        if (arena_fd.get() >= 0 && fstat(arena_fd.get(), &st) == 0) {
          resident += static_cast<uint64_t>(st.st_blocks) * 512;
        }
        if (resident > resident_peak.load()) resident_peak.store(resident);
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
    bool ok = true;
    bool first = true;
    for (double delay : f.delays) {
      for (bool prefetch : {true, false}) {
        if (!ok) break;
        s.SetPrefetch(prefetch ? f.swapper.prefetch_depth : 0,
                      prefetch ? f.swapper.prefetch_bytes : 0);
        Result res;
        res.delay = delay;
        res.prefetch = prefetch;
        Iteration warm;
        ok = RunIteration(s, f, delay, &warm);
        if (first) {
          out->learning = warm;
          first = false;
        }
        for (int i = 1; i < f.iterations && ok; ++i) {
          Iteration it;
          ok = RunIteration(s, f, delay, &it);
          res.its.push_back(it);
        }
        std::printf("delay %.1f ms, prefetch %s: %s\n", delay * 1e3, prefetch ? "on " : "off",
                    absl::StrJoin(res.its, ", ", [](std::string* out, const Iteration& it) {
                      absl::StrAppend(out, absl::StrFormat("%.3f s", it.seconds));
                    }).c_str());
        out->results.push_back(std::move(res));
        s.WaitIdle();  // the prefetch EndIteration started
        fio->Round(
            absl::StrFormat("after %.1f ms, prefetch %s:", delay * 1e3, prefetch ? "on" : "off"));
      }
    }
    for (bool prefetch : {true, false}) {
      if (!ok || f.eval == 0) break;
      s.SetPrefetch(prefetch ? f.swapper.prefetch_depth : 0,
                    prefetch ? f.swapper.prefetch_bytes : 0);
      Result res;
      res.delay = f.delays[0];
      res.prefetch = prefetch;
      Iteration training;
      ok = RunIteration(s, f, res.delay, &training);
      for (int i = 0; i < f.eval && ok; ++i) {
        Iteration it;
        ok = RunIteration(s, f, res.delay, &it, /*forward_only=*/true);
        if (2 * i >= f.eval) res.its.push_back(it);
      }
      s.EndIteration(kTrace);  // (the next step)
      s.WaitIdle();
      out->eval.push_back(std::move(res));
    }
    stop.store(true);
    sampler.join();
    out->hwm = ProcStatus()["VmHWM"];
    out->pool_max = pool_peak.load();
    out->resident_max = resident_peak.load();
    if (!ok) return 1;
    engine->reset();  // before the arena
  }
  return 0;
}

// A configuration's measured iterations: their times and bytes moved, per
// iteration (means), and the counters the reports show, summed.
struct Measured {
  double secs = 0, stall = 0, computed = 0, released = 0, in = 0, out = 0;
  SwapperStats sum;
};
Measured Measure(const Result& r) {
  const double n = static_cast<double>(r.its.size());
  Measured m;
  for (const Iteration& it : r.its) {
    m.secs += it.seconds / n;
    m.stall += it.stalled / n;
    m.computed += it.computed / n;
    m.released += it.released / n;
    m.in += static_cast<double>(it.d.bytes_in) / n;
    m.out += static_cast<double>(it.d.bytes_out) / n;
    m.sum.acquires += it.d.acquires;
    m.sum.hits += it.d.hits;
    m.sum.waited_reads += it.d.waited_reads;
    m.sum.misses += it.d.misses;
    m.sum.prefetches += it.d.prefetches;
    m.sum.prefetch_wasted += it.d.prefetch_wasted;
    m.sum.order_passes += it.d.order_passes;
  }
  return m;
}

// Each configuration against its bound: compute (2 x layers x delay) and
// the bytes moved at the fio rounds' sequential speeds.
void PrintReport(const Flags& f, uint64_t total, const FioRounds& fio, const Replayed& run) {
  std::printf(
      "\nlearning iteration (first after setup, prefetch on, delay %.1f ms): %.3f s, "
      "read %.3f GB, written %.3f GB, relearned %llu\n",
      f.delays[0] * 1e3, run.learning.seconds, run.learning.d.bytes_in / 1e9,
      run.learning.d.bytes_out / 1e9, static_cast<unsigned long long>(run.learning.d.relearned));
  std::printf("\n%-8s %-8s %8s %8s %8s %8s %8s %7s %6s %6s %6s %6s %6s %6s %8s %8s %8s %8s %s\n",
              "delay", "prefetch", "iter s", "compute", "I/O bnd", "ratio", "vs mean", "hits%",
              "acq", "hits", "waited", "misses", "pref", "wasted", "read GB", "stall s", "slept s",
              "unpin s", "target");
  int met = 0, missed = 0;
  const bool have_io = f.fio && fio.rounds.size() == run.results.size() + 1 &&
                       std::all_of(fio.rounds.begin(), fio.rounds.end(),
                                   [](const FioRound& r) { return r.read > 0 && r.write > 0; });
  for (size_t k = 0; k < run.results.size(); ++k) {
    const Result& r = run.results[k];
    const auto [secs, stall, computed, released, in, out, sum] = Measure(r);
    const double compute = 2.0 * f.layers * r.delay;
    // The bytes moved at the sequential speeds of the fio.rounds before and
    // after: the faster one (and, for "vs mean", their mean).
    double io = -1, io_mean = -1;
    if (have_io) {
      const double before = in / fio.rounds[k].read + out / fio.rounds[k].write;
      const double after = in / fio.rounds[k + 1].read + out / fio.rounds[k + 1].write;
      io = std::min(before, after);
      io_mean = (before + after) / 2;
    }
    const double bound = std::max(compute, io);
    const double hit = 100.0 * static_cast<double>(sum.hits) / static_cast<double>(sum.acquires);
    std::string target = "-";
    if (r.prefetch && io > 0) {
      const bool ok_hits = hit >= 90.0, ok_time = secs <= 1.1 * bound;
      target = absl::StrCat(ok_hits && ok_time ? "MET" : "NOT MET", " (hits ", ok_hits ? ">=" : "<",
                            " 90%, time ", ok_time ? "<=" : ">", " 1.1x)");
      (ok_hits && ok_time ? met : missed)++;
    }
    std::printf(
        "%-8s %-8s %8.3f %8.3f %8.3f %7.3fx %7.3fx %6.1f%% %6llu %6llu %6llu %6llu %6llu "
        "%6llu %8.3f %8.3f %8.3f %8.3f %s\n",
        absl::StrFormat("%.1fms", r.delay * 1e3).c_str(), r.prefetch ? "on" : "off", secs, compute,
        io, secs / bound, secs / std::max(compute, io_mean), hit,
        static_cast<unsigned long long>(sum.acquires), static_cast<unsigned long long>(sum.hits),
        static_cast<unsigned long long>(sum.waited_reads),
        static_cast<unsigned long long>(sum.misses),
        static_cast<unsigned long long>(sum.prefetches),
        static_cast<unsigned long long>(sum.prefetch_wasted), in / 1e9, stall, computed, released,
        target.c_str());
  }
  std::printf(
      "iter s: mean of %d measured iterations; compute = %d x 2 x delay; ratio = iter / "
      "max(compute, I/O bnd); hits%% = hits / acquires; per iteration: stall = time inside "
      "Acquire, slept = time in the compute delay, unpin = time releasing pins\n",
      f.iterations - 1, f.layers);
  if (have_io) {
    std::vector<double> reads;
    for (const FioRound& r : fio.rounds) reads.push_back(r.read);
    std::sort(reads.begin(), reads.end());
    std::printf(
        "I/O bnd = bytes moved per iteration (read in + written out) at the sequential "
        "speeds of the fio round just before or just after the configuration, whichever "
        "is faster; vs mean = iter / max(compute, the two rounds' mean); all %d uses read "
        "from NVMe would take %.3f s at the median round's read speed (%.3f GB/s)\n",
        2 * f.layers, 2.0 * static_cast<double>(total) / reads[(reads.size() - 1) / 2],
        reads[(reads.size() - 1) / 2] / 1e9);
  } else {
    std::printf("no fio measurement: no I/O bound (ratio against compute only)\n");
  }
  std::printf("prefetch targets: %d met, %d not met\n", met, missed);
  if (!run.eval.empty()) {
    std::printf(
        "\nevaluation: %d forward passes with no step between them, after a training "
        "iteration; the last %zu measured\n",
        f.eval, run.eval[0].its.size());
    std::printf("%-8s %-8s %8s %8s %8s %7s %6s %6s %6s %6s %6s\n", "delay", "prefetch", "pass s",
                "compute", "ratio", "hits%", "acq", "hits", "waited", "misses", "passes");
    for (const Result& r : run.eval) {
      const Measured m = Measure(r);
      const double secs = m.secs;
      const SwapperStats& sum = m.sum;
      const double compute = f.layers * r.delay;
      std::printf("%-8s %-8s %8.3f %8.3f %7.3fx %6.1f%% %6llu %6llu %6llu %6llu %6llu\n",
                  absl::StrFormat("%.1fms", r.delay * 1e3).c_str(), r.prefetch ? "on" : "off", secs,
                  compute, secs / compute,
                  100.0 * static_cast<double>(sum.hits) / static_cast<double>(sum.acquires),
                  static_cast<unsigned long long>(sum.acquires),
                  static_cast<unsigned long long>(sum.hits),
                  static_cast<unsigned long long>(sum.waited_reads),
                  static_cast<unsigned long long>(sum.misses),
                  static_cast<unsigned long long>(sum.order_passes));
    }
    if (run.eval.size() == 2) {
      std::printf("evaluation with prefetch: %.3fx the time of the same passes without\n",
                  Measure(run.eval[0]).secs / Measure(run.eval[1]).secs);
    }
  }
  std::printf(
      "memory: VmHWM over the iterations %.3f GiB, anonymous and arena pages (sampled "
      "every 5 ms) at most %.3f GiB, pool limit %.3f GiB, pool used max %.3f GiB\n",
      run.hwm / kGiB, run.resident_max / kGiB, f.pool / kGiB, run.pool_max / kGiB);
}

int Main(int argc, char** argv) {
  Flags f;
  if (int refused = ParseFlags(argc, argv, &f); refused != 0) return refused;
  const uint64_t layer_bytes = f.params / static_cast<uint64_t>(f.layers) / 4096 * 4096;
  if (layer_bytes == 0) {
    std::fprintf(stderr, "--params / --layers is under 4 KiB\n");
    return 2;
  }
  const uint64_t total = layer_bytes * static_cast<uint64_t>(f.layers);

  if (mkdir(f.dir.c_str(), 0700) != 0 && errno != EEXIST) {
    std::fprintf(stderr, "mkdir %s: %s\n", f.dir.c_str(), std::strerror(errno));
    return 1;
  }
  PrintMachine(f.dir);
  PrintPlan(f, layer_bytes, total);
  FioRounds fio{f, f.dir + "/fio_bench.dat", total, {}};
  if (f.fio) {
    std::printf("fio: io_uring, O_DIRECT, bs %s, iodepth %lld, sequential, %.2f GB file %s\n",
                FormatByteSize(static_cast<int64_t>(fio.bs())).c_str(),
                static_cast<long long>(f.nvme.io.queue_depth), total / 1e9, fio.file.c_str());
  }
  Replayed run;
  if (int failed = Replay(f, layer_bytes, total, &fio, &run); failed != 0) return failed;
  unlink(fio.file.c_str());
  rmdir(f.dir.c_str());  // only if empty
  PrintReport(f, total, fio, run);
  return 0;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // progress shows as it goes
  return offload::Main(argc, argv);
}
