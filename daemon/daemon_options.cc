#include "daemon/daemon_options.h"

#include "base/memory_limit.h"
#include "ipc/paths.h"

namespace offload {

DaemonOptions::DaemonOptions() {
  server.data_dir = DefaultDataDir();
  memory.host_budget_bytes = DefaultHostBudgetBytes(ReadMemoryLimit());
}

void BindTunables(DaemonOptions* o, ConfigRegistry* r) {
  r->Bind("server.data_dir", &o->server.data_dir,
          {"path", "directory for the socket and state (created 0700)", false});
  r->Bind("server.socket", &o->server.socket,
          {"path", "gRPC Unix socket; empty means <data_dir>/offloadd.sock", false});
  r->Bind("server.socket_group", &o->server.socket_group,
          {"group",
           "members of this group may use offloadd too (its sockets 0660 and this group's); empty: "
           "the owner and root only",
           false});
  r->Bind("server.tcp_port", &o->server.tcp_port,
          {"port", "also serve gRPC on 127.0.0.1:<port>; -1 off, 0 any free port", false,
           kTcpPortRange});
  r->Bind("server.attach_lease_seconds", &o->server.attach_lease_seconds,
          {"seconds", "a session no trainer attached to within this long of opening is closed",
           false, kAttachLeaseRange});
  r->Bind(
      "server.idle_lease_seconds", &o->server.idle_lease_seconds,
      {"seconds",
       "a session no call reached for this long is closed (a frozen trainer; clients call every "
       "quarter of it while open); 0 never",
       false, kIdleLeaseRange});
  r->Bind("server.reconnect_lease_seconds", &o->server.reconnect_lease_seconds,
          {"seconds",
           "a session whose trainer went away is kept this long for a restarted trainer to resume "
           "(ResumeSession) or its restarted job to take over (a new session of its name); a "
           "SIGTERM then keeps every session for the next offloadd; 0 closes it at once",
           false, kReconnectLeaseRange});
  r->Bind("server.max_threads", &o->server.max_threads,
          {"threads", "most gRPC calls served at once; more are RESOURCE_EXHAUSTED", false,
           kServerThreadsRange});
  r->Bind("server.max_streams_per_connection", &o->server.max_streams_per_connection,
          {"calls", "most calls one connection may have open at once", false, kStreamsRange});
  r->Bind("server.max_sessions", &o->server.max_sessions,
          {"sessions",
           "most sessions open at once; OpenSession past it is RESOURCE_EXHAUSTED (0: no "
           "cap but the descriptors)",
           false, IntRange{0, 1 << 20}});
  r->Bind("server.max_sessions_per_user", &o->server.max_sessions_per_user,
          {"sessions",
           "most sessions one user other than offloadd's own or root (a member of "
           "server.socket_group) may hold at once: its OpenSession past it (sessions it opened, "
           "attached or not) and its attach past it (sessions it attached) are "
           "RESOURCE_EXHAUSTED; 0: no bound but server.max_sessions",
           false, IntRange{0, 1 << 20}});
  r->Bind("server.max_connections_per_user", &o->server.max_connections_per_user,
          {"connections",
           "most connections one user other than offloadd's own (a member of "
           "server.socket_group) may hold on the socket at once; its next is closed at once; 0: "
           "no bound",
           false, IntRange{0, 1 << 20}});
  r->Bind("server.reserved_descriptors", &o->server.reserved_descriptors,
          {"descriptors",
           "file descriptors kept free for the listeners, checkpoints and control calls: "
           "OpenSession is RESOURCE_EXHAUSTED when fewer would be left",
           false, IntRange{16, 1 << 20}});
  r->Bind("server.handshake_timeout_seconds", &o->server.handshake_timeout_seconds,
          {"seconds", "a connection that has not started HTTP/2 within this is closed", false,
           IntRange{1, 3600}});
  r->Bind("server.idle_connection_seconds", &o->server.idle_connection_seconds,
          {"seconds", "a connection with no call for this long is closed (0: kept)", false,
           IntRange{0, 7 * 24 * 3600}});
  r->Bind("server.ring_spin_us", &o->server.ring_spin_us,
          {"microseconds",
           "a session's request-ring thread polls this long after each call before it sleeps (the "
           "next call then finds it awake); 0 always sleeps",
           true, kRingSpinRange});
  BindMemoryTunables(&o->memory, r);
  r->Bind(
      "placement.params_host_percent", &o->placement.params_host_percent,
      {"percent", "share of a new session's working parameters kept on the host; the rest on NVMe",
       true, kHostPercentRange});
  r->Bind(
      "placement.grads_host_percent", &o->placement.grads_host_percent,
      {"percent", "share of a new session's gradient buffers kept on the host; the rest on NVMe",
       true, kHostPercentRange});
  r->Bind("placement.optimizer_state_host_percent", &o->placement.optimizer_state_host_percent,
          {"percent", "share of a new session's optimizer state kept on the host; the rest on NVMe",
           true, kHostPercentRange});
  r->Bind("placement.state_chunk_bytes", &o->placement.state_chunk_bytes,
          {"bytes", "data moves and updates in chunks of this many parameters times 4 bytes", false,
           kStateChunkRange});
  r->Bind("gpu.prefetch_depth", &o->gpu.prefetch_depth,
          {"units",
           "every trainer's GPU tier prefetches this many units (modules) ahead; -1: each "
           "trainer's own (gpu.prefetch_depth in zero_config); reaches trainers within about a "
           "second",
           true, kGpuPrefetchDepthRange});
  r->Bind("gpu.prefetch_bytes", &o->gpu.prefetch_bytes,
          {"bytes",
           "every trainer's GPU tier prefetches at most this many bytes ahead; -1: each "
           "trainer's own",
           true, kGpuPrefetchBytesRange});
  r->Bind("checkpoint.auto_dir", &o->checkpoint.dir,
          {"path",
           "automatic checkpoints go to <dir>/<session id> (created 0700); empty means "
           "<data_dir>/auto-checkpoints",
           false});
  r->Bind("checkpoint.auto_interval_seconds", &o->checkpoint.interval_seconds,
          {"seconds",
           "each session is checkpointed in the background after a step once this long passed "
           "since its last one (a crash of offloadd then loses at most that much); 0 not by time",
           true, kAutoCheckpointSecondsRange});
  r->Bind("checkpoint.auto_every_steps", &o->checkpoint.every_steps,
          {"steps",
           "also after this many steps since the session's last automatic checkpoint; 0 not by "
           "steps",
           true, kAutoCheckpointStepsRange});
  r->Bind("checkpoint.lost_keep_hours", &o->checkpoint.lost_keep_hours,
          {"hours",
           "a lost session's automatic checkpoint directory (what a crashed offloadd or an "
           "unfinished job left) is removed at the first start this long after a start first "
           "found it lost; 0 keeps them until a session restores them",
           false, kLostKeepHoursRange});
  r->Bind("checkpoint.write_threads", &o->checkpoint.write_threads,
          {"threads",
           "chunks captured at once by a checkpoint someone waits for (a trainer's, a stop's "
           "keeping of sessions, a session's last one): writes in flight for disks whose "
           "bandwidth needs depth; background checkpoints write one at a time beside training",
           true, kCheckpointWriteThreadsRange});
  r->Bind("metrics.port", &o->metrics.port,
          {"port", "Prometheus metrics on 127.0.0.1:<port>/metrics; -1 off, 0 any free port", false,
           kTcpPortRange});
  r->Bind("metrics.session_names", &o->metrics.session_names,
          {"bool",
           "label the metrics' session series with the sessions' names (any local user can read "
           "the port); off: the name label is empty, the session label holds the id",
           false});
  BindOptimizerTunables(&o->optimizer, r);
  BindNvmeTunables(&o->nvme, r);
  BindSwapperTunables(&o->swapper, r);
}

}  // namespace offload
