// The assembled daemon: owns the memory budget, the optimizer, the session
// manager, the arena channel and the gRPC server, wired to the tunables.
//
// Start() returns once every socket accepts connections. Shutdown() stops
// accepting, lets in-flight calls finish (bounded by a deadline), and removes
// the socket files; it is idempotent and may be called from any thread.
// With a positive server.reconnect_lease_seconds, Shutdown keeps every
// session (SessionManager::Preserve) in <data_dir>/preserved, and the next
// Start in that data directory reopens them for their trainers to resume.
#ifndef OFFLOADD_DAEMON_DAEMON_H_
#define OFFLOADD_DAEMON_DAEMON_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/config_registry.h"
#include "base/unique_fd.h"
#include "daemon/access_guard.h"
#include "daemon/arena_channel.h"
#include "daemon/call_gate.h"
#include "daemon/daemon_options.h"
#include "daemon/grpc_server.h"
#include "daemon/metrics.h"
#include "daemon/ring_service.h"
#include "daemon/service.h"
#include "daemon/snapshot.h"
#include "engine/engine.h"
#include "grpcpp/grpcpp.h"
#include "nvme/io_backend.h"

namespace offload {

class Daemon {
 public:
  // `options` holds the final settings (file and flags applied) and is bound
  // to `registry`; both must outlive the daemon. Freezes the registry.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(DaemonOptions* options,
                                                       ConfigRegistry* registry);
  ~Daemon();

  // Stops serving; with a reconnect lease, keeps the sessions for the next
  // offloadd. Returns how many open sessions could not be kept (logged).
  int Shutdown();

  const std::string& socket_path() const { return socket_path_; }
  // -1 when TCP is off.
  int tcp_port() const { return tcp_port_; }
  // Human-readable lines describing what the daemon serves.
  std::vector<std::string> Describe() const;
  // Counters, tiers and sessions now.
  DaemonSnapshot Snapshot() const;

 private:
  Daemon(DaemonOptions* options, ConfigRegistry* registry);

  void SetHooks();
  // Where Shutdown keeps sessions for the next offloadd.
  std::string PreservedDir() const;
  // Makes checkpoint.auto_dir (resolved, and the automatic checkpoints
  // switched on, by Start before the kept sessions are reopened) and
  // reports the automatic checkpoints of sessions a crashed predecessor
  // lost.
  absl::Status StartAutoCheckpoints();
  // Gives the session manager the checkpoint.auto_* settings now in effect.
  void ApplyAutoCheckpoint();
  // A fresh token for TCP callers, written owner-only to the data directory.
  absl::StatusOr<std::string> WriteTcpToken();

  // Built in this order by Start and destroyed in reverse: what serves the
  // engine before it, the engine (engine/engine.h says its own order)
  // before the I/O backend its swap space writes through.
  DaemonOptions* const options_;
  ConfigRegistry* const registry_;
  // <data_dir>/offloadd.lock, locked (flock) while this offloadd runs: one
  // daemon a data directory (its kept sessions, automatic checkpoints and
  // token are one owner's). Released last.
  UniqueFd data_dir_lock_;
  HostHomePages host_home_pages_;  // memory.host_home_pages, resolved at start
  // The NVMe tier's I/O, when nvme.dirs names directories.
  std::unique_ptr<IoBackend> io_;
  // Every partition call passes it (gRPC's and the request rings'), so a
  // stop can refuse new ones and drain those in flight.
  CallGate calls_;
  // The sessions' request rings' calls: outlives the engine, whose ring
  // threads call it.
  std::unique_ptr<RingService> ring_service_;
  std::unique_ptr<Engine> engine_;
  std::string socket_path_;
  // checkpoint.auto_dir, or its default in the data directory.
  std::string auto_checkpoint_dir_;
  int tcp_port_ = -1;
  std::unique_ptr<ArenaChannel> arena_channel_;
  std::unique_ptr<AccessGuard> guard_;
  std::string tcp_token_path_;  // empty without TCP
  std::unique_ptr<PartitionServiceImpl> partition_service_;
  std::unique_ptr<ConfigServiceImpl> config_service_;
  std::unique_ptr<StatsServiceImpl> stats_service_;
  ConnectionCounters connections_;  // the listeners', outliving them
  std::unique_ptr<GrpcServer> server_;
  std::unique_ptr<MetricsServer> metrics_;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace offload

#endif  // OFFLOADD_DAEMON_DAEMON_H_
