// benches/cpu_adam: how close the daemon's Adam step comes to memory
// bandwidth, and how it compares with torch.optim.AdamW and with DeepSpeed's
// CPU Adam, in one run.
//
//   bazel run -c opt //benches:cpu_adam -- [--sizes=10000000,100000000]
//       [--threads=1,2] [--reps=5] [--rounds=3] [--kernel=auto] [--no-torch]
//       [--peer=PATH|none] [--tiny]
//
// For each thread count it measures a STREAM-style triad (a = b + s*c on
// floats, counted as 16 bytes per element: two reads, one write and the
// write's allocate read), then each case's step. A case's bound is triad
// bandwidth divided by the bytes it must move per parameter:
//   fp32 gradients, in place:          16 read + 12 written = 28
//   bf16 gradients:                    26
//   + separate bf16 working copy:      +2 written, +2 write-allocate = +4
//   + non-finite pre-scan:             +4 (fp32) or +2 (bf16) read
// Every time is the best of --reps after one warm-up. Then gradient
// accumulation (bf16 gradients into the fp32 accumulator, as a returned
// micro-batch is added): this kernel's against the scalar reference's, with
// the same bound (10 bytes per parameter: 2 read, 4 written and 4 read
// for ownership of the written line, or read as the sum's other term); and
// the measuring of handed-over gradients (their squared norm and
// non-finite count, nothing written: 2 bytes per parameter).
//
// The peer is DeepSpeed's CPU Adam (DeepSpeedCPUAdam's C++ op, built from
// its unmodified sources with its CPU op builder's flags), timed by the
// harness in --peer (default: ../shared/peers/deepspeed_cpu_adam from the
// repository root; see its README.md) in a child process with
// OMP_NUM_THREADS=T. For each thread count and size, our cases and the peer
// run --rounds times in alternating order, and each reports its best round,
// so both see the same machine. Same hyperparameters and values on both
// sides. What is compared ("vs DS"):
//   "fp32 grads" with DeepSpeed fp32: the same work, fp32 params, grads and
//       moments updated in place, 28 bytes per parameter on both sides;
//   "bf16 grads" and "bf16 grads + bf16 copy" with DeepSpeed bf16 (marked *):
//       not the same work. DeepSpeed's only bf16-gradient case has bf16
//       params and no fp32 master (22 bytes); ours keep an fp32 master
//       (26 bytes, 30 with the bf16 working copy).
// The peer is skipped, with a line saying why, when --peer=none, when it is
// not there, or when it cannot run (missing packages: tools/setup.sh).
#include <limits.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "cpu_adam/optimizer.h"
#include "tbb/blocked_range.h"
#include "tbb/parallel_for.h"
#include "tbb/task_arena.h"

namespace offload {
namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  std::vector<size_t> sizes = {10'000'000, 100'000'000};
  std::vector<int> threads = {1, 2};
  int reps = 5;
  std::string kernel = "auto";
  bool torch = true;
  int rounds = 3;    // each runs our cases and the peer, in alternating order
  std::string peer;  // the peer's directory; empty: the default; "none": skip
};

template <typename Fn>
double BestSeconds(int reps, Fn&& fn) {
  fn();  // warm-up: page faults, caches, thread start
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto start = Clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  return best;
}

// Parallel first touch, so pages land where the threads run.
void Fill(tbb::task_arena& arena, float* x, size_t n, float value) {
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, n, 1 << 16), [&](const auto& r) {
      for (size_t i = r.begin(); i != r.end(); ++i) x[i] = value;
    });
  });
}

double TriadGBs(int threads, size_t n, int reps) {
  tbb::task_arena arena(threads);
  std::vector<float> a(n), b(n), c(n);
  Fill(arena, a.data(), n, 0.0f);
  Fill(arena, b.data(), n, 1.0f);
  Fill(arena, c.data(), n, 2.0f);
  const float s = 3.0f;
  double t = BestSeconds(reps, [&] {
    arena.execute([&] {
      tbb::parallel_for(tbb::blocked_range<size_t>(0, n, 1 << 16), [&](const auto& r) {
        float* __restrict pa = a.data();
        const float* __restrict pb = b.data();
        const float* __restrict pc = c.data();
        for (size_t i = r.begin(); i != r.end(); ++i) pa[i] = pb[i] + s * pc[i];
      });
    });
  });
  if (a[n / 2] != 7.0f) std::fprintf(stderr, "triad result wrong\n");
  return 16.0 * static_cast<double>(n) / t / 1e9;
}

double TorchSeconds(size_t n, int threads, int reps) {
  std::string cmd = "/usr/bin/python3 benches/torch_adamw.py " + std::to_string(n) + " " +
                    std::to_string(threads) + " " + std::to_string(reps);
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return -1;
  char line[128] = {};
  const bool got = std::fgets(line, sizeof(line), pipe) != nullptr;
  const int rc = pclose(pipe);
  double t;
  if (!got || rc != 0 || !absl::SimpleAtod(absl::StripAsciiWhitespace(line), &t)) return -1;
  return t;
}

// The peer's cases, as its run.sh names them, in the order RunPeer returns.
struct PeerCase {
  const char* name;   // run.sh --cases
  const char* label;  // our table's row
  double bytes;       // per parameter
};

constexpr PeerCase kPeerCases[] = {
    {"fp32", "DeepSpeed fp32 (peer)", 28},
    {"bf16", "DeepSpeed bf16 params+grads (peer)", 22},
};
constexpr int kPeerFp32 = 0;
constexpr int kPeerBf16 = 1;
constexpr int kNoPeer = -1;

using PeerRates = std::array<double, std::size(kPeerCases)>;  // params/s

struct Case {
  const char* name;
  DType grad;
  bool bf16_copy;
  bool check_finite;
  double bytes;    // per parameter, as in the header comment
  int peer;        // the kPeerCases entry it is compared with, or kNoPeer
  bool same_work;  // whether that peer case does exactly this work
};

constexpr Case kCases[] = {
    {"fp32 grads", DType::kFp32, false, false, 28, kPeerFp32, true},
    {"fp32 grads + bf16 copy", DType::kFp32, true, false, 32, kNoPeer, false},
    {"bf16 grads", DType::kBf16, false, false, 26, kPeerBf16, false},
    {"bf16 grads + bf16 copy", DType::kBf16, true, false, 30, kPeerBf16, false},
    {"bf16 grads + copy + finite check", DType::kBf16, true, true, 32, kNoPeer, false},
};

// The repository root: `bazel run` names it; otherwise the real path of
// benches/torch_adamw.py gives it, run from the checkout or from the
// runfiles tree (where that file is a link into the checkout).
std::string RepoRoot() {
  if (const char* w = std::getenv("BUILD_WORKSPACE_DIRECTORY"); w != nullptr && *w != '\0') {
    return w;
  }
  char buf[PATH_MAX];
  if (realpath("benches/torch_adamw.py", buf) == nullptr) return ".";
  std::string path = buf;  // ROOT/benches/torch_adamw.py
  return path.substr(0, path.rfind('/', path.rfind('/') - 1));
}

std::string ShellQuote(absl::string_view s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

// Runs the peer's harness once for one size and thread count and returns
// its rate per kPeerCases entry, or why it could not.
absl::StatusOr<PeerRates> RunPeer(const std::string& dir, size_t n, int threads, int reps) {
  const std::string cmd = absl::StrCat(ShellQuote(dir + "/run.sh"), " --n ", n, " --threads ",
                                       threads, " --reps ", reps, " --cases fp32,bf16 2>&1");
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError(absl::StrCat("popen: ", std::strerror(errno)));
  PeerRates rates;
  rates.fill(-1);
  std::string other;  // the last line that is not a result: the error, if any
  char buf[4096];
  while (std::fgets(buf, sizeof(buf), pipe) != nullptr) {
    const absl::string_view line = absl::StripAsciiWhitespace(buf);
    // deepspeed_cpu_adam CASE n=N threads=T Gparam/s=X
    const std::vector<absl::string_view> w = absl::StrSplit(line, ' ', absl::SkipEmpty());
    bool result = false;
    if (w.size() == 5 && w[0] == "deepspeed_cpu_adam" && w[2] == absl::StrCat("n=", n) &&
        w[3] == absl::StrCat("threads=", threads) && absl::StartsWith(w[4], "Gparam/s=")) {
      for (size_t k = 0; k < std::size(kPeerCases); ++k) {
        double g;
        if (w[1] == kPeerCases[k].name && absl::SimpleAtod(w[4].substr(9), &g) && g > 0) {
          rates[k] = g * 1e9;
          result = true;
        }
      }
    }
    if (!result && !line.empty()) other = std::string(line);
  }
  const int rc = pclose(pipe);
  const bool all = std::all_of(rates.begin(), rates.end(), [](double r) { return r > 0; });
  if (rc != 0 || !all) {
    return absl::UnavailableError(absl::StrCat(
        dir, "/run.sh ",
        rc != 0 ? absl::StrCat("exited with status ", WIFEXITED(rc) ? WEXITSTATUS(rc) : rc)
                : "printed no result",
        other.empty() ? "" : ": ", other));
  }
  return rates;
}

// The peer's directory, or empty after printing why it is skipped. An
// explicit --peer=PATH that cannot run is an error (*error set).
std::string FindPeer(const Flags& f, bool* error) {
  const char* skipped = f.peer.empty() || f.peer == "none" ? "peer DeepSpeed cpu_adam: skipped:"
                                                           : "peer DeepSpeed cpu_adam: error:";
  if (f.peer == "none") {
    std::printf("%s --peer=none\n", skipped);
    return "";
  }
  std::string dir = f.peer.empty() ? RepoRoot() + "/../shared/peers/deepspeed_cpu_adam" : f.peer;
  char buf[PATH_MAX];
  if (realpath(dir.c_str(), buf) != nullptr) dir = buf;
  if (access((dir + "/run.sh").c_str(), X_OK) != 0) {
    std::printf("%s no executable %s/run.sh (%s; pass --peer=PATH, or --peer=none)\n", skipped,
                dir.c_str(), std::strerror(errno));
    *error = !f.peer.empty();
    return "";
  }
  std::printf("peer DeepSpeed cpu_adam: %s (building its extension unless cached: a minute)\n",
              dir.c_str());
  if (absl::StatusOr<PeerRates> r = RunPeer(dir, 1000, 1, 1); !r.ok()) {
    std::printf("%s %s\n", skipped, std::string(r.status().message()).c_str());
    *error = !f.peer.empty();
    return "";
  }
  return dir;
}

int Main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto list = [&](size_t prefix) {
      return std::vector<std::string>(absl::StrSplit(a.substr(prefix), ','));
    };
    if (a == "--tiny") {
      f.sizes = {100'000};
      f.threads = {1};
      f.reps = 1;
      f.rounds = 1;
    } else if (a.rfind("--rounds=", 0) == 0) {
      f.rounds = std::max(1, std::stoi(a.substr(9)));
    } else if (a.rfind("--peer=", 0) == 0) {
      f.peer = a.substr(7);
      if (f.peer.empty()) {
        std::fprintf(stderr, "--peer= needs a directory, or none\n");
        return 2;
      }
    } else if (a.rfind("--sizes=", 0) == 0) {
      f.sizes.clear();
      for (const auto& s : list(8)) f.sizes.push_back(std::stoull(s));
    } else if (a.rfind("--threads=", 0) == 0) {
      f.threads.clear();
      for (const auto& s : list(10)) f.threads.push_back(std::stoi(s));
    } else if (a.rfind("--reps=", 0) == 0) {
      f.reps = std::max(1, std::stoi(a.substr(7)));
    } else if (a.rfind("--kernel=", 0) == 0) {
      f.kernel = a.substr(9);
    } else if (a == "--no-torch") {
      f.torch = false;
    } else {
      std::fprintf(stderr, "unknown flag %s (see the header of benches/cpu_adam_bench.cc)\n",
                   a.c_str());
      return 2;
    }
  }

  bool peer_error = false;
  const std::string peer = FindPeer(f, &peer_error);
  if (peer_error) return 1;

  int failures = 0;
  for (int threads : f.threads) {
    const size_t triad_n = std::max<size_t>(
        f.sizes.back(), f.sizes.size() == 1 && f.sizes[0] < 1'000'000 ? f.sizes[0] : 32'000'000);
    const double triad = TriadGBs(threads, triad_n, f.reps);
    std::printf("\n== %d thread%s: triad %.1f GB/s (%zu floats per array)\n", threads,
                threads == 1 ? "" : "s", triad, triad_n);
    std::printf("%-12s %-34s %9s %8s %9s %8s %10s %8s\n", "params", "case", "Gparam/s", "GB/s",
                "bound", "% bound", "vs torch", "vs DS");
    for (size_t n : f.sizes) {
      double torch_rate = -1;
      if (f.torch) {
        const double t = TorchSeconds(n, threads, std::min(f.reps, 3));
        if (t > 0) {
          torch_rate = static_cast<double>(n) / t;
        } else {
          std::printf("torch AdamW could not run (is python3-torch installed?)\n");
          ++failures;
        }
      }
      std::vector<float> p(n), m(n), v(n), g32(n);
      std::vector<uint16_t> g16(n), w16(n);
      {
        tbb::task_arena arena(threads);
        Fill(arena, p.data(), n, 0.5f);
        Fill(arena, m.data(), n, 0.0f);
        Fill(arena, v.data(), n, 0.0f);
        Fill(arena, g32.data(), n, 0.01f);
        std::fill(g16.begin(), g16.end(), FloatToBf16(0.01f));
        std::fill(w16.begin(), w16.end(), 0);
      }

      // Our cases and the peer, --rounds times in alternating order; each
      // keeps its best round.
      std::vector<double> best(std::size(kCases), 1e30);  // seconds
      PeerRates peer_rate;
      peer_rate.fill(-1);
      bool peer_ok = !peer.empty();
      auto run_peer = [&] {
        if (!peer_ok) return;
        absl::StatusOr<PeerRates> r = RunPeer(peer, n, threads, f.reps);
        if (!r.ok()) {
          std::printf("peer failed: %s\n", std::string(r.status().message()).c_str());
          ++failures;
          peer_ok = false;
          peer_rate.fill(-1);
          return;
        }
        for (size_t k = 0; k < peer_rate.size(); ++k) {
          peer_rate[k] = std::max(peer_rate[k], (*r)[k]);
        }
      };
      for (int round = 0; round < f.rounds; ++round) {
        const bool peer_first = round % 2 == 1;
        if (peer_first) run_peer();
        for (size_t ci = 0; ci < std::size(kCases); ++ci) {
          const Case& c = kCases[ci];
          OptimizerOptions o;
          o.threads = threads;
          o.kernel = f.kernel;
          o.check_finite = c.check_finite;
          Optimizer opt(o);
          if (absl::Status s = opt.SetKernel(f.kernel); !s.ok()) {
            std::fprintf(stderr, "%s\n", s.ToString().c_str());
            return 2;
          }
          AdamTask task;
          task.span = AdamSpan{p.data(),
                               m.data(),
                               v.data(),
                               c.grad == DType::kFp32 ? static_cast<const void*>(g32.data())
                                                      : static_cast<const void*>(g16.data()),
                               c.grad,
                               c.bf16_copy ? w16.data() : nullptr,
                               DType::kBf16,
                               n};
          uint64_t step = 0;
          bool ok = true;
          const double t = BestSeconds(f.reps, [&] {
            task.step = ++step;
            auto r = opt.Step({&task, 1}, AdamHyperparams{});
            ok = ok && r.ok() && !r->skipped;
          });
          if (!ok) {
            std::printf("step failed for %s\n", c.name);
            ++failures;
          }
          best[ci] = std::min(best[ci], t);
        }
        if (!peer_first) run_peer();
      }

      auto ratio = [](double ours, double theirs, const char* mark) {
        if (ours <= 0 || theirs <= 0) return std::string("-");
        char s[32];
        std::snprintf(s, sizeof(s), "%.2fx%s", ours / theirs, mark);
        return std::string(s);
      };
      auto row = [&](const char* name, double rate, double bytes, const std::string& vs_torch,
                     const std::string& vs_ds) {
        const double bound = triad * 1e9 / bytes;
        std::printf("%-12zu %-34s %9.3f %8.1f %9.3f %7.1f%% %10s %8s\n", n, name, rate / 1e9,
                    rate * bytes / 1e9, bound / 1e9, 100.0 * rate / bound, vs_torch.c_str(),
                    vs_ds.c_str());
      };
      for (size_t ci = 0; ci < std::size(kCases); ++ci) {
        const Case& c = kCases[ci];
        const double rate = static_cast<double>(n) / best[ci];
        char vs_torch[32] = "-";
        if (torch_rate > 0) std::snprintf(vs_torch, sizeof(vs_torch), "%.1fx", rate / torch_rate);
        row(c.name, rate, c.bytes, vs_torch,
            c.peer == kNoPeer ? "-" : ratio(rate, peer_rate[c.peer], c.same_work ? "" : "*"));
      }
      for (size_t k = 0; k < std::size(kPeerCases); ++k) {
        if (peer_rate[k] <= 0) continue;
        char vs_torch[32] = "-";
        if (torch_rate > 0) {
          std::snprintf(vs_torch, sizeof(vs_torch), "%.1fx", peer_rate[k] / torch_rate);
        }
        row(kPeerCases[k].label, peer_rate[k], kPeerCases[k].bytes, vs_torch, "1.00x");
      }
      if (torch_rate > 0) {
        std::printf("%-12zu %-34s %9.3f %8.1f %9s %8s %10s %8s\n", n, "torch AdamW (fp32)",
                    torch_rate / 1e9, torch_rate * 28 / 1e9, "", "", "1.0x", "");
      }
      // Gradient accumulation (returned bf16 gradients into the fp32
      // accumulator), this kernel against the scalar reference ("vs torch"
      // column: vs scalar), 10 bytes per parameter either way; and the
      // measuring of handed-over gradients (no accumulator: the squared
      // norm and non-finite count alone), 2 bytes per parameter.
      // Page-aligned, as the daemon's pool leases are.
      std::unique_ptr<float, decltype(&std::free)> acc_memory(
          static_cast<float*>(std::aligned_alloc(4096, (n * sizeof(float) + 4095) / 4096 * 4096)),
          &std::free);
      float* const acc = acc_memory.get();
      std::fill(acc, acc + n, 0.0f);
      for (int mode = 0; mode < 3; ++mode) {
        const bool first = mode != 1, measure = mode == 2;
        double t[2] = {1e30, 1e30};  // this kernel, scalar
        for (int round = 0; round < f.rounds; ++round) {
          for (int which = 0; which < 2; ++which) {
            OptimizerOptions o;
            o.threads = threads;
            Optimizer opt(o);
            if (absl::Status s = opt.SetKernel(which == 0 ? f.kernel : "scalar"); !s.ok()) {
              std::fprintf(stderr, "%s\n", s.ToString().c_str());
              return 2;
            }
            AccumulateTask task{g16.data(), DType::kBf16, measure ? nullptr : acc, n, first};
            t[which] = std::min(t[which], BestSeconds(f.reps, [&] {
                                  opt.Accumulate(absl::MakeConstSpan(&task, 1));
                                }));
          }
        }
        const double rate = static_cast<double>(n) / t[0];
        row(measure ? "measure handed-over bf16"
            : first ? "accumulate bf16, first micro-batch"
                    : "accumulate bf16, later micro-batch",
            rate, measure ? 2 : 10, absl::StrFormat("%.1fx", t[1] / t[0]), "-");
      }
    }
  }
  std::printf(
      "\nkernel %s; bound = triad GB/s / bytes per parameter; best of %d round%s, "
      "each the best of %d step%s after a warm-up\n",
      Optimizer(OptimizerOptions{0, 1 << 16, f.kernel, false}).kernel_name().c_str(), f.rounds,
      f.rounds == 1 ? "" : "s", f.reps, f.reps == 1 ? "" : "s");
  if (!peer.empty()) {
    std::printf(
        "vs DS: our Gparam/s over DeepSpeed cpu_adam's, measured in alternating rounds "
        "(DeepSpeed with OMP_NUM_THREADS=threads)\n"
        "  fp32 grads vs DeepSpeed fp32: the same work (fp32 params, grads and moments, in "
        "place: 28 B/param each)\n"
        "  * vs DeepSpeed bf16: not the same work: DeepSpeed's bf16 case has bf16 params and "
        "grads and no fp32 master (22 B/param);\n"
        "    ours keep an fp32 master (26 B/param, 30 with the bf16 copy)\n");
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // progress shows as it goes
  return offload::Main(argc, argv);
}
