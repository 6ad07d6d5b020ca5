// benches/cpu_adam: how close the daemon's Adam step comes to memory
// bandwidth, and how it compares with torch.optim.AdamW, in one run.
//
//   bazel run -c opt //benches:cpu_adam -- [--sizes=10000000,100000000]
//       [--threads=1,2] [--reps=5] [--kernel=auto] [--no-torch] [--tiny]
//
// For each thread count it measures a STREAM-style triad (a = b + s*c on
// floats, counted as 16 bytes per element: two reads, one write and the
// write's allocate read), then each case's step. A case's bound is triad
// bandwidth divided by the bytes it must move per parameter:
//   fp32 gradients, in place:          16 read + 12 written = 28
//   bf16 gradients:                    26
//   + separate bf16 working copy:      +2 written, +2 write-allocate = +4
//   + non-finite pre-scan:             +4 (fp32) or +2 (bf16) read
// Every time is the best of --reps after one warm-up.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
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

struct Case {
  const char* name;
  DType grad;
  bool bf16_copy;
  bool check_finite;
  double bytes;  // per parameter, as in the header comment
};

constexpr Case kCases[] = {
    {"fp32 grads", DType::kFp32, false, false, 28},
    {"fp32 grads + bf16 copy", DType::kFp32, true, false, 32},
    {"bf16 grads", DType::kBf16, false, false, 26},
    {"bf16 grads + bf16 copy", DType::kBf16, true, false, 30},
    {"bf16 grads + copy + finite check", DType::kBf16, true, true, 32},
};

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

  int failures = 0;
  for (int threads : f.threads) {
    const size_t triad_n = std::max<size_t>(f.sizes.back(), f.sizes.size() == 1 &&
                                                                    f.sizes[0] < 1'000'000
                                                                ? f.sizes[0]
                                                                : 32'000'000);
    const double triad = TriadGBs(threads, triad_n, f.reps);
    std::printf("\n== %d thread%s: triad %.1f GB/s (%zu floats per array)\n", threads,
                threads == 1 ? "" : "s", triad, triad_n);
    std::printf("%-12s %-34s %9s %8s %9s %8s %10s\n", "params", "case", "Gparam/s", "GB/s",
                "bound", "% bound", "vs torch");
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
      for (const Case& c : kCases) {
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
        task.span = AdamSpan{p.data(), m.data(), v.data(),
                             c.grad == DType::kFp32 ? static_cast<const void*>(g32.data())
                                                    : static_cast<const void*>(g16.data()),
                             c.grad, c.bf16_copy ? w16.data() : nullptr, DType::kBf16, n};
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
        const double rate = static_cast<double>(n) / t;
        const double bound = triad * 1e9 / c.bytes;
        char vs_torch[32] = "-";
        if (torch_rate > 0) std::snprintf(vs_torch, sizeof(vs_torch), "%.1fx", rate / torch_rate);
        std::printf("%-12zu %-34s %9.3f %8.1f %9.3f %7.1f%% %10s\n", n, c.name, rate / 1e9,
                    rate * c.bytes / 1e9, bound / 1e9, 100.0 * rate / bound, vs_torch);
      }
      if (torch_rate > 0) {
        std::printf("%-12zu %-34s %9.3f %8.1f %9s %8s %10s\n", n, "torch AdamW (fp32)",
                    torch_rate / 1e9, torch_rate * 28 / 1e9, "", "", "1.0x");
      }
    }
  }
  std::printf("\nkernel %s; bound = triad GB/s / bytes per parameter\n",
              Optimizer(OptimizerOptions{0, 1 << 16, f.kernel, false}).kernel_name().c_str());
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // progress shows as it goes
  return offload::Main(argc, argv);
}
