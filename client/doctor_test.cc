#include "client/doctor.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "base/config_registry.h"
#include "gpu/emulated_device.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr char kThp[] = "/kernel/mm/transparent_hugepage/";

// A made-up node under $TEST_TMPDIR/<name>: proc/ and sys/, empty.
NodeRoots Node(const std::string& name) {
  const std::string root = std::string(getenv("TEST_TMPDIR")) + "/" + name;
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root + "/proc");
  std::filesystem::create_directories(root + "/sys");
  return {root + "/proc", root + "/sys"};
}

void Write(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path) << text << "\n";
}

std::string Dir(const std::string& name) {
  const std::string dir = std::string(getenv("TEST_TMPDIR")) + "/" + name;
  std::filesystem::create_directories(dir);
  return dir;
}

DoctorSettings WithNvme(const std::string& dirs) {
  DoctorSettings s;
  s.nvme.dirs = dirs;
  return s;
}

#define EXPECT_VERDICT(check, v)                                                            \
  EXPECT_EQ((check).verdict, v) << VerdictName((check).verdict) << ": " << (check).measured \
                                << " / " << (check).fix

TEST(Doctor, SharedHugePagesByModeAndTier) {
  const NodeRoots node = Node("shmem");
  DoctorSettings host_only;
  Check c = CheckSharedHugePages(node, host_only);  // no THP in the kernel
  EXPECT_VERDICT(c, Verdict::kInfo);
  EXPECT_TRUE(absl::StrContains(c.measured, "missing")) << c.measured;

  Write(node.sys + kThp + "hpage_pmd_size", "2097152");
  Write(node.sys + kThp + "shmem_enabled", "always within_size advise [never] deny force");
  EXPECT_VERDICT(CheckSharedHugePages(node, host_only), Verdict::kInfo);
  c = CheckSharedHugePages(node, WithNvme("/nvme0"));
  EXPECT_VERDICT(c, Verdict::kSlow);
  EXPECT_EQ(c.fix,
            "as root, before offloadd starts: echo advise > "
            "/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  DoctorSettings off = WithNvme("/nvme0");
  off.memory.arena_huge_pages = false;
  EXPECT_VERDICT(CheckSharedHugePages(node, off), Verdict::kInfo);

  Write(node.sys + kThp + "shmem_enabled", "always within_size [advise] never deny force");
  c = CheckSharedHugePages(node, WithNvme("/nvme0"));
  EXPECT_VERDICT(c, Verdict::kOk);
  EXPECT_TRUE(absl::StrContains(c.measured, "[advise]")) << c.measured;
  EXPECT_TRUE(absl::StrContains(c.measured, "2.0 MiB")) << c.measured;
}

TEST(Doctor, PrivateHugePagesByModeAndTier) {
  const NodeRoots node = Node("anon");
  Write(node.sys + kThp + "enabled", "always madvise [never]");
  EXPECT_VERDICT(CheckPrivateHugePages(node, DoctorSettings()), Verdict::kInfo);
  Check c = CheckPrivateHugePages(node, WithNvme("/nvme0"));
  EXPECT_VERDICT(c, Verdict::kSlow);
  EXPECT_TRUE(
      absl::StrContains(c.fix, "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled"))
      << c.fix;
  Write(node.sys + kThp + "enabled", "always [madvise] never");
  EXPECT_VERDICT(CheckPrivateHugePages(node, WithNvme("/nvme0")), Verdict::kOk);
}

TEST(Doctor, DamonByWhatThePoolsPagesWouldBe) {
  const NodeRoots node = Node("damon");
  Write(node.proc + "/1/comm", "systemd");
  EXPECT_VERDICT(CheckDamon(node, DoctorSettings()), Verdict::kOk);

  // A user's process of that name is no monitor; the kernel thread is.
  Write(node.proc + "/4242/comm", "kdamond.0");
  Write(node.proc + "/4242/stat", "4242 (kdamond.0) S 1000 4242 4242 0 -1 4194304 0 0 0 0");
  EXPECT_VERDICT(CheckDamon(node, DoctorSettings()), Verdict::kOk);
  Write(node.proc + "/507/comm", "kdamond.0");
  Write(node.proc + "/507/stat", "507 (kdamond.0) S 2 0 0 0 -1 2129984 0 0 0 0");
  Write(node.sys + "/kernel/mm/damon/admin/kdamonds/0/pid", "507");
  Write(node.sys + "/kernel/mm/damon/admin/kdamonds/0/contexts/0/operations", "paddr");
  Check c = CheckDamon(node, DoctorSettings());  // auto: small pages, host only
  EXPECT_VERDICT(c, Verdict::kInfo);
  EXPECT_TRUE(absl::StrContains(c.measured, "kdamond.0 (pid 507, paddr)")) << c.measured;
  EXPECT_TRUE(absl::StrContains(c.fix, "kdamonds/N/state")) << c.fix;
  EXPECT_VERDICT(CheckDamon(node, WithNvme("/nvme0")), Verdict::kSlow);
  DoctorSettings huge;
  huge.memory.host_home_pages = "huge";
  EXPECT_VERDICT(CheckDamon(node, huge), Verdict::kSlow);
  DoctorSettings bad;
  bad.memory.host_home_pages = "Huge";
  EXPECT_VERDICT(CheckDamon(node, bad), Verdict::kFail);
}

TEST(Doctor, PoolAgainstTheCgroupLimit) {
  const NodeRoots node = Node("cgroup");
  Write(node.proc + "/meminfo", "MemTotal:       16777216 kB");
  Write(node.proc + "/self/cgroup", "0::/offloadd.service");
  Write(node.sys + "/fs/cgroup/offloadd.service/memory.max", "4294967296");
  DoctorSettings s;
  s.memory.host_budget_bytes = 2 * kGiB;
  Check c = CheckMemoryLimit(node, s);
  EXPECT_VERDICT(c, Verdict::kOk);
  EXPECT_TRUE(absl::StrContains(c.measured, "2.0 GiB of 4.0 GiB (the cgroup limit in "))
      << c.measured;

  s.memory.host_budget_bytes = 3900 * kMiB;  // over nine tenths
  EXPECT_VERDICT(CheckMemoryLimit(node, s), Verdict::kSlow);

  s.memory.host_budget_bytes = 6 * kGiB;  // offloadd refuses to start
  c = CheckMemoryLimit(node, s);
  EXPECT_VERDICT(c, Verdict::kFail);
  EXPECT_TRUE(absl::StrContains(c.fix, "default is half: 2GiB")) << c.fix;
  EXPECT_TRUE(absl::StrContains(c.fix, "MemoryMax=")) << c.fix;

  Write(node.sys + "/fs/cgroup/offloadd.service/memory.max", "max");  // physical memory then
  c = CheckMemoryLimit(node, s);
  EXPECT_VERDICT(c, Verdict::kOk);
  EXPECT_TRUE(absl::StrContains(c.measured, "16.0 GiB (physical memory)")) << c.measured;
  s.memory.host_budget_bytes = 17 * kGiB;
  c = CheckMemoryLimit(node, s);
  EXPECT_VERDICT(c, Verdict::kFail);
  EXPECT_FALSE(absl::StrContains(c.fix, "MemoryMax=")) << c.fix;
}

TEST(Doctor, MemlockAgainstWhatLocksOrRegisters) {
  const NodeRoots node = Node("memlock");
  Write(node.proc + "/self/status", "Name:\tofflodctl\nCapEff:\t0000000000000000");
  DoctorSettings s;
  s.memory.host_budget_bytes = 4 * kGiB;
  EXPECT_VERDICT(CheckMemlock(node, UINT64_MAX, true, s), Verdict::kOk);
  EXPECT_VERDICT(CheckMemlock(node, 8 * kMiB, false, s), Verdict::kOk);
  Check c = CheckMemlock(node, 8 * kMiB, true, s);
  EXPECT_VERDICT(c, Verdict::kSlow);
  EXPECT_TRUE(absl::StrContains(c.fix, "at least 4GiB")) << c.fix;
  s.memory.lock_pool = true;
  EXPECT_VERDICT(CheckMemlock(node, 8 * kMiB, false, s), Verdict::kSlow);
  EXPECT_VERDICT(CheckMemlock(node, 4 * kGiB, false, s), Verdict::kOk);
  Write(node.proc + "/self/status", "Name:\toffloadctl\nCapEff:\t000001ffffffffff");
  c = CheckMemlock(node, 8 * kMiB, true, s);
  EXPECT_VERDICT(c, Verdict::kOk);
  EXPECT_TRUE(absl::StrContains(c.measured, "CAP_IPC_LOCK")) << c.measured;
}

TEST(Doctor, NoNvmeTierIsInformational) {
  std::vector<Check> c = CheckSwapDirs(DoctorSettings());
  ASSERT_EQ(c.size(), 1u);
  EXPECT_VERDICT(c[0], Verdict::kInfo);
}

TEST(Doctor, ARealSwapDirectoryIsTriedAndJudgedByWhatItDoes) {
  const std::string dir = Dir("swap");
  DoctorSettings s = WithNvme(dir);
  s.nvme.bytes_per_dir = 16 * kMiB;
  const SwapDirProbe probe = ProbeSwapDir(dir, s.nvme);
  std::vector<Check> c = CheckSwapDirs(s);
  ASSERT_EQ(c.size(), 4u);
  EXPECT_EQ(c[0].name, "swap dir " + dir);
  EXPECT_TRUE(absl::StartsWith(c[0].measured, probe.filesystem)) << c[0].measured;
  EXPECT_VERDICT(c[0], probe.in_memory ? Verdict::kSlow : Verdict::kOk);
  // O_DIRECT: the verdict of what this filesystem really does.
  EXPECT_EQ(c[1].name, "O_DIRECT " + dir);
  EXPECT_VERDICT(c[1], probe.direct ? Verdict::kOk : Verdict::kSlow);
  if (probe.filesystem == "ext4" || probe.filesystem == "xfs") {
    EXPECT_VERDICT(c[1], Verdict::kOk);
  }
  // io_uring: written and read back, or refused by this kernel.
  EXPECT_EQ(c[2].name, "io_uring " + dir);
  EXPECT_VERDICT(c[2], probe.io.ok() ? Verdict::kOk : Verdict::kSlow);
  EXPECT_EQ(c[3].name, "swap space " + dir);
  EXPECT_VERDICT(c[3], Verdict::kOk);
  EXPECT_EQ(ExitStatus(c), probe.in_memory || !probe.direct || !probe.io.ok() ? 1 : 0);

  // A budget no disk has.
  s.nvme.bytes_per_dir = int64_t{1} << 60;
  c = CheckSwapDirs(s);
  ASSERT_EQ(c.size(), 4u);
  EXPECT_VERDICT(c[3], Verdict::kFail);
  EXPECT_TRUE(absl::StrContains(c[3].fix, "set nvme.bytes_per_dir to at most ")) << c[3].fix;
  EXPECT_EQ(ExitStatus(c), 2);
}

TEST(Doctor, AMissingSwapDirectoryFails) {
  const std::string dir = Dir("nothing") + "/here";
  std::vector<Check> c = CheckSwapDirs(WithNvme(dir));
  ASSERT_EQ(c.size(), 1u);
  EXPECT_VERDICT(c[0], Verdict::kFail);
  EXPECT_EQ(c[0].fix, "mkdir -p " + dir + " writable by offloadd's user, or change nvme.dirs");
}

// A swap file held in a directory of the running offloadd's own is its;
// held in another (doctor asked about other nvme.dirs) it is another
// process's, which a second offloadd could not use.
TEST(Doctor, OnlyTheRunningOffloaddsOwnDirectoriesHoldItsSwapFile) {
  const std::string dir = Dir("held_swap");
  const int fd = open((dir + "/offloadd.swap").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(flock(fd, LOCK_EX | LOCK_NB), 0);  // as an offloadd holds it
  auto verdict_of_dir = [&](const std::vector<Check>& checks) {
    for (const Check& c : checks) {
      if (c.name == "swap dir " + dir) return c.verdict;
    }
    return Verdict::kInfo;
  };
  EXPECT_EQ(verdict_of_dir(CheckSwapDirs(WithNvme(dir), {dir})), Verdict::kOk);
  EXPECT_EQ(verdict_of_dir(CheckSwapDirs(WithNvme(dir), {"/srv/other-nvme"})), Verdict::kFail);
  EXPECT_EQ(verdict_of_dir(CheckSwapDirs(WithNvme(dir))), Verdict::kFail);
  close(fd);
}

TEST(Doctor, SwapDirectoryJudgements) {
  SwapDirProbe p;
  p.dir = "/nvme0";
  p.filesystem = "ext4";
  p.free_bytes = 100 * kGiB;
  p.direct = true;
  p.direct_alignment = 512;
  p.backend = "io_uring";
  p.io_bytes = 64 << 10;
  DoctorSettings s = WithNvme("/nvme0");
  EXPECT_EQ(ExitStatus(JudgeSwapDir(p, s, false)), 0);

  SwapDirProbe held = p;  // another offloadd's swap file
  held.swap_file_locked = true;
  held.swap_file_bytes = 8 * kGiB;
  EXPECT_VERDICT(JudgeSwapDir(held, s, false)[0], Verdict::kFail);
  EXPECT_EQ(ExitStatus(JudgeSwapDir(held, s, true)), 0) << "the running offloadd's own";

  SwapDirProbe full = p;  // a stopped offloadd's swap file counts as space
  full.free_bytes = 1 * kGiB;
  full.swap_file_bytes = 8 * kGiB;
  EXPECT_VERDICT(JudgeSwapDir(full, s, false)[3], Verdict::kOk);
  full.swap_file_bytes = 0;
  EXPECT_VERDICT(JudgeSwapDir(full, s, false)[3], Verdict::kFail);

  SwapDirProbe refused = p;
  refused.io = absl::FailedPreconditionError("io_uring_queue_init: Operation not permitted");
  std::vector<Check> c = JudgeSwapDir(refused, s, false);
  EXPECT_VERDICT(c[2], Verdict::kSlow);
  EXPECT_TRUE(absl::StrContains(c[2].fix, "kernel.io_uring_disabled=0")) << c[2].fix;
  s.nvme.io.backend = "io_uring";
  EXPECT_VERDICT(JudgeSwapDir(refused, s, false)[2], Verdict::kFail);
  s.nvme.io.backend = "auto";

  SwapDirProbe broken = p;
  broken.io = absl::DataLossError("read back differs");
  EXPECT_VERDICT(JudgeSwapDir(broken, s, false)[2], Verdict::kFail);

  SwapDirProbe tmpfs = p;
  tmpfs.filesystem = "tmpfs";
  tmpfs.in_memory = true;
  tmpfs.direct = false;
  tmpfs.direct_alignment = 0;
  c = JudgeSwapDir(tmpfs, s, false);
  EXPECT_VERDICT(c[0], Verdict::kSlow);
  EXPECT_VERDICT(c[1], Verdict::kSlow);
  s.nvme.direct_io = false;
  EXPECT_VERDICT(JudgeSwapDir(tmpfs, s, false)[1], Verdict::kInfo);
}

TEST(Doctor, AdamKernelAgainstTheWidestThisCpuRuns) {
  EXPECT_VERDICT(CheckAdamKernel("auto", std::string("avx512"), "avx512"), Verdict::kOk);
  EXPECT_VERDICT(CheckAdamKernel("auto", std::string("avx2"), "avx2"), Verdict::kOk);
  EXPECT_VERDICT(CheckAdamKernel("auto", std::string("scalar"), "scalar"), Verdict::kSlow);
  Check c = CheckAdamKernel("scalar", std::string("scalar"), "avx512");
  EXPECT_VERDICT(c, Verdict::kSlow);
  EXPECT_EQ(c.fix, "set optimizer.kernel=auto");
  EXPECT_VERDICT(
      CheckAdamKernel("avx512", absl::FailedPreconditionError("this CPU lacks AVX-512"), "avx2"),
      Verdict::kFail);
}

TEST(Doctor, NumaNodes) {
  const NodeRoots node = Node("numa");
  EXPECT_VERDICT(CheckNuma(node), Verdict::kOk);
  const std::string nodes = node.sys + "/devices/system/node";
  Write(nodes + "/node0/cpulist", "0-15");
  Write(nodes + "/node0/meminfo", "Node 0 MemTotal:       67108864 kB\nNode 0 MemFree: 1 kB");
  Write(nodes + "/possible", "0-1");
  Check c = CheckNuma(node);
  EXPECT_VERDICT(c, Verdict::kOk);
  EXPECT_EQ(c.measured, "one node: node0 (cpus 0-15, 64.0 GiB)");
  Write(nodes + "/node1/cpulist", "16-31");
  Write(nodes + "/node1/meminfo", "Node 1 MemTotal:       67108864 kB");
  c = CheckNuma(node);
  EXPECT_VERDICT(c, Verdict::kInfo);
  EXPECT_TRUE(absl::StartsWith(c.measured,
                               "2 nodes: node0 (cpus 0-15, 64.0 GiB), node1 (cpus "
                               "16-31, 64.0 GiB)"))
      << c.measured;
}

TEST(Doctor, GpuFromTheBuildTheDeviceAndRegistration) {
  const NodeRoots node = Node("gpu");
  std::vector<Check> c = CheckGpu(node, nullptr);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_VERDICT(c[0], Verdict::kInfo);
  EXPECT_EQ(c[0].measured, "no CUDA in this build, no NVIDIA driver");
  Write(node.proc + "/driver/nvidia/version",
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024");
  c = CheckGpu(node, nullptr);
  EXPECT_EQ(c[0].measured, "no CUDA in this build; NVIDIA driver 550.54.15");
  // The open kernel modules' line (an H200 node's said "NVIDIA driver for").
  Write(node.proc + "/driver/nvidia/version",
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.82.07  Release Build  "
        "(dvs-builder@U16-I3-B03-4-3)  Wed Aug 27 01:01:01 UTC 2025");
  EXPECT_EQ(CheckGpu(node, nullptr)[0].measured, "no CUDA in this build; NVIDIA driver 580.82.07");
  Write(node.proc + "/driver/nvidia/version",
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024");

  c = CheckGpu(node, []() -> absl::StatusOr<std::unique_ptr<gpu::Device>> {
    return absl::FailedPreconditionError("no CUDA-capable device is detected");
  });
  ASSERT_EQ(c.size(), 1u);
  EXPECT_VERDICT(c[0], Verdict::kInfo);

  c = CheckGpu(node, []() -> absl::StatusOr<std::unique_ptr<gpu::Device>> {
    return std::make_unique<gpu::EmulatedDevice>();
  });
  ASSERT_EQ(c.size(), 2u);
  EXPECT_VERDICT(c[0], Verdict::kOk);
  EXPECT_EQ(c[0].measured, "emulated, NVIDIA driver 550.54.15, 1.0 GiB free");
  EXPECT_VERDICT(c[1], Verdict::kOk);

  c = CheckGpu(node, []() -> absl::StatusOr<std::unique_ptr<gpu::Device>> {
    auto d = std::make_unique<gpu::EmulatedDevice>();
    d->SetRegisterFault(
        [](void*, uint64_t) { return absl::ResourceExhaustedError("RLIMIT_MEMLOCK is 8388608"); });
    return d;
  });
  ASSERT_EQ(c.size(), 2u);
  EXPECT_VERDICT(c[1], Verdict::kSlow);
  EXPECT_TRUE(absl::StrContains(c[1].measured, "RLIMIT_MEMLOCK is 8388608")) << c[1].measured;
}

TEST(Doctor, ExitStatusIsTheWorstVerdict) {
  EXPECT_EQ(ExitStatus({}), 0);
  EXPECT_EQ(ExitStatus({{"a", Verdict::kOk, "", ""}, {"b", Verdict::kInfo, "", ""}}), 0);
  EXPECT_EQ(ExitStatus({{"a", Verdict::kSlow, "", ""}, {"b", Verdict::kInfo, "", ""}}), 1);
  EXPECT_EQ(ExitStatus({{"a", Verdict::kSlow, "", ""}, {"b", Verdict::kFail, "", ""}}), 2);
}

TEST(Doctor, ReportLinesAreAlignedAndEndInASummary) {
  const std::string report = FormatReport({{"DAMON", Verdict::kOk, "none", "unused"},
                                           {"swap space /x", Verdict::kFail, "full", "free it"},
                                           {"NUMA", Verdict::kInfo, "2 nodes", ""}});
  const std::vector<std::string> lines = absl::StrSplit(report, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0], "ok    DAMON          none");
  EXPECT_EQ(lines[1], "FAIL  swap space /x  full; fix: free it");
  EXPECT_EQ(lines[2], "info  NUMA           2 nodes");
  EXPECT_EQ(lines[3],
            "1 ok, 1 info, 0 slow, 1 fail: something here would make offloadd fail (exit 2)");
}

TEST(Doctor, RunDoctorOnAMadeUpNode) {
  DoctorEnvironment e;
  e.roots = Node("whole");
  Write(e.roots.sys + kThp + "enabled", "always [madvise] never");
  Write(e.roots.sys + kThp + "shmem_enabled", "always within_size [advise] never deny force");
  Write(e.roots.proc + "/meminfo", "MemTotal:       16777216 kB");
  e.adam_kernel = [](const std::string&) -> absl::StatusOr<std::string> { return "avx2"; };
  e.widest_adam_kernel = "avx2";
  DoctorSettings s;
  s.memory.host_budget_bytes = 8 * kGiB;
  std::vector<Check> c = RunDoctor(e, s);
  std::vector<std::string> names;
  for (const Check& x : c) names.push_back(x.name);
  EXPECT_EQ(names, (std::vector<std::string>{"shmem huge pages", "anon huge pages", "DAMON",
                                             "memory limit", "RLIMIT_MEMLOCK", "swap dirs",
                                             "Adam kernel", "NUMA", "GPU"}));
  EXPECT_EQ(ExitStatus(c), 0) << FormatReport(c);

  s.memory.host_budget_bytes = 32 * kGiB;
  EXPECT_EQ(ExitStatus(RunDoctor(e, s)), 2);
}

TEST(Doctor, SettingsParseByTheDaemonsNames) {
  DoctorSettings s;
  ConfigRegistry r;
  BindDoctorTunables(&s, &r);
  ASSERT_TRUE(r.Set("memory.host_budget_bytes", "2GiB").ok());
  ASSERT_TRUE(r.Set("nvme.dirs", "/a, /b").ok());
  ASSERT_TRUE(r.Set("optimizer.kernel", "scalar").ok());
  EXPECT_EQ(s.memory.host_budget_bytes, int64_t{2} << 30);
  EXPECT_EQ(s.nvme.DirList(), (std::vector<std::string>{"/a", "/b"}));
  EXPECT_EQ(s.optimizer.kernel, "scalar");
  EXPECT_EQ(r.Set("memory.host_budget_bytes", "12").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Set("server.socket", "/x").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace offload
