// offloadctl doctor: judges the node offloadd runs on, or would run on,
// against the settings it would run with, and says for each finding what
// was measured and, where it matters, the exact fix. Needs no daemon: the
// settings are offloadd's defaults, a running offloadd's live ones, or the
// caller's, all by the daemon's own definitions (base/memory_options.h,
// nvme/nvme_options.h, cpu_adam/optimizer_options.h).
//
// Each check reads the node through NodeRoots (made-up /proc and /sys
// trees in tests) or takes what it cannot read there as a parameter
// (RLIMIT_MEMLOCK, the CPU's instruction sets, the GPU), so every verdict
// can be produced on any machine. The swap directory checks really try the
// directory (nvme/swap_dir_probe.h): a scratch file, O_DIRECT, one block
// through the configured I/O backend.
//
// Verdicts, and what the exit status makes of them (ExitStatus):
//   ok    nothing to do;
//   info  worth knowing, changes nothing in how offloadd runs here (no
//         CUDA in this build, no NVMe tier configured, several NUMA nodes);
//   slow  offloadd runs, slower or at risk (no huge pages, no O_DIRECT,
//         io_uring refused, DAMON sampling, a pool close to the limit): 1;
//   fail  offloadd would refuse to start or fail its first I/O (a swap
//         directory missing or full, a pool over the memory limit, an
//         instruction set the CPU lacks): 2.
//
// Thread-compatible: RunDoctor is called once per `offloadctl doctor`.
#ifndef OFFLOADD_CLIENT_DOCTOR_H_
#define OFFLOADD_CLIENT_DOCTOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/config_registry.h"
#include "base/memory_options.h"
#include "cpu_adam/optimizer_options.h"
#include "gpu/device.h"
#include "nvme/nvme_options.h"
#include "nvme/swap_dir_probe.h"

namespace offload {

// Where the node's /proc and /sys are: the real ones, or made-up trees.
struct NodeRoots {
  std::string proc = "/proc";
  std::string sys = "/sys";
};

// Ordered by severity: a report's worst verdict decides its exit status.
enum class Verdict { kOk, kInfo, kSlow, kFail };

// "ok", "info", "SLOW", "FAIL".
const char* VerdictName(Verdict verdict);

struct Check {
  std::string name;  // "DAMON", "swap space /mnt/nvme0"
  Verdict verdict = Verdict::kOk;
  std::string measured;  // what was found, with its figures
  std::string fix;       // the exact remedy; empty where there is none to take
};

// The settings offloadd would run with, as far as the checks use them:
// the same structs the daemon binds, under the same names.
struct DoctorSettings {
  // offloadd's defaults, memory.host_budget_bytes included (half of what
  // this process may use, as the daemon computes it).
  DoctorSettings();

  MemoryOptions memory;
  NvmeOptions nvme;
  OptimizerOptions optimizer;
};

// Binds the settings' fields under their daemon names ("memory.*",
// "nvme.*", "optimizer.*"), so that `--NAME=VALUE` and a daemon's live
// values parse and range-check exactly as offloadd's do.
void BindDoctorTunables(DoctorSettings* settings, ConfigRegistry* registry);

// What the checks cannot read from the trees.
struct DoctorEnvironment {
  NodeRoots roots;
  // The settings came from a running offloadd: the swap files in its own
  // swap directories (its nvme.dirs) are expected to be locked, by it.
  bool daemon_running = false;
  std::vector<std::string> daemon_swap_dirs;
  // RLIMIT_MEMLOCK's soft limit in bytes; UINT64_MAX for unlimited.
  uint64_t memlock_bytes = UINT64_MAX;
  // The Adam kernel `optimizer.kernel` resolves to on this CPU
  // (SelectAdamKernels: "avx512", "avx2", "scalar", or its refusal), and
  // the widest this CPU runs.
  std::function<absl::StatusOr<std::string>(const std::string& setting)> adam_kernel;
  std::string widest_adam_kernel = "scalar";
  // Opens the GPU the trainers' tiers would use; null in a build without
  // CUDA.
  std::function<absl::StatusOr<std::unique_ptr<gpu::Device>>()> open_gpu;
};

// This machine: /proc, /sys, getrlimit, the CPU's kernels, CUDA device 0
// where the build has CUDA.
DoctorEnvironment ThisMachine();

// The checks, one or more findings each, in the order the report prints.
Check CheckSharedHugePages(const NodeRoots& roots, const DoctorSettings& settings);
Check CheckPrivateHugePages(const NodeRoots& roots, const DoctorSettings& settings);
Check CheckDamon(const NodeRoots& roots, const DoctorSettings& settings);
Check CheckMemoryLimit(const NodeRoots& roots, const DoctorSettings& settings);
// `gpu_present`: a device opened (the trainers register arenas for DMA).
// CAP_IPC_LOCK (from <proc>/self/status) lifts the limit.
Check CheckMemlock(const NodeRoots& roots, uint64_t memlock_bytes, bool gpu_present,
                   const DoctorSettings& settings);
// Tries every directory of nvme.dirs (ProbeSwapDir) and judges it; one
// informational line where nvme.dirs is empty.
// `daemon_swap_dirs`: a running offloadd's own swap directories (a swap
// file held elsewhere is another process's).
std::vector<Check> CheckSwapDirs(const DoctorSettings& settings,
                                 const std::vector<std::string>& daemon_swap_dirs = {});
// The judgement of one directory's probe: its directory and filesystem,
// O_DIRECT, the I/O backend, and its space against nvme.bytes_per_dir.
std::vector<Check> JudgeSwapDir(const SwapDirProbe& probe, const DoctorSettings& settings,
                                bool daemon_running);
Check CheckAdamKernel(const std::string& setting, const absl::StatusOr<std::string>& chosen,
                      const std::string& widest);
Check CheckNuma(const NodeRoots& roots);
// The device (and the NVIDIA driver in <proc>/driver/nvidia/version), then
// whether a shared host mapping (as a session's arena is) can be
// registered for DMA.
std::vector<Check> CheckGpu(
    const NodeRoots& roots,
    const std::function<absl::StatusOr<std::unique_ptr<gpu::Device>>()>& open_gpu);

// Every check, in report order.
std::vector<Check> RunDoctor(const DoctorEnvironment& environment, const DoctorSettings& settings);

// 0 where nothing would fail or slow offloadd, 1 where something would
// slow it, 2 where something would make it fail.
int ExitStatus(const std::vector<Check>& checks);

// One aligned line per check: "VERDICT  name  measured[; fix: ...]", and a
// summary line naming the counts and the exit status.
std::string FormatReport(const std::vector<Check>& checks);

}  // namespace offload

#endif  // OFFLOADD_CLIENT_DOCTOR_H_
