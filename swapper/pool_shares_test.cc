#include "swapper/pool_shares.h"

#include <chrono>
#include <limits>

#include "gtest/gtest.h"

namespace offload {
namespace {

using Clock = PoolShares::Clock;
constexpr uint64_t kMiB = 1 << 20;
constexpr double kInf = std::numeric_limits<double>::infinity();

// Times from an arbitrary start, in milliseconds.
Clock::time_point At(int64_t ms) {
  return Clock::time_point{} + std::chrono::hours(1) + std::chrono::milliseconds(ms);
}

TEST(PoolSharesTest, IdleAfterASecondOrTwoOfItsIterations) {
  PoolShares s;
  EXPECT_TRUE(s.Quiet(7, At(0)));  // never seen
  s.Touched(7, At(0));
  EXPECT_FALSE(s.Quiet(7, At(1000)));
  EXPECT_TRUE(s.Quiet(7, At(1001)));
  // An iteration of 5 s (its first use at 0 to EndIteration): idle 10 s
  // after its last use, at 4 s.
  s.Touched(7, At(2000));
  s.Touched(7, At(4000));
  s.EndIteration(7, At(5000));
  EXPECT_FALSE(s.Quiet(7, At(14000)));
  EXPECT_TRUE(s.Quiet(7, At(14001)));
  // A pause between iterations does not lengthen the next: it starts at
  // its first Acquire (20 s), not at the last EndIteration.
  s.Touched(7, At(20000));
  s.EndIteration(7, At(20100));
  EXPECT_FALSE(s.Quiet(7, At(21000)));
  EXPECT_TRUE(s.Quiet(7, At(21001)));
  s.Forget(7);
  EXPECT_TRUE(s.Quiet(7, At(20100)));
}

TEST(PoolSharesTest, ServedIsBytesOverWeightAndAheadPassesTheSlack) {
  PoolShares s;
  s.SetWeight(1, 2);
  s.Served(1, 64 * kMiB, At(0));
  s.Served(2, 64 * kMiB, At(0));  // new: starts at the floor, 32 MiB
  EXPECT_EQ(s.served(1), 32.0 * kMiB);
  EXPECT_EQ(s.served(2), 96.0 * kMiB);
  const double floor = s.Floor(At(1));
  EXPECT_EQ(floor, 32.0 * kMiB);
  // The slack: two of the largest blocks served (64 MiB), past 32 MiB.
  EXPECT_EQ(s.Slack(), 128.0 * kMiB);
  EXPECT_FALSE(s.Ahead(2, floor));  // 64 MiB ahead: not past it
  for (int i = 0; i < 65; ++i) s.Served(2, kMiB, At(2));
  EXPECT_TRUE(s.Ahead(2, s.Floor(At(2))));  // 128 + 1 MiB ahead
  EXPECT_FALSE(s.Ahead(1, s.Floor(At(2))));
}

TEST(PoolSharesTest, ALeadStays) {
  PoolShares s;
  s.Served(1, kMiB, At(0));
  for (int i = 0; i < 1000; ++i) s.Served(2, kMiB, At(0));  // a checkpoint's reads, say
  EXPECT_EQ(s.served(2), 1001.0 * kMiB);                    // from the floor (1), then 1000 more
  EXPECT_TRUE(s.Ahead(2, s.Floor(At(0))));
}

TEST(PoolSharesTest, OnlyTracesUsingThePoolSetTheFloorAndShareTheRoom) {
  PoolShares s;
  s.Served(1, 10 * kMiB, At(0));
  s.Touched(2, At(0));  // at work on host-homed blocks only: not using the pool
  s.SetWeight(4, 2);
  s.Served(4, 20 * kMiB, At(0));  // new: from the floor (10), 10 more
  EXPECT_EQ(s.served(4), 20.0 * kMiB);
  EXPECT_EQ(s.Floor(At(0)), 10.0 * kMiB);
  EXPECT_TRUE(s.UsesPool(4, At(0)));
  EXPECT_EQ(s.RoomShare(1, At(0)), 1.0 / 3);
  EXPECT_EQ(s.RoomShare(4, At(0)), 2.0 / 3);
  s.Forget(4);
  EXPECT_EQ(s.Floor(At(0), /*except=*/1), kInf);
  EXPECT_TRUE(s.UsesPool(1, At(0)));
  EXPECT_FALSE(s.UsesPool(2, At(0)));
  EXPECT_EQ(s.RoomShare(1, At(0)), 1.0);
  s.SetWeight(3, 3);
  s.Served(3, kMiB, At(0));
  EXPECT_EQ(s.RoomShare(1, At(0)), 0.25);
  EXPECT_EQ(s.RoomShare(3, At(0)), 0.75);
  EXPECT_EQ(s.RoomShare(2, At(0)), 1.0);
  // Past their idle time, traces no longer count.
  EXPECT_EQ(s.Floor(At(1001)), kInf);
  EXPECT_FALSE(s.UsesPool(1, At(1001)));
}

// A trace away for a while comes back at least at the least of the others'
// (no credit for the rest); one that stayed keeps its lead.
TEST(PoolSharesTest, BackFromARestNoCredit) {
  PoolShares s;
  s.Served(1, 10 * kMiB, At(0));
  s.Served(2, 10 * kMiB, At(0));                                        // starts at 10: served 20
  for (int t = 100; t <= 5000; t += 100) s.Served(2, 2 * kMiB, At(t));  // 120 MiB
  EXPECT_EQ(s.served(2), 120.0 * kMiB);
  s.Served(1, kMiB, At(5000));  // away 5 s: from 120, not 10
  EXPECT_EQ(s.served(1), 121.0 * kMiB);
  EXPECT_FALSE(s.Ahead(2, s.Floor(At(5000))));
  // Within its idle time it keeps its place: ahead stays ahead.
  for (int i = 0; i < 10; ++i) s.Served(1, 10 * kMiB, At(5500));
  EXPECT_TRUE(s.Ahead(1, s.Floor(At(5500))));  // 221 against 120
}

TEST(PoolSharesTest, AWeightSetLaterCountsFromThen) {
  PoolShares s;
  s.Served(1, kMiB, At(0));
  s.Served(2, kMiB, At(0));
  EXPECT_EQ(s.RoomShare(1, At(0)), 0.5);
  s.SetWeight(1, 3);
  EXPECT_EQ(s.RoomShare(1, At(0)), 0.75);
}

// An Acquire that waited longer than the idle time still leaves its trace
// at work when it succeeds.
TEST(PoolSharesTest, ASlowAcquireIsWork) {
  PoolShares s;
  s.Touched(1, At(0));
  s.Served(1, kMiB, At(5000));
  EXPECT_FALSE(s.Quiet(1, At(5000)));
}

// A block of the learned order acquired again within its trace's iteration
// (a fetch's hold and the step's, forward and backward) counts once: the
// shares count the state a trace works through, not how often it touches
// it. Acquires outside the order count each time.
TEST(PoolSharesTest, ABlockInTheOrderCountsOnceAnIteration) {
  PoolShares s;
  for (int i = 0; i < 3; ++i) s.ServedInPass(1, /*block=*/7, kMiB, At(10 * i));
  s.ServedInPass(1, /*block=*/8, kMiB, At(30));
  EXPECT_EQ(s.served(1), 2.0 * kMiB);
  s.Served(1, kMiB, At(35));  // a checkpoint's read of block 7, say
  EXPECT_EQ(s.served(1), 3.0 * kMiB);
  s.EndIteration(1, At(40));
  s.ServedInPass(1, 7, kMiB, At(50));
  s.ServedInPass(1, 7, kMiB, At(60));
  EXPECT_EQ(s.served(1), 4.0 * kMiB);
  // A trace that never ends an iteration: a pass lasts its idle time.
  s.ServedInPass(2, 9, kMiB, At(0));
  const double first = s.served(2);  // (new: from the floor, trace 1's)
  s.ServedInPass(2, 9, kMiB, At(1000));
  EXPECT_EQ(s.served(2), first);
  EXPECT_FALSE(s.Quiet(2, At(1900)));  // a use all the same
  s.ServedInPass(2, 9, kMiB, At(1001));
  EXPECT_EQ(s.served(2), first + kMiB);
}

// The slack follows the blocks of the traces there are: the largest of
// their last two passes, not the largest there ever was.
TEST(PoolSharesTest, TheSlackFollowsTheBlocksServedLately) {
  PoolShares s;
  s.Served(1, 100 * kMiB, At(0));
  s.Served(2, kMiB, At(0));
  EXPECT_EQ(s.Slack(), 200.0 * kMiB);
  s.EndIteration(1, At(10));
  EXPECT_EQ(s.Slack(), 200.0 * kMiB);  // the pass before's
  s.Served(1, kMiB, At(20));
  s.EndIteration(1, At(30));
  EXPECT_EQ(s.Slack(), PoolShares::kShareSlack);
  s.Served(3, 50 * kMiB, At(40));
  EXPECT_EQ(s.Slack(), 100.0 * kMiB);
  s.Forget(3);
  EXPECT_EQ(s.Slack(), PoolShares::kShareSlack);
}

}  // namespace
}  // namespace offload
