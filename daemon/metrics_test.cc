#include "daemon/metrics.h"

#include <string>

#include "gtest/gtest.h"
#include "httplib.h"

namespace offload {
namespace {

DaemonSnapshot Sample() {
  DaemonSnapshot m;
  m.counters = {{"steps", 7, "steps"}, {"swap_resident_bytes", 4096, "bytes", /*gauge=*/true}};
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
  EXPECT_NE(text.find("offloadd_tier_budget_bytes{tier=\"nvme\"} 5000\n"), std::string::npos);
  EXPECT_NE(text.find("offloadd_session_placed_bytes{session=\"3\",name=\"rank\\\"0\\\"\\nx\","
                      "kind=\"optimizer_state\",tier=\"nvme\"} 12\n"),
            std::string::npos)
      << text;
  // The per-session families: HELP and TYPE, then a line a session.
  const std::string labels = "{session=\"3\",name=\"rank\\\"0\\\"\\nx\"} ";
  EXPECT_NE(text.find("# HELP offloadd_session_steps optimizer steps applied\n"
                      "# TYPE offloadd_session_steps gauge\n"
                      "offloadd_session_steps" +
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

}  // namespace
}  // namespace offload
