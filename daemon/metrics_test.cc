#include "daemon/metrics.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "httplib.h"

namespace offload {
namespace {

DaemonSnapshot Sample() {
  DaemonSnapshot m;
  m.counters = {{"steps", 7, "steps"},
                {"swap_resident_bytes", 4096, "bytes", /*gauge=*/true},
                {"step_time", 2500000, "us"}};
  m.tiers = {{"host", 100, 1000}, {"nvme", 0, 5000}};
  SessionSummary s;
  s.id = 3;
  s.name = "rank\"0\"\nx";  // hostile: quotes and a newline
  s.steps = 7;
  s.share_weight = 2;
  s.optimizer_queued_nanos = 1'500'000'000;
  s.nvme_bytes[static_cast<int>(DataKind::kOptimizerState)] = 12;
  m.sessions = {s};
  return m;
}

TEST(Metrics, PrometheusTextTypesCountersAndEscapesLabels) {
  const std::string text = FormatPrometheus(Sample());
  EXPECT_NE(text.find("# TYPE offloadd_steps_total counter\noffloadd_steps_total 7\n"),
            std::string::npos)
      << text;
  EXPECT_NE(
      text.find("# TYPE offloadd_swap_resident_bytes gauge\noffloadd_swap_resident_bytes 4096"),
      std::string::npos);
  // Times in seconds, named so (the daemon counts them in microseconds).
  EXPECT_NE(text.find("# TYPE offloadd_step_seconds_total counter\n"
                      "offloadd_step_seconds_total 2.500000\n"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("offloadd_step_time"), std::string::npos) << text;
  EXPECT_NE(text.find("offloadd_tier_budget_bytes{tier=\"nvme\"} 5000\n"), std::string::npos);
  EXPECT_NE(text.find("offloadd_session_placed_bytes{session=\"3\",name=\"rank\\\"0\\\"\\nx\","
                      "kind=\"optimizer_state\",tier=\"nvme\"} 12\n"),
            std::string::npos)
      << text;
  // The per-session families: HELP and TYPE, then a line a session.
  const std::string labels = "{session=\"3\",name=\"rank\\\"0\\\"\\nx\"} ";
  EXPECT_NE(text.find("# HELP offloadd_session_steps_total optimizer steps applied\n"
                      "# TYPE offloadd_session_steps_total counter\n"
                      "offloadd_session_steps_total" +
                      labels + "7\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("# TYPE offloadd_session_share_weight gauge\n"
                      "offloadd_session_share_weight" +
                      labels + "2\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("# TYPE offloadd_session_optimizer_queued_seconds_total counter\n"
                      "offloadd_session_optimizer_queued_seconds_total" +
                      labels + "1.500000000\n"),
            std::string::npos)
      << text;
  // Every sample line is one line: the newline in the name did not break it.
  for (size_t at = 0; (at = text.find('\n', at)) != std::string::npos; ++at) {
    const size_t next = text.find('\n', at + 1);
    if (next == std::string::npos) break;
    const std::string line = text.substr(at + 1, next - at - 1);
    EXPECT_TRUE(line.rfind("# ", 0) == 0 || line.rfind("offloadd_", 0) == 0) << line;
  }
}

TEST(Metrics, ServesOnLoopbackAndStops) {
  int scrapes = 0;
  auto server = MetricsServer::Start(0, [&] {
    ++scrapes;
    return Sample();
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);
  httplib::Client client("127.0.0.1", port);
  auto res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_NE(res->body.find("offloadd_steps_total 7"), std::string::npos);
  EXPECT_EQ(client.Get("/other")->status, 404);
  EXPECT_EQ(scrapes, 1);
  server->reset();
  EXPECT_FALSE(httplib::Client("127.0.0.1", port).Get("/metrics"));
}

// Connections nobody speaks on (any local user can open them) are served
// a few at a time: offloadd's descriptors are not theirs to take (before:
// each was accepted and queued, one descriptor each, without end).
TEST(Metrics, IdleConnectionsDoNotTakeTheDaemonsDescriptors) {
  auto server = MetricsServer::Start(0, [] { return Sample(); });
  ASSERT_TRUE(server.ok()) << server.status();
  auto open_fds = [] {
    int n = 0;
    if (DIR* d = opendir("/proc/self/fd")) {
      while (readdir(d) != nullptr) ++n;
      closedir(d);
    }
    return n;
  };
  const int before = open_fds();
  constexpr int kIdle = 200;
  std::vector<int> idle;
  for (int i = 0; i < kIdle; ++i) {
    // (Not blocking: past what the server takes, the kernel's backlog
    // makes a connect wait.)
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>((*server)->port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const int r = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    ASSERT_TRUE(r == 0 || errno == EINPROGRESS) << errno;
    idle.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(300));  // (the server accepts what it will)
  const int accepted = open_fds() - before - kIdle;
  EXPECT_LE(accepted, 16) << "the server holds a descriptor for each idle connection";
  for (int fd : idle) close(fd);
  // Served again once they are gone.
  httplib::Client client("127.0.0.1", (*server)->port());
  client.set_read_timeout(10, 0);
  auto res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
}

}  // namespace
}  // namespace offload
