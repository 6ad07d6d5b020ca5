#include "swapper/victim_index.h"

#include <cstdint>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "swapper/access_trace.h"

namespace offload {
namespace {

constexpr uint64_t kNever = VictimIndex::kNever;

VictimIndex::Standing Held(uint64_t room = 0) { return {true, room, false, 0}; }
VictimIndex::Standing Candidate(uint64_t room, uint64_t last_use) {
  return {false, room, true, last_use};
}

// An order learned from one iteration of `ids`.
AccessTrace Learned(const std::vector<uint64_t>& ids) {
  AccessTrace t;
  for (uint64_t id : ids) t.RecordUse(id);
  t.EndIteration();
  return t;
}

// The trace's candidates, the first to evict first: (id, next use).
std::vector<std::pair<uint64_t, uint64_t>> Order(VictimIndex& index, uint64_t trace,
                                                 const AccessTrace* order) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  index.ForEachCandidate(trace, order, [&](uint64_t id, uint64_t next, uint64_t) {
    out.emplace_back(id, next);
    return true;
  });
  return out;
}

std::vector<std::pair<uint64_t, uint64_t>> Pairs(
    std::initializer_list<std::pair<uint64_t, uint64_t>> p) {
  return p;
}

TEST(VictimIndexTest, KeepsEachTracesHoldsAndRoom) {
  VictimIndex index;
  index.Set(1, 7, Held(), nullptr);             // a host-homed block pinned
  index.Set(2, 7, Candidate(100, 1), nullptr);  // resident on NVMe
  index.Set(3, 8, Held(50), nullptr);           // pinned, NVMe-homed
  EXPECT_TRUE(index.Held(7));
  EXPECT_TRUE(index.Held(8));
  EXPECT_EQ(index.Room(7), 100u);
  EXPECT_EQ(index.Room(8), 50u);
  EXPECT_EQ(index.all_room(), 150u);
  std::vector<uint64_t> traces;
  index.TracesWithCandidates(&traces);
  EXPECT_EQ(traces, std::vector<uint64_t>{7});

  index.Set(1, 7, {}, nullptr);  // released
  EXPECT_FALSE(index.Held(7));
  index.Set(3, 8, Candidate(50, 2), nullptr);  // released: may go now
  index.TracesWithCandidates(&traces);
  EXPECT_EQ(traces.size(), 2u);
  index.Erase(2);
  EXPECT_EQ(index.Room(7), 0u);
  EXPECT_EQ(index.all_room(), 50u);
  EXPECT_EQ(index.size(), 1u);  // 3 (1 stands for nothing)
  EXPECT_EQ(index.Of(3), Candidate(50, 2));
  EXPECT_EQ(index.Of(2), VictimIndex::Standing{});
  EXPECT_TRUE(index.CheckForTesting([](uint64_t) { return nullptr; }).empty());
  // A trace forgotten goes once its blocks stand for nothing.
  index.Forget(8);
  EXPECT_TRUE(index.CheckForTesting([](uint64_t) { return nullptr; }).empty());
  EXPECT_EQ(index.traces(), 2u);
  index.Erase(3);
  EXPECT_EQ(index.traces(), 1u);  // 8 gone with its last block
  index.Erase(1);
  index.Forget(7);
  EXPECT_EQ(index.traces(), 0u);
  EXPECT_EQ(index.size(), 0u);
  EXPECT_EQ(index.all_room(), 0u);
  EXPECT_TRUE(index.CheckForTesting([](uint64_t) { return nullptr; }).empty());
}

TEST(VictimIndexTest, TheFarthestNextUseFirstThenThoseNotUsedByLastUse) {
  AccessTrace t = Learned({1, 2, 3, 4});
  VictimIndex index;
  index.Set(2, 7, Candidate(1, 10), &t);
  index.Set(4, 7, Candidate(1, 11), &t);
  index.Set(3, 7, Candidate(1, 12), &t);
  index.Set(9, 7, Candidate(1, 14), &t);  // not in the order
  index.Set(8, 7, Candidate(1, 13), &t);  // nor this one, used less lately
  EXPECT_EQ(Order(index, 7, &t), Pairs({{8, kNever}, {9, kNever}, {4, 3}, {3, 2}, {2, 1}}));
  // The trace goes on: 1 used, then 2 (which would be held meanwhile).
  t.RecordUse(1);
  index.Set(2, 7, Held(1), &t);
  t.RecordUse(2);
  index.Set(2, 7, Candidate(1, 15), &t);  // its next use: the next iteration's second
  EXPECT_EQ(Order(index, 7, &t), Pairs({{8, kNever}, {9, kNever}, {2, 3}, {4, 1}, {3, 0}}));
  EXPECT_TRUE(index.CheckForTesting([&](uint64_t) { return &t; }).empty());
}

TEST(VictimIndexTest, APositionTheTraceSkippedIsLookedUpAgain) {
  AccessTrace t = Learned({1, 2, 3, 4, 5});
  VictimIndex index;
  index.Set(2, 7, Candidate(1, 1), &t);  // at position 1
  index.Set(5, 7, Candidate(1, 2), &t);  // at position 4
  t.RecordUse(1);
  t.RecordUse(4);  // skips 2 and 3: block 2's next use is now the next iteration's
  EXPECT_EQ(t.position(), 4u);
  EXPECT_EQ(t.NextUse(2), 2u);
  // Kept at position 1 (behind the trace), block 2 would come last.
  EXPECT_EQ(Order(index, 7, &t), Pairs({{2, 2}, {5, 0}}));
  EXPECT_TRUE(index.CheckForTesting([&](uint64_t) { return &t; }).empty());
}

TEST(VictimIndexTest, OffItsOrderATraceGivesItsLeastRecentlyUsedFirst) {
  AccessTrace t = Learned({1, 2, 3});
  VictimIndex index;
  index.Set(1, 7, Candidate(1, 30), &t);
  index.Set(2, 7, Candidate(1, 10), &t);
  index.Set(3, 7, Candidate(1, 20), &t);
  EXPECT_EQ(Order(index, 7, &t), Pairs({{3, 2}, {2, 1}, {1, 0}}));
  t.RecordUse(42);  // not in the order: predictions stop for this iteration
  ASSERT_FALSE(t.on_trace());
  EXPECT_EQ(Order(index, 7, &t), Pairs({{2, kNever}, {3, kNever}, {1, kNever}}));
  // No order at all (a trace forgotten): the same.
  EXPECT_EQ(Order(index, 7, nullptr), Pairs({{2, kNever}, {3, kNever}, {1, kNever}}));
}

TEST(VictimIndexTest, ANewOrderLooksEveryCandidateUpAgain) {
  AccessTrace t = Learned({1, 2, 3});
  VictimIndex index;
  index.Set(1, 7, Candidate(1, 1), &t);
  index.Set(3, 7, Candidate(1, 2), &t);
  for (uint64_t id : {3, 2, 1}) t.RecordUse(id);  // the order changed: learned at the end
  t.EndIteration();
  EXPECT_EQ(Order(index, 7, &t), Pairs({{1, 2}, {3, 0}}));
  EXPECT_TRUE(index.CheckForTesting([&](uint64_t) { return &t; }).empty());
}

// The same order again, for one iteration or several between two visits:
// positions left behind in the iterations passed are looked up again.
TEST(VictimIndexTest, TheSameOrderAgainMovesThePositionsOn) {
  AccessTrace t = Learned({1, 2, 3, 4});
  VictimIndex index;
  index.Set(2, 7, Candidate(1, 1), &t);
  index.Set(4, 7, Candidate(1, 2), &t);
  auto iteration = [&] {
    for (uint64_t id : {1, 2, 3, 4}) t.RecordUse(id);  // (2 and 4 held meanwhile, in truth)
    t.EndIteration();
  };
  iteration();
  EXPECT_EQ(Order(index, 7, &t), Pairs({{4, 3}, {2, 1}}));
  iteration();
  iteration();
  EXPECT_EQ(Order(index, 7, &t), Pairs({{4, 3}, {2, 1}}));
  EXPECT_TRUE(index.CheckForTesting([&](uint64_t) { return &t; }).empty());
  t.RecordUse(1);
  t.RecordUse(2);
  index.Set(2, 7, Candidate(1, 3), &t);  // used: its next use is the next iteration's
  EXPECT_EQ(Order(index, 7, &t), Pairs({{2, 3}, {4, 1}}));
  EXPECT_TRUE(index.CheckForTesting([&](uint64_t) { return &t; }).empty());
}

// A position past the order's end (the next iteration's use) carries over
// the iteration's end as it is: the same order again, nothing looked up.
TEST(VictimIndexTest, APositionInTheNextIterationCarriesOver) {
  AccessTrace t = Learned({1, 2, 3, 4});
  VictimIndex index;
  t.RecordUse(1);
  t.RecordUse(2);
  index.Set(2, 7, Candidate(1, 1), &t);  // next used at the next iteration's second
  EXPECT_EQ(Order(index, 7, &t), Pairs({{2, 3}}));
  t.RecordUse(3);
  t.RecordUse(4);
  t.EndIteration();
  EXPECT_EQ(Order(index, 7, &t), Pairs({{2, 1}}));
  EXPECT_TRUE(index.CheckForTesting([&](uint64_t) { return &t; }).empty());
}

// Listed while its trace was off its order, a candidate's next use is
// unknown; once the trace is on an order again, it is looked up, even where
// that order is the one it was off (two orders taking turns, A B A B, as
// the delayed update's two working-copy buffers make them, predict the
// other one again). So is every one, when the order was forgotten and a new
// one began.
TEST(VictimIndexTest, NextUsesUnknownWhenListedAreLookedUpLater) {
  AccessTrace t;
  const std::vector<uint64_t> a = {1, 2, 3}, b = {2, 1, 3};
  for (const auto* order : {&a, &b, &a}) {
    for (uint64_t id : *order) t.RecordUse(id);
    t.EndIteration();
  }
  const uint64_t orders = t.orders();
  VictimIndex index;
  index.Set(9, 7, Candidate(1, 1), &t);  // (not in the order: never used by it)
  t.RecordUse(2);
  t.RecordUse(1);  // b again: off a, the order predicted
  ASSERT_FALSE(t.on_trace());
  index.Set(3, 7, Candidate(1, 2), &t);
  EXPECT_EQ(Order(index, 7, &t), Pairs({{9, kNever}, {3, kNever}}));
  t.RecordUse(3);
  t.EndIteration();  // a b a b: a predicted, the same order as before
  ASSERT_EQ(t.orders(), orders);
  EXPECT_EQ(Order(index, 7, &t), Pairs({{9, kNever}, {3, 2}}));

  // A new order under the same id, as far along in its iterations and
  // changes of order as the old one was: only Forget tells them apart.
  index.Erase(9);
  index.Set(2, 7, Candidate(1, 3), &t);
  EXPECT_EQ(Order(index, 7, &t), Pairs({{3, 2}, {2, 1}}));
  AccessTrace again;
  for (const std::vector<uint64_t>& order :
       std::vector<std::vector<uint64_t>>{{9}, {9}, {8}, {3, 2}}) {
    for (uint64_t id : order) again.RecordUse(id);
    again.EndIteration();
  }
  ASSERT_EQ(again.orders(), t.orders());
  ASSERT_EQ(again.iterations(), t.iterations());
  index.Forget(7);
  EXPECT_EQ(Order(index, 7, &again), Pairs({{2, 1}, {3, 0}}));
  EXPECT_TRUE(index.CheckForTesting([&](uint64_t) { return &again; }).empty());
}

TEST(VictimIndexTest, ABlockMovedToAnotherTraceTakesItsRoomAlong) {
  VictimIndex index;
  index.Set(1, 7, Candidate(10, 1), nullptr);
  EXPECT_TRUE(index.CheckForTesting([](uint64_t) { return nullptr; }).empty());
  // A block that moves to another trace takes its room and candidacy along.
  index.Set(1, 8, Candidate(10, 1), nullptr);
  EXPECT_EQ(index.Room(7), 0u);
  EXPECT_EQ(index.Room(8), 10u);
  std::vector<uint64_t> traces;
  index.TracesWithCandidates(&traces);
  EXPECT_EQ(traces, std::vector<uint64_t>{8});
  EXPECT_TRUE(index.CheckForTesting([](uint64_t) { return nullptr; }).empty());
}

}  // namespace
}  // namespace offload
