// offloadd: the per-node offload daemon.
//
//   offloadd [--config=FILE.yaml] [--<tunable>=<value> ...]
//
// Every tunable (offloadctl config list, or --help here) has a default, so
// plain `offloadd` works. The config file is applied first, flags after it.
// SIGTERM or SIGINT shuts down cleanly.
#include <signal.h>
#include <sys/resource.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/config_registry.h"
#include "base/log.h"
#include "daemon/config_file.h"
#include "daemon/daemon.h"
#include "daemon/daemon_options.h"
#include "daemon/sd_notify.h"
#include "engine/version.h"

namespace offload {
namespace {

void PrintHelp(const ConfigRegistry& registry) {
  std::printf(
      "offloadd %s: holds ZeRO-3 partitions for the trainers on this node.\n\n"
      "usage: offloadd [--config=FILE.yaml] [--NAME=VALUE ...]\n"
      "       offloadd --print-config   (a config file of every setting, commented out)\n\n"
      "The YAML file nests settings by their dotted names, e.g.\n"
      "  optimizer:\n    threads: 2\n  memory:\n    host_budget_bytes: 8GiB\n\n"
      "Settings (default; * = changeable while running via offloadctl):\n",
      kOffloaddVersion);
  for (const TunableInfo& t : registry.List()) {
    std::printf("  --%s=%s%s\n      %s [%s]\n", t.name.c_str(),
                t.default_value.empty() ? "\"\"" : t.default_value.c_str(), t.dynamic ? " *" : "",
                t.description.c_str(), t.unit.c_str());
  }
}

// --print-config: a config file naming every setting, each commented out
// at its default with its description (the package's /etc/offloadd file).
// Defaults that depend on the machine (the host budget) are said as such.
void PrintConfig(const ConfigRegistry& registry) {
  std::printf(
      "# offloadd's configuration (offloadd --config=FILE). Every setting, commented out\n"
      "# at its default on the machine this was written on; uncomment to change one.\n"
      "# Settings marked 'live' also change while offloadd runs (offloadctl config set, or\n"
      "# edit this file and reload: systemctl reload offloadd); the others at a restart.\n"
      "# Command-line flags (--NAME=VALUE) override this file.\n");
  std::string section;
  for (const TunableInfo& t : registry.List()) {
    const size_t dot = t.name.find('.');
    const std::string head = t.name.substr(0, dot);
    if (head != section) {
      section = head;
      std::printf("\n#%s:\n", section.c_str());
    }
    std::vector<std::string> words = absl::StrSplit(t.description, ' ');
    std::string line = "#   #";
    for (const std::string& w : words) {
      if (line.size() + 1 + w.size() > 96) {
        std::printf("%s\n", line.c_str());
        line = "#   #";
      }
      absl::StrAppend(&line, " ", w);
    }
    std::printf("%s\n#   # [%s%s]\n#   %s: %s\n", line.c_str(), t.unit.c_str(),
                t.dynamic ? ", live" : "", t.name.substr(dot + 1).c_str(),
                t.default_value.empty() ? "\"\"" : t.default_value.c_str());
  }
}

// Raises the soft limit on open descriptors to the hard one: every trainer
// holds connections and shares memory through descriptors, and running out
// (EMFILE) leaves gRPC 1.51's listener deaf until restart.
void RaiseDescriptorLimit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur >= lim.rlim_max) return;
  const rlim_t before = lim.rlim_cur;
  lim.rlim_cur = lim.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &lim) == 0) {
    LogInfo("open descriptors: limit raised from %d to %d", static_cast<int64_t>(before),
            static_cast<int64_t>(lim.rlim_cur));
  }
}

// SIGHUP: the config file again, what can change live applied (and said),
// what cannot said to need a restart.
void Reload(ConfigRegistry& registry, const std::string& config_file,
            const std::vector<std::string>& from_command_line,
            std::vector<std::string>* from_file) {
  if (config_file.empty()) {
    LogWarning(
        "SIGHUP: no --config file to re-read; settings change live with offloadctl config set");
    return;
  }
  absl::StatusOr<ConfigReload> r =
      ReloadYamlFile(registry, config_file, from_command_line, from_file);
  if (!r.ok()) {
    LogError("SIGHUP: %s; nothing changed", r.status().ToString());
    return;
  }
  LogInfo("SIGHUP: re-read %s: %d setting(s) applied%s%s", config_file,
          static_cast<int64_t>(r->applied.size()),
          r->applied.empty() ? "" : absl::StrCat(" (", absl::StrJoin(r->applied, ", "), ")"),
          r->kept.empty()
              ? ""
              : absl::StrCat("; the file's value not applied where the command line sets it (",
                             absl::StrJoin(r->kept, ", "), ")"));
  if (!r->need_restart.empty()) {
    LogWarning("SIGHUP: %s cannot change while offloadd runs: it takes effect at the next start",
               absl::StrJoin(r->need_restart, ", "));
  }
  if (!r->refused.empty()) {
    LogError("SIGHUP: refused (the value in force stays): %s", absl::StrJoin(r->refused, "; "));
  }
}

int Main(int argc, char** argv) {
  DaemonOptions options;
  ConfigRegistry registry;
  BindTunables(&options, &registry);

  std::string config_file;
  std::vector<std::string> from_file;  // the settings the config file set (a reload updates it)
  std::vector<std::pair<std::string, std::string>> flags;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      PrintHelp(registry);
      return 0;
    }
    if (arg == "--print-config") {
      PrintConfig(registry);
      return 0;
    }
    if (!absl::StartsWith(arg, "--") || arg.find('=') == std::string::npos) {
      std::fprintf(stderr, "offloadd: expected --NAME=VALUE, got '%s' (see --help)\n", arg.c_str());
      return 2;
    }
    std::string name = arg.substr(2, arg.find('=') - 2);
    std::string value = arg.substr(arg.find('=') + 1);
    if (name == "config") {
      config_file = value;
    } else {
      flags.emplace_back(name, value);
    }
  }
  if (!config_file.empty()) {
    if (absl::Status s = ApplyYamlFile(registry, config_file, &from_file); !s.ok()) {
      std::fprintf(stderr, "offloadd: %s\n", s.ToString().c_str());
      return 2;
    }
  }
  std::vector<std::string> from_command_line;
  for (const auto& [name, value] : flags) {
    from_command_line.push_back(name);
    if (auto s = registry.Set(name, value); !s.ok()) {
      std::fprintf(stderr, "offloadd: --%s: %s\n", name.c_str(), s.status().ToString().c_str());
      return 2;
    }
  }

  // A log line to a pipe whose reader went (offloadd 2>&1 | tee, the tee
  // ended) is an EPIPE to ignore, not a signal that ends every session.
  // (systemd ignores SIGPIPE for its services already.)
  signal(SIGPIPE, SIG_IGN);

  // Block the shutdown signals in every thread; this one waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  RaiseDescriptorLimit();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(&options, &registry);
  if (!daemon.ok()) {
    LogError("cannot start: %s", daemon.status().ToString());
    return 1;
  }
  LogInfo("offloadd %s started (pid %d)", kOffloaddVersion, getpid());
  for (const std::string& line : (*daemon)->Describe()) LogInfo("%s", line);
  if (!config_file.empty()) LogInfo("configuration from %s", config_file);

  // Serving: a service manager waiting for readiness (Type=notify) learns it.
  if (absl::Status n = NotifySystemd("READY=1"); !n.ok()) LogWarning("%s", n.ToString());
  int signal_number = 0;
  for (;;) {
    sigwait(&signals, &signal_number);
    if (signal_number != SIGHUP) break;
    NotifySystemd("RELOADING=1").IgnoreError();
    Reload(registry, config_file, from_command_line, &from_file);
    NotifySystemd("READY=1").IgnoreError();
  }
  NotifySystemd("STOPPING=1").IgnoreError();
  LogInfo("received %s, shutting down", signal_number == SIGINT ? "SIGINT" : "SIGTERM");
  const int lost = (*daemon)->Shutdown();
  daemon->reset();
  if (lost > 0) {
    // (A service manager sees the stop fail: state went.)
    LogError(
        "stopped; %d session(s) could not be kept across the restart (said above): "
        "what they held is lost but for their automatic checkpoints",
        lost);
    return 1;
  }
  LogInfo("stopped cleanly");
  return 0;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) { return offload::Main(argc, argv); }
