// Every setting of the daemon, one Options struct per component, and the
// binding of their fields to tunable names (BindTunables). Defaults are the
// in-class initializers; each field says its unit, its trade-off and whether
// it can change while offloadd runs.
#ifndef OFFLOADD_ENGINE_OPTIONS_H_
#define OFFLOADD_ENGINE_OPTIONS_H_

#include <cstdint>
#include <string>

#include "cpu_adam/optimizer.h"
#include "engine/config.h"
#include "nvme/io_backend.h"

namespace offload {

struct ServerOptions {
  // Directory holding the socket and the daemon's state; created (0700) if
  // missing. Default: $XDG_STATE_HOME/offloadd or ~/.local/state/offloadd.
  // Static.
  std::string data_dir;

  // gRPC Unix socket path, created owner-only. Empty means
  // <data_dir>/offloadd.sock. The arena channel listens on <socket>.arena.
  // Static.
  std::string socket;

  // Also serve gRPC on 127.0.0.1:<tcp_port> (never on other interfaces).
  // -1 disables TCP, 0 picks a free port. Trainers still need the Unix
  // socket for shared memory; TCP is for tools. Static.
  int64_t tcp_port = -1;
};

struct MemoryOptions {
  // Host memory offloadd may hold for all sessions together: shared arenas
  // plus fp32 master weights and Adam moments (16 bytes per fp32-gradient
  // parameter plus its working and gradient buffers). Registrations beyond
  // it fail with RESOURCE_EXHAUSTED. Default: half of physical memory.
  // Dynamic: lowering it below current use only blocks new registrations.
  int64_t host_budget_bytes = 0;

  // Address space reserved per session for its shared arena (both in the
  // daemon and the trainer). Costs no memory until used; bounds the total
  // working+gradient bytes one session can register. Dynamic: applies to
  // sessions opened afterwards.
  int64_t session_arena_bytes = int64_t{256} << 30;
};

struct NvmeOptions {
  // Comma-separated directories for swap files, one per NVMe device; empty
  // (the default) means no NVMe tier. Static.
  std::string dirs;

  // Space preallocated per directory at start-up. Static.
  int64_t bytes_per_dir = int64_t{8} << 30;

  // Striping unit across the directories. Static.
  int64_t stripe_bytes = int64_t{1} << 20;

  // XXH3 checksum per extent, verified on swap-in. Costs hashing time
  // (benches/RESULTS.md). Dynamic.
  bool checksum = true;

  // O_DIRECT where the filesystem supports it. Static.
  bool direct_io = true;

  // The I/O engine's settings (nvme/io_backend.h says which are dynamic).
  IoOptions io;
};

struct DaemonOptions {
  DaemonOptions();  // fills the defaults that depend on the machine

  ServerOptions server;
  MemoryOptions memory;
  OptimizerOptions optimizer;
  NvmeOptions nvme;
};

// Binds every field of `options` to its tunable name in `registry`.
// `options` must outlive `registry`.
void BindTunables(DaemonOptions* options, ConfigRegistry* registry);

}  // namespace offload

#endif  // OFFLOADD_ENGINE_OPTIONS_H_
