#include "daemon/daemon.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <ctime>
#include <filesystem>
#include <fstream>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/directory.h"
#include "base/file_io.h"
#include "base/host_memory.h"
#include "base/log.h"
#include "base/memory_limit.h"
#include "base/posix_error.h"
#include "base/status_macros.h"
#include "base/unique_fd.h"
#include "checkpoint/format.h"
#include "daemon/sd_notify.h"
#include "engine/kept_sessions.h"
#include "ipc/paths.h"
#include "ipc/unix_socket.h"
#include "nvme/io_backend_factory.h"

namespace offload {
namespace {

// The directory above `path` that members of group `gid` may not search
// (neither theirs with g+x nor anyone's with o+x), with its mode; empty if
// they reach `path`'s directory. (A member who is also the directory's
// owner is not told apart.)
std::string DirectoryBlockingGroup(const std::string& path, gid_t gid) {
  for (std::filesystem::path dir = std::filesystem::path(path).parent_path(); !dir.empty();
       dir = dir.parent_path()) {
    struct stat st;
    if (stat(dir.c_str(), &st) != 0) return "";
    const bool searchable = (st.st_mode & S_IXOTH) || (st.st_gid == gid && (st.st_mode & S_IXGRP));
    if (!searchable) return absl::StrFormat("%s (mode %04o)", dir.string(), st.st_mode & 07777);
    if (dir == dir.root_path()) break;
  }
  return "";
}

// Before each kept session is written or read back: systemd (Type=notify)
// is told to wait a while longer for the start or the stop, and what is
// under way (a session of 100 GB takes minutes at the disk's speed; the
// unit's timeouts are for the daemon itself).
EachKeptSession TellSystemdToWait(const char* doing) {
  return [doing](uint64_t id) {
    NotifySystemd(absl::StrCat("EXTEND_TIMEOUT_USEC=", int64_t{600} * 1000 * 1000,
                               "\nSTATUS=", doing, " kept session ", id))
        .IgnoreError();
  };
}

// The placement tunables, one per kind of data.
struct PlacementTunable {
  DataKind kind;
  const char* name;
  const int64_t* value;
};
std::array<PlacementTunable, kDataKinds> PlacementTunables(const PlacementOptions& o) {
  return {{{DataKind::kParams, "placement.params_host_percent", &o.params_host_percent},
           {DataKind::kGrads, "placement.grads_host_percent", &o.grads_host_percent},
           {DataKind::kOptimizerState, "placement.optimizer_state_host_percent",
            &o.optimizer_state_host_percent}}};
}

// memory.max_mappings resolved: -1 is three quarters of vm.max_map_count
// (65530 where it cannot be read, the kernel's default).
int64_t MappingBudget(int64_t setting) {
  if (setting >= 0) return setting;
  int64_t max_map_count = 65530;
  std::ifstream f("/proc/sys/vm/max_map_count");
  int64_t v;
  if (f >> v && v > 0) max_map_count = v;
  return max_map_count / 4 * 3;
}

// memory.pool_dir belongs to the offloadd of one data directory (its first
// start there writes which): another one's start would take the kept
// memory there for litter, its sessions being kept in another directory.
// The directory is checked first (this user's, writable by no one else),
// and the marker read as a regular file of at most a path's length: no
// FIFO, device or link another user planted stops or floods the start.
absl::Status ClaimPoolDir(const std::string& pool_dir, const std::string& data_dir) {
  RETURN_IF_ERROR(CheckPrivateDir(pool_dir));
  const std::string marker = absl::StrCat(pool_dir, "/data_dir");
  std::string owner;
  UniqueFd in(open(marker.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (in.valid()) {
    struct stat st;
    if (fstat(in.get(), &st) != 0) return PosixError(absl::StrCat("stat of ", marker), errno);
    if (!S_ISREG(st.st_mode) || st.st_size > PATH_MAX) {
      return absl::FailedPreconditionError(
          absl::StrCat(marker, " is not the file offloadd writes there: remove it"));
    }
    owner.resize(static_cast<size_t>(st.st_size));
    size_t missing = 0;
    if (int err = PreadAll(in.get(), owner.data(), owner.size(), 0, &missing); err > 0) {
      return PosixError(absl::StrCat("reading ", marker), err);
    }
    owner.resize(owner.size() - missing);  // (shorter than it said: what was there)
  } else if (errno == ENOENT) {
    RETURN_IF_ERROR(WriteFileAtomically(pool_dir, "data_dir", data_dir));
    owner = data_dir;
  } else {
    return PosixError(absl::StrCat("opening ", marker), errno);
  }
  if (owner != data_dir) {
    return absl::FailedPreconditionError(
        absl::StrCat("memory.pool_dir ", pool_dir, " belongs to the offloadd of data directory ",
                     owner, " (", marker, "), not ", data_dir, ": give each its own"));
  }
  return absl::OkStatus();
}

// <data_dir>/offloadd.lock, locked for this process, holding its pid;
// FAILED_PRECONDITION naming the pid that holds it. (Another offloadd with
// its own socket in the same data directory would reopen the same kept
// sessions, mark the first one's live checkpoints lost and replace its
// token.)
absl::StatusOr<UniqueFd> LockDataDir(const std::string& data_dir) {
  const std::string path = absl::StrCat(data_dir, "/offloadd.lock");
  UniqueFd fd(open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd.valid()) return PosixError(absl::StrCat("opening ", path), errno);
  if (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) return PosixError(absl::StrCat("locking ", path), errno);
    char pid[32] = {};
    (void)!pread(fd.get(), pid, sizeof(pid) - 1, 0);
    return absl::FailedPreconditionError(
        absl::StrCat("data directory ", data_dir, " is in use by another offloadd (pid ",
                     absl::StripAsciiWhitespace(pid), ", ", path,
                     "): give each offloadd its own server.data_dir"));
  }
  const std::string mine = absl::StrCat(getpid(), "\n");
  if (ftruncate(fd.get(), 0) != 0 || PwriteAll(fd.get(), mine.data(), mine.size(), 0) != 0) {
    return PosixError(absl::StrCat("writing ", path), errno);
  }
  return fd;
}

}  // namespace

Daemon::Daemon(DaemonOptions* options, ConfigRegistry* registry)
    : options_(options), registry_(registry) {}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(DaemonOptions* options,
                                                      ConfigRegistry* registry) {
  std::unique_ptr<Daemon> d(new Daemon(options, registry));
  const ServerOptions& server = options->server;
  // The data directory first: a second offloadd there touches nothing (not
  // the pool's directory, the NVMe swap files, nor a socket it would judge
  // stale) and names the first's pid.
  RETURN_IF_ERROR(MakeDirs(server.data_dir));
  RETURN_IF_ERROR(CheckPrivateDir(server.data_dir));
  ASSIGN_OR_RETURN(d->data_dir_lock_, LockDataDir(server.data_dir));
  ASSIGN_OR_RETURN(d->host_home_pages_,
                   ResolveHostHomePages(options->memory.host_home_pages, DamonMonitors()));
  RETURN_IF_ERROR(CheckHostBudget(options->memory.host_budget_bytes, ReadMemoryLimit()));
  EngineOptions e;
  e.host_budget_bytes = static_cast<uint64_t>(options->memory.host_budget_bytes);
  e.lock_pool = options->memory.lock_pool;
  if (!options->memory.pool_dir.empty()) {
    RETURN_IF_ERROR(MakeDirs(options->memory.pool_dir));
    RETURN_IF_ERROR(ClaimPoolDir(options->memory.pool_dir, options->server.data_dir));
    e.pool_dir = options->memory.pool_dir;
  }
  e.optimizer = options->optimizer;
  e.swapper = options->swapper;
  e.swapper.host_home_pages = d->host_home_pages_.pages;
  const bool nvme = !options->nvme.DirList().empty();
  for (const auto& [kind, name, value] : PlacementTunables(options->placement)) {
    e.placement[kind] = static_cast<int>(*value);
    absl::Status ok = PartitionStoreFactory::CheckPlacement(kind, e.placement[kind], nvme);
    if (!ok.ok()) return absl::Status(ok.code(), absl::StrCat(name, ": ", ok.message()));
  }
  e.state_chunk_elems = static_cast<uint64_t>(options->placement.state_chunk_bytes) / sizeof(float);
  e.session_arena_bytes = static_cast<uint64_t>(options->memory.session_arena_bytes);
  e.huge_page_bytes = options->memory.arena_huge_pages ? SharedHugePageBytes() : 0;
  if (nvme) {
    ASSIGN_OR_RETURN(d->io_, MakeIoBackend(options->nvme.io));
    e.nvme = options->nvme;
  }
  ASSIGN_OR_RETURN(d->engine_, Engine::Create(e, Env::Default(), d->io_.get()));
  if (options->memory.arena_huge_pages && SharedHugePageBytes() == 0 && nvme) {
    LogWarning(
        "shared memory gets no huge pages on this node "
        "(/sys/kernel/mm/transparent_hugepage/shmem_enabled is never or deny): parameters and "
        "gradients placed on NVMe are swapped on 4 KiB pages, slower than on 2 MiB ones, and "
        "trainers take a page fault on each 4 KiB page they touch; as root, "
        "'echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled' before starting "
        "offloadd lifts that");
  }
  SessionManager& sessions = d->engine_->sessions();
  d->ring_service_ = std::make_unique<RingService>(&sessions, &d->engine_->stats(), &d->calls_);
  sessions.SetRingCalls(d->ring_service_.get());
  sessions.SetRingSpin(absl::Microseconds(options->server.ring_spin_us));
  sessions.SetGpuTierSettings({options->gpu.prefetch_depth, options->gpu.prefetch_bytes});
  sessions.SetMappingBudget(MappingBudget(options->memory.max_mappings));
  sessions.SetMaxSessions(options->server.max_sessions);
  sessions.SetMaxSessionsPerUser(options->server.max_sessions_per_user);
  sessions.SetCaptureThreads(static_cast<int>(options->checkpoint.write_threads));
  d->socket_path_ = server.socket.empty() ? SocketPathIn(server.data_dir) : server.socket;
  RETURN_IF_ERROR(ClaimSocketPath(d->socket_path_));
  // Sessions the previous offloadd kept when it stopped (Shutdown), before
  // any call or lease can reach them.
  const std::string kept = d->PreservedDir();
  d->engine_->sessions().SetKeptDirectory(kept);  // (no trainer's checkpoint goes there)
  // The automatic checkpoints' directory known before the kept sessions
  // are reopened: one that restored a lost session's checkpoint there goes
  // on removing it once two of its own are in.
  // (Resolved here, not in the setting: a reload of a config file that
  // leaves it empty would see it changed.)
  d->auto_checkpoint_dir_ = options->checkpoint.dir.empty()
                                ? absl::StrCat(server.data_dir, "/auto-checkpoints")
                                : options->checkpoint.dir;
  d->ApplyAutoCheckpoint();
  // Should the start fail after the kept sessions were reopened (a group
  // that does not exist, a port taken), they are kept again, as a stop
  // keeps them: reopening took what the pool's file held (memory.pool_dir)
  // out of the previous offloadd's keeping.
  int reopened = 0;
  bool started = false;
  absl::Cleanup keep_again = [&] {
    if (started || reopened == 0) return;
    KeptBytes bytes;
    const int n = KeepSessions(d->engine_->sessions(), kept, d->engine_->pool().file(), &bytes,
                               TellSystemdToWait("keeping"));
    LogWarning("offloadd did not start: the %d session(s) it reopened are kept again (%d)",
               reopened, n);
  };
  if (access(kept.c_str(), F_OK) == 0) {
    if (server.reconnect_lease_seconds > 0) {
      const int n = ReopenKeptSessions(d->engine_->sessions(), kept, d->engine_->pool().file(),
                                       TellSystemdToWait("reopening"));
      reopened = n;
      LogInfo(
          "reopened %d session(s) kept across the restart; their trainers have %d s to "
          "resume them",
          n, static_cast<int>(server.reconnect_lease_seconds));
    } else {
      LogWarning(
          "sessions kept by the previous offloadd are in %s; with "
          "server.reconnect_lease_seconds 0 they are not reopened",
          kept);
    }
  }
  RETURN_IF_ERROR(d->StartAutoCheckpoints());
  std::optional<gid_t> group;
  if (!server.socket_group.empty()) {
    absl::StatusOr<gid_t> gid = GroupNamed(server.socket_group);
    if (!gid.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("server.socket_group: ", gid.status().message()));
    }
    group = *gid;
    if (const std::string blocked = DirectoryBlockingGroup(d->socket_path_, *gid);
        !blocked.empty()) {
      LogWarning(
          "server.socket_group %s: its members cannot reach the socket %s: the directory %s is "
          "not theirs to search; give the socket a directory they may search (server.socket, "
          "as the packaged service's /run/offloadd)",
          server.socket_group, d->socket_path_, blocked);
    }
  }
  ASSIGN_OR_RETURN(
      d->arena_channel_,
      ArenaChannel::Start(
          absl::StrCat(d->socket_path_, ".arena"), &d->engine_->sessions(),
          absl::Seconds(server.attach_lease_seconds), absl::Seconds(server.idle_lease_seconds),
          absl::Seconds(server.reconnect_lease_seconds), group, server.max_sessions_per_user));

  if (server.tcp_port >= 0 || group.has_value()) {
    ASSIGN_OR_RETURN(std::string token, d->WriteTcpToken());
    d->guard_ = std::make_unique<AccessGuard>(std::move(token), d->tcp_token_path_,
                                              /*group_shared=*/group.has_value());
  } else {
    d->guard_ = std::make_unique<AccessGuard>("", "");
  }
  d->partition_service_ = std::make_unique<PartitionServiceImpl>(
      &d->engine_->sessions(), &d->engine_->stats(), &d->calls_, d->guard_.get(),
      d->arena_channel_->path(), absl::Seconds(server.idle_lease_seconds));
  d->partition_service_->LimitCallsPerUser(std::max(2, static_cast<int>(server.max_threads) / 4));
  d->config_service_ = std::make_unique<ConfigServiceImpl>(registry, d->guard_.get());
  ServerIdentity identity;
  identity.started = absl::Now();
  identity.listening.push_back(absl::StrCat("unix:", d->socket_path_));

  Daemon* raw = d.get();
  d->stats_service_ = std::make_unique<StatsServiceImpl>(
      [raw] { return raw->Snapshot(); }, &d->engine_->optimizer(), identity, d->guard_.get());
  d->partition_service_->SetReservedDescriptors(server.reserved_descriptors);
  GrpcServerOptions listen;
  listen.unix_path = d->socket_path_;
  listen.tcp_port = static_cast<int>(server.tcp_port);
  listen.max_threads = static_cast<int>(server.max_threads);
  listen.max_streams_per_connection = static_cast<int>(server.max_streams_per_connection);
  listen.handshake_timeout = absl::Seconds(server.handshake_timeout_seconds);
  listen.idle_timeout = absl::Seconds(server.idle_connection_seconds);
  listen.reserved_descriptors = server.reserved_descriptors;
  listen.group = group;
  listen.max_connections_per_user = server.max_connections_per_user;
  listen.counters = &d->connections_;
  ASSIGN_OR_RETURN(d->server_,
                   GrpcServer::Start(listen, {d->partition_service_.get(), d->config_service_.get(),
                                              d->stats_service_.get()}));
  d->tcp_port_ = d->server_->tcp_port();
  if (d->tcp_port_ >= 0) {
    // The port is known only now that the server runs.
    d->stats_service_->AddListening(absl::StrCat("127.0.0.1:", d->tcp_port_));
  }

  if (options->metrics.port >= 0) {
    const bool names = options->metrics.session_names;
    ASSIGN_OR_RETURN(d->metrics_,
                     MetricsServer::Start(static_cast<int>(options->metrics.port), [raw, names] {
                       DaemonSnapshot s = raw->Snapshot();
                       if (!names) {
                         for (auto& x : s.sessions) x.name.clear();
                       }
                       return s;
                     }));
    // (Its port is known only now: metrics.port 0 has the kernel choose.)
    d->stats_service_->AddListening(
        absl::StrCat("http://127.0.0.1:", d->metrics_->port(), "/metrics"));
  }
  d->SetHooks();
  RETURN_IF_ERROR(registry->Freeze());
  started = true;
  return d;
}

void Daemon::SetHooks() {
  Daemon* raw = this;
  registry_->SetHook<int64_t>("optimizer.threads", [raw](const int64_t& v) {
    return raw->engine_->optimizer().SetThreads(v);
  });
  registry_->SetHook<int64_t>("optimizer.tile_elems", [raw](const int64_t& v) {
    return raw->engine_->optimizer().SetTileElems(v);
  });
  registry_->SetHook<std::string>("optimizer.kernel", [raw](const std::string& v) {
    return raw->engine_->optimizer().SetKernel(v);
  });
  registry_->SetHook<bool>("optimizer.check_finite", [raw](const bool& v) {
    raw->engine_->optimizer().SetCheckFinite(v);
    return absl::OkStatus();
  });
  registry_->SetHook<bool>("nvme.checksum", [raw](const bool& v) {
    if (raw->engine_->swap_space() != nullptr) raw->engine_->swap_space()->SetChecksum(v);
    return absl::OkStatus();
  });
  registry_->SetHook<int64_t>("nvme.queue_depth", [raw](const int64_t& v) {
    return raw->io_ != nullptr ? raw->io_->SetQueueDepth(v) : absl::OkStatus();
  });
  registry_->SetHook<int64_t>("nvme.request_bytes", [raw](const int64_t& v) {
    return raw->io_ != nullptr ? raw->io_->SetRequestBytes(v) : ValidateRequestBytes(v);
  });
  registry_->SetHook<int64_t>("nvme.submit_batch", [raw](const int64_t& v) {
    return raw->io_ != nullptr ? raw->io_->SetSubmitBatch(v) : absl::OkStatus();
  });
  registry_->SetHook<int64_t>("server.ring_spin_us", [raw](const int64_t& v) {
    raw->engine_->sessions().SetRingSpin(absl::Microseconds(v));
    return absl::OkStatus();
  });
  registry_->SetHook<int64_t>("memory.host_budget_bytes", [raw](const int64_t& v) {
    RETURN_IF_ERROR(CheckHostBudget(v, ReadMemoryLimit()));
    // State homed on the host never leaves the pool: a budget below it
    // would fail every session's next step, not free anything.
    const uint64_t homed = raw->engine_->swapper().Stats().host_home_charged_bytes;
    if (static_cast<uint64_t>(v) < homed) {
      return absl::FailedPreconditionError(absl::StrCat(
          "memory.host_budget_bytes ", v, " is below the ", homed,
          " bytes the pool holds for state the sessions placed on the host, which never leaves "
          "it: set more than that (their holds and swaps need room besides), or place state on "
          "NVMe first (the budget in force stays)"));
    }
    raw->engine_->pool().SetLimit(static_cast<uint64_t>(v));
    raw->engine_->swapper().Trim();  // gives cached state back if the pool is now over
    if (const uint64_t used = raw->engine_->pool().used(); used > static_cast<uint64_t>(v)) {
      LogWarning(
          "memory.host_budget_bytes is now %d, below the %d bytes the pool holds (held by "
          "trainers or being written out): new holds wait until it is under",
          v, static_cast<int64_t>(used));
    }
    return absl::OkStatus();
  });
  registry_->SetHook<int64_t>("memory.session_arena_bytes", [raw](const int64_t& v) {
    raw->engine_->store().SetArenaCapacity(static_cast<uint64_t>(v));
    return absl::OkStatus();
  });
  for (const auto& [kind, name, value] : PlacementTunables(options_->placement)) {
    registry_->SetHook<int64_t>(name, [raw, kind = kind](const int64_t& v) {
      RETURN_IF_ERROR(PartitionStoreFactory::CheckPlacement(kind, static_cast<int>(v),
                                                            raw->engine_->swap_space() != nullptr));
      raw->engine_->store().SetDefaultPlacement(kind, static_cast<int>(v));
      return absl::OkStatus();
    });
  }
  registry_->SetHook<int64_t>("memory.max_mappings", [raw](const int64_t& v) {
    raw->engine_->sessions().SetMappingBudget(MappingBudget(v));
    return absl::OkStatus();
  });
  registry_->SetHook<int64_t>("checkpoint.auto_interval_seconds", [raw](const int64_t& v) {
    raw->options_->checkpoint.interval_seconds = v;
    raw->ApplyAutoCheckpoint();
    return absl::OkStatus();
  });
  registry_->SetHook<int64_t>("checkpoint.auto_every_steps", [raw](const int64_t& v) {
    raw->options_->checkpoint.every_steps = v;
    raw->ApplyAutoCheckpoint();
    return absl::OkStatus();
  });
  registry_->SetHook<int64_t>("checkpoint.write_threads", [raw](const int64_t& v) {
    raw->engine_->sessions().SetCaptureThreads(static_cast<int>(v));
    return absl::OkStatus();
  });
  registry_->SetHook<int64_t>("gpu.prefetch_depth", [raw](const int64_t& v) {
    raw->engine_->sessions().SetGpuTierSettings({v, raw->options_->gpu.prefetch_bytes});
    return absl::OkStatus();
  });
  registry_->SetHook<int64_t>("gpu.prefetch_bytes", [raw](const int64_t& v) {
    raw->engine_->sessions().SetGpuTierSettings({raw->options_->gpu.prefetch_depth, v});
    return absl::OkStatus();
  });
  registry_->SetHook<int64_t>("swapper.prefetch_depth", [raw](const int64_t& v) {
    raw->engine_->swapper().SetPrefetch(v, raw->options_->swapper.prefetch_bytes);
    return absl::OkStatus();
  });
  registry_->SetHook<int64_t>("swapper.prefetch_bytes", [raw](const int64_t& v) {
    raw->engine_->swapper().SetPrefetch(raw->options_->swapper.prefetch_depth, v);
    return absl::OkStatus();
  });
}

absl::StatusOr<std::string> Daemon::WriteTcpToken() {
  unsigned char raw[16];
  RETURN_IF_ERROR(Env::Default()->RandomBytes(raw, sizeof(raw)));
  std::string token;
  for (unsigned char c : raw) absl::StrAppend(&token, absl::Hex(c, absl::kZeroPad2));
  tcp_token_path_ = TcpTokenPathIn(options_->server.data_dir);
  unlink(tcp_token_path_.c_str());  // ours from a previous run, or a stale one
  UniqueFd fd(open(tcp_token_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd.valid()) return PosixError(absl::StrCat("creating ", tcp_token_path_), errno);
  if (write(fd.get(), token.data(), token.size()) != static_cast<ssize_t>(token.size())) {
    return PosixError(absl::StrCat("writing ", tcp_token_path_), errno);
  }
  return token;
}

DaemonSnapshot Daemon::Snapshot() const {
  DaemonSnapshot s;
  s.counters = engine_->stats().Snapshot();
  AppendSwapperCounters(engine_->swapper().Stats(), &s.counters);
  auto v = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
  s.counters.push_back({"grpc_unix_connections_accepted", v(connections_.accepted), "connections"});
  s.counters.push_back({"grpc_unix_connections_refused", v(connections_.refused), "connections"});
  s.counters.push_back({"grpc_unix_connections_dropped", v(connections_.dropped), "connections"});
  s.counters.push_back({"grpc_unix_accept_pauses", v(connections_.accept_pauses), "pauses"});
  s.counters.push_back(
      {"grpc_tcp_listener_rebuilds", v(connections_.listener_rebuilds), "rebuilds"});
  s.tiers.push_back({"host", engine_->pool().used(), engine_->pool().limit()});
  // The pool's spares: evicted blocks' pages waiting for reads from NVMe,
  // charged but not in the host tier's use.
  s.counters.push_back({"pool_spare_bytes", static_cast<int64_t>(engine_->pool().spare_bytes()),
                        "bytes", /*gauge=*/true});
  s.counters.push_back(
      {"pool_spares_taken", static_cast<int64_t>(engine_->pool().spares_taken()), "leases"});
  // The mappings the daemon holds (small partitions' spans share one per
  // arena window) against memory.max_mappings (0: no budget).
  s.counters.push_back({"memory_mappings", HostMemory::LiveMappings(), "mappings", /*gauge=*/true});
  s.counters.push_back(
      {"memory_mapping_budget", engine_->sessions().mapping_budget(), "mappings", /*gauge=*/true});
  if (engine_->swap_space() != nullptr) {
    const SwapStats nvme = engine_->swap_space()->Stats();
    s.tiers.push_back({"nvme", nvme.capacity - nvme.free, nvme.capacity});
  }
  s.sessions = engine_->sessions().Sessions();
  return s;
}

std::vector<std::string> Daemon::Describe() const {
  std::vector<std::string> lines;
  lines.push_back(
      absl::StrCat("serving gRPC on unix:", socket_path_,
                   options_->server.socket_group.empty()
                       ? " (owner-only)"
                       : absl::StrCat(" (owner and group ", options_->server.socket_group, ")")));
  if (tcp_port_ >= 0) {
    lines.push_back(absl::StrCat("serving gRPC on 127.0.0.1:", tcp_port_,
                                 " (read-only status; more with the token in ", tcp_token_path_,
                                 ")"));
  }
  lines.push_back(absl::StrCat("arena channel on ", arena_channel_->path()));
  if (metrics_ != nullptr) {
    lines.push_back(
        absl::StrCat("metrics (Prometheus) on http://127.0.0.1:", metrics_->port(), "/metrics"));
  }
  lines.push_back(absl::StrCat(
      "tier host: budget ", FormatByteSize(static_cast<int64_t>(engine_->pool().limit())),
      " (one pool for every session's arena and optimizer state",
      options_->memory.lock_pool ? ", locked where permitted" : "", "); per-session arena up to ",
      FormatByteSize(options_->memory.session_arena_bytes)));
  lines.push_back(absl::StrCat(
      "host pool: state homed on the host on ",
      host_home_pages_.pages == Pages::kSmall ? "4 KiB pages" : "pages asking for 2 MiB", " (",
      host_home_pages_.why, "); blocks homed on NVMe brought in on pages asking for 2 MiB"));
  const uint64_t huge = SharedHugePageBytes();
  lines.push_back(absl::StrCat(
      "session arenas: ",
      !options_->memory.arena_huge_pages ? "4 KiB pages (memory.arena_huge_pages is false)"
      : huge == 0 ? "4 KiB pages (the kernel gives shared memory no huge pages: "
                    "/sys/kernel/mm/transparent_hugepage/shmem_enabled)"
                  : absl::StrCat("large partitions on ", FormatByteSize(static_cast<int64_t>(huge)),
                                 " pages")));
  lines.push_back("tier gpu: none (no CUDA device support in this build)");
  if (engine_->swap_space() == nullptr) {
    lines.push_back("tier nvme: off (set nvme.dirs to enable)");
  } else {
    SwapStats s = engine_->swap_space()->Stats();
    std::vector<std::string> files;
    for (const auto& d : s.dirs) {
      files.push_back(absl::StrCat(d.path, d.direct ? " (O_DIRECT)" : " (buffered)"));
    }
    lines.push_back(absl::StrCat("tier nvme: ", FormatByteSize(static_cast<int64_t>(s.capacity)),
                                 " preallocated in ", absl::StrJoin(files, ", "), "; ", io_->name(),
                                 " backend, queue depth ", options_->nvme.io.queue_depth,
                                 ", checksums ", options_->nvme.checksum ? "on" : "off"));
  }
  lines.push_back(absl::StrCat("placement on the host by default: params ",
                               options_->placement.params_host_percent, "%, grads ",
                               options_->placement.grads_host_percent, "%, optimizer state ",
                               options_->placement.optimizer_state_host_percent, "%; prefetch ",
                               options_->swapper.prefetch_depth, " uses / ",
                               FormatByteSize(options_->swapper.prefetch_bytes), " ahead"));
  lines.push_back(absl::StrCat("optimizer: ", engine_->optimizer().kernel_name(), " Adam on ",
                               engine_->optimizer().threads(), " threads, non-finite check ",
                               options_->optimizer.check_finite ? "on" : "off"));
  lines.push_back(absl::StrCat("data directory ", options_->server.data_dir));
  return lines;
}

namespace {
// In a lost session's automatic checkpoint directory: when a start first
// found it lost (its modification time).
constexpr char kLostSinceFile[] = ".lost_since";
}  // namespace

absl::Status Daemon::StartAutoCheckpoints() {
  const AutoCheckpointNodeOptions& o = options_->checkpoint;
  const std::string& root = auto_checkpoint_dir_;
  RETURN_IF_ERROR(MakeDirs(root));
  RETURN_IF_ERROR(CheckPrivateDir(root));
  SessionManager& sessions = engine_->sessions();
  // What a crashed predecessor left: every directory no open session (one
  // kept across a restart) owns.
  absl::flat_hash_set<uint64_t> open;
  for (const SessionSummary& s : sessions.Sessions()) open.insert(s.id);
  int lost = 0;
  for (const std::string& name : ListDirectory(root)) {
    if (absl::StrContains(name, SessionManager::kClosingSuffix)) {
      // A closed session's, renamed aside but not yet removed at the crash.
      RemoveDirectoryOfFiles(absl::StrCat(root, "/", name));
      continue;
    }
    uint64_t id = 0;
    if (!absl::SimpleAtoi(name, &id) || open.contains(id)) continue;
    const std::string dir = absl::StrCat(root, "/", name);
    if (sessions.RestoresAutomaticCheckpoint(dir)) continue;  // a reopened session's source
    if (const std::string kept = absl::StrCat(PreservedDir(), "/", name); IsDirectory(kept)) {
      // Kept by a stop and not reopened (said above): not lost, and its
      // kept state is newer than this checkpoint.
      LogWarning(
          "session %d was kept across the restart in %s but not reopened (see above); its "
          "automatic checkpoint, of an earlier step, is in %s (OpenSession with restore_from %s "
          "resumes from it where the kept one cannot be reopened)",
          static_cast<int64_t>(id), kept, dir, dir);
      continue;
    }
    absl::StatusOr<std::vector<std::pair<std::string, checkpoint::Manifest>>> manifests =
        checkpoint::ReadManifests(dir);
    if (!manifests.ok() && ListDirectory(dir).empty()) {
      RemoveDirectoryOfFiles(dir);  // (one a session made and never checkpointed into)
      continue;
    }
    // Aged from when a start first found it lost (its marker's time), not
    // from its checkpoint's: a node that was off for long keeps what its
    // jobs would resume from.
    const std::string marker = absl::StrCat(dir, "/", kLostSinceFile);
    struct stat since;
    if (stat(marker.c_str(), &since) != 0) {
      UniqueFd made(::open(marker.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600));
      since.st_mtime = time(nullptr);
    }
    const absl::Time found = absl::FromTimeT(since.st_mtime);
    const bool expired =
        o.lost_keep_hours > 0 && absl::Now() - found > absl::Hours(o.lost_keep_hours);
    const std::string found_on =
        absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", found, absl::UTCTimeZone());
    if (!manifests.ok()) {
      // Its latest checkpoint unreadable: a previous one may be intact.
      std::string previous;
      for (const std::string& file : ListDirectory(dir)) {
        if (!absl::EndsWith(file, ".previous")) continue;
        absl::StatusOr<checkpoint::Manifest> p =
            checkpoint::ReadManifest(absl::StrCat(dir, "/", file));
        if (p.ok()) {
          previous = absl::StrFormat("%s, of step %d of session '%s'", file, p->steps(),
                                     p->session_name());
          break;
        }
      }
      if (expired) {
        RemoveDirectoryOfFiles(dir);
        LogInfo(
            "removed %s, an automatic checkpoint whose latest did not read back, found lost on "
            "%s: none resumed it within checkpoint.lost_keep_hours (%d)",
            dir, found_on, static_cast<int>(o.lost_keep_hours));
      } else if (previous.empty()) {
        LogWarning(
            "%s holds no readable automatic checkpoint (%s): nothing can resume from it; remove "
            "it (it goes by itself after checkpoint.lost_keep_hours)",
            dir, manifests.status().ToString());
      } else {
        LogWarning(
            "%s: its latest automatic checkpoint is unreadable (%s); its previous one is "
            "intact (%s): a job resuming by itself goes on from it, and restore_from this "
            "directory with restore_steps of that step restores it; keep the directory",
            dir, manifests.status().ToString(), previous);
      }
      continue;
    }
    const checkpoint::Manifest& m = manifests->front().second;
    if (expired) {
      RemoveDirectoryOfFiles(dir);
      LogInfo(
          "removed %s, the automatic checkpoint of step %d of session '%s', found lost on %s: "
          "none resumed it within checkpoint.lost_keep_hours (%d)",
          dir, static_cast<int64_t>(m.steps()), m.session_name(), found_on,
          static_cast<int>(o.lost_keep_hours));
      continue;
    }
    ++lost;
    LogWarning(
        "session %d ('%s') was lost with the previous offloadd: its automatic checkpoint of "
        "step %d (%s) is in %s; OpenSession with restore_from %s resumes it (the directory goes "
        "when that session closes)",
        static_cast<int64_t>(id), m.session_name(), static_cast<int64_t>(m.steps()),
        absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::FromUnixMillis(m.created_unix_ms()),
                         absl::UTCTimeZone()),
        dir, dir);
  }
  if (lost > 0) LogInfo("%d lost session(s) can be resumed from %s", lost, root);
  return absl::OkStatus();
}

void Daemon::ApplyAutoCheckpoint() {
  const AutoCheckpointNodeOptions& o = options_->checkpoint;
  SessionManager::AutoCheckpointOptions a;
  a.dir = auto_checkpoint_dir_;  // also while off: closing sessions remove theirs
  a.every_steps = static_cast<uint64_t>(o.every_steps);
  a.interval = absl::Seconds(o.interval_seconds);
  engine_->sessions().SetAutoCheckpoint(a);
}

std::string Daemon::PreservedDir() const {
  return absl::StrCat(options_->server.data_dir, "/preserved");
}

int Daemon::Shutdown() {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_) return 0;
    shut_down_ = true;
  }
  // Partition calls in flight (a Step may take a while) get 30 seconds to
  // finish; new ones are refused with UNAVAILABLE meanwhile. When sessions
  // are kept, 120 seconds (a checkpoint a call writes would stop the
  // session's from being taken).
  const bool keep = options_->server.reconnect_lease_seconds > 0;
  // (No lease runs out while the sessions wait to be kept.)
  if (keep) engine_->sessions().PauseLeases();
  const absl::Duration drain = keep ? absl::Seconds(120) : absl::Seconds(30);
  if (!calls_.CloseAndDrain(drain)) {
    LogWarning("calls still running after %s; going on without them", absl::FormatDuration(drain));
  }
  // Trainers may come back (a positive reconnect lease): each session is
  // kept, at a step boundary, for the next offloadd to reopen.
  int lost = 0;
  if (keep) {
    KeptBytes bytes;
    const absl::Time began = absl::Now();
    const int n = KeepSessions(engine_->sessions(), PreservedDir(), engine_->pool().file(), &bytes,
                               TellSystemdToWait("keeping"));
    if (n > 0) {
      LogInfo("kept %d session(s) in %s for the next offloadd in %s: %d bytes written%s", n,
              PreservedDir(), absl::FormatDuration(absl::Now() - began),
              static_cast<int64_t>(bytes.written),
              options_->memory.pool_dir.empty()
                  ? " (memory.pool_dir unset: every byte written)"
                  : absl::StrCat(", ", bytes.referenced, " left in the pool's file in ",
                                 options_->memory.pool_dir));
    }
    lost = bytes.lost;
  }
  metrics_.reset();
  server_->Shutdown();
  arena_channel_.reset();
  unlink(socket_path_.c_str());
  if (!tcp_token_path_.empty()) unlink(tcp_token_path_.c_str());
  return lost;
}

Daemon::~Daemon() {
  if (server_ != nullptr) {
    Shutdown();
  } else if (!tcp_token_path_.empty()) {
    unlink(tcp_token_path_.c_str());  // a start that failed after writing it
  }
}

}  // namespace offload
