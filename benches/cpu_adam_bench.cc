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
// write's allocate read), printed for reference, then each case's step
// against its bound. A case's bound is its own memory traffic without its
// arithmetic, measured in the same round on the same arrays and threads
// (the "stream" of the case): the arrays the step reads read, the arrays it
// updates written back in place (their lines were read: no allocate read),
// the working copy written around the cache (non-temporal stores: no
// allocate read), the pre-scan's extra read of the gradients. The bytes
// each case must move per parameter, as the GB/s column counts them:
//   fp32 gradients, in place:          16 read + 12 written = 28
//   bf16 gradients:                    26
//   + separate bf16 working copy:      +2 written (+2 write-allocate for
//                                      the kernel's ordinary stores) = +4
//                                      (fp32 copy: +4 +4 = +8); the AVX-512
//                                      kernel writes a copy on a 64-byte
//                                      boundary (these arrays are on pages)
//                                      around the cache: +2 (fp32: +4)
//   + non-finite pre-scan:             +4 (fp32) or +2 (bf16) read
// (Until 2026-11-27 the bound was the triad's bandwidth over those bytes;
// both the kernel and DeepSpeed's ran at 120-235% of it: a triad moves
// memory differently from an update in place.)
// Every time is the best of --reps after one warm-up. Then gradient
// accumulation (bf16 gradients into the fp32 accumulator, as a returned
// micro-batch is added): this kernel's against the scalar reference's, with
// the same bound (10 bytes per parameter: 2 read, 4 written and 4 read
// for ownership of the written line, or read as the sum's other term); and
// the measuring of handed-over gradients (their squared norm and
// non-finite count, nothing written: 2 bytes per parameter).
//
// The peer is DeepSpeed's CPU Adam (DeepSpeedCPUAdam's C++ op, built from
// its unmodified sources with its CPU op builder's flags by the harness in
// --peer (default: ../shared/peers/deepspeed_cpu_adam from the repository
// root; see its README.md), timed by benches/ds_peer.py in one child process
// per thread count and size with OMP_NUM_THREADS=T. Each round times every
// case of ours and its peer's case back to back (the order alternating by
// round), so that each pair sees the same phase of a machine whose memory
// bandwidth drifts over minutes; "vs DS" is the median of the rounds' ratios
// (each printed below the table), the rates each side's best round. Same
// hyperparameters and values on both sides. What is compared ("vs DS"):
//   "fp32 grads" with DeepSpeed fp32: the same work, fp32 params, grads and
//       moments updated in place, 28 bytes per parameter on both sides;
//   "bf16 grads" with DeepSpeed bf16 (marked *): not the same work.
//       DeepSpeed's only bf16-gradient case has bf16 params and no fp32
//       master (22 bytes); ours keep an fp32 master (26 bytes);
//   "bf16 grads + bf16 copy" with DeepSpeed's ZeRO-3 step (marked z): the
//       same job, not the same bytes: fp32 master weights and moments
//       updated and the bf16 working copy written, for a step of bf16
//       training. DeepSpeed's ZeRO-3 runs its Adam on fp32 gradients and then
//       copies the fp32 parameters into the bf16 ones (stage3.py;
//       benches/ds_peer.py times it with the harness's op and torch's
//       copy_): 36 bytes; ours 30 (28 where the copy goes around the cache),
//       from bf16 gradients, the copy written in the same pass. DeepSpeed's
//       unscale-and-clip pass is left out.
//   "fp32 grads + fp32 copy" with DeepSpeed's ZeRO-3 fp32 step (z): the
//       same for fp32 training, which is what offloadd's step does with an
//       fp32 working copy (the master weights kept apart from the copy the
//       trainers read): 36 bytes (32 around the cache); DeepSpeed's ZeRO-3, whose offloaded
//       optimizer keeps its fp32 partition a copy of the fp32 parameters too
//       and copies it back after the step, 40.
// The peer is skipped, with a line saying why, when --peer=none, when it is
// not there, or when it cannot run (missing packages: tools/setup.sh).
#include <fcntl.h>
#include <immintrin.h>
#include <limits.h>
#include <signal.h>
#include <spawn.h>
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
#include <memory>
#include <string>
#include <vector>

#include "absl/base/casts.h"
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
  int rounds = 3;    // each times our cases, each beside its peer's
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

// The arrays a case's step reads and writes.
struct Arrays {
  float* p;
  float* m;
  float* v;
  const float* g32;
  const uint16_t* g16;
  uint16_t* w16;
  float* w32;
  size_t n;
};

// `n` values of T on page boundaries (uninitialised: every array is filled
// before use).
template <typename T>
class PageArray {
 public:
  explicit PageArray(size_t n)
      : memory_(static_cast<T*>(std::aligned_alloc(4096, (n * sizeof(T) + 4095) / 4096 * 4096)),
                &std::free) {
    if (memory_ == nullptr) {
      std::fprintf(stderr, "out of memory for %zu values\n", n);
      std::exit(1);
    }
  }
  T* data() const { return memory_.get(); }

 private:
  std::unique_ptr<T, decltype(&std::free)> memory_;
};

// The working copy a case writes beside the master weights.
enum class Copy { kNone, kBf16, kFp32 };

// Keeps `x` (a value nothing else reads) from being optimized away.
template <typename T>
void Keep(T x) {
  asm volatile("" : : "r"(x));
}

// The pre-scan's pass over a range of the gradients: plain C++ (the
// compiler's vectors for this target).
template <bool kBf16Grads>
void ScanRange(const Arrays& a, size_t begin, size_t end) {
  uint32_t any = 0;
  for (size_t i = begin; i != end; ++i) {
    any |= kBf16Grads ? a.g16[i] : absl::bit_cast<uint32_t>(a.g32[i]);
  }
  Keep(any);
}

// The same with AVX-512.
template <bool kBf16Grads>
__attribute__((target("avx512f"))) void ScanRange512(const Arrays& a, size_t begin, size_t end) {
  const size_t whole = begin + (end - begin) / 16 * 16;
  __m512i any = _mm512_setzero_si512();
  for (size_t i = begin; i != whole; i += 16) {
    any = _mm512_or_si512(any, kBf16Grads ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                reinterpret_cast<const __m256i*>(a.g16 + i)))
                                          : _mm512_castps_si512(_mm512_loadu_ps(a.g32 + i)));
  }
  Keep(_mm512_reduce_or_epi32(any));
  if (whole != end) ScanRange<kBf16Grads>(a, whole, end);
}

// One range of a case's update traffic without its arithmetic: plain C++,
// for machines without AVX-512.
template <bool kBf16Grads>
void UpdateRange(const Arrays& a, size_t begin, size_t end, Copy copy) {
  float* __restrict p = a.p;
  float* __restrict m = a.m;
  float* __restrict v = a.v;
  const float* __restrict g32 = a.g32;
  const uint16_t* __restrict g16 = a.g16;
  for (size_t i = begin; i != end; ++i) {
    const float g =
        kBf16Grads ? absl::bit_cast<float>(static_cast<uint32_t>(g16[i]) << 16) : g32[i];
    p[i] = p[i] - 1e-30f * g;
    m[i] = m[i] + 0.0f * g;
    v[i] = v[i] + 0.0f * g;
  }
  if (copy == Copy::kFp32) {
    for (size_t i = begin; i != end; ++i) {
      _mm_stream_si32(reinterpret_cast<int*>(a.w32 + i), absl::bit_cast<int>(p[i]));
    }
    _mm_sfence();
  } else if (copy == Copy::kBf16) {
    size_t i = begin;
    for (; i + 1 < end; i += 2) {
      const uint32_t pair = (absl::bit_cast<uint32_t>(p[i]) >> 16) |
                            (absl::bit_cast<uint32_t>(p[i + 1]) & 0xffff0000u);
      _mm_stream_si32(reinterpret_cast<int*>(a.w16 + i), static_cast<int>(pair));
    }
    if (i < end) a.w16[i] = static_cast<uint16_t>(absl::bit_cast<uint32_t>(p[i]) >> 16);
    _mm_sfence();
  }
}

// The same with AVX-512, 16 lanes as the Adam kernel moves them. The
// working copy's stores are non-temporal (16 bytes at a time): ranges
// start on whole blocks of kStreamBlock values, so they stay aligned.
template <bool kBf16Grads>
__attribute__((target("avx512f"))) void UpdateRange512(const Arrays& a, size_t begin, size_t end,
                                                       Copy copy) {
  const size_t whole = begin + (end - begin) / 16 * 16;
  const __m512 tiny = _mm512_set1_ps(1e-30f), zero = _mm512_setzero_ps();
  const bool stream_copy = copy == Copy::kFp32
                               ? reinterpret_cast<uintptr_t>(a.w32 + begin) % 64 == 0
                               : reinterpret_cast<uintptr_t>(a.w16 + begin) % 16 == 0;
  for (size_t i = begin; i != whole; i += 16) {
    const __m512 g = kBf16Grads ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                      _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                          reinterpret_cast<const __m256i*>(a.g16 + i))),
                                      16))
                                : _mm512_loadu_ps(a.g32 + i);
    const __m512 p = _mm512_sub_ps(_mm512_loadu_ps(a.p + i), _mm512_mul_ps(tiny, g));
    _mm512_storeu_ps(a.p + i, p);
    _mm512_storeu_ps(a.m + i, _mm512_fmadd_ps(zero, g, _mm512_loadu_ps(a.m + i)));
    _mm512_storeu_ps(a.v + i, _mm512_fmadd_ps(zero, g, _mm512_loadu_ps(a.v + i)));
    if (copy == Copy::kFp32) {
      if (stream_copy) {
        _mm512_stream_ps(a.w32 + i, p);
      } else {
        _mm512_storeu_ps(a.w32 + i, p);
      }
    } else if (copy == Copy::kBf16) {
      const __m256i w = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16));
      if (stream_copy) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(a.w16 + i), _mm256_castsi256_si128(w));
        _mm_stream_si128(reinterpret_cast<__m128i*>(a.w16 + i + 8), _mm256_extracti128_si256(w, 1));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.w16 + i), w);
      }
    }
  }
  if (copy != Copy::kNone) _mm_sfence();
  if (whole != end) UpdateRange<kBf16Grads>(a, whole, end, copy);
}

constexpr size_t kStreamBlock = 32;  // values: 64 bytes of a bf16 working copy, 128 of fp32

// Which path the streams take on this machine (printed with the results).
bool StreamHasAvx512() {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  return avx512;
}

// One pass of a case's memory traffic without its arithmetic (see the top
// of this file): what its bound is measured by. The pre-scan, as the
// optimizer's, is a pass of its own over all the gradients first.
void StreamPass(tbb::task_arena& arena, DType grad, Copy copy, bool prescan, const Arrays& a) {
  const bool avx512 = StreamHasAvx512();
  const bool bf16 = grad != DType::kFp32;
  auto blocks = [&](auto&& fn) {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, (a.n + kStreamBlock - 1) / kStreamBlock, 2048),
                      [&](const auto& r) {
                        fn(kStreamBlock * r.begin(), std::min(a.n, kStreamBlock * r.end()));
                      });
  };
  arena.execute([&] {
    if (prescan) {
      blocks([&](size_t begin, size_t end) {
        if (avx512) {
          bf16 ? ScanRange512<true>(a, begin, end) : ScanRange512<false>(a, begin, end);
        } else {
          bf16 ? ScanRange<true>(a, begin, end) : ScanRange<false>(a, begin, end);
        }
      });
    }
    blocks([&](size_t begin, size_t end) {
      if (avx512) {
        bf16 ? UpdateRange512<true>(a, begin, end, copy)
             : UpdateRange512<false>(a, begin, end, copy);
      } else {
        bf16 ? UpdateRange<true>(a, begin, end, copy) : UpdateRange<false>(a, begin, end, copy);
      }
    });
  });
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

// The peer's cases, as benches/ds_peer.py names them.
struct PeerCase {
  const char* name;   // ds_peer.py's CASE
  const char* label;  // our table's row
  double bytes;       // per parameter
};

constexpr PeerCase kPeerCases[] = {
    {"fp32", "DeepSpeed fp32 (peer)", 28},
    {"bf16", "DeepSpeed bf16 params+grads (peer)", 22},
    {"zero3", "DeepSpeed ZeRO-3 step (peer)", 36},
    {"zero3_fp32", "DeepSpeed ZeRO-3 fp32 step (peer)", 40},
};
constexpr int kPeerFp32 = 0;
constexpr int kPeerBf16 = 1;
constexpr int kPeerZero3 = 2;      // ZeRO-3's step (benches/ds_peer.py), bf16
constexpr int kPeerZero3Fp32 = 3;  // the same, fp32
constexpr int kNoPeer = -1;

using PeerRates = std::array<double, std::size(kPeerCases)>;  // params/s

struct Case {
  const char* name;
  DType grad;
  Copy copy;
  bool check_finite;
  double bytes;      // per parameter, as in the header comment
  int peer;          // the kPeerCases entry it is compared with, or kNoPeer
  const char* mark;  // "" the same work; "*" not; "z" each side's ZeRO-3 step
};

constexpr Case kCases[] = {
    {"fp32 grads", DType::kFp32, Copy::kNone, false, 28, kPeerFp32, ""},
    {"fp32 grads + fp32 copy", DType::kFp32, Copy::kFp32, false, 36, kPeerZero3Fp32, "z"},
    {"fp32 grads + bf16 copy", DType::kFp32, Copy::kBf16, false, 32, kNoPeer, ""},
    {"bf16 grads", DType::kBf16, Copy::kNone, false, 26, kPeerBf16, "*"},
    {"bf16 grads + bf16 copy", DType::kBf16, Copy::kBf16, false, 30, kPeerZero3, "z"},
    {"bf16 grads + copy + finite check", DType::kBf16, Copy::kBf16, true, 32, kNoPeer, ""},
};

// A case's bytes per parameter: its `bytes` (the copy with its allocate
// read), less that read where the kernel writes the copy around the cache.
double CaseBytes(const Case& c, bool copy_streams) {
  if (!copy_streams || c.copy == Copy::kNone) return c.bytes;
  return c.bytes - (c.copy == Copy::kFp32 ? 4 : 2);
}

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

// The peer's cases (benches/ds_peer.py) in one child process for one size
// and thread count: each Measure times one case there, the best of `reps`
// steps after one, so that the bench can time each of its cases and the
// matching one of the peer back to back.
class PeerServer {
 public:
  // Starts ds_peer.py with OMP_NUM_THREADS=threads and waits for it to be
  // ready (it has built or loaded the peer's op).
  static absl::StatusOr<std::unique_ptr<PeerServer>> Start(const std::string& dir, size_t n,
                                                           int threads) {
    const char* python = std::getenv("PYTHON");  // as run.sh honours it (PATH searched)
    const std::string interpreter =
        python != nullptr && *python != '\0' ? python : "/usr/bin/python3";
    const std::string script = RepoRoot() + "/benches/ds_peer.py";
    // Everything the child needs is built before it starts.
    const std::vector<std::string> args = {interpreter, script, "--peer=" + dir,
                                           absl::StrCat("--n=", n),
                                           absl::StrCat("--threads=", threads)};
    std::vector<std::string> env = {absl::StrCat("OMP_NUM_THREADS=", threads)};
    for (char** e = environ; *e != nullptr; ++e) {
      if (!absl::StartsWith(*e, "OMP_NUM_THREADS=")) env.push_back(*e);
    }
    auto pointers = [](const std::vector<std::string>& v) {
      std::vector<char*> p;
      for (const std::string& s : v) p.push_back(const_cast<char*>(s.c_str()));
      p.push_back(nullptr);
      return p;
    };
    std::vector<char*> argv = pointers(args), envp = pointers(env);
    int to_child[2], from_child[2];
    if (pipe2(to_child, O_CLOEXEC) != 0) return absl::InternalError(std::strerror(errno));
    if (pipe2(from_child, O_CLOEXEC) != 0) {
      const int err = errno;
      close(to_child[0]);
      close(to_child[1]);
      return absl::InternalError(std::strerror(err));
    }
    // The child's stdin, stdout and stderr (dup2 clears close-on-exec).
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], 2);
    // SIGPIPE as the child would have it by default (this process ignores it).
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t default_signals;
    sigemptyset(&default_signals);
    sigaddset(&default_signals, SIGPIPE);
    posix_spawnattr_setsigdefault(&attr, &default_signals);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF);
    pid_t pid = -1;
    const int spawned = posix_spawnp(&pid, argv[0], &actions, &attr, argv.data(), envp.data());
    posix_spawnattr_destroy(&attr);
    posix_spawn_file_actions_destroy(&actions);
    close(to_child[0]);
    close(from_child[1]);
    FILE* in = spawned == 0 ? fdopen(to_child[1], "w") : nullptr;
    FILE* out = spawned == 0 ? fdopen(from_child[0], "r") : nullptr;
    if (in == nullptr || out == nullptr) {
      const int err = spawned != 0 ? spawned : errno;
      if (in != nullptr) {
        std::fclose(in);
      } else {
        close(to_child[1]);
      }
      if (out != nullptr) {
        std::fclose(out);
      } else {
        close(from_child[0]);
      }
      while (spawned == 0 && waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
      }  // its stdin closed: it ends
      return absl::UnavailableError(
          absl::StrCat("starting ", interpreter, " ", script, ": ", std::strerror(err)));
    }
    auto server = std::unique_ptr<PeerServer>(new PeerServer(pid, in, out, n, threads, script));
    std::string line;
    while (server->ReadLine(&line)) {
      if (line == "ready") return server;
      server->last_other_ = line;
    }
    return server->Failed("started");
  }

  ~PeerServer() {
    std::fclose(in_);  // the child's stdin: it exits at end of input
    std::fclose(out_);
    Reap();
  }

  // Params/s of one kPeerCases entry: the best of `reps` steps after one.
  absl::StatusOr<double> Measure(int peer_case, int reps) {
    const char* name = kPeerCases[peer_case].name;
    // A peer that died fails the write (EPIPE: SIGPIPE is ignored, Main);
    // what it printed last is read to its end.
    if (std::fprintf(in_, "%s %d\n", name, reps) < 0 || std::fflush(in_) != 0) {
      std::string line;
      while (ReadLine(&line)) last_other_ = line;
      return Failed(absl::StrCat("asked for ", name));
    }
    std::string line;
    while (ReadLine(&line)) {
      // deepspeed_cpu_adam CASE n=N threads=T Gparam/s=X
      const std::vector<absl::string_view> w = absl::StrSplit(line, ' ', absl::SkipEmpty());
      double g;
      if (w.size() == 5 && w[0] == "deepspeed_cpu_adam" && w[1] == name &&
          w[2] == absl::StrCat("n=", n_) && w[3] == absl::StrCat("threads=", threads_) &&
          absl::StartsWith(w[4], "Gparam/s=") && absl::SimpleAtod(w[4].substr(9), &g) && g > 0) {
        return g * 1e9;
      }
      last_other_ = line;
      if (absl::StartsWith(line, "error ")) break;
    }
    return Failed(absl::StrCat("asked for ", name));
  }

 private:
  PeerServer(pid_t pid, FILE* in, FILE* out, size_t n, int threads, std::string script)
      : pid_(pid), in_(in), out_(out), n_(n), threads_(threads), script_(std::move(script)) {}

  bool ReadLine(std::string* line) {
    char buf[4096];
    if (std::fgets(buf, sizeof(buf), out_) == nullptr) {
      ended_ = true;  // its output closed: it has ended or is ending
      return false;
    }
    *line = std::string(absl::StripAsciiWhitespace(buf));
    return true;
  }

  // Waits for the child once (reaped_: status_ is its exit status).
  void Reap() {
    if (pid_ <= 0) return;
    pid_t got;
    while ((got = waitpid(pid_, &status_, 0)) < 0 && errno == EINTR) {
    }
    reaped_ = got == pid_;
    pid_ = -1;
  }

  // Why the peer gave no result: its last other line and, where it has
  // ended, how.
  absl::Status Failed(absl::string_view when) {
    std::string how;
    if (ended_) Reap();  // ended (a Python script does not close its output and go on)
    if (reaped_) {
      how = WIFEXITED(status_) ? absl::StrCat(" (it exited with status ", WEXITSTATUS(status_), ")")
            : WIFSIGNALED(status_) ? absl::StrCat(" (killed by signal ", WTERMSIG(status_), ")")
                                   : "";
    }
    return absl::UnavailableError(absl::StrCat(script_, " ", when, ", then gave no result", how,
                                               last_other_.empty() ? "" : ": ", last_other_));
  }

  pid_t pid_;
  FILE* in_;
  FILE* out_;
  size_t n_;
  int threads_;
  std::string script_;
  int status_ = 0;          // the child's, once reaped
  bool ended_ = false;      // its output reached its end
  bool reaped_ = false;     // status_ is its exit status
  std::string last_other_;  // the last line that was not a result (an error)
};

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
  // The harness builds the op (and says which Debian package is missing);
  // then the server times one step of each case.
  std::string last;
  FILE* pipe = popen(
      absl::StrCat(ShellQuote(dir + "/run.sh"), " --n 1000 --threads 1 --reps 1 --cases fp32 2>&1")
          .c_str(),
      "r");
  char buf2[4096];
  while (pipe != nullptr && std::fgets(buf2, sizeof(buf2), pipe) != nullptr) {
    if (!absl::StripAsciiWhitespace(buf2).empty())
      last = std::string(absl::StripAsciiWhitespace(buf2));
  }
  const int rc = pipe == nullptr ? -1 : pclose(pipe);
  absl::Status ok = absl::OkStatus();
  if (rc != 0) {
    ok = absl::UnavailableError(absl::StrCat(dir, "/run.sh failed: ", last));
  } else if (auto server = PeerServer::Start(dir, 1000, 1); !server.ok()) {
    ok = server.status();
  } else {
    for (size_t k = 0; k < std::size(kPeerCases) && ok.ok(); ++k) {
      ok = (*server)->Measure(static_cast<int>(k), 1).status();
    }
  }
  if (!ok.ok()) {
    std::printf("%s %s\n", skipped, std::string(ok.message()).c_str());
    *error = !f.peer.empty();
    return "";
  }
  return dir;
}

int Main(int argc, char** argv) {
  // A peer that dies fails our next write to it (EPIPE) instead of killing
  // the bench.
  signal(SIGPIPE, SIG_IGN);
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

  // Whether the kernel writes aligned working copies around the cache (the
  // AVX-512 one: cpu_adam/adam_avx512.cc).
  const bool copy_streams =
      Optimizer(OptimizerOptions{0, 1 << 16, f.kernel, false}).kernel_name() == "avx512";
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
      // On page boundaries, as the daemon's pool and arena give the kernel
      // its arrays (a vector's large block starts 16 bytes past one, so that
      // every 64-byte access would span two cache lines).
      PageArray<float> p(n), m(n), v(n), g32(n), w32(n);
      PageArray<uint16_t> g16(n), w16(n);
      {
        tbb::task_arena arena(threads);
        Fill(arena, p.data(), n, 0.5f);
        Fill(arena, m.data(), n, 0.0f);
        Fill(arena, v.data(), n, 0.0f);
        Fill(arena, g32.data(), n, 0.01f);
        Fill(arena, w32.data(), n, 0.0f);
        std::fill(g16.data(), g16.data() + n, FloatToBf16(0.01f));
        std::fill(w16.data(), w16.data() + n, 0);
      }

      // Our cases, each with its stream (its bound) and its peer's case,
      // --rounds times; each keeps its best round.
      std::vector<double> best(std::size(kCases), 1e30);         // seconds
      std::vector<double> stream_best(std::size(kCases), 1e30);  // seconds
      tbb::task_arena stream_arena(threads);
      const Arrays arrays{p.data(),   m.data(),   v.data(),   g32.data(),
                          g16.data(), w16.data(), w32.data(), n};
      PeerRates peer_rate;  // its best round per case
      peer_rate.fill(-1);
      // Per case: our rate over the peer's, each round (the two timed back
      // to back).
      std::vector<std::vector<double>> round_ratios(std::size(kCases));
      std::unique_ptr<PeerServer> server;
      if (!peer.empty()) {
        absl::StatusOr<std::unique_ptr<PeerServer>> s = PeerServer::Start(peer, n, threads);
        if (s.ok()) {
          server = *std::move(s);
        } else {
          std::printf("peer failed: %s\n", std::string(s.status().message()).c_str());
          ++failures;
        }
      }
      // The peer's rate for its case `k` this round, or -1.
      auto run_peer = [&](int k) {
        if (server == nullptr || k == kNoPeer) return -1.0;
        absl::StatusOr<double> r = server->Measure(k, f.reps);
        if (!r.ok()) {
          std::printf("peer failed: %s\n", std::string(r.status().message()).c_str());
          ++failures;
          server.reset();
          return -1.0;
        }
        peer_rate[k] = std::max(peer_rate[k], *r);
        return *r;
      };
      for (int round = 0; round < f.rounds; ++round) {
        const bool peer_first = round % 2 == 1;
        for (size_t ci = 0; ci < std::size(kCases); ++ci) {
          const Case& c = kCases[ci];
          double theirs = peer_first ? run_peer(c.peer) : -1;
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
                               c.copy == Copy::kFp32   ? static_cast<void*>(w32.data())
                               : c.copy == Copy::kBf16 ? static_cast<void*>(w16.data())
                                                       : nullptr,
                               c.copy == Copy::kFp32 ? DType::kFp32 : DType::kBf16,
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
          if (!peer_first) theirs = run_peer(c.peer);
          if (theirs > 0) round_ratios[ci].push_back(static_cast<double>(n) / t / theirs);
          stream_best[ci] =
              std::min(stream_best[ci], BestSeconds(f.reps, [&] {
                         StreamPass(stream_arena, c.grad, c.copy, c.check_finite, arrays);
                       }));
        }
      }
      server.reset();  // its memory back before the accumulation's

      // The median of a case's per-round ratios ("-" where the peer did
      // not run).
      auto median_ratio = [&](size_t ci, const char* mark) {
        std::vector<double> r = round_ratios[ci];
        if (r.empty()) return std::string("-");
        std::sort(r.begin(), r.end());
        const double mid =
            r.size() % 2 == 1 ? r[r.size() / 2] : (r[r.size() / 2 - 1] + r[r.size() / 2]) / 2;
        return absl::StrFormat("%.2fx%s", mid, mark);
      };
      // `bound`: params/s (its case's stream, or the triad's over `bytes`
      // where `by_triad`); <= 0: none.
      auto row = [&](const char* name, double rate, double bytes, double bound, bool by_triad,
                     const std::string& vs_torch, const std::string& vs_ds) {
        if (by_triad) bound = triad * 1e9 / bytes;
        char bound_text[16] = "-", share[16] = "-";
        if (bound > 0) {
          std::snprintf(bound_text, sizeof(bound_text), "%.3f", bound / 1e9);
          std::snprintf(share, sizeof(share), "%.1f%%%s", 100.0 * rate / bound,
                        by_triad ? "t" : "");
        }
        std::printf("%-12zu %-34s %9.3f %8.1f %9s %8s %10s %8s\n", n, name, rate / 1e9,
                    rate * bytes / 1e9, bound_text, share, vs_torch.c_str(), vs_ds.c_str());
      };
      for (size_t ci = 0; ci < std::size(kCases); ++ci) {
        const Case& c = kCases[ci];
        const double rate = static_cast<double>(n) / best[ci];
        char vs_torch[32] = "-";
        if (torch_rate > 0) std::snprintf(vs_torch, sizeof(vs_torch), "%.1fx", rate / torch_rate);
        row(c.name, rate, CaseBytes(c, copy_streams), static_cast<double>(n) / stream_best[ci],
            false, vs_torch, median_ratio(ci, c.mark));
      }
      for (size_t k = 0; k < std::size(kPeerCases); ++k) {
        if (peer_rate[k] <= 0) continue;
        char vs_torch[32] = "-";
        if (torch_rate > 0) {
          std::snprintf(vs_torch, sizeof(vs_torch), "%.1fx", peer_rate[k] / torch_rate);
        }
        // DeepSpeed fp32 moves what "fp32 grads" does: that case's stream.
        static_assert(kCases[0].peer == kPeerFp32 && kCases[0].mark[0] == '\0');
        const double bound = k == kPeerFp32 ? static_cast<double>(n) / stream_best[0] : -1;
        row(kPeerCases[k].label, peer_rate[k], kPeerCases[k].bytes, bound, false, vs_torch,
            "1.00x");
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
      PageArray<float> acc_array(n);
      float* const acc = acc_array.data();
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
            rate, measure ? 2 : 10, -1, true, absl::StrFormat("%.1fx", t[1] / t[0]), "-");
      }
      // Each round's ratio, so that the spread shows beside the median.
      for (size_t ci = 0; ci < std::size(kCases); ++ci) {
        if (round_ratios[ci].empty()) continue;
        std::string rounds;
        for (double r : round_ratios[ci]) absl::StrAppendFormat(&rounds, " %.2f", r);
        std::printf("%-12zu   vs DS by round, %s:%s\n", n, kCases[ci].name, rounds.c_str());
      }
    }
  }
  std::printf(
      "\nkernel %s; bound = the case's own memory traffic without its arithmetic (its stream, "
      "%s: the same arrays read, updated in place, the working copy written around the cache, "
      "the pre-scan a pass of its own), measured in the same rounds in this process; t: the "
      "triad's GB/s over the bytes per parameter instead; best of %d round%s, each the best of "
      "%d step%s after a warm-up\n",
      Optimizer(OptimizerOptions{0, 1 << 16, f.kernel, false}).kernel_name().c_str(),
      StreamHasAvx512() ? "AVX-512" : "the compiler's vectors", f.rounds, f.rounds == 1 ? "" : "s",
      f.reps, f.reps == 1 ? "" : "s");
  if (!peer.empty()) {
    std::printf(
        "vs DS: the median over the rounds of our Gparam/s over DeepSpeed cpu_adam's, each "
        "case and its peer's timed back to back, in alternating order (DeepSpeed in one "
        "process, benches/ds_peer.py, with OMP_NUM_THREADS=threads)\n"
        "  fp32 grads vs DeepSpeed fp32: the same work (fp32 params, grads and moments, in "
        "place: 28 B/param each)\n"
        "  * vs DeepSpeed bf16: not the same work: DeepSpeed's bf16 case has bf16 params and "
        "grads and no fp32 master (22 B/param);\n"
        "    ours keep an fp32 master (26 B/param)\n"
        "  z vs DeepSpeed's ZeRO-3 step: the same job, not the same bytes (fp32 master and "
        "moments updated, the working copy written): DeepSpeed's Adam on fp32\n"
        "    gradients, then torch's copy into the parameters its ZeRO-3 makes (stage3.py; "
        "benches/ds_peer.py): bf16 36 B/param, ours from bf16 gradients in one pass %d;\n"
        "    fp32 40 B/param, ours %d\n",
        copy_streams ? 28 : 30, copy_streams ? 32 : 36);
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // progress shows as it goes
  return offload::Main(argc, argv);
}
