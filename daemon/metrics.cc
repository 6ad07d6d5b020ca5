#include "daemon/metrics.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "httplib.h"

namespace offload {
namespace {

// A Prometheus label value: backslash, double quote and newline escaped.
std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// One metric with a line per session (its id and name the labels): the HELP
// and TYPE lines, then `value(session)` for each.
template <typename Value>
void AppendPerSession(std::string* out, const char* name, const char* help, const char* type,
                      const std::vector<SessionSummary>& sessions, Value value) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
  for (const SessionSummary& s : sessions) {
    absl::StrAppend(out, name, "{session=\"", s.id, "\",name=\"", Escape(s.name), "\"} ", value(s),
                    "\n");
  }
}

}  // namespace

std::string FormatPrometheus(const DaemonSnapshot& m) {
  std::string out;
  for (const CounterValue& c : m.counters) {
    const bool gauge = c.gauge;
    const std::string name = absl::StrCat("offloadd_", c.name, gauge ? "" : "_total");
    absl::StrAppend(&out, "# HELP ", name, " ", c.name, " (", c.unit, ")\n", "# TYPE ", name,
                    gauge ? " gauge\n" : " counter\n", name, " ", c.value, "\n");
  }
  absl::StrAppend(&out, "# HELP offloadd_tier_used_bytes bytes in use per tier\n",
                  "# TYPE offloadd_tier_used_bytes gauge\n");
  for (const TierValue& t : m.tiers) {
    absl::StrAppend(&out, "offloadd_tier_used_bytes{tier=\"", Escape(t.name), "\"} ", t.used_bytes,
                    "\n");
  }
  absl::StrAppend(&out, "# HELP offloadd_tier_budget_bytes capacity per tier\n",
                  "# TYPE offloadd_tier_budget_bytes gauge\n");
  for (const TierValue& t : m.tiers) {
    absl::StrAppend(&out, "offloadd_tier_budget_bytes{tier=\"", Escape(t.name), "\"} ",
                    t.budget_bytes, "\n");
  }
  struct SessionMetric {
    const char* name;
    const char* help;
    uint64_t SessionSummary::*field;
  };
  static const SessionMetric kSession[] = {
      {"offloadd_session_partitions", "partitions registered", &SessionSummary::partitions},
      {"offloadd_session_held", "partitions the trainer holds", &SessionSummary::held},
      {"offloadd_session_arena_bytes", "shared arena bytes", &SessionSummary::arena_bytes},
      {"offloadd_session_steps", "optimizer steps applied", &SessionSummary::steps},
      {"offloadd_session_optimizer_params", "parameters the node's optimizer updated for it",
       &SessionSummary::optimizer_params},
      {"offloadd_session_pool_room_bytes", "the host pool's room its NVMe-homed blocks hold",
       &SessionSummary::pool_room_bytes},
  };
  for (const SessionMetric& metric : kSession) {
    AppendPerSession(&out, metric.name, metric.help, "gauge", m.sessions,
                     [&](const SessionSummary& s) { return s.*metric.field; });
  }
  AppendPerSession(&out, "offloadd_session_pool_evictions_total",
                   "its NVMe-homed blocks evicted from the host pool", "counter", m.sessions,
                   [](const SessionSummary& s) { return s.pool_evictions; });
  AppendPerSession(&out, "offloadd_session_share_weight",
                   "its weight in the node's optimizer, NVMe I/O and pool", "gauge", m.sessions,
                   [](const SessionSummary& s) { return s.share_weight; });
  // Per-session times kept in nanoseconds, exported in seconds.
  struct SessionSeconds {
    const char* name;
    const char* help;
    int64_t SessionSummary::*nanos;
  };
  static const SessionSeconds kSessionSeconds[] = {
      {"offloadd_session_optimizer_queued_seconds_total",
       "time its updates waited for other sessions'", &SessionSummary::optimizer_queued_nanos},
      {"offloadd_session_io_queued_seconds_total",
       "time its blocks' transfers waited for the swapper's I/O threads",
       &SessionSummary::io_queued_nanos},
  };
  for (const SessionSeconds& metric : kSessionSeconds) {
    AppendPerSession(&out, metric.name, metric.help, "counter", m.sessions,
                     [&](const SessionSummary& s) {
                       return absl::StrFormat("%.9f", static_cast<double>(s.*metric.nanos) / 1e9);
                     });
  }
  absl::StrAppend(&out,
                  "# HELP offloadd_session_nvme_bytes_total bytes of its blocks moved to and "
                  "from NVMe (direction: read, swapped in; write, written out)\n"
                  "# TYPE offloadd_session_nvme_bytes_total counter\n");
  for (const SessionSummary& s : m.sessions) {
    for (const auto& [direction, bytes] :
         {std::pair<const char*, uint64_t>{"read", s.nvme_read_bytes},
          {"write", s.nvme_write_bytes}}) {
      absl::StrAppend(&out, "offloadd_session_nvme_bytes_total{session=\"", s.id, "\",name=\"",
                      Escape(s.name), "\",direction=\"", direction, "\"} ", bytes, "\n");
    }
  }
  absl::StrAppend(&out,
                  "# HELP offloadd_session_step_seconds_total the session's steps' time: in all "
                  "(wall), waiting for optimizer state (state_wait), in the update (compute)\n"
                  "# TYPE offloadd_session_step_seconds_total counter\n");
  for (const SessionSummary& s : m.sessions) {
    const std::pair<const char*, int64_t> parts[] = {{"wall", s.step_wall_nanos},
                                                     {"state_wait", s.step_wait_nanos},
                                                     {"compute", s.step_compute_nanos}};
    for (const auto& [part, nanos] : parts) {
      absl::StrAppend(&out, "offloadd_session_step_seconds_total{session=\"", s.id, "\",name=\"",
                      Escape(s.name), "\",part=\"", part, "\"} ",
                      absl::StrFormat("%.9f", static_cast<double>(nanos) / 1e9), "\n");
    }
  }
  absl::StrAppend(&out,
                  "# HELP offloadd_session_placed_bytes bytes placed per kind and tier\n"
                  "# TYPE offloadd_session_placed_bytes gauge\n");
  for (const SessionSummary& s : m.sessions) {
    for (int k = 0; k < kDataKinds; ++k) {
      for (const char* tier : {"host", "nvme"}) {
        const uint64_t bytes = tier[0] == 'h' ? s.host_bytes[k] : s.nvme_bytes[k];
        absl::StrAppend(&out, "offloadd_session_placed_bytes{session=\"", s.id, "\",name=\"",
                        Escape(s.name), "\",kind=\"", DataKindName(static_cast<DataKind>(k)),
                        "\",tier=\"", tier, "\"} ", bytes, "\n");
      }
    }
  }
  return out;
}

struct MetricsServer::Impl {
  httplib::Server server;
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(int port, SnapshotFn snapshot) {
  std::unique_ptr<MetricsServer> m(new MetricsServer());
  m->impl_ = std::make_unique<Impl>();
  m->impl_->server.Get("/metrics", [snapshot](const httplib::Request&, httplib::Response& res) {
    res.set_content(FormatPrometheus(snapshot()), "text/plain; version=0.0.4");
  });
  const int bound = port == 0 ? m->impl_->server.bind_to_any_port("127.0.0.1")
                              : (m->impl_->server.bind_to_port("127.0.0.1", port) ? port : -1);
  if (bound < 0) {
    return absl::UnavailableError(absl::StrCat("metrics.port: cannot listen on 127.0.0.1:", port));
  }
  m->port_ = bound;
  Impl* impl = m->impl_.get();
  m->thread_ = std::thread([impl] { impl->server.listen_after_bind(); });
  return m;
}

MetricsServer::~MetricsServer() {
  if (impl_ != nullptr) impl_->server.stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace offload
