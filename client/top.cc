#include "client/top.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/human.h"

namespace offload {
namespace {

std::string Rate(double bytes_per_second) { return HumanBytes(bytes_per_second) + "/s"; }

std::map<std::string, int64_t> Counters(const DaemonStats& s) {
  std::map<std::string, int64_t> out;
  for (const auto& c : s.counters) out[c.name] = c.value;
  return out;
}

std::string Duration(int64_t ms) {
  const int64_t s = ms / 1000;
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
}

// The first `n` bytes of `s`, or fewer: never the part of a UTF-8
// character (a session's name may hold any).
std::string CutUtf8(const std::string& s, size_t n) {
  if (s.size() <= n) return s;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return s.substr(0, n);
}

std::string Percent(double part, double whole) {
  return whole <= 0 ? std::string("-") : absl::StrFormat("%.0f%%", 100.0 * part / whole);
}

}  // namespace

std::string RenderTop(const DaemonStats& now, const DaemonStats* before, double seconds,
                      int width) {
  std::vector<std::string> lines;
  // Another offloadd since the last screen (a restart keeps sessions, whose
  // counters start again): no rates, as on the first.
  if (before != nullptr && (before->pid != now.pid || before->uptime_ms > now.uptime_ms)) {
    before = nullptr;
  }
  const std::map<std::string, int64_t> c = Counters(now);
  const std::map<std::string, int64_t> b = before != nullptr ? Counters(*before) : c;
  const bool rates = before != nullptr && seconds > 0;
  auto delta = [&](const char* name) -> double {
    auto x = c.find(name), y = b.find(name);
    return x == c.end() || y == b.end() ? 0.0 : static_cast<double>(x->second - y->second);
  };
  auto per_second = [&](const char* name) { return rates ? delta(name) / seconds : 0.0; };

  lines.push_back(absl::StrFormat("offloadd %s  pid %u  up %s  optimizer %s  sessions %d%s",
                                  now.version, now.pid, Duration(now.uptime_ms), now.optimizer,
                                  now.sessions.size(),
                                  rates ? absl::StrFormat("  every %.1f s", seconds) : ""));
  std::string tiers;
  for (const auto& t : now.tiers) {
    absl::StrAppend(&tiers, tiers.empty() ? "" : "   ", "tier ", t.name, " ",
                    HumanBytes(static_cast<double>(t.used_bytes)), " of ",
                    HumanBytes(static_cast<double>(t.budget_bytes)), " (",
                    Percent(static_cast<double>(t.used_bytes), static_cast<double>(t.budget_bytes)),
                    ")");
  }
  lines.push_back(tiers);
  const double reads = delta("prefetch_used") + delta("swap_misses") + delta("swap_waited_reads");
  lines.push_back(absl::StrFormat(
      "swap in %s  out %s   prefetch used %s of reads (%s wasted)   updates %s params/s   "
      "calls failed %s/s",
      rates ? Rate(per_second("swap_in_bytes")) : "-",
      rates ? Rate(per_second("swap_out_bytes")) : "-",
      rates ? Percent(delta("prefetch_used"), reads) : "-",
      rates ? Percent(delta("prefetch_wasted"), delta("prefetch_issued")) : "-",
      rates ? absl::StrFormat("%.3g", per_second("params_updated")) : "-",
      rates ? absl::StrFormat("%.0f", per_second("requests_failed")) : "-"));
  lines.push_back("");
  lines.push_back(absl::StrFormat(
      "%-20s %-18s %6s %5s %21s %21s %21s %8s %9s %6s %8s %5s %9s %7s %11s %11s %8s", "SESSION",
      "NAME", "PARTS", "HELD", "PARAMS HOST/NVME", "GRADS HOST/NVME", "STATE HOST/NVME", "STEPS/S",
      "STEP MS", "WAIT%", "COMPUTE%", "SHARE", "UPDATES/S", "QUEUED%", "NVME I/O/S", "GPU IN/S",
      "GPU HIT%"));
  std::map<uint64_t, const DaemonStats::Session*> earlier;
  if (before != nullptr) {
    for (const auto& s : before->sessions) earlier[s.id] = &s;
  }
  for (const auto& s : now.sessions) {
    auto placed = [](uint64_t host, uint64_t nvme) {
      return HumanBytes(static_cast<double>(host)) + "/" + HumanBytes(static_cast<double>(nvme));
    };
    const auto it = earlier.find(s.id);
    const DaemonStats::Session* e = it == earlier.end() ? nullptr : it->second;
    // A counter that went back (the session's counts began again): no rates
    // for it this time, rather than an unsigned difference's nonsense.
    if (e != nullptr &&
        (s.steps < e->steps || s.step_wall_nanos < e->step_wall_nanos ||
         s.step_wait_nanos < e->step_wait_nanos || s.step_compute_nanos < e->step_compute_nanos ||
         s.optimizer_params < e->optimizer_params ||
         s.optimizer_queued_nanos < e->optimizer_queued_nanos ||
         s.nvme_read_bytes + s.nvme_write_bytes < e->nvme_read_bytes + e->nvme_write_bytes)) {
      e = nullptr;
    }
    std::string steps = "-", step_ms = "-", wait = "-", compute = "-", gpu_in = "-", hit = "-";
    std::string updates = "-", queued = "-", nvme = "-";
    if (s.detached_seconds >= 0) {
      // Its trainer went away without closing it: kept for a resume, not at
      // work (its steps column says since when).
      steps = absl::StrCat("gone ", s.detached_seconds, "s");
    } else if (rates && e != nullptr) {
      const double dsteps = static_cast<double>(s.steps - e->steps);
      const double wall = static_cast<double>(s.step_wall_nanos - e->step_wall_nanos);
      steps = absl::StrFormat("%.2f", dsteps / seconds);
      updates = absl::StrFormat(
          "%.3g", static_cast<double>(s.optimizer_params - e->optimizer_params) / seconds);
      // (A wait is counted when it ends: one longer than the screen's
      // interval is at most all of it.)
      queued = Percent(
          std::min(static_cast<double>(s.optimizer_queued_nanos - e->optimizer_queued_nanos),
                   seconds * 1e9),
          seconds * 1e9);
      nvme = Rate(static_cast<double>((s.nvme_read_bytes + s.nvme_write_bytes) -
                                      (e->nvme_read_bytes + e->nvme_write_bytes)) /
                  seconds);
      if (dsteps > 0 && wall > 0) {
        step_ms = absl::StrFormat("%.2f", wall / dsteps / 1e6);
        wait = Percent(static_cast<double>(s.step_wait_nanos - e->step_wait_nanos), wall);
        compute = Percent(static_cast<double>(s.step_compute_nanos - e->step_compute_nanos), wall);
      }
      if (s.gpu.has_value() && e->gpu.has_value() && s.gpu->h2d_bytes >= e->gpu->h2d_bytes &&
          s.gpu->tensor_uses >= e->gpu->tensor_uses &&
          s.gpu->resident_hits + s.gpu->prefetch_hits >=
              e->gpu->resident_hits + e->gpu->prefetch_hits) {
        gpu_in = Rate(static_cast<double>(s.gpu->h2d_bytes - e->gpu->h2d_bytes) / seconds);
        hit = Percent(static_cast<double>((s.gpu->resident_hits + s.gpu->prefetch_hits) -
                                          (e->gpu->resident_hits + e->gpu->prefetch_hits)),
                      static_cast<double>(s.gpu->tensor_uses - e->gpu->tensor_uses));
      }
    }
    lines.push_back(absl::StrFormat(
        "%-20d %-18s %6d %5d %21s %21s %21s %8s %9s %6s %8s %5d %9s %7s %11s %11s %8s", s.id,
        s.name.empty() ? "(hidden)" : CutUtf8(s.name, 18), s.partitions, s.held,
        placed(s.params_host_bytes, s.params_nvme_bytes),
        placed(s.grads_host_bytes, s.grads_nvme_bytes),
        placed(s.state_host_bytes, s.state_nvme_bytes), steps, step_ms, wait, compute,
        s.share_weight, updates, queued, nvme, gpu_in, hit));
  }
  if (now.sessions.empty()) lines.push_back("(no sessions)");
  std::string out;
  for (std::string& l : lines) {
    if (static_cast<int>(l.size()) > width) l = CutUtf8(l, static_cast<size_t>(width));
    absl::StrAppend(&out, l, "\n");
  }
  return out;
}

}  // namespace offload
