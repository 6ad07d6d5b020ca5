// Prometheus text exposition (format 0.0.4) of the daemon's counters,
// tiers and sessions, and the opt-in loopback HTTP server that serves it at
// /metrics (metrics.port). Served with Debian's cpp-httplib on 127.0.0.1
// only; off by default.
//
// Names: offloadd_<counter>, with _total for monotonic counters and the
// unit in HELP; offloadd_tier_{used,budget}_bytes{tier="..."};
// offloadd_session_*{session="id",name="..."} (label values escaped).
//
// Thread-safety: FormatPrometheus is a pure function. MetricsServer answers
// on its own thread, calling the snapshot function it was given for each
// scrape; that function must be thread-safe.
#ifndef OFFLOADD_DAEMON_METRICS_H_
#define OFFLOADD_DAEMON_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/snapshot.h"

namespace offload {

std::string FormatPrometheus(const DaemonSnapshot& snapshot);

class MetricsServer {
 public:
  // Listens on 127.0.0.1:`port` (0: any free port). UNAVAILABLE if it cannot
  // bind.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(int port, SnapshotFn snapshot);
  ~MetricsServer();  // stops serving

  int port() const { return port_; }

 private:
  MetricsServer() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = -1;
  std::thread thread_;
};

}  // namespace offload

#endif  // OFFLOADD_DAEMON_METRICS_H_
