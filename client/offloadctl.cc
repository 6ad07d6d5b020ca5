// offloadctl: inspect and tune a running offloadd.
//
//   offloadctl [--address=ADDR] status
//   offloadctl [--address=ADDR] config list
//   offloadctl [--address=ADDR] config get NAME
//   offloadctl [--address=ADDR] config set NAME VALUE
//   offloadctl [--address=ADDR] stats
//   offloadctl [--address=ADDR] top [--interval=SECONDS] [--iterations=N]
//   offloadctl [--address=ADDR] checkpoint SESSION_ID DIR
//   offloadctl [--address=ADDR] share SESSION_ID WEIGHT
//   offloadctl [--address=ADDR] close SESSION_ID
//   offloadctl export [--format=safetensors] [--steps=N] CHECKPOINT_DIR OUTPUT
//   offloadctl [--address=ADDR] doctor [--offline] [--NAME=VALUE ...]
//
// export reads a checkpoint directory offline (no daemon needed) and
// writes every tensor's consolidated fp32 weights, across all the ranks
// that checkpointed into it, into one file (with --steps, each rank's
// checkpoint of that step: the latest or the one kept before it). doctor checks this node for
// offloadd (client/doctor.h) and exits 0, 1 or 2 by what it found.
// ADDR defaults to $OFFLOADD_ADDRESS, else the daemon's default socket. Over
// TCP, anything but reading (status, stats, config list and get) needs
// $OFFLOADD_TOKEN (<data_dir>/tcp_token); so do share, close, checkpoint and
// config set over a socket shared with a group (server.socket_group).
// Exit status: 0 success, 1 the daemon refused or could not be reached
// (the reason is printed with its status code), 2 usage error; doctor's
// own are in kDoctorUsage.
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/config_registry.h"
#include "checkpoint/export.h"
#include "checkpoint/tensor_index.h"
#include "client/client.h"
#include "client/doctor.h"
#include "client/human.h"
#include "client/top.h"

namespace offload {
namespace {

constexpr char kUsage[] =
    "usage: offloadctl [--address=ADDR] COMMAND\n"
    "commands:\n"
    "  status                  what the daemon serves and holds\n"
    "  config list             every tunable with value, default, unit\n"
    "  config get NAME         one tunable\n"
    "  config set NAME VALUE   change a tunable (dynamic ones only while running)\n"
    "  stats                   counters and sessions\n"
    "  top [--interval=S] [--iterations=N]\n"
    "                          a live view: tiers, swap and prefetch rates, and per session its\n"
    "                          placement, steps a second and step time split into waiting for\n"
    "                          state and computing (every S seconds, 1; N screens, 0 = until ^C)\n"
    "  checkpoint ID DIR       write session ID's checkpoint into DIR (atomically)\n"
    "  share ID WEIGHT         session ID's weight in the node's optimizer, NVMe I/O and pool\n"
    "                          (1-1000): sessions stepping at once get updates, and the disk\n"
    "                          when they wait for it, in proportion\n"
    "  close ID                end session ID now, one whose trainer went away (kept for the\n"
    "                          reconnect lease): its memory and NVMe space go now; as at the\n"
    "                          lease's end, its automatic checkpoints stay only if it was\n"
    "                          opened for a resume. Refused while a trainer is attached\n"
    "  export [--format=safetensors] [--steps=N] CHECKPOINT_DIR OUTPUT\n"
    "                          consolidated fp32 weights of a checkpoint (offline); --steps:\n"
    "                          of the checkpoints taken after N steps (where the ranks' latest\n"
    "                          differ)\n"
    "  doctor [--offline] [--NAME=VALUE ...]\n"
    "                          check this node for offloadd (no daemon needed; doctor --help)\n"
    "ADDR: unix:PATH or 127.0.0.1:PORT (default $OFFLOADD_ADDRESS, else the default socket).\n"
    "Over TCP, only what reads (status, stats, config list and get) is served unless\n"
    "$OFFLOADD_TOKEN holds <data_dir>/tcp_token; over a socket shared with a group\n"
    "(server.socket_group), share, close, checkpoint and config set need it too.\n";

constexpr char kDoctorUsage[] =
    "usage: offloadctl [--address=ADDR] doctor [--offline] [--NAME=VALUE ...]\n"
    "Checks the node offloadd runs on, or would run on, and prints one line per check:\n"
    "  VERDICT  CHECK  MEASURED; fix: WHAT TO DO\n"
    "with VERDICT ok, info (worth knowing, changes nothing), SLOW (offloadd runs, slower or at\n"
    "risk) or FAIL (offloadd would refuse to start or fail its first I/O). Checked: huge pages\n"
    "for shared and private memory, DAMON, the memory limit (cgroup or physical) against\n"
    "memory.host_budget_bytes, RLIMIT_MEMLOCK, each nvme.dirs directory (filesystem, O_DIRECT,\n"
    "a block written and read back through io_uring, free space against nvme.bytes_per_dir),\n"
    "the Adam kernel this CPU gets, NUMA nodes, and the GPU (driver, device, DMA registration).\n"
    "\n"
    "Settings: a running offloadd's (at ADDR, as for the other commands), else offloadd's\n"
    "defaults; --NAME=VALUE sets memory.*, nvme.* and optimizer.* settings on top, as offloadd\n"
    "takes them (e.g. --nvme.dirs=/mnt/nvme0 --memory.host_budget_bytes=64GiB); other offloadd\n"
    "settings are ignored. --offline asks no daemon. Limits (cgroup, RLIMIT_MEMLOCK) are this\n"
    "process's: run it as, and where, offloadd and the trainers run.\n"
    "\n"
    "Exit status: 0 nothing would make offloadd fail or slow, 1 something would slow it,\n"
    "2 something would make it fail (or a setting given does not parse).\n";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "offloadctl: %s\n", s.ToString().c_str());
  return 1;
}

void PrintTunable(const Tunable& t) {
  std::printf("%s = %s\n  default %s%s%s; %s\n  %s\n", t.name.c_str(), t.value.c_str(),
              t.default_value.empty() ? "\"\"" : t.default_value.c_str(),
              t.unit.empty() ? "" : ", unit ", t.unit.c_str(),
              t.dynamic ? "changeable while running" : "fixed while running (restart to change)",
              t.description.c_str());
}

int Status(Client& client) {
  absl::StatusOr<DaemonStats> s = client.GetStats();
  if (!s.ok()) return Fail(s.status());
  std::printf("offloadd %s, pid %u, up %.1f s\n", s->version.c_str(), s->pid,
              static_cast<double>(s->uptime_ms) / 1000.0);
  for (const std::string& l : s->listening) std::printf("listening  %s\n", l.c_str());
  for (const auto& t : s->tiers) {
    std::printf("tier %-5s %s used of %s budget\n", t.name.c_str(),
                HumanBytes(t.used_bytes).c_str(), HumanBytes(t.budget_bytes).c_str());
  }
  std::printf("optimizer  %s\n", s->optimizer.c_str());
  std::printf("sessions   %zu open\n", s->sessions.size());
  return 0;
}

// The columns `text` takes: its characters (UTF-8 continuation bytes take
// none; printf's field widths count bytes).
int Width(const std::string& text) {
  int n = 0;
  for (unsigned char c : text) n += (c & 0xC0) != 0x80;
  return n;
}

// `text` padded with spaces to `width` columns.
std::string Padded(const std::string& text, int width) {
  return text + std::string(std::max(0, width - Width(text)), ' ');
}

int Stats(Client& client) {
  absl::StatusOr<DaemonStats> s = client.GetStats();
  if (!s.ok()) return Fail(s.status());
  int name_width = 24;  // (columns as wide as their longest entry)
  for (const auto& c : s->counters) name_width = std::max(name_width, Width(c.name));
  for (const auto& c : s->counters) {
    std::printf("%-*s %14lld %s\n", name_width, c.name.c_str(), static_cast<long long>(c.value),
                c.unit.c_str());
  }
  // Bytes placed per kind, host/NVMe.
  auto placed = [](uint64_t host, uint64_t nvme) {
    return HumanBytes(host) + "/" + HumanBytes(nvme);
  };
  int session_width = 16;
  for (const auto& x : s->sessions) session_width = std::max(session_width, Width(x.name));
  std::printf("\n%-20s %-*s %6s %5s %10s %6s %21s %21s %21s %5s %12s %9s %21s %9s %10s %9s %-12s\n",
              "SESSION", session_width, "NAME", "PARTS", "HELD", "ARENA", "STEPS",
              "PARAMS HOST/NVME", "GRADS HOST/NVME", "STATE HOST/NVME", "SHARE", "UPDATED",
              "QUEUED S", "NVME READ/WRITTEN", "IO WAIT S", "POOL ROOM", "EVICTED", "TRAINER");
  for (const auto& x : s->sessions) {
    // A trainer gone without closing (its session kept for a resume until
    // the reconnect lease runs out) is not one at work.
    const std::string trainer =
        x.detached_seconds < 0 ? "here" : absl::StrCat("gone ", x.detached_seconds, "s");
    std::printf(
        "%-20llu %s %6llu %5llu %10s %6llu %21s %21s %21s %5lld %12llu %9.3f %21s %9.3f %10s "
        "%9llu %-12s\n",
        static_cast<unsigned long long>(x.id), Padded(x.name, session_width).c_str(),
        static_cast<unsigned long long>(x.partitions), static_cast<unsigned long long>(x.held),
        HumanBytes(x.arena_bytes).c_str(), static_cast<unsigned long long>(x.steps),
        placed(x.params_host_bytes, x.params_nvme_bytes).c_str(),
        placed(x.grads_host_bytes, x.grads_nvme_bytes).c_str(),
        placed(x.state_host_bytes, x.state_nvme_bytes).c_str(),
        static_cast<long long>(x.share_weight), static_cast<unsigned long long>(x.optimizer_params),
        static_cast<double>(x.optimizer_queued_nanos) / 1e9,
        placed(x.nvme_read_bytes, x.nvme_write_bytes).c_str(),
        static_cast<double>(x.io_queued_nanos) / 1e9, HumanBytes(x.pool_room_bytes).c_str(),
        static_cast<unsigned long long>(x.pool_evictions), trainer.c_str());
  }
  // The sessions whose trainers run a GPU tier, as they last reported.
  bool header = false;
  for (const auto& x : s->sessions) {
    if (!x.gpu.has_value()) continue;
    const GpuTierCounters& g = *x.gpu;
    if (!header) {
      header = true;
      std::printf("\n%-20s %10s %10s %10s %9s %9s %8s %10s %17s %9s\n", "GPU TIER OF SESSION",
                  "TO GPU", "STAGED", "FROM GPU", "RESIDENT%", "PREFETCH%", "EVICTED", "ON GPU",
                  "PREFETCH AHEAD", "DMA");
    }
    auto percent = [](uint64_t part, uint64_t whole) {
      return whole == 0 ? 0.0 : 100.0 * static_cast<double>(part) / static_cast<double>(whole);
    };
    const std::string ahead =
        absl::StrCat(g.prefetch_depth, " units/", HumanBytes(g.prefetch_bytes));
    std::printf("%-20llu %10s %10s %10s %8.1f%% %8.1f%% %8llu %10s %17s %9s\n",
                static_cast<unsigned long long>(x.id), HumanBytes(g.h2d_bytes).c_str(),
                HumanBytes(g.h2d_staged_bytes).c_str(), HumanBytes(g.d2h_bytes).c_str(),
                percent(g.resident_hits, g.tensor_uses), percent(g.prefetch_hits, g.tensor_uses),
                static_cast<unsigned long long>(g.evictions),
                (HumanBytes(g.resident_bytes) + "/" + HumanBytes(g.budget_bytes)).c_str(),
                ahead.c_str(), HumanBytes(g.dma_bytes).c_str());
  }
  return 0;
}

// An absolute form of `path`.
std::string Absolute(const std::string& path) {
  if (!path.empty() && path[0] == '/') return path;
  char cwd[4096];
  if (getcwd(cwd, sizeof(cwd)) == nullptr) return path;
  return absl::StrCat(cwd, "/", path);
}

int Checkpoint(Client& client, uint64_t id, const std::string& dir) {
  absl::StatusOr<CheckpointResult> r = client.CheckpointSession(id, Absolute(dir));
  if (!r.ok()) return Fail(r.status());
  std::printf(
      "checkpoint of session %llu at step %llu: %s\n  %llu partitions, %s, %.1f ms "
      "(training paused %.1f ms)\n",
      static_cast<unsigned long long>(id), static_cast<unsigned long long>(r->steps),
      r->manifest.c_str(), static_cast<unsigned long long>(r->partitions),
      HumanBytes(r->bytes).c_str(), static_cast<double>(r->wall_us) / 1000.0,
      static_cast<double>(r->pause_us) / 1000.0);
  return 0;
}

int Export(const std::string& dir, const std::string& output, std::optional<uint64_t> steps) {
  absl::StatusOr<std::unique_ptr<checkpoint::TensorIndex>> index =
      checkpoint::TensorIndex::Load(Absolute(dir), steps);
  if (!index.ok()) return Fail(index.status());
  absl::StatusOr<checkpoint::ExportSummary> s = checkpoint::ExportSafetensors(**index, output);
  if (!s.ok()) return Fail(s.status());
  std::printf("%s: %llu tensors, %llu fp32 values, %s (from %zu session manifests)\n",
              output.c_str(), static_cast<unsigned long long>(s->tensors),
              static_cast<unsigned long long>(s->elements), HumanBytes(s->bytes).c_str(),
              (*index)->manifests().size());
  return 0;
}

// `offloadctl top`: a screen every `interval` from two snapshots.
int Top(Client& client, double interval, int64_t iterations) {
  const bool tty = isatty(STDOUT_FILENO) != 0;
  std::optional<DaemonStats> before;
  auto taken = std::chrono::steady_clock::now();
  for (int64_t i = 0; iterations == 0 || i < iterations; ++i) {
    absl::StatusOr<DaemonStats> now = client.GetStats();
    if (!now.ok()) return Fail(now.status());
    const auto at = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(at - taken).count();
    // A terminal's own width, read each screen (it may have been resized);
    // lines past it would wrap and scroll the redraw away.
    // (Through a pipe: whole lines, every column.)
    int width = tty ? 200 : 1 << 16;
    winsize ws{};
    if (tty && ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) width = ws.ws_col;
    const std::string screen = RenderTop(*now, before ? &*before : nullptr, seconds, width);
    // A terminal is redrawn in place; a pipe gets one screen after another.
    std::fputs(tty ? "\x1b[H\x1b[2J" : (i > 0 ? "\n" : ""), stdout);
    std::fputs(screen.c_str(), stdout);
    std::fflush(stdout);
    before = std::move(*now);
    taken = at;
    if (iterations == 0 || i + 1 < iterations) {
      std::this_thread::sleep_for(std::chrono::duration<double>(interval));
    }
  }
  return 0;
}

// `offloadctl doctor`: see kDoctorUsage.
int Doctor(const ClientOptions& options, const std::vector<std::string>& flags) {
  DoctorSettings settings;
  ConfigRegistry registry;
  BindDoctorTunables(&settings, &registry);
  bool offline = false;
  std::vector<std::pair<std::string, std::string>> given;
  for (const std::string& f : flags) {
    if (f == "--offline") {
      offline = true;
    } else if (absl::StartsWith(f, "--") && f.find('=') != std::string::npos) {
      given.emplace_back(f.substr(2, f.find('=') - 2), f.substr(f.find('=') + 1));
    } else {
      std::fprintf(stderr, "offloadctl doctor: expected --offline or --NAME=VALUE, got '%s'\n%s",
                   f.c_str(), kDoctorUsage);
      return 2;
    }
  }
  DoctorEnvironment environment = ThisMachine();
  std::string source = "offloadd's defaults";
  if (offline) {
    absl::StrAppend(&source, " (--offline)");
  } else {
    ClientOptions quick = options;
    quick.connect_timeout = absl::Seconds(1);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(quick);
    absl::StatusOr<std::vector<Tunable>> live =
        client.ok() ? (*client)->ListTunables() : client.status();
    if (live.ok()) {
      for (const Tunable& t : *live) {
        // The checks' settings only; the rest are the daemon's own.
        if (registry.Get(t.name).ok()) (void)registry.Set(t.name, t.value);
      }
      environment.daemon_running = true;
      // Its own swap directories, before any --nvme.dirs given here.
      environment.daemon_swap_dirs = settings.nvme.DirList();
      source = absl::StrCat("the running offloadd's at ", (*client)->address());
    } else {
      std::string why(live.status().message());
      why = why.substr(0, why.find(" (is it running?"));
      absl::StrAppend(&source, " (", why, ")");
    }
  }
  for (const auto& [name, value] : given) {
    absl::StatusOr<TunableInfo> set = registry.Set(name, value);
    if (set.ok()) continue;
    const bool checked = absl::StartsWith(name, "memory.") || absl::StartsWith(name, "nvme.") ||
                         absl::StartsWith(name, "optimizer.");
    if (set.status().code() == absl::StatusCode::kNotFound && !checked) {
      std::fprintf(stderr, "offloadctl doctor: --%s is no setting the checks use; ignored\n",
                   name.c_str());
      continue;
    }
    std::fprintf(stderr, "offloadctl doctor: --%s: %s\n", name.c_str(),
                 set.status().ToString().c_str());
    return 2;
  }
  std::printf(
      "settings: %s%s\n", source.c_str(),
      given.empty() ? "" : absl::StrCat(", with ", given.size(), " from the command line").c_str());
  const std::vector<Check> checks = RunDoctor(environment, settings);
  std::fputs(FormatReport(checks).c_str(), stdout);
  return ExitStatus(checks);
}

// One line on a command line that names no command (the usage follows).
std::string WhatIsWrong(const std::vector<std::string>& args) {
  static const std::pair<const char*, const char*> kForms[] = {
      {"status", "status"},
      {"stats", "stats"},
      {"config", "config list | config get NAME | config set NAME VALUE"},
      {"checkpoint", "checkpoint ID DIR"},
      {"export", "export [--format=safetensors] [--steps=N] CHECKPOINT_DIR OUTPUT"},
      {"share", "share ID WEIGHT"},
      {"close", "close ID"}};
  for (const auto& [name, form] : kForms) {
    if (args[0] == name) return absl::StrCat("offloadctl: ", name, " is used as: ", form);
  }
  if (args[0] == "set" || args[0] == "get" || args[0] == "list") {
    return absl::StrCat("offloadctl: no command '", args[0], "': settings are 'offloadctl config ",
                        args[0], "'");
  }
  return absl::StrCat("offloadctl: no command '", args[0], "'");
}

int Main(int argc, char** argv) {
  ClientOptions options;
  std::string format = "safetensors";
  bool export_flags = false;  // --format or --steps given (export's alone)
  std::optional<uint64_t> steps;
  std::vector<std::string> args;
  bool help = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (absl::StartsWith(a, "--address=")) {
      options.address = a.substr(10);
    } else if (absl::StartsWith(a, "--format=")) {
      format = a.substr(9);
      export_flags = true;
    } else if (absl::StartsWith(a, "--steps=")) {
      uint64_t n = 0;
      if (!absl::SimpleAtoi(a.substr(8), &n)) {
        std::fprintf(stderr, "offloadctl: --steps takes a number of steps, not '%s'\n",
                     a.substr(8).c_str());
        return 2;
      }
      steps = n;
      export_flags = true;
    } else if (a == "--help" || a == "-h") {
      help = true;
    } else {
      args.push_back(a);
    }
  }
  if (help) {
    std::fputs(!args.empty() && args[0] == "doctor" ? kDoctorUsage : kUsage, stdout);
    return 0;
  }
  if (export_flags && !args.empty() && args[0] != "export") {
    std::fprintf(stderr, "offloadctl: --format and --steps are export's, not %s's\n",
                 args[0].c_str());
    return 2;
  }
  // doctor takes settings as --NAME=VALUE after it.
  if (!args.empty() && args[0] == "doctor") {
    return Doctor(options, std::vector<std::string>(args.begin() + 1, args.end()));
  }
  auto usage = [] {
    std::fputs(kUsage, stderr);
    return 2;
  };
  if (args.empty()) return usage();
  if (args[0] == "top") {
    double interval = 1.0;
    int64_t iterations = 0;
    for (size_t i = 1; i < args.size(); ++i) {
      const std::string& a = args[i];
      // (At most a day: "inf" parses, and would sleep for no time at all.)
      if (absl::StartsWith(a, "--interval=") && absl::SimpleAtod(a.substr(11), &interval) &&
          interval >= 0.05 && interval <= 86400) {
        continue;
      }
      if (absl::StartsWith(a, "--iterations=") && absl::SimpleAtoi(a.substr(13), &iterations) &&
          iterations >= 0) {
        continue;
      }
      std::fprintf(stderr, "offloadctl top: bad argument '%s'\n", a.c_str());
      return usage();
    }
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    if (!client.ok()) return Fail(client.status());
    return Top(**client, interval, iterations);
  }
  const bool known =
      (args[0] == "status" && args.size() == 1) || (args[0] == "stats" && args.size() == 1) ||
      (args[0] == "config" && args.size() == 2 && args[1] == "list") ||
      (args[0] == "config" && args.size() == 3 && args[1] == "get") ||
      (args[0] == "config" && args.size() == 4 && args[1] == "set") ||
      (args[0] == "checkpoint" && args.size() == 3) || (args[0] == "export" && args.size() == 3) ||
      (args[0] == "share" && args.size() == 3) || (args[0] == "close" && args.size() == 2);
  if (!known) {
    std::fprintf(stderr, "%s\n\n", WhatIsWrong(args).c_str());
    return usage();
  }
  // Numbers checked before any connection: a usage error whether or not
  // offloadd runs.
  uint64_t session_id = 0;
  uint32_t weight = 0;
  if ((args[0] == "checkpoint" || args[0] == "share" || args[0] == "close") &&
      !absl::SimpleAtoi(args[1], &session_id)) {
    std::fprintf(stderr, "offloadctl %s: session id '%s' is not a number (ids: offloadctl stats)\n",
                 args[0].c_str(), args[1].c_str());
    return 2;
  }
  if (args[0] == "share" && !absl::SimpleAtoi(args[2], &weight)) {
    std::fprintf(stderr, "offloadctl share: weight '%s' is not a number\n", args[2].c_str());
    return 2;
  }
  if (args[0] == "export") {
    if (format != "safetensors") {
      std::fprintf(stderr, "offloadctl: export writes --format=safetensors only, not '%s'\n",
                   format.c_str());
      return 2;
    }
    return Export(args[1], args[2], steps);
  }

  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  if (!client.ok()) return Fail(client.status());
  Client& c = **client;
  if (args[0] == "status") return Status(c);
  if (args[0] == "stats") return Stats(c);
  if (args[0] == "checkpoint") return Checkpoint(c, session_id, args[2]);
  if (args[0] == "share") {
    if (absl::Status s = c.SetShare(session_id, weight); !s.ok()) return Fail(s);
    std::printf("session %llu: share weight %u\n", static_cast<unsigned long long>(session_id),
                weight);
    return 0;
  }
  if (args[0] == "close") {
    if (absl::Status s = c.CloseUnattachedSession(session_id); !s.ok()) return Fail(s);
    std::printf("session %llu closed\n", static_cast<unsigned long long>(session_id));
    return 0;
  }
  if (args[1] == "list") {
    absl::StatusOr<std::vector<Tunable>> list = c.ListTunables();
    if (!list.ok()) return Fail(list.status());
    auto shown = [](const std::string& v) { return v.empty() ? std::string("\"\"") : v; };
    int w[4] = {28, 16, 16, 9};  // (columns as wide as their longest entry)
    for (const Tunable& t : *list) {
      w[0] = std::max(w[0], Width(t.name));
      w[1] = std::max(w[1], Width(shown(t.value)));
      w[2] = std::max(w[2], Width(shown(t.default_value)));
      w[3] = std::max(w[3], Width(t.unit));
    }
    std::printf("%-*s %-*s %-*s %-*s %s\n", w[0], "NAME", w[1], "VALUE", w[2], "DEFAULT", w[3],
                "UNIT", "DYNAMIC");
    for (const Tunable& t : *list) {
      std::printf("%s %s %s %s %s\n", Padded(t.name, w[0]).c_str(),
                  Padded(shown(t.value), w[1]).c_str(),
                  Padded(shown(t.default_value), w[2]).c_str(), Padded(t.unit, w[3]).c_str(),
                  t.dynamic ? "yes" : "no");
    }
    return 0;
  }
  absl::StatusOr<Tunable> t =
      args[1] == "get" ? c.GetTunable(args[2]) : c.SetTunable(args[2], args[3]);
  if (!t.ok()) return Fail(t.status());
  PrintTunable(*t);
  return 0;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) { return offload::Main(argc, argv); }
