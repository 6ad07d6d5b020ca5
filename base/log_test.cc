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

}  // namespace
}  // namespace offload
