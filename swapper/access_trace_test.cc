#include "swapper/access_trace.h"

#include <vector>

#include "gtest/gtest.h"

namespace offload {
namespace {

void Iterate(AccessTrace& t, const std::vector<uint64_t>& uses) {
  for (uint64_t id : uses) t.RecordUse(id);
  t.EndIteration();
}

TEST(AccessTrace, NoPredictionsBeforeAnIterationWasSeen) {
  AccessTrace t;
  EXPECT_FALSE(t.on_trace());
  t.RecordUse(1);
  EXPECT_EQ(t.NextUse(1), AccessTrace::kNever);
  EXPECT_TRUE(t.Upcoming(4).empty());
}

TEST(AccessTrace, PredictsTheNextUsesAndTheirDistancesWrappingAround) {
  AccessTrace t;
  // Forward 1 2 3, backward 3 2 1, as ZeRO-3 fetches layers.
  Iterate(t, {1, 2, 3, 3, 2, 1});
  ASSERT_TRUE(t.on_trace());
  EXPECT_EQ(t.NextUse(1), 0u);
  EXPECT_EQ(t.NextUse(2), 1u);
  EXPECT_EQ(t.NextUse(3), 2u);
  EXPECT_EQ(t.NextUse(9), AccessTrace::kNever);
  t.RecordUse(1);
  EXPECT_EQ(t.NextUse(1), 4u);  // its backward use
  EXPECT_EQ(t.Upcoming(3), (std::vector<uint64_t>{2, 3, 3}));
  for (uint64_t id : {2, 3, 3, 2}) t.RecordUse(id);
  EXPECT_EQ(t.NextUse(2), 2u);  // not again this iteration: next iteration's position 1
  EXPECT_EQ(t.Upcoming(3), (std::vector<uint64_t>{1, 1, 2}));
  t.RecordUse(1);
  EXPECT_TRUE(t.on_trace());
  EXPECT_EQ(t.NextUse(1), 0u);
  t.EndIteration();
  EXPECT_EQ(t.relearned(), 0u);  // the same order again
}

TEST(AccessTrace, UsesThatDoNotRecurAreSkipped) {
  AccessTrace t;
  // The first iteration registered 1 and 2 (held them) before training.
  Iterate(t, {1, 2, 1, 2, 9});
  t.RecordUse(1);  // expected 1: on trace
  t.RecordUse(1);  // expected 2: 1 comes later, skip ahead to it
  EXPECT_TRUE(t.on_trace());
  EXPECT_EQ(t.Upcoming(2), (std::vector<uint64_t>{2, 9}));
  EXPECT_EQ(t.NextUse(9), 1u);
}

TEST(AccessTrace, AChangedOrderStopsPredictionsAndIsLearnedAgain) {
  AccessTrace t;
  Iterate(t, {1, 2, 3});
  t.RecordUse(3);  // expected 1; 3 is later: skipped ahead
  EXPECT_TRUE(t.on_trace());
  t.RecordUse(2);  // not again in this iteration: the order changed
  EXPECT_FALSE(t.on_trace());
  EXPECT_EQ(t.NextUse(1), AccessTrace::kNever);
  t.RecordUse(1);
  t.EndIteration();
  EXPECT_EQ(t.relearned(), 1u);
  ASSERT_TRUE(t.on_trace());
  EXPECT_EQ(t.Upcoming(3), (std::vector<uint64_t>{3, 2, 1}));
  // A longer iteration than the trace diverges too.
  for (uint64_t id : {3, 2, 1}) t.RecordUse(id);
  EXPECT_TRUE(t.on_trace());
  t.RecordUse(3);
  EXPECT_FALSE(t.on_trace());
}

// Two orders taking turns (the delayed update: the trainer reads a
// partition's two working-copy buffers in turn, 11 12 13 then 21 22 23,
// with the same optimizer state 5 6 between): once an order came back after
// another, the other is predicted next, and every iteration follows its
// prediction. A steady order and a changed one behave as before.
TEST(AccessTrace, TwoOrdersTakingTurnsArePredictedInTurn) {
  const std::vector<uint64_t> a = {11, 12, 13, 5, 6}, b = {21, 22, 23, 5, 6};
  AccessTrace t;
  Iterate(t, a);
  Iterate(t, b);  // A, then B: a changed order, learned as such
  EXPECT_EQ(t.relearned(), 1u);
  EXPECT_EQ(t.Upcoming(1), (std::vector<uint64_t>{21}));
  Iterate(t, a);  // A again: taking turns; B predicted next
  EXPECT_EQ(t.relearned(), 2u);
  EXPECT_EQ(t.Upcoming(5), b);
  for (int i = 0; i < 6; ++i) {
    const std::vector<uint64_t>& next = i % 2 == 0 ? b : a;
    EXPECT_EQ(t.Upcoming(5), next) << i;
    for (uint64_t id : next) {
      t.RecordUse(id);
      EXPECT_TRUE(t.on_trace()) << i << " at " << id;
    }
    t.EndIteration();
  }
  EXPECT_EQ(t.relearned(), 2u);
  // Back to one order: A A (after ... B A) predicts A; nothing alternates.
  Iterate(t, a);
  EXPECT_EQ(t.Upcoming(1), (std::vector<uint64_t>{11}));
  const uint64_t before = t.relearned();
  for (int i = 0; i < 3; ++i) Iterate(t, a);
  EXPECT_EQ(t.relearned(), before);
}

}  // namespace
}  // namespace offload
