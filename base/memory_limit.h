// How much memory this process may use: physical memory, or less where the
// process runs in a cgroup with a memory limit (a container, a systemd slice
// with MemoryMax=). A daemon sized by physical memory alone is OOM-killed in
// a container instead of refusing work with RESOURCE_EXHAUSTED.
#ifndef OFFLOADD_BASE_MEMORY_LIMIT_H_
#define OFFLOADD_BASE_MEMORY_LIMIT_H_

#include <cstdint>
#include <string>

namespace offload {

struct MemoryLimit {
  uint64_t physical = 0;    // sysconf(_SC_PHYS_PAGES) * page size
  uint64_t cgroup = 0;      // 0: no cgroup limit found
  std::string cgroup_file;  // where the limit was read

  uint64_t effective() const { return cgroup != 0 && cgroup < physical ? cgroup : physical; }
};

// Reads the limit of this process's cgroup: cgroup v2 `memory.max` of its
// unified hierarchy path, else cgroup v1 `memory.limit_in_bytes` of its
// memory controller path, each also at the mount's root (containers mount
// their own cgroup there). Unreadable files, "max" and v1's "no limit"
// (about 2^63) mean no limit.
MemoryLimit ReadMemoryLimit();

// ReadMemoryLimit on the node whose /proc and /sys are at `proc_dir` and
// `sys_dir` (made-up trees in tests): <proc_dir>/self/cgroup, the cgroup
// mount <sys_dir>/fs/cgroup, and physical memory from <proc_dir>/meminfo's
// MemTotal (this machine's sysconf where that cannot be read).
MemoryLimit ReadMemoryLimitIn(const std::string& proc_dir, const std::string& sys_dir);

// As ReadMemoryLimit, with /proc/self/cgroup's contents, the cgroup mount
// (normally /sys/fs/cgroup) and physical memory given. For tests.
MemoryLimit ReadMemoryLimitFrom(const std::string& proc_self_cgroup, const std::string& cgroup_root,
                                uint64_t physical);

}  // namespace offload

#endif  // OFFLOADD_BASE_MEMORY_LIMIT_H_
