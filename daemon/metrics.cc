#include "daemon/metrics.h"

#include <sys/socket.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
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
    if (c.unit == "us") {
      // Times in Prometheus' base unit: step_time (us) is
      // offloadd_step_seconds_total.
      absl::string_view base = c.name;
      absl::ConsumeSuffix(&base, "_time");
      const std::string name = absl::StrCat("offloadd_", base, "_seconds", gauge ? "" : "_total");
      absl::StrAppend(&out, "# HELP ", name, " ", c.name, "\n", "# TYPE ", name,
                      gauge ? " gauge\n" : " counter\n", name, " ",
                      absl::StrFormat("%.6f", static_cast<double>(c.value) / 1e6), "\n");
      continue;
    }
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
    const char* type = "gauge";
  };
  static const SessionMetric kSession[] = {
      {"offloadd_session_partitions", "partitions registered", &SessionSummary::partitions},
      {"offloadd_session_held", "partitions the trainer holds", &SessionSummary::held},
      {"offloadd_session_arena_bytes", "shared arena bytes", &SessionSummary::arena_bytes},
      // (Counters: they only grow with a session.)
      {"offloadd_session_steps_total", "optimizer steps applied", &SessionSummary::steps,
       "counter"},
      {"offloadd_session_optimizer_params_total", "parameters the node's optimizer updated for it",
       &SessionSummary::optimizer_params, "counter"},
      {"offloadd_session_pool_room_bytes", "the host pool's room its NVMe-homed blocks hold",
       &SessionSummary::pool_room_bytes},
  };
  for (const SessionMetric& metric : kSession) {
    AppendPerSession(&out, metric.name, metric.help, metric.type, m.sessions,
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

namespace {

// httplib's connections go to a few workers with a short queue; past it
// the accepting thread serves the connection itself, and so accepts no
// more meanwhile (the kernel's backlog holds the rest): any local user can
// open connections to the port, and an unbounded queue of idle ones took
// offloadd's descriptors from the sessions.
class BoundedQueue : public httplib::TaskQueue {
 public:
  BoundedQueue(int workers, size_t most_queued) : most_queued_(most_queued) {
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { Work(); });
  }
  ~BoundedQueue() override {
    shutdown();
    for (std::thread& t : threads_) t.join();
  }

  void enqueue(std::function<void()> fn) override {
    {
      absl::MutexLock lock(&mu_);
      if (!stopping_ && queue_.size() < most_queued_) {
        queue_.push_back(std::move(fn));
        return;
      }
    }
    fn();  // (inline: the accepting thread waits for it)
  }

  void shutdown() override {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }

 private:
  void Work() {
    for (;;) {
      std::function<void()> fn;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](BoundedQueue* q) ABSL_EXCLUSIVE_LOCKS_REQUIRED(q->mu_) {
              return q->stopping_ || !q->queue_.empty();
            },
            this));
        if (queue_.empty()) return;  // stopping, and nothing left to serve
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      fn();
    }
  }

  const size_t most_queued_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

constexpr int kWorkers = 2;
constexpr size_t kMostQueued = 8;

}  // namespace

struct MetricsServer::Impl {
  httplib::Server server;
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(int port, SnapshotFn snapshot) {
  std::unique_ptr<MetricsServer> m(new MetricsServer());
  m->impl_ = std::make_unique<Impl>();
  httplib::Server& server = m->impl_->server;
  server.new_task_queue = [] { return new BoundedQueue(kWorkers, kMostQueued); };
  // One request a connection, and no connection idle for long.
  server.set_keep_alive_max_count(1);
  server.set_keep_alive_timeout(2);
  server.set_read_timeout(2, 0);
  server.set_write_timeout(2, 0);
  // SO_REUSEADDR only: httplib's default, SO_REUSEPORT, let a second offloadd
  // listen on the same port, sharing the scrapes between the two.
  server.set_socket_options([](socket_t sock) {
    const int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server.Get("/metrics", [snapshot](const httplib::Request&, httplib::Response& res) {
    res.set_content(FormatPrometheus(snapshot()), "text/plain; version=0.0.4");
  });
  const int bound = port == 0 ? server.bind_to_any_port("127.0.0.1")
                              : (server.bind_to_port("127.0.0.1", port) ? port : -1);
  if (bound < 0) {
    return absl::UnavailableError(absl::StrCat("metrics.port: cannot listen on 127.0.0.1:", port));
  }
  m->port_ = bound;
  Impl* impl = m->impl_.get();
  auto ended = std::make_shared<std::atomic<bool>>(false);
  m->thread_ = std::thread([impl, ended] {
    impl->server.listen_after_bind();
    ended->store(true);
  });
  // Running before it is returned: a stop before httplib's loop began was
  // lost, and the destructor's join waited for ever.
  while (!impl->server.is_running() && !ended->load()) absl::SleepFor(absl::Milliseconds(1));
  if (!impl->server.is_running()) {
    m->thread_.join();
    m->impl_.reset();
    return absl::UnavailableError(
        absl::StrCat("metrics.port: serving on 127.0.0.1:", bound, " ended as it began"));
  }
  return m;
}

MetricsServer::~MetricsServer() {
  if (impl_ != nullptr) impl_->server.stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace offload
