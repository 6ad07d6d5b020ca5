#include "base/log.h"

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(LogTest, LinesCarryTheTimeOrTheJournalsPriority) {
  const absl::Time t = absl::FromUnixMillis(1764115200123);  // 2025-11-26T00:00:00.123Z
  EXPECT_EQ(FormatLogLine(LogLevel::kWarning, "disk slow", /*journal=*/false, t),
            "2025-11-26T00:00:00.123Z W offloadd: disk slow\n");
  EXPECT_EQ(FormatLogLine(LogLevel::kInfo, "started", /*journal=*/true, t),
            "<6>offloadd: started\n");
  EXPECT_EQ(FormatLogLine(LogLevel::kWarning, "w", /*journal=*/true, t), "<4>offloadd: w\n");
  EXPECT_EQ(FormatLogLine(LogLevel::kError, "e", /*journal=*/true, t), "<3>offloadd: e\n");
}

TEST(LogTest, ALimiterLetsOneLineAnIntervalThroughAndCountsTheRest) {
  LogLimiter limiter(absl::Seconds(10));
  const absl::Time t = absl::FromUnixSeconds(1000);
  EXPECT_EQ(limiter.Admit(t), 0);  // the first
  for (int i = 1; i <= 500; ++i) EXPECT_EQ(limiter.Admit(t + absl::Milliseconds(i)), -1);
  EXPECT_EQ(limiter.Admit(t + absl::Seconds(10)), 500);  // one line, with the count
  EXPECT_EQ(limiter.Admit(t + absl::Seconds(11)), -1);
  EXPECT_EQ(limiter.Admit(t + absl::Seconds(60)), 1);
  EXPECT_EQ(limiter.Admit(t + absl::Seconds(120)), 0);
  EXPECT_EQ(LogLimiter::Held(0), "");
  EXPECT_EQ(LogLimiter::Held(3), " (3 more like it since the last report)");
}

}  // namespace
}  // namespace offload
