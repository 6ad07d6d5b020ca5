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

// A session whose trainer went away (kept for a resume) says since when,
// in place of its step rate.
TEST(Top, ASessionWhoseTrainerWentAwaySaysSo) {
  const DaemonStats before = Snapshot(0, 10, 1000, 100);
  DaemonStats now = Snapshot(0, 10, 1000, 100);
  now.sessions[0].detached_seconds = 42;
  const std::string screen = RenderTop(now, &before, 2.0);
  EXPECT_TRUE(absl::StrContains(screen, "gone 42s")) << screen;
}

// Counters that start again (offloadd restarted keeping the session, a
// session's GPU tier replaced) and waits longer than the interval: dashes
// and at most 100%, not an unsigned difference or a negative rate.
TEST(Top, CountersThatGoBackGiveNoRates) {
  const DaemonStats before = Snapshot(int64_t{4} << 30, 30, 2600, 500);
  DaemonStats restarted = Snapshot(0, 2, 100, 10);
  restarted.pid = 43;
  std::string screen = RenderTop(restarted, &before, 1.0);
  EXPECT_TRUE(absl::StrContains(screen, "swap in -  out -")) << screen;
  EXPECT_TRUE(absl::StrContains(screen, "updates - params/s")) << screen;
  DaemonStats went_back = Snapshot(int64_t{5} << 30, 1, 50, 5);  // the same pid
  screen = RenderTop(went_back, &before, 1.0);
  std::string row;
  for (absl::string_view l : absl::StrSplit(screen, '\n')) {
    if (absl::StrContains(l, "gpt/rank0")) row = std::string(l);
  }
  EXPECT_FALSE(absl::StrContains(row, "18446744")) << row;  // 2^64 - something
  EXPECT_FALSE(absl::StrContains(row, "-1")) << row;
  DaemonStats a = Snapshot(0, 30, 2600, 500), b = a;
  a.sessions[0].optimizer_queued_nanos = 0;
  b.sessions[0].optimizer_queued_nanos = 3000000000;  // a 3-s wait ended in 1 s
  screen = RenderTop(b, &a, 1.0);
  EXPECT_TRUE(absl::StrContains(screen, " 100% ")) << screen;
  EXPECT_FALSE(absl::StrContains(screen, "300%")) << screen;
  DaemonStats g1 = a, g2 = a;
  g1.sessions[0].gpu.emplace();
  g1.sessions[0].gpu->h2d_bytes = 1 << 30;
  g1.sessions[0].gpu->tensor_uses = 1000;
  g2.sessions[0].gpu.emplace();  // the tier replaced: its counts from zero
  g2.sessions[0].gpu->h2d_bytes = 1 << 20;
  g2.sessions[0].gpu->tensor_uses = 10;
  screen = RenderTop(g2, &g1, 1.0, 400);  // (wide enough for the GPU columns)
  for (const char* absurd : {"TiB/s", "PiB/s", "EiB/s", "e+"}) {
    EXPECT_FALSE(absl::StrContains(screen, absurd)) << screen;
  }
}

// A name is cut between characters, never inside one (UTF-8).
TEST(Top, NamesAreCutBetweenCharacters) {
  DaemonStats s = Snapshot(0, 0, 0, 0);
  s.sessions[0].name = "abcdefghijklmnopq\xc3\xa9";  // 17 letters and an "é" (2 bytes)
  const std::string screen = RenderTop(s, nullptr, 0);
  std::string row;
  for (absl::string_view l : absl::StrSplit(screen, '\n')) {
    if (absl::StrContains(l, "abcdefghijklmnopq")) row = std::string(l);
  }
  ASSERT_FALSE(row.empty()) << screen;
  // 18 bytes would end inside the "é": the cut keeps the 17 letters.
  EXPECT_TRUE(absl::StrContains(row, "abcdefghijklmnopq ")) << row;
  EXPECT_FALSE(absl::StrContains(row, "\xc3")) << row;
}

TEST(Top, LinesAreCutToTheWidth) {
  const std::string screen = RenderTop(Snapshot(0, 0, 0, 0), nullptr, 0, 40);
  for (absl::string_view l : absl::StrSplit(screen, '\n')) EXPECT_LE(l.size(), 40u) << l;
}

}  // namespace
}  // namespace offload
