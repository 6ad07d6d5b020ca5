#include "base/memory_options.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace offload {

int64_t DefaultHostBudgetBytes(const MemoryLimit& limit) {
  const uint64_t most = limit.effective();
  return most > 0 ? static_cast<int64_t>(most / 2 >> 20 << 20) : int64_t{8} << 30;
}

absl::Status CheckHostBudget(int64_t bytes, const MemoryLimit& limit) {
  const uint64_t most = limit.effective();
  if (most != 0 && static_cast<uint64_t>(bytes) > most) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory.host_budget_bytes ", bytes,
                     " is more than this process may use: ", most, " bytes (",
                     limit.cgroup != 0 && limit.cgroup < limit.physical
                         ? absl::StrCat("the cgroup limit in ", limit.cgroup_file)
                         : std::string("physical memory"),
                     ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<HostHomePages> ResolveHostHomePages(const std::string& setting,
                                                   const std::vector<std::string>& damon_monitors) {
  if (setting == "huge") return HostHomePages{Pages::kHuge, "memory.host_home_pages is huge"};
  if (setting == "small") return HostHomePages{Pages::kSmall, "memory.host_home_pages is small"};
  if (setting != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("memory.host_home_pages: '", setting, "' is none of auto, huge, small"));
  }
  if (damon_monitors.empty()) {
    return HostHomePages{Pages::kHuge, "memory.host_home_pages auto: no DAMON monitor runs here"};
  }
  return HostHomePages{
      Pages::kSmall,
      absl::StrCat("memory.host_home_pages auto: DAMON monitors this node (",
                   absl::StrJoin(damon_monitors, ", "),
                   "), whose sampling stalled passes over huge pages on a paravirtualised "
                   "guest; 'huge' overrides")};
}

void BindMemoryTunables(MemoryOptions* o, ConfigRegistry* r) {
  r->Bind("memory.host_budget_bytes", &o->host_budget_bytes,
          {"bytes",
           "the host pool: arenas, master weights, moments of all sessions. It needs what every "
           "rank homes on the host (per parameter placed there: the working copy, 2 or 4 bytes, "
           "twice with the delayed update; gradients 4; master and moments 12; an accumulator 4 "
           "with several micro-batches a step: 18-28 bytes all on the host) and, with data on "
           "NVMe, the larger of: every rank's largest module's parameters and gradients held at "
           "once, and one step's chunk of the largest partition's state (18-20 bytes a parameter "
           "of placement.state_chunk_bytes / 4); offloadd.torch names the figure when it is "
           "short (README: How large the pool must be)",
           true, kHostBudgetRange});
  r->Bind("memory.session_arena_bytes", &o->session_arena_bytes,
          {"bytes", "most bytes one session's arena may hold (new sessions)", true,
           kSessionArenaRange});
  r->Bind("memory.max_mappings", &o->max_mappings,
          {"mappings",
           "most memory mappings offloadd holds; a registration that could pass it is "
           "RESOURCE_EXHAUSTED; -1: three quarters of vm.max_map_count, 0: no budget",
           true, kMaxMappingsRange});
  r->Bind("memory.lock_pool", &o->lock_pool,
          {"bool", "mlock the host pool where permitted", false});
  r->Bind("memory.arena_huge_pages", &o->arena_huge_pages,
          {"bool",
           "lay large partitions out for huge pages in the session arenas where the kernel gives "
           "them to shared memory (shmem_enabled advise, within_size, always)",
           false});
  r->Bind("memory.pool_dir", &o->pool_dir,
          {"path",
           "a directory on tmpfs whose file holds the host pool: a SIGTERM stop then keeps "
           "sessions there instead of writing them to disk (empty: private memory)",
           false});
  r->Bind("memory.host_home_pages", &o->host_home_pages,
          {"pages",
           "pages of the host pool's memory for blocks homed on the host (optimizer state, "
           "accumulators): auto (small where DAMON monitors this node, else huge), huge, small",
           false,
           {},
           {"auto", "huge", "small"}});
}

}  // namespace offload
