// What the benchmarks share: timing, this process's memory figures, the
// machine's description, and fio's bandwidth for one run (the same-run
// bound the NVMe benchmarks measure themselves against).
#ifndef OFFLOADD_BENCHES_BENCH_UTIL_H_
#define OFFLOADD_BENCHES_BENCH_UTIL_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace offload {
class ConfigRegistry;
}

namespace offload::bench {

using Clock = std::chrono::steady_clock;

// The q-quantile of `v` (0 <= q <= 1: the element at rank q * (n - 1),
// rounded), 0 when `v` is empty. Reorders `v`.
template <typename T>
double Quantile(std::vector<T>& v, double q) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return static_cast<double>(v[k]);
}

double SecondsSince(Clock::time_point start);

// /proc/self/status's "kB" fields in bytes (VmRSS, VmHWM, RssAnon, ...).
std::map<std::string, uint64_t> ProcStatus();

// Resets VmHWM to the current RSS (/proc/self/clear_refs, "5").
bool ResetPeakRss();

// The first line of `path` that starts with `key`, or "?".
std::string FirstLineWith(const char* path, const char* key);

// One line: CPU model, CPUs online, load average, MemAvailable and the free
// space under `dir` (the conditions a result was measured in).
void PrintMachine(const std::string& dir);

// fio's bandwidth (bytes/s) for one sequential run in one direction over
// `size` bytes of `file` (io_uring, O_DIRECT, fixed buffers, registered
// file, request `bs`, depth `depth`), or -1 if fio failed.
double FioBandwidth(const std::string& file, bool write, uint64_t bs, int64_t depth, uint64_t size);

// Command-line flags of the benchmarks: the value of `arg` if it is
// --`name`=VALUE, else null.
const char* FlagValue(const char* arg, const char* name);
// A flag spelled as one of offloadd's tunables bound in `registry`
// (--nvme.queue_depth=64, --swapper.prefetch_bytes=1GiB: the daemon's names,
// units and ranges): set there, and true; false if `arg` names none of them.
// A value the registry refuses exits 2 with its reason.
bool TunableFlag(ConfigRegistry& registry, const char* arg);
// A positive byte size ("1GiB", "256MiB", "4096"), or exit 2 saying why.
int64_t ByteSizeOrExit(const char* text);
// A positive count with an optional decimal suffix ("400M", "1.5G", "10k"),
// or exit 2 saying why.
uint64_t CountOrExit(const char* text);

}  // namespace offload::bench

#endif  // OFFLOADD_BENCHES_BENCH_UTIL_H_
