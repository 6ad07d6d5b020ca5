#include "client/top.h"

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

DaemonStats Snapshot(int64_t swap_in, int64_t steps, int64_t wall_ms, int64_t wait_ms) {
  DaemonStats s;
  s.version = "0.1.0";
  s.pid = 42;
  s.uptime_ms = 3725000;
  s.optimizer = "avx512 Adam on 2 threads";
  s.tiers = {{"host", 3ull << 30, 12ull << 30}};
  s.counters = {{"swap_in_bytes", swap_in, "bytes"},
                {"swap_out_bytes", 0, "bytes"},
                {"prefetch_used", steps * 9, "blocks"},
                {"swap_misses", steps, "acquires"},
                {"params_updated", steps * 1000, "params"}};
  DaemonStats::Session a;
  a.id = 4294967297;
  a.name = "gpt/rank0";
  a.partitions = 12;
  a.steps = static_cast<uint64_t>(steps);
  a.state_nvme_bytes = 1ull << 30;
  a.step_wall_nanos = wall_ms * 1000000;
  a.step_wait_nanos = wait_ms * 1000000;
  a.step_compute_nanos = (wall_ms - wait_ms) * 1000000;
  s.sessions.push_back(a);
  return s;
}

TEST(Top, TheFirstScreenHasNoRatesYet) {
  const std::string screen = RenderTop(Snapshot(0, 0, 0, 0), nullptr, 0);
  EXPECT_TRUE(absl::StrContains(screen, "offloadd 0.1.0  pid 42  up 1h02m")) << screen;
  EXPECT_TRUE(absl::StrContains(screen, "tier host 3.0 GiB of 12.0 GiB (25%)")) << screen;
  EXPECT_TRUE(absl::StrContains(screen, "swap in -  out -")) << screen;
  EXPECT_TRUE(absl::StrContains(screen, "gpt/rank0")) << screen;
}

TEST(Top, RatesAndTheStepSplitComeFromTwoSnapshots) {
  const DaemonStats before = Snapshot(0, 10, 1000, 100);
  // 2 s later: 2 GiB swapped in, 20 more steps taking 1600 ms, 400 ms of
  // it waiting for state.
  const DaemonStats now = Snapshot(int64_t{2} << 30, 30, 2600, 500);
  const std::string screen = RenderTop(now, &before, 2.0);
  EXPECT_TRUE(absl::StrContains(screen, "swap in 1.0 GiB/s")) << screen;
  EXPECT_TRUE(absl::StrContains(screen, "prefetch used 90% of reads")) << screen;
  EXPECT_TRUE(absl::StrContains(screen, "updates 1e+04 params/s")) << screen;
  std::string row;
  for (absl::string_view l : absl::StrSplit(screen, '\n')) {
    if (absl::StrContains(l, "gpt/rank0")) row = std::string(l);
  }
  // 10 steps/s, 80 ms a step, 25% of it waiting, 75% computing.
  EXPECT_TRUE(absl::StrContains(row, " 10.00 ")) << row;
  EXPECT_TRUE(absl::StrContains(row, " 80.00 ")) << row;
  EXPECT_TRUE(absl::StrContains(row, " 25% ")) << row;
  EXPECT_TRUE(absl::StrContains(row, " 75% ")) << row;
  EXPECT_TRUE(absl::StrContains(row, "0 B/1.0 GiB")) << row;  // state on NVMe
}

TEST(Top, LinesAreCutToTheWidth) {
  const std::string screen = RenderTop(Snapshot(0, 0, 0, 0), nullptr, 0, 40);
  for (absl::string_view l : absl::StrSplit(screen, '\n')) EXPECT_LE(l.size(), 40u) << l;
}

}  // namespace
}  // namespace offload
