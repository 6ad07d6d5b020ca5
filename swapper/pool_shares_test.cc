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

// Traces 1 and 2 at `ms`: each waited for a read and was served a MiB.
void BothAt(PoolShares& s, int64_t ms) {
  for (uint64_t t : {1, 2}) {
    s.Missed(t, At(ms));
    s.Served(t, kMiB, At(ms));
  }
}

// Whether traces 1 and 2 hold or wait for blocks (Turn's `busy`): both.
struct Working {
  bool trace[3] = {false, true, true};
  bool operator()(uint64_t t) const { return trace[t]; }
};

// Both traces want room at 0; the turn goes (at 1 ms) to the least served,
// which is returned; trace 1 ends an iteration at 50 ms.
uint64_t BothWantRoom(PoolShares& s, const Working& working) {
  BothAt(s, 0);
  const uint64_t holder = s.Turn(At(1), working);
  s.EndIteration(1, At(50));
  return holder;
}

// Trace 2 alone from 100 ms to `until`: a MiB served and an iteration
// every 10 ms.
void TwoAloneUntil(PoolShares& s, int64_t until) {
  for (int64_t ms = 100; ms <= until; ms += 10) {
    s.Served(2, kMiB, At(ms));
    s.EndIteration(2, At(ms));
  }
}

// Ahead at `now`, with the floor and the slack as the swapper takes them.
bool AheadAt(const PoolShares& s, uint64_t trace, Clock::time_point now) {
  return s.Lead(trace, s.Floor(now), s.Slack(now)) > 0;
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
  EXPECT_EQ(s.Slack(At(1)), 128.0 * kMiB);
  EXPECT_EQ(s.Lead(2, floor, s.Slack(At(1))), 0u);  // 64 MiB ahead: not past it
  for (int i = 0; i < 65; ++i) s.Served(2, kMiB, At(2));
  EXPECT_TRUE(AheadAt(s, 2, At(2)));  // 128 + 1 MiB ahead
  EXPECT_FALSE(AheadAt(s, 1, At(2)));
}

// The lead in whole slacks (0 within the first): of the traces ahead of one
// that holds the floor low, the farthest ahead gives room first.
TEST(PoolSharesTest, LeadIsInWholeSlacks) {
  PoolShares s;
  s.Served(1, kMiB, At(0));                // the floor: 1 MiB
  for (int i = 0; i < 100; ++i) {          // each from 1, as none is ahead yet
    s.Served(2, kMiB, At(0));              // 101
    if (i < 40) s.Served(3, kMiB, At(0));  // 41
    if (i < 20) s.Served(4, kMiB, At(0));  // 21
  }
  const double floor = s.Floor(At(0));
  const double slack = s.Slack(At(0));
  EXPECT_EQ(floor, 1.0 * kMiB);
  EXPECT_EQ(slack, PoolShares::kShareSlack);
  EXPECT_EQ(s.Lead(2, floor, slack), 3u);  // 100 MiB: 3 slacks of 32
  EXPECT_EQ(s.Lead(3, floor, slack), 1u);
  EXPECT_EQ(s.Lead(4, floor, slack), 0u);  // within the slack
  EXPECT_EQ(s.Lead(1, floor, slack), 0u);
  EXPECT_EQ(s.Lead(5, floor, slack), 0u);  // unknown
  // A trace new (or back from a rest) starts at the least of the others'.
  s.Served(6, kMiB, At(0));
  EXPECT_EQ(s.served(6), 2.0 * kMiB);
  // Or, where some compete for room (bring blocks into the pool), at the
  // least of theirs: trace 1 (slow, its blocks fit) holds the floor low
  // without competing, and a newcomer is not owed the others' lead over it.
  for (uint64_t t : {2, 3, 4}) s.BroughtIn(t, At(0));
  s.Served(7, kMiB, At(0));
  EXPECT_EQ(s.served(7), 22.0 * kMiB);  // from trace 4's 21
}

// A rest ends the pass: a block counted before it counts again after it,
// and the trace comes back at the others' level (no credit for the rest),
// though its iterations (1 s) make a pass last longer than the rest (2.4 s).
TEST(PoolSharesTest, ARestEndsThePass) {
  PoolShares s;
  uint64_t b = 0;
  s.Touched(8, At(0));
  s.EndIteration(8, At(1000));
  s.Touched(8, At(1100));
  s.ServedInPass(8, &b, kMiB, At(1100));
  for (int i = 0; i < 100; ++i) s.Served(9, kMiB, At(3000));
  s.Touched(8, At(3500));
  s.ServedInPass(8, &b, kMiB, At(3500));
  EXPECT_GE(s.served(8), s.served(9));
}

TEST(PoolSharesTest, ALeadStays) {
  PoolShares s;
  s.Served(1, kMiB, At(0));
  for (int i = 0; i < 1000; ++i) s.Served(2, kMiB, At(0));  // a checkpoint's reads, say
  EXPECT_EQ(s.served(2), 1001.0 * kMiB);                    // from the floor (1), then 1000 more
  EXPECT_TRUE(AheadAt(s, 2, At(0)));
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
  EXPECT_FALSE(AheadAt(s, 2, At(5000)));
  // Within its idle time it keeps its place: ahead stays ahead.
  for (int i = 0; i < 10; ++i) s.Served(1, 10 * kMiB, At(5500));
  EXPECT_TRUE(AheadAt(s, 1, At(5500)));  // 221 against 120
}

// A trace that comes (or comes back) while every other rests starts where
// the least served of those using the pool last got to, not at what it had
// (zero, new): else one that used the pool alone for a long while, back
// from a rest, is ahead by all of it and gives room first until the
// newcomer has moved as much.
TEST(PoolSharesTest, ANewcomerWhileTheOthersRestGetsNoCreditEither) {
  PoolShares s;
  for (int t = 0; t <= 5000; t += 100) s.Served(1, 2 * kMiB, At(t));  // alone: 102 MiB
  s.Served(2, kMiB, At(7000));  // trace 1 resting (past its idle time): trace 2 comes
  EXPECT_EQ(s.served(2), 103.0 * kMiB);
  s.Served(1, kMiB, At(7100));  // trace 1 back: neither is ahead of the other
  EXPECT_FALSE(AheadAt(s, 1, At(7100)));
  EXPECT_FALSE(AheadAt(s, 2, At(7100)));
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
  uint64_t b7 = 0, b8 = 0, b9 = 0;  // the blocks' records of their passes
  for (int i = 0; i < 3; ++i) s.ServedInPass(1, &b7, kMiB, At(10 * i));
  s.ServedInPass(1, &b8, kMiB, At(30));
  EXPECT_EQ(s.served(1), 2.0 * kMiB);
  s.Served(1, kMiB, At(35));  // a checkpoint's read of block 7, say
  EXPECT_EQ(s.served(1), 3.0 * kMiB);
  s.EndIteration(1, At(40));
  s.ServedInPass(1, &b7, kMiB, At(50));
  s.ServedInPass(1, &b7, kMiB, At(60));
  EXPECT_EQ(s.served(1), 4.0 * kMiB);
  // A trace that never ends an iteration: a pass lasts its idle time.
  s.ServedInPass(2, &b9, kMiB, At(0));
  const double first = s.served(2);  // (new: from the floor, trace 1's)
  s.ServedInPass(2, &b9, kMiB, At(1000));
  EXPECT_EQ(s.served(2), first);
  EXPECT_FALSE(s.Quiet(2, At(1900)));  // a use all the same
  s.ServedInPass(2, &b9, kMiB, At(1001));
  EXPECT_EQ(s.served(2), first + kMiB);
  // A pause between iterations is not part of a pass's time: trace 3's
  // iteration takes 300 ms (a pass without EndIteration: 1.2 s), then it
  // pauses 700 ms; the pass that began at its EndIteration is timed from its
  // next first Acquire (1 s), so 1.6 s is the same pass.
  uint64_t c1 = 0, c2 = 0;
  s.Touched(3, At(0));
  s.ServedInPass(3, &c1, kMiB, At(0));
  s.EndIteration(3, At(300));
  s.Touched(3, At(1000));
  s.ServedInPass(3, &c2, kMiB, At(1000));
  const double counted = s.served(3);
  s.Touched(3, At(1600));
  s.ServedInPass(3, &c2, kMiB, At(1600));  // not again
  EXPECT_EQ(s.served(3), counted);
}

// The slack follows the blocks of the traces there are: the largest of
// their last two passes, not the largest there ever was.
TEST(PoolSharesTest, TheSlackFollowsTheBlocksServedLately) {
  PoolShares s;
  s.Served(1, 100 * kMiB, At(0));
  s.Served(2, kMiB, At(0));
  EXPECT_EQ(s.Slack(At(0)), 200.0 * kMiB);
  s.EndIteration(1, At(10));
  EXPECT_EQ(s.Slack(At(10)), 200.0 * kMiB);  // the pass before's
  s.Served(1, kMiB, At(20));
  s.EndIteration(1, At(30));
  EXPECT_EQ(s.Slack(At(30)), PoolShares::kShareSlack);
  s.Served(3, 50 * kMiB, At(40));
  EXPECT_EQ(s.Slack(At(40)), 100.0 * kMiB);
  s.Forget(3);
  EXPECT_EQ(s.Slack(At(40)), PoolShares::kShareSlack);
  // Only the traces using the pool count: trace 4's block, a second after
  // its last use, no longer does.
  s.Served(4, 80 * kMiB, At(50));
  EXPECT_EQ(s.Slack(At(1050)), 160.0 * kMiB);
  EXPECT_EQ(s.Slack(At(1051)), PoolShares::kShareSlack);
}

// Turns: none while fewer than two traces want room and are at work at
// once; then the least served holds the pool until its turn is over (three
// times its first iteration begun in it, at least kMinTurn), and the next
// least served gets it; a turn whose holder got through no more than one
// iteration more than another at work did not pay: no turns for a while.
TEST(PoolSharesTest, TwoTracesWantingRoomAtOnceTakeTurns) {
  PoolShares s;
  s.SetWeight(1, 2);
  bool busy1 = true;
  auto busy = [&](uint64_t t) { return t != 1 || busy1; };
  s.Served(1, 64 * kMiB, At(0));  // 32 MiB over its weight
  s.Served(2, 48 * kMiB, At(0));  // new: starts at the floor (32), then 80
  // Neither has waited for a read, nor given a block: no turns.
  EXPECT_EQ(s.Turn(At(1), busy), PoolShares::kNone);
  s.Missed(2, At(2));
  EXPECT_EQ(s.Turn(At(3), busy), PoolShares::kNone);  // one wants room
  s.Missed(1, At(4));
  busy1 = false;  // ... but rests (computes)
  EXPECT_EQ(s.Turn(At(5), busy), PoolShares::kNone);
  busy1 = true;
  EXPECT_EQ(s.Turn(At(6), busy), 1u);  // the least served
  EXPECT_EQ(s.holder(), 1u);
  EXPECT_EQ(s.turns(), 1u);
  // The iteration running at the start ends at 50 ms, the first one begun
  // in the turn at 106: the switch took 100 ms, the turn lasts 300.
  s.EndIteration(1, At(50));
  s.EndIteration(1, At(106));
  for (int64_t ms : {200, 305}) {
    s.Served(1, 96 * kMiB, At(ms));  // now at 80 MiB over its weight, then 128
    EXPECT_EQ(s.Turn(At(ms), busy), 1u) << ms;
  }
  // Over, and it paid (two iterations, trace 2 none): trace 2 is the least
  // served.
  EXPECT_EQ(s.Turn(At(306), busy), 2u);
  EXPECT_EQ(s.turns(), 2u);
  // Trace 2's switch: 194 ms (its second iteration in the turn ends at
  // 500): the turn lasts 582 ms. Trace 1 gets through one meanwhile.
  for (int64_t ms : {400, 500, 600}) {
    s.Served(2, 40 * kMiB, At(ms));  // 200 MiB by 600
    s.EndIteration(2, At(ms));
  }
  s.Missed(1, At(550));
  s.Served(1, kMiB, At(550));
  s.EndIteration(1, At(550));
  EXPECT_EQ(s.Turn(At(887), busy), 2u);
  s.Missed(1, At(888));
  s.Served(1, kMiB, At(888));
  EXPECT_EQ(s.Turn(At(889), busy), 1u);  // it paid: 3 against 1
  EXPECT_EQ(s.turns(), 3u);
  // Trace 1's turn (switch 111 ms, 333 ms long) does not pay: 2 iterations
  // against trace 2's 1. No turns for 2 s (four times the turn, at least).
  s.EndIteration(1, At(900));
  s.EndIteration(1, At(1000));
  s.EndIteration(2, At(950));
  for (uint64_t t : {1, 2}) {
    s.Missed(t, At(1200));
    s.Served(t, kMiB, At(1200));
  }
  EXPECT_EQ(s.Turn(At(1223), busy), PoolShares::kNone);
  EXPECT_EQ(s.idle_turns(), 1u);
  for (uint64_t t : {1, 2}) {
    s.Missed(t, At(3200));
    s.Served(t, kMiB, At(3200));
  }
  EXPECT_EQ(s.Turn(At(3222), busy), PoolShares::kNone);
  const uint64_t holder = s.Turn(At(3224), busy);
  ASSERT_NE(holder, PoolShares::kNone);
  EXPECT_EQ(s.turns(), 4u);
  s.Forget(holder);  // its session closed: no turn is held for it
  EXPECT_EQ(s.holder(), PoolShares::kNone);
  EXPECT_EQ(s.Turn(At(3225), busy), PoolShares::kNone);
}

// A holder that rests (holds and waits for nothing, begins no Acquire, for
// kMinTurn) gives its turn up before it is over: to the least served of
// the traces at work.
TEST(PoolSharesTest, AHolderThatRestsGivesItsTurnUp) {
  PoolShares s;
  bool busy1 = true;
  auto busy = [&](uint64_t t) { return t != 1 || busy1; };
  s.Served(1, 10 * kMiB, At(0));
  s.Served(2, 50 * kMiB, At(0));
  s.Served(3, 30 * kMiB, At(0));
  for (uint64_t t : {1, 2}) s.Missed(t, At(0));
  ASSERT_EQ(s.Turn(At(1), busy), 1u);
  for (int64_t ms : {50, 100, 150}) s.EndIteration(1, At(ms));  // a turn of 297 ms
  busy1 = false;
  EXPECT_EQ(s.Turn(At(150), busy), 1u);                 // a pause (149 ms), not yet a rest
  EXPECT_EQ(s.Turn(At(202), busy), PoolShares::kNone);  // resting: trace 2 alone at work
  s.Missed(3, At(210));
  EXPECT_EQ(s.Turn(At(220), busy), 3u);  // its turn paid; trace 3 is the least served at work
  EXPECT_EQ(s.turns(), 2u);
  EXPECT_EQ(s.idle_turns(), 0u);
}

// A turn that lapses (its holder rests, as a rank waiting for the others
// at a step's end does, and nobody else competes) is judged too: one
// iteration against the other's one did not pay; no turns for 2 s, then
// twice as long after another such turn.
TEST(PoolSharesTest, ATurnThatLapsesUnpaidStopsTurnsForAWhile) {
  PoolShares s;
  Working working;
  ASSERT_EQ(BothWantRoom(s, working), 1u);
  s.EndIteration(2, At(60));
  working.trace[1] = false;
  EXPECT_EQ(s.Turn(At(150), working), 1u);                 // a pause, not yet a rest
  EXPECT_EQ(s.Turn(At(300), working), PoolShares::kNone);  // trace 2 alone at work
  EXPECT_EQ(s.idle_turns(), 0u);
  EXPECT_EQ(s.Turn(At(400), working), PoolShares::kNone);  // lapsed: judged, not paid
  EXPECT_EQ(s.idle_turns(), 1u);
  working.trace[1] = true;
  BothAt(s, 500);
  EXPECT_EQ(s.Turn(At(500), working), PoolShares::kNone);
  BothAt(s, 2399);
  EXPECT_EQ(s.Turn(At(2399), working), PoolShares::kNone);
  BothAt(s, 2401);
  const uint64_t holder = s.Turn(At(2401), working);
  ASSERT_NE(holder, PoolShares::kNone);
  EXPECT_EQ(s.turns(), 2u);
  // Unpaid again (neither ends an iteration; the holder rests, and the
  // turn lapses at 2700): no turns for 4 s.
  working.trace[holder] = false;
  const uint64_t other = 3 - holder;
  for (int64_t ms : {2700, 2900}) {
    s.Missed(other, At(ms));
    s.Served(other, kMiB, At(ms));
    EXPECT_EQ(s.Turn(At(ms), working), PoolShares::kNone) << ms;
  }
  EXPECT_EQ(s.idle_turns(), 2u);
  working.trace[holder] = true;
  BothAt(s, 6699);
  EXPECT_EQ(s.Turn(At(6699), working), PoolShares::kNone);
  BothAt(s, 6701);
  EXPECT_NE(s.Turn(At(6701), working), PoolShares::kNone);
}

// A holder gone idle (no Acquire within its idle time: its job stopped, or
// paused for seconds) while another trace goes on alone, its state fitting
// (no eviction asks for a turn meanwhile): the turn ends unjudged (what the
// other did alone was not its doing), and turns start again when both
// compete. Before, the first eviction judged it seconds late, unpaid by the
// other's iterations alone, and stopped turns for a minute (benches/shares
// with the state on NVMe: 0.25-0.33x of one session alone in 5 of 11 runs).
TEST(PoolSharesTest, AHolderGoneIdleEndsItsTurnUnjudged) {
  PoolShares s;
  Working working;
  ASSERT_EQ(BothWantRoom(s, working), 1u);
  working.trace[1] = false;  // trace 1 stops; trace 2 steps alone, its state fitting
  TwoAloneUntil(s, 20000);
  EXPECT_EQ(s.Turn(At(20000), working), PoolShares::kNone);  // trace 2 alone at work
  EXPECT_EQ(s.idle_turns(), 0u);
  working.trace[1] = true;
  BothAt(s, 20100);
  EXPECT_NE(s.Turn(At(20100), working), PoolShares::kNone);  // at once
  EXPECT_EQ(s.turns(), 2u);
}

// The same where the holder comes back before anything asks for a turn:
// its return ends the gone turn, unjudged.
TEST(PoolSharesTest, AHolderBackFromIdleStartsAfresh) {
  PoolShares s;
  Working working;
  ASSERT_EQ(BothWantRoom(s, working), 1u);
  TwoAloneUntil(s, 20000);
  BothAt(s, 20100);
  EXPECT_NE(s.Turn(At(20101), working), PoolShares::kNone);
  EXPECT_EQ(s.idle_turns(), 0u);
}

// A turn that lapsed (trace 2 stopped wanting room, its state fitting) but
// is found so only seconds later, at the next eviction: it ends unjudged.
// Judged then, both traces' iterations since made it unpaid, and the pause
// (four times the seconds since the turn began) stopped turns when both
// competed again.
TEST(PoolSharesTest, ATurnFoundLapsedLongAfterEndsUnjudged) {
  PoolShares s;
  Working working;
  ASSERT_EQ(BothWantRoom(s, working), 1u);
  for (int64_t ms = 100; ms <= 5000; ms += 100) {
    for (uint64_t t : {1, 2}) {
      s.Served(t, kMiB, At(ms));
      s.EndIteration(t, At(ms));
    }
  }
  EXPECT_EQ(s.Turn(At(5000), working), PoolShares::kNone);  // trace 2 wants no room
  EXPECT_EQ(s.idle_turns(), 0u);
  BothAt(s, 5100);
  EXPECT_NE(s.Turn(At(5100), working), PoolShares::kNone);
}

// A trace whose first use of the pool was counted as such (Served: a
// checkpoint's read) had begun no pass: the first block of its iteration's
// work counts all the same.
TEST(PoolSharesTest, TheFirstPassCountsAfterAUseBesideTheIteration) {
  PoolShares s;
  s.Touched(1, At(0));
  s.Served(1, kMiB, At(0));
  uint64_t block_pass = 0;
  s.Touched(1, At(10));
  s.ServedInPass(1, &block_pass, 64 * kMiB, At(10));
  EXPECT_EQ(s.served(1), 65.0 * kMiB);
}

}  // namespace
}  // namespace offload
