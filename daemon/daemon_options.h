// Every setting of the daemon: its own (server, placement, ...) and the
// components' (base/memory_options.h, cpu_adam/optimizer_options.h,
// nvme/nvme_options.h, swapper/swapper_options.h), gathered in
// DaemonOptions and bound to tunable names by BindTunables. Defaults are the
// in-class initializers; each field says its unit and its trade-off; its
// range and whether it can change while offloadd runs are declared once, where
// it is bound.
#ifndef OFFLOADD_DAEMON_DAEMON_OPTIONS_H_
#define OFFLOADD_DAEMON_DAEMON_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/config_registry.h"
#include "base/memory_options.h"
#include "cpu_adam/optimizer_options.h"
#include "nvme/nvme_options.h"
#include "swapper/swapper_options.h"

namespace offload {

struct ServerOptions {
  // Directory holding the socket and the daemon's state; created (0700) if
  // missing. Default: $XDG_STATE_HOME/offloadd or ~/.local/state/offloadd.
  std::string data_dir;

  // gRPC Unix socket path, created owner-only. Empty means
  // <data_dir>/offloadd.sock. The arena channel listens on <socket>.arena.
  std::string socket;

  // A group whose members may use offloadd too (the trainers' group, under
  // a system service): both sockets are made 0660 and that group's, and the
  // arena channel admits its members. Empty: the owner (and root) only.
  std::string socket_group;

  // Also serve gRPC on 127.0.0.1:<tcp_port> (never on other interfaces).
  // -1 disables TCP, 0 picks a free port. Trainers still need the Unix
  // socket for shared memory; TCP is for tools.
  int64_t tcp_port = -1;

  // A session no trainer attached to (through the arena channel) within
  // this many seconds of opening is closed: one opened over raw gRPC and
  // abandoned cannot hold its memory forever.
  int64_t attach_lease_seconds = 60;

  // A session no call reached for this many seconds (and with none in
  // flight) is closed: its trainer's process is frozen (stopped) while
  // still connected, or a client without a keepalive stopped calling.
  // Clients call every quarter of it (ClientOptions::keepalive), so a
  // healthy trainer quiet for longer keeps its session (and so does a
  // trainer hung with its keepalive thread running). 0: never.
  int64_t idle_lease_seconds = 900;

  // When a trainer's arena-channel connection closes (it exited or crashed
  // without closing its session), its holds are released at once and the
  // session is kept this many seconds for a restarted trainer to resume
  // with its id and token (ResumeSession: optimizer state, steps and all),
  // then closed, unless a new session of its name takes it over first (its
  // job restarted: SessionManager::TakeOverDetached). With it, a SIGTERM
  // keeps every session for the next offloadd. 0: closed at once.
  int64_t reconnect_lease_seconds = 120;

  // gRPC's synchronous server runs each call on a thread of its own; these
  // bound them (a burst of calls, or of reset streams, cannot make
  // thousands of threads): at most `max_threads` serve calls at once (more
  // are answered RESOURCE_EXHAUSTED), and one connection may have at most
  // `max_streams_per_connection` calls open.
  int64_t max_threads = 128;
  int64_t max_streams_per_connection = 64;

  // Descriptors: each session holds a few (its arena, its request ring's
  // wake-ups) and a thread, each connection one. OpenSession is refused
  // (RESOURCE_EXHAUSTED) past `max_sessions` (0: no cap but the
  // descriptors) or when fewer than `reserved_descriptors` would be left,
  // which stay for the listeners, checkpoints and the owner's control
  // calls. A connection that has not started HTTP/2 within
  // `handshake_timeout_seconds`, or had no call for
  // `idle_connection_seconds` (0: kept), is closed. Should gRPC's listeners
  // still stop accepting (accept4 failing with EMFILE leaves gRPC 1.51's
  // deaf), offloadd builds them anew once descriptors are free again.
  int64_t max_sessions = 1024;
  // Sessions one user other than offloadd's own or root (a member of
  // `socket_group`) may hold at once: its OpenSession past it is
  // RESOURCE_EXHAUSTED (counting the sessions it opened, attached or not),
  // and so is its attach past it (counting the sessions it has attached).
  // 0: no bound but max_sessions.
  int64_t max_sessions_per_user = 128;
  // Connections one such user may hold at once on the unix socket (offloadd
  // accepts them itself: daemon/unix_acceptor); its next is closed at once.
  // 0: no bound.
  int64_t max_connections_per_user = 256;
  int64_t reserved_descriptors = 64;
  int64_t handshake_timeout_seconds = 10;
  int64_t idle_connection_seconds = 600;

  // After each call of a session ends, its request-ring thread polls the
  // mailbox this many microseconds before it sleeps, so that the trainer's
  // next call finds it awake (waking a sleeping thread costs ~100 us on a
  // virtual machine). It yields to any other runnable thread meanwhile; an
  // idle node spends at most this much of a core per call. 0: always sleep.
  int64_t ring_spin_us = 1000;
};

struct PlacementOptions {
  // Percentage of each new session's bytes of a kind kept on the host: its
  // working parameters, its gradient buffers, its optimizer state (fp32
  // master weights and Adam moments, 12 bytes a parameter, and the gradient
  // accumulator, 4 more, made when a return first needs one). The rest rests
  // on the NVMe tier and is brought into the host pool while in use
  // (parameters while the trainer holds them, everything during the step).
  // 100 keeps all of it in memory (fastest); lower values train models
  // larger than the pool. A session may ask for its own when it opens, and
  // change it while it trains. A change here applies to sessions opened
  // afterwards.
  int64_t params_host_percent = 100;
  int64_t grads_host_percent = 100;
  int64_t optimizer_state_host_percent = 100;

  // Data moves and is updated in chunks of this many parameters times 4
  // bytes (each kind of optimizer state is that big; parameters and
  // gradients of the same elements are smaller in 16-bit types). Smaller
  // chunks stream in less pool memory and start sooner; larger ones mean
  // fewer, bigger NVMe requests.
  int64_t state_chunk_bytes = int64_t{16} << 20;
};

inline constexpr IntRange kTcpPortRange{-1, 65535};
inline constexpr IntRange kAttachLeaseRange{1, 86400};
inline constexpr IntRange kIdleLeaseRange{0, 604800};
inline constexpr IntRange kReconnectLeaseRange{0, 86400};
inline constexpr IntRange kServerThreadsRange{8, 4096};
inline constexpr IntRange kStreamsRange{1, 4096};
inline constexpr IntRange kRingSpinRange{0, 100000};
inline constexpr IntRange kHostPercentRange{0, 100};
inline constexpr IntRange kStateChunkRange{8192, int64_t{1} << 30};

// Settings for the trainers' GPU tiers (client/gpu_tier.h), which run in
// the trainer processes: each learns them when it reports (ReportGpuTier,
// about once a second), so a change reaches every trainer of the node
// within a second or so. -1: each trainer's own setting.
struct GpuTierNodeOptions {
  int64_t prefetch_depth = -1;  // units (modules) ahead
  int64_t prefetch_bytes = -1;  // bytes ahead, at most
};
inline constexpr IntRange kGpuPrefetchDepthRange{-1, 1 << 16};
inline constexpr IntRange kGpuPrefetchBytesRange{-1, int64_t{1} << 44};

// Automatic checkpoints (SessionManager::SetAutoCheckpoint): every session
// is checkpointed in the background into <dir>/<session id> after a step
// once `interval_seconds` passed (or `every_steps` steps) since its last
// one, so that a crash of offloadd loses at most that much training. A
// session that closes removes its own; after a crash the next offloadd
// logs each lost session's, for OpenSession's restore_from. Each takes the
// session's state on disk (14 bytes a parameter for bf16 training).
struct AutoCheckpointNodeOptions {
  // Empty: <data_dir>/auto-checkpoints.
  std::string dir;
  // 0: not by time.
  int64_t interval_seconds = 600;
  // 0: not by steps.
  int64_t every_steps = 0;
  // Chunks a checkpoint written while someone waits captures at once.
  int64_t write_threads = 4;
  // A lost session's directory (what a crashed offloadd or a session kept
  // for a resume left) is removed at the first start this long after a
  // start first found it lost (a marker file in it). 0: kept until a
  // session restores it.
  int64_t lost_keep_hours = 168;
};
inline constexpr IntRange kLostKeepHoursRange{0, 24 * 3650};
inline constexpr IntRange kAutoCheckpointSecondsRange{0, 604800};
inline constexpr IntRange kCheckpointWriteThreadsRange{1, 64};
inline constexpr IntRange kAutoCheckpointStepsRange{0, int64_t{1} << 40};

struct MetricsOptions {
  // Serve Prometheus text metrics at http://127.0.0.1:<port>/metrics (never
  // on other interfaces). -1 (default) off, 0 any free port (logged).
  int64_t port = -1;
  // Label each session's series with its name (name="..."): any local user
  // can read the port, while GetStats shows names over TCP only with the
  // token. Off: the label is empty, the session's id is there.
  bool session_names = false;
};

struct DaemonOptions {
  DaemonOptions();  // fills the defaults that depend on the machine

  ServerOptions server;
  MemoryOptions memory;
  OptimizerOptions optimizer;
  NvmeOptions nvme;
  SwapperOptions swapper;
  PlacementOptions placement;
  GpuTierNodeOptions gpu;
  AutoCheckpointNodeOptions checkpoint;
  MetricsOptions metrics;
};

// Binds every field of `options` to its tunable name in `registry`.
// `options` must outlive `registry`.
void BindTunables(DaemonOptions* options, ConfigRegistry* registry);

}  // namespace offload

#endif  // OFFLOADD_DAEMON_DAEMON_OPTIONS_H_
