#include "client/doctor.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/host_memory.h"
#include "base/memory_limit.h"
#include "base/unique_fd.h"
#include "client/human.h"
#include "cpu_adam/kernel_select.h"
#include "gpu/cuda_device.h"

namespace offload {
namespace {

constexpr char kThp[] = "/sys/kernel/mm/transparent_hugepage";

// The first line of `path`; empty where it cannot be read.
std::string FirstLine(const std::string& path) {
  std::string line;
  std::getline(std::ifstream(path), line);
  return line;
}

bool NvmeTier(const DoctorSettings& s) { return !s.nvme.DirList().empty(); }

// "[never]" for a control's selected mode, "missing" where there is none.
std::string Mode(const std::string& mode) { return mode.empty() ? "missing" : "[" + mode + "]"; }

Check Make(std::string name, Verdict verdict, std::string measured, std::string fix = "") {
  return Check{std::move(name), verdict, std::move(measured), std::move(fix)};
}

}  // namespace

const char* VerdictName(Verdict verdict) {
  switch (verdict) {
    case Verdict::kOk:
      return "ok";
    case Verdict::kInfo:
      return "info";
    case Verdict::kSlow:
      return "SLOW";
    case Verdict::kFail:
      return "FAIL";
  }
  return "?";
}

DoctorSettings::DoctorSettings() {
  memory.host_budget_bytes = DefaultHostBudgetBytes(ReadMemoryLimit());
}

void BindDoctorTunables(DoctorSettings* s, ConfigRegistry* r) {
  BindMemoryTunables(&s->memory, r);
  BindNvmeTunables(&s->nvme, r);
  BindOptimizerTunables(&s->optimizer, r);
}

DoctorEnvironment ThisMachine() {
  DoctorEnvironment e;
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) == 0) {
    e.memlock_bytes = limit.rlim_cur == RLIM_INFINITY ? UINT64_MAX : limit.rlim_cur;
  }
  e.adam_kernel = [](const std::string& setting) -> absl::StatusOr<std::string> {
    absl::StatusOr<const AdamKernels*> k = SelectAdamKernels(setting);
    if (!k.ok()) return k.status();
    return std::string((*k)->name);
  };
  e.widest_adam_kernel = SupportedAdamKernels().back()->name;
  if (gpu::BuiltWithCuda()) e.open_gpu = [] { return gpu::OpenCudaDevice(0); };
  return e;
}

Check CheckSharedHugePages(const NodeRoots& roots, const DoctorSettings& s) {
  const std::string name = "shmem huge pages";
  const std::string mode = Mode(TransparentHugePageMode(roots.sys, "shmem_enabled"));
  const uint64_t huge = SharedHugePageBytesIn(roots.sys);
  const std::string fix =
      absl::StrCat("as root, before offloadd starts: echo advise > ", kThp, "/shmem_enabled");
  if (huge != 0) {
    return Make(
        name, Verdict::kOk,
        absl::StrCat("shmem_enabled ", mode, ": session arenas on ", HumanBytes(huge), " pages",
                     s.memory.arena_huge_pages ? "" : " (memory.arena_huge_pages is off)"));
  }
  if (!s.memory.arena_huge_pages) {
    return Make(name, Verdict::kInfo,
                absl::StrCat("shmem_enabled ", mode,
                             "; memory.arena_huge_pages is off: arenas on 4 KiB pages anyway"));
  }
  const std::string measured =
      absl::StrCat("shmem_enabled ", mode, ": session arenas on 4 KiB pages");
  if (NvmeTier(s)) {
    return Make(name, Verdict::kSlow,
                absl::StrCat(measured,
                             "; parameters and gradients on NVMe are swapped through them (ZeRO-3 "
                             "passes 1.4-6.3x slower, benches/RESULTS.md trace_replay)"),
                fix);
  }
  return Make(name, Verdict::kInfo,
              absl::StrCat(measured,
                           "; matters once nvme.dirs puts parameters or gradients on "
                           "NVMe, and each trainer faults per 4 KiB page"),
              fix);
}

Check CheckPrivateHugePages(const NodeRoots& roots, const DoctorSettings& s) {
  const std::string name = "anon huge pages";
  const std::string mode = Mode(TransparentHugePageMode(roots.sys, "enabled"));
  const uint64_t huge = PrivateHugePageBytesIn(roots.sys);
  if (huge != 0) {
    return Make(name, Verdict::kOk,
                absl::StrCat("enabled ", mode, ": host pool and I/O staging may get ",
                             HumanBytes(huge), " pages"));
  }
  const std::string fix =
      absl::StrCat("as root, before offloadd starts: echo madvise > ", kThp, "/enabled");
  const std::string measured =
      absl::StrCat("enabled ", mode, ": host pool and I/O staging on 4 KiB pages");
  if (NvmeTier(s)) {
    return Make(name, Verdict::kSlow,
                absl::StrCat(measured,
                             "; blocks read in from NVMe land on them (a step with optimizer "
                             "state on NVMe took 3.8-4.4x as long, benches/RESULTS.md "
                             "step_overlap)"),
                fix);
  }
  return Make(name, Verdict::kInfo,
              absl::StrCat(measured, "; with state on the host only, the two measured alike"), fix);
}

Check CheckDamon(const NodeRoots& roots, const DoctorSettings& s) {
  const std::string name = "DAMON";
  const std::vector<std::string> monitors =
      DamonMonitorsIn(roots.proc, roots.sys + "/kernel/mm/damon/admin/kdamonds");
  absl::StatusOr<HostHomePages> pages = ResolveHostHomePages(s.memory.host_home_pages, monitors);
  if (!pages.ok()) {
    return Make(name, Verdict::kFail, std::string(pages.status().message()),
                "set memory.host_home_pages to auto, huge or small");
  }
  if (monitors.empty()) return Make(name, Verdict::kOk, "no kdamond thread runs");
  const std::string fix =
      "stop the monitor, as root: echo off > /sys/kernel/mm/damon/admin/kdamonds/N/state (one "
      "DAMON_RECLAIM started: echo N > /sys/module/damon_reclaim/parameters/enabled; "
      "damon_lru_sort likewise)";
  const std::string running = absl::StrCat(absl::StrJoin(monitors, ", "), " sampling");
  if (pages->pages == Pages::kHuge) {
    return Make(name, Verdict::kSlow,
                absl::StrCat(running,
                             "; host pool on huge pages (memory.host_home_pages huge): passes "
                             "stalled 2-7x around its rounds (benches/RESULTS.md step_overlap)"),
                fix);
  }
  if (NvmeTier(s)) {
    return Make(name, Verdict::kSlow,
                absl::StrCat(running,
                             "; host pool on 4 KiB pages, but blocks from NVMe still come in on "
                             "huge ones, whose passes stalled 2-7x around its rounds"),
                fix);
  }
  return Make(name, Verdict::kInfo,
              absl::StrCat(running, "; host pool on 4 KiB pages (memory.host_home_pages ",
                           s.memory.host_home_pages,
                           "): updates ran 1.05-1.11x the bound on them, against 1.22-1.57x on "
                           "huge pages (benches/RESULTS.md step_overlap)"),
              fix);
}

Check CheckMemoryLimit(const NodeRoots& roots, const DoctorSettings& s) {
  const std::string name = "memory limit";
  const MemoryLimit limit = ReadMemoryLimitIn(roots.proc, roots.sys);
  const uint64_t most = limit.effective();
  const auto budget = static_cast<uint64_t>(s.memory.host_budget_bytes);
  const bool cgroup = limit.cgroup != 0 && limit.cgroup < limit.physical;
  const std::string where = cgroup ? absl::StrCat("the cgroup limit in ", limit.cgroup_file)
                                   : std::string("physical memory");
  const std::string measured = absl::StrCat("memory.host_budget_bytes ", HumanBytes(budget), " of ",
                                            HumanBytes(most), " (", where, ")");
  const std::string fix = absl::StrCat(
      "lower memory.host_budget_bytes (offloadd's default is half: ",
      FormatByteSize(DefaultHostBudgetBytes(limit)), ")",
      cgroup ? ", or raise the cgroup's limit (MemoryMax= of its unit, docker --memory)" : "");
  if (most == 0) return Make(name, Verdict::kInfo, "neither physical memory nor a limit is known");
  if (absl::Status ok = CheckHostBudget(s.memory.host_budget_bytes, limit); !ok.ok()) {
    return Make(name, Verdict::kFail, absl::StrCat(measured, ": offloadd refuses to start"), fix);
  }
  if (budget > most / 10 * 9) {
    return Make(name, Verdict::kSlow,
                absl::StrCat(measured, ": leaves ", HumanBytes(most - budget),
                             " for offloadd's threads, staging and the page cache; the OOM killer "
                             "ends offloadd instead of a registration failing"),
                fix);
  }
  return Make(name, Verdict::kOk, measured);
}

Check CheckMemlock(const NodeRoots& roots, uint64_t memlock_bytes, bool gpu_present,
                   const DoctorSettings& s) {
  const std::string name = "RLIMIT_MEMLOCK";
  if (memlock_bytes == UINT64_MAX) return Make(name, Verdict::kOk, "unlimited");
  // CapEff's bit 14: CAP_IPC_LOCK, under which the limit is not enforced.
  std::ifstream status(roots.proc + "/self/status");
  for (std::string line; std::getline(status, line);) {
    if (!absl::StartsWith(line, "CapEff:")) continue;
    const uint64_t caps = std::strtoull(line.c_str() + 7, nullptr, 16);
    if ((caps >> 14 & 1) != 0) {
      return Make(name, Verdict::kOk,
                  absl::StrCat(HumanBytes(memlock_bytes), ", not enforced (CAP_IPC_LOCK)"));
    }
  }
  const auto budget = static_cast<uint64_t>(s.memory.host_budget_bytes);
  const std::string fix = absl::StrCat(
      "raise it to at least ", FormatByteSize(s.memory.host_budget_bytes),
      " or unlimited for offloadd and the trainers: ulimit -l unlimited, LimitMEMLOCK=infinity in "
      "a systemd unit, docker run --ulimit memlock=-1, or a memlock line in "
      "/etc/security/limits.conf");
  if (s.memory.lock_pool && memlock_bytes < budget) {
    return Make(name, Verdict::kSlow,
                absl::StrCat(HumanBytes(memlock_bytes), ": memory.lock_pool is on but the pool (",
                             HumanBytes(budget), ") cannot be locked, and may be swapped out"),
                fix);
  }
  if (gpu_present && memlock_bytes < budget) {
    return Make(name, Verdict::kSlow,
                absl::StrCat(HumanBytes(memlock_bytes),
                             ": trainers cannot register their arenas (up to the pool, ",
                             HumanBytes(budget), ") for DMA; GPU copies are staged instead"),
                fix);
  }
  return Make(
      name, Verdict::kOk,
      absl::StrCat(HumanBytes(memlock_bytes), " (nothing locks the pool",
                   gpu_present ? "" : ", no GPU registers it",
                   NvmeTier(s) ? "; io_uring registers staging as fixed buffers within it" : "",
                   ")"));
}

std::vector<Check> JudgeSwapDir(const SwapDirProbe& p, const DoctorSettings& s,
                                bool daemon_running) {
  std::vector<Check> out;
  const std::string other =
      "put nvme.dirs on a local NVMe filesystem that takes O_DIRECT (ext4, xfs)";
  if (!p.usable.ok()) {
    out.push_back(Make(absl::StrCat("swap dir ", p.dir), Verdict::kFail,
                       absl::StrCat(p.usable.message(), ": offloadd fails to start"),
                       absl::StrCat("mkdir -p ", p.dir,
                                    " writable by offloadd's user, or change "
                                    "nvme.dirs")));
    return out;
  }
  // The directory and its filesystem.
  {
    const std::string name = absl::StrCat("swap dir ", p.dir);
    static const char* kRemote[] = {"nfs", "cifs", "smb2", "fuse", "9p", "ceph", "lustre", "gpfs"};
    const bool remote = std::any_of(std::begin(kRemote), std::end(kRemote),
                                    [&](const char* fs) { return p.filesystem == fs; });
    std::string measured = absl::StrCat(p.filesystem, ", writable");
    if (p.swap_file_locked) {
      absl::StrAppend(&measured, "; offloadd.swap is locked by ",
                      daemon_running ? "the running offloadd" : "another process");
    }
    if (p.swap_file_locked && !daemon_running) {
      out.push_back(Make(name, Verdict::kFail,
                         absl::StrCat(measured, ": a second offloadd cannot use it"),
                         "stop the offloadd that holds it, or give this one other nvme.dirs"));
    } else if (p.in_memory) {
      out.push_back(Make(name, Verdict::kSlow,
                         absl::StrCat(measured,
                                      ": a filesystem in memory, so the NVMe tier would take host "
                                      "memory"),
                         other));
    } else if (remote) {
      out.push_back(Make(name, Verdict::kSlow,
                         absl::StrCat(measured, ": a network or user-space filesystem"), other));
    } else {
      out.push_back(Make(name, Verdict::kOk, measured));
    }
  }
  // O_DIRECT.
  {
    const std::string name = absl::StrCat("O_DIRECT ", p.dir);
    if (p.direct) {
      out.push_back(
          Make(name, Verdict::kOk, absl::StrCat("opened, alignment ", p.direct_alignment, " B")));
    } else if (!s.nvme.direct_io) {
      out.push_back(Make(name, Verdict::kInfo,
                         "not tried: nvme.direct_io is off (swap I/O through the page cache)",
                         "set nvme.direct_io=true"));
    } else {
      out.push_back(Make(name, Verdict::kSlow,
                         absl::StrCat(p.filesystem,
                                      " refuses it: swap I/O goes through the page cache (copies, "
                                      "and memory beside the pool)"),
                         other));
    }
  }
  // The I/O backend.
  {
    const std::string name = absl::StrCat(p.backend.empty() ? "I/O" : p.backend, " ", p.dir);
    const std::string did =
        absl::StrCat("wrote and read back ", HumanBytes(p.io_bytes), p.direct ? " directly" : "");
    const std::string uring_fix =
        "allow io_uring: as root, sysctl kernel.io_uring_disabled=0; in a container, a seccomp "
        "profile that permits io_uring_setup, io_uring_enter and io_uring_register";
    if (p.io.ok()) {
      out.push_back(Make(name, p.backend == "posix" ? Verdict::kInfo : Verdict::kOk,
                         p.backend == "posix" ? absl::StrCat(did, " (nvme.backend is posix)") : did,
                         p.backend == "posix" ? "set nvme.backend=auto for io_uring" : ""));
    } else if (p.io.code() == absl::StatusCode::kFailedPrecondition && p.backend == "io_uring") {
      const bool asked = s.nvme.io.backend == "io_uring";
      out.push_back(
          Make(name, asked ? Verdict::kFail : Verdict::kSlow,
               absl::StrCat("unavailable (", p.io.message(), "): ",
                            asked ? "nvme.backend is io_uring, so offloadd fails to start"
                                  : "offloadd falls back to the pread/pwrite thread pool"),
               uring_fix));
    } else {
      out.push_back(Make(name, Verdict::kFail,
                         absl::StrCat("a block written and read back failed: ", p.io.ToString()),
                         "check the device (dmesg) and the filesystem"));
    }
  }
  // Space against nvme.bytes_per_dir (SwapSpace::Create truncates and
  // reuses an offloadd.swap of a stopped daemon; a running one's is its).
  {
    const std::string name = absl::StrCat("swap space ", p.dir);
    const uint64_t align = std::max<uint64_t>(p.direct_alignment, 512);
    const uint64_t need = static_cast<uint64_t>(s.nvme.bytes_per_dir) / align * align;
    if (p.swap_file_locked && daemon_running) {
      out.push_back(Make(name, Verdict::kOk,
                         absl::StrCat("the running offloadd holds ", HumanBytes(p.swap_file_bytes),
                                      "; ", HumanBytes(p.free_bytes),
                                      " more free (nvme.bytes_per_dir ", HumanBytes(need), ")")));
    } else {
      const uint64_t have = p.free_bytes + p.swap_file_bytes;
      const std::string measured =
          absl::StrCat(HumanBytes(p.free_bytes), " free",
                       p.swap_file_bytes != 0
                           ? absl::StrCat(" + ", HumanBytes(p.swap_file_bytes), " offloadd.swap")
                           : "",
                       " for nvme.bytes_per_dir ", HumanBytes(need));
      if (have < need) {
        out.push_back(
            Make(name, Verdict::kFail,
                 absl::StrCat(measured, ": preallocation fails, offloadd does not start"),
                 absl::StrCat("free space there, or set nvme.bytes_per_dir to at most ",
                              FormatByteSize(static_cast<int64_t>(have / (1 << 20) * (1 << 20))))));
      } else {
        out.push_back(Make(name, Verdict::kOk, measured));
      }
    }
  }
  return out;
}

std::vector<Check> CheckSwapDirs(const DoctorSettings& s,
                                 const std::vector<std::string>& daemon_swap_dirs) {
  const std::vector<std::string> dirs = s.nvme.DirList();
  if (dirs.empty()) {
    return {Make("swap dirs", Verdict::kInfo, "nvme.dirs is empty: no NVMe tier",
                 "--nvme.dirs=DIR[,DIR...] to try swap directories")};
  }
  std::vector<Check> out;
  for (const std::string& dir : dirs) {
    // (Only the running offloadd's own directories hold its swap files.)
    const bool its_own =
        std::find(daemon_swap_dirs.begin(), daemon_swap_dirs.end(), dir) != daemon_swap_dirs.end();
    std::vector<Check> one = JudgeSwapDir(ProbeSwapDir(dir, s.nvme), s, its_own);
    out.insert(out.end(), one.begin(), one.end());
  }
  return out;
}

Check CheckAdamKernel(const std::string& setting, const absl::StatusOr<std::string>& chosen,
                      const std::string& widest) {
  const std::string name = "Adam kernel";
  if (!chosen.ok()) {
    return Make(name, Verdict::kFail,
                absl::StrCat("optimizer.kernel ", setting, ": ", chosen.status().message()),
                "set optimizer.kernel=auto");
  }
  if (*chosen == "scalar" && widest == "scalar") {
    return Make(name, Verdict::kSlow, "scalar: this CPU has no AVX2/FMA/F16C",
                "a CPU with AVX2, FMA and F16C (in a VM: pass the host's CPU model, e.g. QEMU "
                "-cpu host)");
  }
  if (*chosen != widest) {
    return Make(
        name, Verdict::kSlow,
        absl::StrCat(*chosen, " (optimizer.kernel ", setting, ") where this CPU runs ", widest),
        "set optimizer.kernel=auto");
  }
  return Make(name, Verdict::kOk,
              absl::StrCat(*chosen, " (optimizer.kernel ", setting, "; the widest this CPU has)"));
}

Check CheckNuma(const NodeRoots& roots) {
  const std::string name = "NUMA";
  std::map<int, std::string> nodes;  // by number
  std::error_code error;
  const std::string dir = roots.sys + "/devices/system/node";
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string file = entry.path().filename().string();
    absl::string_view number = file;
    int n = 0;
    if (!absl::ConsumePrefix(&number, "node") || !absl::SimpleAtoi(number, &n)) continue;
    // "Node 0 MemTotal:       16318420 kB"
    uint64_t kib = 0;
    std::ifstream meminfo(entry.path() / "meminfo");
    for (std::string line; kib == 0 && std::getline(meminfo, line);) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() >= 4 && f[2] == "MemTotal:") (void)absl::SimpleAtoi(f[3], &kib);
    }
    nodes[n] = absl::StrCat("node", n, " (cpus ", FirstLine((entry.path() / "cpulist").string()),
                            ", ", HumanBytes(kib << 10), ")");
  }
  if (nodes.empty()) return Make(name, Verdict::kOk, "no NUMA topology (one node)");
  std::vector<std::string> described;
  for (const auto& [n, text] : nodes) described.push_back(text);
  if (nodes.size() == 1) return Make(name, Verdict::kOk, absl::StrCat("one node: ", described[0]));
  return Make(name, Verdict::kInfo,
              absl::StrCat(nodes.size(), " nodes: ", absl::StrJoin(described, ", "),
                           "; offloadd places nothing by node (pages land where first touched, "
                           "optimizer threads span all nodes)"),
              "to spread the pool over every node's memory: numactl --interleave=all offloadd "
              "... (not measured by this project)");
}

std::vector<Check> CheckGpu(
    const NodeRoots& roots,
    const std::function<absl::StatusOr<std::unique_ptr<gpu::Device>>()>& open_gpu) {
  // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ...", or
  // the open modules' "... NVIDIA UNIX Open Kernel Module for x86_64  580.82.07  Release
  // Build ...": the version is the first word after "Kernel Module" that
  // starts with a digit.
  std::string driver;
  const std::string nvrm = FirstLine(roots.proc + "/driver/nvidia/version");
  if (const size_t at = nvrm.find("Kernel Module"); at != std::string::npos) {
    for (absl::string_view word :
         absl::StrSplit(nvrm.substr(at + 13), ' ', absl::SkipWhitespace())) {
      if (absl::ascii_isdigit(static_cast<unsigned char>(word[0]))) {
        driver = absl::StrCat("NVIDIA driver ", word);
        break;
      }
    }
  }
  if (driver.empty() && !nvrm.empty()) driver = "NVIDIA driver loaded";
  if (!open_gpu) {
    return {Make(
        "GPU", Verdict::kInfo,
        driver.empty() ? "no CUDA in this build, no NVIDIA driver"
                       : absl::StrCat("no CUDA in this build; ", driver),
        driver.empty() ? "" : "rebuild with the CUDA toolkit (bazel/cuda.bzl) for the GPU tier")};
  }
  absl::StatusOr<std::unique_ptr<gpu::Device>> device = open_gpu();
  if (!device.ok()) {
    return {Make("GPU", Verdict::kInfo,
                 absl::StrCat("no device: ", device.status().message(),
                              driver.empty() ? "" : absl::StrCat(" (", driver, ")")))};
  }
  std::vector<Check> out;
  absl::StatusOr<uint64_t> free = (*device)->FreeBytes();
  out.push_back(
      Make("GPU", Verdict::kOk,
           absl::StrCat((*device)->name(), driver.empty() ? "" : ", ", driver,
                        free.ok() ? absl::StrCat(", ", HumanBytes(*free), " free") : "")));
  // A shared mapping of a memfd, as a session's arena is, registered for
  // DMA as a trainer's GPU tier registers its arena.
  const uint64_t bytes = uint64_t{2} << 20;
  absl::Status registered;
  UniqueFd fd(memfd_create("offloadd-doctor", MFD_CLOEXEC));
  if (!fd.valid() || ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    registered = absl::InternalError(absl::StrCat("memfd_create: ", strerror(errno)));
  } else if (absl::StatusOr<HostMemory> m = HostMemory::MapShared(fd.get(), 0, bytes); !m.ok()) {
    registered = m.status();
  } else {
    std::fill_n(m->data(), bytes, std::byte{0});
    absl::StatusOr<gpu::HostRegistration> r = (*device)->RegisterHost(m->data(), bytes);
    registered = r.status();
  }
  if (registered.ok()) {
    out.push_back(
        Make("GPU DMA", Verdict::kOk,
             absl::StrCat("a ", HumanBytes(bytes), " shared mapping registered for DMA")));
  } else {
    out.push_back(
        Make("GPU DMA", Verdict::kSlow,
             absl::StrCat("a ", HumanBytes(bytes), " shared mapping cannot be registered (",
                          registered.message(), "): GPU copies are staged"),
             "raise RLIMIT_MEMLOCK for the trainers (ulimit -l unlimited)"));
  }
  return out;
}

std::vector<Check> RunDoctor(const DoctorEnvironment& e, const DoctorSettings& s) {
  std::vector<Check> gpu = CheckGpu(e.roots, e.open_gpu);
  // CheckGpu adds its DMA line only where a device opened.
  const bool gpu_present = gpu.size() > 1;
  std::vector<Check> out = {
      CheckSharedHugePages(e.roots, s),
      CheckPrivateHugePages(e.roots, s),
      CheckDamon(e.roots, s),
      CheckMemoryLimit(e.roots, s),
      CheckMemlock(e.roots, e.memlock_bytes, gpu_present, s),
  };
  for (Check& c :
       CheckSwapDirs(s, e.daemon_running ? e.daemon_swap_dirs : std::vector<std::string>())) {
    out.push_back(std::move(c));
  }
  const absl::StatusOr<std::string> chosen =
      e.adam_kernel ? e.adam_kernel(s.optimizer.kernel)
                    : absl::StatusOr<std::string>(absl::UnavailableError("not measured"));
  out.push_back(CheckAdamKernel(s.optimizer.kernel, chosen, e.widest_adam_kernel));
  out.push_back(CheckNuma(e.roots));
  for (Check& c : gpu) out.push_back(std::move(c));
  return out;
}

int ExitStatus(const std::vector<Check>& checks) {
  Verdict worst = Verdict::kOk;
  for (const Check& c : checks) worst = std::max(worst, c.verdict);
  return worst == Verdict::kFail ? 2 : worst == Verdict::kSlow ? 1 : 0;
}

std::string FormatReport(const std::vector<Check>& checks) {
  size_t width = 0;
  for (const Check& c : checks) width = std::max(width, c.name.size());
  std::string out;
  int counts[4] = {0, 0, 0, 0};
  for (const Check& c : checks) {
    ++counts[static_cast<int>(c.verdict)];
    absl::StrAppendFormat(&out, "%-4s  %-*s  %s", VerdictName(c.verdict), static_cast<int>(width),
                          c.name, c.measured);
    if (c.verdict != Verdict::kOk && !c.fix.empty()) absl::StrAppend(&out, "; fix: ", c.fix);
    out += '\n';
  }
  const int status = ExitStatus(checks);
  absl::StrAppendFormat(&out, "%d ok, %d info, %d slow, %d fail: %s (exit %d)\n", counts[0],
                        counts[1], counts[2], counts[3],
                        status == 2   ? "something here would make offloadd fail"
                        : status == 1 ? "offloadd would run here, slower or at risk"
                                      : "nothing here would make offloadd fail or slow",
                        status);
  return out;
}

}  // namespace offload
