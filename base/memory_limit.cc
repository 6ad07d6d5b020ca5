#include "base/memory_limit.h"

#include <unistd.h>

#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace offload {
namespace {

// The limit in `path`, or 0 for none or unreadable.
uint64_t ReadLimitFile(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text)) return 0;
  text = std::string(absl::StripAsciiWhitespace(text));
  uint64_t v = 0;
  if (text == "max" || !absl::SimpleAtoi(text, &v)) return 0;
  // cgroup v1 reports "no limit" as the largest page-aligned int64.
  if (v >= (uint64_t{1} << 62)) return 0;
  return v;
}

}  // namespace

MemoryLimit ReadMemoryLimitFrom(const std::string& proc_self_cgroup, const std::string& cgroup_root,
                                uint64_t physical) {
  MemoryLimit limit;
  limit.physical = physical;
  std::vector<std::string> candidates;
  // The process's cgroup and every one above it (a limit on a parent, a
  // user's slice say, bounds it as its own does), up to the root.
  auto with_ancestors = [&](const std::string& base, std::string path, const std::string& file) {
    for (;;) {
      candidates.push_back(base + path + "/" + file);
      if (path.empty()) break;
      path.resize(path.rfind('/') == std::string::npos ? 0 : path.rfind('/'));
    }
  };
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup, '\n', absl::SkipEmpty())) {
    // "hierarchy-id:controllers:path"
    std::vector<std::string> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    const std::string& path = f[2] == "/" ? "" : f[2];
    if (f[0] == "0" && f[1].empty()) {
      with_ancestors(cgroup_root, path, "memory.max");
    } else {
      for (absl::string_view c : absl::StrSplit(f[1], ',')) {
        if (c != "memory") continue;
        with_ancestors(cgroup_root + "/memory", path, "memory.limit_in_bytes");
      }
    }
  }
  // The smallest of them is the one that binds.
  for (const std::string& file : candidates) {
    const uint64_t v = ReadLimitFile(file);
    if (v != 0 && (limit.cgroup == 0 || v < limit.cgroup)) {
      limit.cgroup = v;
      limit.cgroup_file = file;
    }
  }
  return limit;
}

MemoryLimit ReadMemoryLimitIn(const std::string& proc_dir, const std::string& sys_dir) {
  // "MemTotal:       16318420 kB"; the same figure as sysconf's pages.
  uint64_t physical = 0;
  std::ifstream meminfo(proc_dir + "/meminfo");
  for (std::string line; physical == 0 && std::getline(meminfo, line);) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    uint64_t kib = 0;
    if (f.size() >= 2 && f[0] == "MemTotal:" && absl::SimpleAtoi(f[1], &kib)) physical = kib << 10;
  }
  if (physical == 0) {
    const int64_t pages = sysconf(_SC_PHYS_PAGES);
    const int64_t page_size = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page_size > 0) {
      physical = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
    }
  }
  std::ifstream in(proc_dir + "/self/cgroup");
  std::stringstream text;
  text << in.rdbuf();
  return ReadMemoryLimitFrom(text.str(), sys_dir + "/fs/cgroup", physical);
}

MemoryLimit ReadMemoryLimit() { return ReadMemoryLimitIn("/proc", "/sys"); }

}  // namespace offload
