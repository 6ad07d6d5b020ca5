// What the daemon reports about itself at one moment: its counters (the
// engine's and the swapper's), its tiers and its sessions. Assembled in one
// place (Daemon::Snapshot) for both the Stats gRPC service and the
// Prometheus endpoint, so the two cannot drift apart.
#ifndef OFFLOADD_DAEMON_SNAPSHOT_H_
#define OFFLOADD_DAEMON_SNAPSHOT_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/session_manager.h"
#include "engine/stats.h"

namespace offload {

struct TierValue {
  std::string name;
  uint64_t used_bytes = 0;
  uint64_t budget_bytes = 0;
};

struct DaemonSnapshot {
  std::vector<CounterValue> counters;
  std::vector<TierValue> tiers;
  std::vector<SessionSummary> sessions;
};

using SnapshotFn = std::function<DaemonSnapshot()>;

}  // namespace offload

#endif  // OFFLOADD_DAEMON_SNAPSHOT_H_
