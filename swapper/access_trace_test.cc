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

// Two orders taking turns (the delayed update with the working copy on
// NVMe: the trainer reads a partition's two buffers in turn, 11 12 13 then
// 21 22 23, with the same optimizer state 5 6 between): once they took
// turns twice, the other is predicted next, and every iteration follows its
// prediction. Back to one order, it is learned again at once.
TEST(AccessTrace, TwoOrdersTakingTurnsArePredictedInTurn) {
  const std::vector<uint64_t> a = {11, 12, 13, 5, 6}, b = {21, 22, 23, 5, 6};
  AccessTrace t;
  Iterate(t, a);
  Iterate(t, b);  // a changed order, learned as such
  Iterate(t, a);  // A B A: not yet taking turns; the newest predicted
  EXPECT_EQ(t.Upcoming(5), a);
  Iterate(t, b);  // A B A B: taking turns; A predicted next
  EXPECT_EQ(t.relearned(), 3u);
  for (int i = 0; i < 6; ++i) {
    const std::vector<uint64_t>& next = i % 2 == 0 ? a : b;
    EXPECT_EQ(t.Upcoming(5), next) << i;
    for (uint64_t id : next) {
      t.RecordUse(id);
      EXPECT_TRUE(t.on_trace()) << i << " at " << id;
    }
    t.EndIteration();
  }
  EXPECT_EQ(t.relearned(), 3u);
  Iterate(t, b);  // B B: one order again
  EXPECT_EQ(t.Upcoming(1), (std::vector<uint64_t>{21}));
  const uint64_t before = t.relearned();
  for (int i = 0; i < 3; ++i) Iterate(t, b);
  EXPECT_EQ(t.relearned(), before);
}

// One odd iteration in a steady order (a skipped step pins no optimizer
// state: with everything else on the host it records nothing) costs the
// next iteration its predictions, as a changed order does, and no more: A
// X A is not taken for two orders taking turns.
TEST(AccessTrace, OneOddIterationIsNotTakenForTwoOrdersTakingTurns) {
  const std::vector<uint64_t> a = {1, 2, 3};
  for (const std::vector<uint64_t>& odd : {std::vector<uint64_t>{}, std::vector<uint64_t>{3, 1}}) {
    AccessTrace t;
    for (int i = 0; i < 3; ++i) Iterate(t, a);
    Iterate(t, odd);
    Iterate(t, a);
    EXPECT_EQ(t.Upcoming(3), a) << odd.size();
    const uint64_t before = t.relearned();
    for (int i = 0; i < 3; ++i) Iterate(t, a);
    EXPECT_EQ(t.relearned(), before) << odd.size();
  }
}

// `micro` micro-batches of forward and backward (1 2 3 4 4 3 2 1), then
// the step's state (40 41).
std::vector<uint64_t> Accumulated(int micro) {
  std::vector<uint64_t> uses;
  for (int m = 0; m < micro; ++m) {
    for (uint64_t id : {1, 2, 3, 4, 4, 3, 2, 1}) uses.push_back(id);
  }
  uses.push_back(40);
  uses.push_back(41);
  return uses;
}

// Records `uses`; the number of them that began a pass (RecordUse).
int Record(AccessTrace& t, const std::vector<uint64_t>& uses) {
  int passes = 0;
  for (uint64_t id : uses) passes += t.RecordUse(id) ? 1 : 0;
  return passes;
}

// A session that only fetches (inference) never ends an iteration: the
// order its uses repeat is learned from them, each repeat is a pass, and
// the recording stays within its bound.
TEST(AccessTrace, UsesThatRepeatWithoutAStepLearnTheirOrder) {
  const std::vector<uint64_t> forward = {1, 2, 3, 4, 5};
  AccessTrace t;
  int passes = 0;
  for (int i = 0; i < 4; ++i) passes += Record(t, forward);
  ASSERT_TRUE(t.on_trace());
  EXPECT_EQ(t.Upcoming(5), forward);
  EXPECT_EQ(t.NextUse(3), 2u);
  for (int i = 0; i < 10; ++i) {
    passes += Record(t, forward);
    EXPECT_TRUE(t.on_trace()) << i;
  }
  EXPECT_GE(passes, 10);
  EXPECT_EQ(t.passes(), static_cast<uint64_t>(passes));
  EXPECT_GE(t.iterations(), t.passes());
  // However long it goes on, its recording is bounded.
  for (size_t i = 0; i < AccessTrace::kMaxRecording / 4; ++i) Record(t, forward);
  EXPECT_TRUE(t.on_trace());
  EXPECT_LE(t.recorded(), AccessTrace::kMaxRecording);
}

// Evaluation after training: forward passes without a step go off the
// training order (forward then backward) at the second; once they ran past
// twice the last iteration's uses, their own order is learned, and the next
// step's iteration is learned as before.
TEST(AccessTrace, ForwardPassesAfterTrainingArePredicted) {
  const std::vector<uint64_t> forward = {1, 2, 3, 4, 5, 6};
  const std::vector<uint64_t> training = {1, 2, 3, 4, 5, 6, 6, 5, 4, 3, 2, 1, 40, 41};
  AccessTrace t;
  for (int i = 0; i < 3; ++i) Iterate(t, training);
  for (int i = 0; i < 8; ++i) Record(t, forward);
  ASSERT_TRUE(t.on_trace());
  EXPECT_EQ(t.Upcoming(6), forward);
  EXPECT_GT(t.passes(), 0u);
  for (int i = 0; i < 20; ++i) {
    Record(t, forward);
    EXPECT_TRUE(t.on_trace()) << i;
  }
  // Training again: the iteration with the evaluation in it ends at the
  // step; the one after is learned whole and followed.
  Iterate(t, training);
  Iterate(t, training);
  const uint64_t passes = t.passes(), relearned = t.relearned();
  for (uint64_t id : training) {
    EXPECT_FALSE(t.RecordUse(id));
    EXPECT_TRUE(t.on_trace()) << id;
  }
  t.EndIteration();
  EXPECT_EQ(t.passes(), passes);
  EXPECT_EQ(t.relearned(), relearned);
}

// Gradient accumulation repeats forward and backward within an iteration
// whose whole order (with the step's state, 40 41) is learned and followed
// from the second iteration on, with no passes (the first, with nothing
// known, finds repeats: its end learns it whole all the same).
TEST(AccessTrace, GradientAccumulationKeepsItsWholeOrder) {
  const std::vector<uint64_t> iteration = Accumulated(8);
  AccessTrace t;
  Iterate(t, iteration);
  const uint64_t passes = t.passes();
  for (int i = 0; i < 3; ++i) {
    for (uint64_t id : iteration) {
      EXPECT_FALSE(t.RecordUse(id));
      EXPECT_TRUE(t.on_trace()) << i << " at " << id;
    }
    EXPECT_EQ(t.NextUse(1), 0u);  // the next iteration's first
    t.EndIteration();
  }
  EXPECT_EQ(t.passes(), passes);
  // A skipped step with nothing recorded (its state not used) changes
  // none of that.
  Iterate(t, {});
  Iterate(t, iteration);
  for (uint64_t id : iteration) EXPECT_FALSE(t.RecordUse(id));
  EXPECT_TRUE(t.on_trace());
  EXPECT_EQ(t.passes(), passes);
}

// An iteration much shorter than the next (an epoch's last, with fewer
// micro-batches) opens the gate for the next, which finds passes; its end
// learns it whole, and the iterations after follow it with none.
TEST(AccessTrace, AShortIterationLeavesNoPassesInTheNext) {
  AccessTrace t;
  for (int i = 0; i < 3; ++i) Iterate(t, Accumulated(8));
  Iterate(t, Accumulated(1));
  Iterate(t, Accumulated(8));
  const uint64_t passes = t.passes();
  for (int i = 0; i < 3; ++i) {
    for (uint64_t id : Accumulated(8)) {
      EXPECT_FALSE(t.RecordUse(id));
      EXPECT_TRUE(t.on_trace()) << i << " at " << id;
    }
    t.EndIteration();
  }
  EXPECT_EQ(t.passes(), passes);
}

// An iteration longer than the bound on the recording (a large model's,
// or gradient accumulation's), from the first or after a short one:
// dropped once, learned at the next, followed after.
TEST(AccessTrace, IterationsLongerThanTheBoundAreLearned) {
  for (int kind = 0; kind < 4; ++kind) {
    const int micro = kind % 2 == 0 ? 1 : 4;
    const size_t n = AccessTrace::kMaxRecording / micro;  // (two of them a micro-batch)
    std::vector<uint64_t> iteration;
    for (int m = 0; m < micro; ++m) {
      for (uint64_t id = 0; id < n; ++id) iteration.push_back(id);
      for (uint64_t id = n; id-- > 0;) iteration.push_back(id);
    }
    iteration.push_back(n);  // the step's state
    AccessTrace t;
    if (kind >= 2) Iterate(t, {1, 2, 3});
    Iterate(t, iteration);
    Iterate(t, iteration);
    const uint64_t passes = t.passes();
    for (int i = 0; i < 2; ++i) {
      for (uint64_t id : iteration) {
        ASSERT_FALSE(t.RecordUse(id)) << kind;
        ASSERT_TRUE(t.on_trace()) << kind << " " << i << " at " << id;
      }
      t.EndIteration();
    }
    EXPECT_EQ(t.passes(), passes) << kind;
  }
}

// Uses that never repeat and never end an iteration keep a bounded
// recording; the iteration that ends at last learns nothing from what is
// left of it.
TEST(AccessTrace, ARecordingWithoutEndIsBounded) {
  AccessTrace t;
  Iterate(t, {1, 2, 3});
  for (uint64_t id = 100; id < 100 + 3 * AccessTrace::kMaxRecording; ++id) {
    t.RecordUse(id);
    ASSERT_LE(t.recorded(), AccessTrace::kMaxRecording);
  }
  EXPECT_EQ(t.passes(), 0u);
  t.EndIteration();
  EXPECT_EQ(t.Upcoming(3), (std::vector<uint64_t>{1, 2, 3}));
}

}  // namespace
}  // namespace offload
