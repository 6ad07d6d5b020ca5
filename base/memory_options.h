// The host memory tier's settings (bound under "memory.*"): the pool's
// budget, the session arenas' limits, and the pages the pool and the arenas
// ask for. One light header, as nvme/nvme_options.h and
// cpu_adam/optimizer_options.h are for their components: the daemon binds
// these fields, and `offloadctl doctor` reads the same ones to judge a node
// against them, so both know each setting by one definition.
#ifndef OFFLOADD_BASE_MEMORY_OPTIONS_H_
#define OFFLOADD_BASE_MEMORY_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/config_registry.h"
#include "base/host_memory.h"
#include "base/memory_limit.h"

namespace offload {

struct MemoryOptions {
  // Most memory mappings offloadd may hold; a registration that could pass
  // it is refused (RESOURCE_EXHAUSTED) instead of the kernel refusing an
  // mmap somewhere later. -1: three quarters of vm.max_map_count (the rest
  // for threads, the allocator, libraries); 0: no budget.
  int64_t max_mappings = -1;
  // Host memory offloadd may hold for all sessions together: shared arenas
  // plus fp32 master weights and Adam moments (16 bytes per fp32-gradient
  // parameter plus its working and gradient buffers). Registrations beyond
  // it fail with RESOURCE_EXHAUSTED. Default: half of the memory this
  // process may use (physical memory, or its cgroup's limit in a container).
  // Lowering it below current use only blocks new registrations.
  int64_t host_budget_bytes = 0;

  // Most bytes one session's shared arena may hold: its partitions' working
  // copies and gradients together. Reserves nothing: the daemon and the
  // trainer map each partition's regions, not the whole. A change applies to
  // sessions opened afterwards.
  int64_t session_arena_bytes = int64_t{256} << 30;

  // Lock the pool's memory (mlock) where RLIMIT_MEMLOCK permits, so the
  // kernel never swaps it. Warned about once when refused.
  bool lock_pool = false;

  // Lay large partitions out in the session arenas for huge pages (2 MiB)
  // and ask the kernel for them, where it gives them to shared memory
  // (/sys/kernel/mm/transparent_hugepage/shmem_enabled: advise, within_size
  // or always; never is the usual default, and then this does nothing).
  // Parameters and gradients placed on NVMe are read and written directly
  // in the arena, and through fresh 4 KiB pages a ZeRO-3 pass over them ran
  // 1.4-6.3x slower (benches/RESULTS.md, trace_replay).
  // Costs: a partition so laid out rounds each of its regions up to whole
  // huge pages (only partitions where that wastes at most an eighth are).
  bool arena_huge_pages = true;

  // The pages of the host pool's memory for blocks homed on the host (the
  // optimizer state, the gradient accumulators and their versions placed
  // on the host): "huge" (2 MiB, transparent), "small" (4 KiB), or "auto":
  // small where DAMON monitors this node when offloadd starts (a kdamond
  // thread runs), huge elsewhere.
  // On this project's VMs, with DAMON sampling physical memory, updates over
  // huge pages stalled 2-7x around its rounds and the delayed update ran
  // 1.22-1.57x the bound against 1.05-1.11x on small pages (gradients
  // handed over with their statistics); with DAMON off
  // the two measured alike (benches/RESULTS.md, step_overlap). Blocks homed
  // on NVMe are brought in on huge pages whatever this says
  // (SwapperOptions::host_home_pages).
  std::string host_home_pages = "auto";

  // A directory on tmpfs (e.g. /dev/shm/offloadd; not systemd's
  // RuntimeDirectory, which a stop removes) whose file holds the host pool's memory
  // (swapper/pool_file.h). Then a SIGTERM stop keeping sessions (the
  // reconnect lease) leaves their host-resident state in that file instead
  // of writing it to the data directory, and the next offloadd reads it
  // from there: the stop takes milliseconds, not the disk's time for every
  // session. Costs: the pool is shared memory (4 KiB pages where
  // shmem_enabled is never), and state kept there holds memory until the
  // next offloadd takes it (or its files are removed, or a reboot). One
  // offloadd (one data directory) per directory. Empty: private memory.
  std::string pool_dir;
};

inline constexpr IntRange kHostBudgetRange{4096, INT64_MAX};
inline constexpr IntRange kSessionArenaRange{int64_t{1} << 20, int64_t{1} << 44};
inline constexpr IntRange kMaxMappingsRange{-1, INT32_MAX};

// memory.host_budget_bytes's default: half of what this process may use
// (`limit.effective()`: physical memory, or its cgroup's limit inside a
// container), in whole MiB; 8 GiB where neither is known.
int64_t DefaultHostBudgetBytes(const MemoryLimit& limit);

// memory.host_budget_bytes checked against what the process may use: a pool
// past it would promise registrations the kernel then refuses (the OOM
// killer, not an error). INVALID_ARGUMENT naming both figures and where the
// limit comes from; offloadd refuses to start with it.
absl::Status CheckHostBudget(int64_t bytes, const MemoryLimit& limit);

// memory.host_home_pages resolved: the pages, and why (for the start-up
// lines).
struct HostHomePages {
  Pages pages = Pages::kHuge;
  std::string why;
};

// Resolves `setting` ("auto", "huge" or "small") with `damon_monitors` (what
// DamonMonitors() returned). INVALID_ARGUMENT naming the setting for any
// other value.
absl::StatusOr<HostHomePages> ResolveHostHomePages(const std::string& setting,
                                                   const std::vector<std::string>& damon_monitors);

// Binds every field under "memory.*". `options` must outlive `registry`.
void BindMemoryTunables(MemoryOptions* options, ConfigRegistry* registry);

}  // namespace offload

#endif  // OFFLOADD_BASE_MEMORY_OPTIONS_H_
