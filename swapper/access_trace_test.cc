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

}  // namespace
}  // namespace offload
