#include "engine/optimizer_shares.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

// Sessions that want the optimizer without pause get it in proportion to
// their weights; a run of the heavier never overlaps another's. (Runs of
// the two of one weight may overlap while the heavier is not there: at the
// start and the end.)
TEST(OptimizerShares, BusySessionsShareByWeight) {
  OptimizerShares shares;
  std::atomic<bool> stop{false};
  std::atomic<int> holders{0}, heavy{0};
  std::atomic<bool> overlapped{false};
  auto stepper = [&](uint64_t session, int64_t weight) {
    while (!stop.load()) {
      OptimizerShares::Turn turn = shares.Take(session, weight, 1000);
      const int others = holders.fetch_add(1);
      if (weight == 2) {
        heavy.fetch_add(1);
        if (others != 0) overlapped = true;
      } else if (heavy.load() != 0) {
        overlapped = true;
      }
      absl::SleepFor(absl::Microseconds(200));
      if (weight == 2) heavy.fetch_sub(1);
      holders.fetch_sub(1);
    }
    shares.Idle(session);
  };
  std::vector<std::thread> threads;
  threads.emplace_back(stepper, 1, 2);
  threads.emplace_back(stepper, 2, 1);
  threads.emplace_back(stepper, 3, 1);
  absl::SleepFor(absl::Seconds(1));
  stop = true;
  for (auto& t : threads) t.join();
  EXPECT_FALSE(overlapped.load());
  const double a = static_cast<double>(shares.UsageOf(1).elems);
  const double b = static_cast<double>(shares.UsageOf(2).elems);
  const double c = static_cast<double>(shares.UsageOf(3).elems);
  ASSERT_GT(b, 0);
  EXPECT_NEAR(a / b, 2.0, 0.2) << a << " " << b << " " << c;
  EXPECT_NEAR(c / b, 1.0, 0.1) << a << " " << b << " " << c;
  // Session 2 holds one run in four: it waits about three times as long as
  // it runs (the accounting Prometheus and offloadctl show).
  const OptimizerShares::Usage used = shares.UsageOf(2);
  EXPECT_GT(used.running_nanos, 0);
  EXPECT_GT(used.queued_nanos, used.running_nanos) << used.running_nanos;
}

// Session 1 (weight 1) alone for a while, then resting: its virtual time
// far ahead.
void OneAloneForAWhile(OptimizerShares& shares) {
  for (int i = 0; i < 1000; ++i) shares.Take(1, 1, 1000);
  shares.Idle(1);
}

// Sessions 1 (weight 1) and 2 (weight 2) stepping without pause for half
// a second, a run of 1000 parameters every 200 us: session 2 updates
// twice what session 1 does.
void ExpectTwoToOneStepping(OptimizerShares& shares) {
  std::atomic<bool> stop{false};
  auto stepper = [&](uint64_t session, int64_t weight) {
    while (!stop.load()) {
      OptimizerShares::Turn turn = shares.Take(session, weight, 1000);
      absl::SleepFor(absl::Microseconds(200));
    }
    shares.Idle(session);
  };
  const uint64_t a0 = shares.UsageOf(1).elems, b0 = shares.UsageOf(2).elems;
  std::thread one(stepper, 1, 1), two(stepper, 2, 2);
  absl::SleepFor(absl::Milliseconds(500));
  stop = true;
  one.join();
  two.join();
  const double a = static_cast<double>(shares.UsageOf(1).elems - a0);
  const double b = static_cast<double>(shares.UsageOf(2).elems - b0);
  ASSERT_GT(a, 0);
  EXPECT_NEAR(b / a, 2.0, 0.2) << a << " " << b;
}

// A session that ran alone for a long while (its virtual time far ahead)
// and a newcomer share by weight from the start: the newcomer gets no
// credit for the time it was absent, and does not run alone until it
// caught up.
TEST(OptimizerShares, AbsenceEarnsNoCredit) {
  OptimizerShares shares;
  OneAloneForAWhile(shares);
  ExpectTwoToOneStepping(shares);
}

// The same where the newcomer's first run comes while the session that
// ran alone rests (between two of its steps, as a trainer computes): the
// newcomer starts where the optimizer's virtual time got to, not at zero,
// so the one that ran alone is not held back until the newcomer has
// updated as much as it did (before: session 1 got 1 run in 500 ms).
TEST(OptimizerShares, ANewcomerWhileTheOthersRestGetsNoCreditEither) {
  OptimizerShares shares;
  OneAloneForAWhile(shares);
  absl::SleepFor(absl::Milliseconds(10));                     // (past its anticipation: it rests)
  { OptimizerShares::Turn first = shares.Take(2, 2, 1000); }  // session 2 comes meanwhile
  shares.Idle(2);
  ExpectTwoToOneStepping(shares);
}

// Sessions of one weight (the default) run as they come: their runs may
// overlap, and none waits for another's.
TEST(OptimizerShares, OneWeightRunsTogether) {
  OptimizerShares shares;
  OptimizerShares::Turn a = shares.Take(1, 1, 100);
  OptimizerShares::Turn b = shares.Take(2, 1, 100);  // would block if runs were exclusive
  EXPECT_EQ(shares.UsageOf(2).elems, 100u);
}

// A session of another weight that just ended its step is present for a
// moment (kAnticipation); when the moment is over, a session of the running
// one's weight runs beside it at once, not when that (long) run ends.
TEST(OptimizerShares, OneOfAnotherWeightThatEndedStopsCountingAfterItsMoment) {
  OptimizerShares shares;
  shares.Take(3, 2, 100);  // ends its run and its step
  shares.Idle(3);
  OptimizerShares::Turn a = shares.Take(1, 1, 100);  // a long run
  std::atomic<bool> ran{false};
  std::thread b([&] {
    shares.Take(2, 1, 100);
    ran = true;
    shares.Idle(2);
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (!ran.load() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_TRUE(ran.load()) << "waited for the other run to end";
  { OptimizerShares::Turn ended = std::move(a); }
  b.join();
}

TEST(OptimizerShares, AloneNothingWaits) {
  OptimizerShares shares;
  for (int i = 0; i < 100; ++i) shares.Take(7, 1, 10);
  EXPECT_EQ(shares.UsageOf(7).elems, 1000u);
  shares.Idle(7);
  shares.Forget(7);
  EXPECT_EQ(shares.UsageOf(7).elems, 0u);
}

}  // namespace
}  // namespace offload
