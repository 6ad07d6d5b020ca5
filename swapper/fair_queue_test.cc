#include "swapper/fair_queue.h"

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace offload {
namespace {

using Clock = FairQueue<uint64_t>::Clock;
using std::chrono::milliseconds;

// Pops up to `n` items at `now`, each done at once; the cost each flow got.
std::map<uint64_t, uint64_t> Serve(FairQueue<uint64_t>& q, int n, Clock::time_point now = {}) {
  std::map<uint64_t, uint64_t> got;
  for (int i = 0; i < n; ++i) {
    uint64_t flow;
    Clock::time_point recheck = Clock::time_point::max();
    std::optional<uint64_t> cost = q.Pop(now, &flow, &recheck);
    if (!cost.has_value()) break;
    got[flow] += *cost;
    q.Done(flow, now);
  }
  return got;
}

TEST(FairQueue, BackloggedFlowsAreServedByWeight) {
  FairQueue<uint64_t> q;  // the item is its cost
  q.SetWeight(7, 2);
  q.SetWeight(9, 1);
  for (int i = 0; i < 300; ++i) {
    q.Push(7, 4, 4);
    q.Push(9, 4, 4);
  }
  // While both are backlogged: 2:1 (within one item).
  std::map<uint64_t, uint64_t> got = Serve(q, 300);
  EXPECT_NEAR(static_cast<double>(got[7]) / static_cast<double>(got[9]), 2.0, 0.05);
  EXPECT_EQ(got[7] + got[9], 1200u);
  // Then the rest of both.
  EXPECT_EQ(q.size(), 300u);
}

TEST(FairQueue, CostsOfDifferentSizesAreCountedInBytes) {
  FairQueue<uint64_t> q;
  // Equal weights, one flow with items 8 times larger: equal bytes each.
  for (int i = 0; i < 100; ++i) q.Push(1, 8, 8);
  for (int i = 0; i < 800; ++i) q.Push(2, 1, 1);
  std::map<uint64_t, uint64_t> got = Serve(q, 450);
  EXPECT_NEAR(static_cast<double>(got[1]) / static_cast<double>(got[2]), 1.0, 0.05);
}

TEST(FairQueue, WithinAFlowItemsLeaveInOrder) {
  FairQueue<std::string> q;
  q.SetWeight(1, 3);
  q.Push(1, 10, "a");
  q.Push(2, 10, "x");
  q.Push(1, 10, "b");
  q.Push(1, 10, "c");
  q.Push(2, 10, "y");
  std::vector<std::string> one, two;
  Clock::time_point now = Clock::now();
  while (!q.empty()) {
    uint64_t flow;
    Clock::time_point recheck = Clock::time_point::max();
    std::optional<std::string> s = q.Pop(now, &flow, &recheck);
    if (!s.has_value()) {  // waits for flow 1's anticipation
      now = recheck;
      continue;
    }
    q.Done(flow, now);
    (flow == 1 ? one : two).push_back(*s);
  }
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(one, (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(two, (std::vector<std::string>{"x", "y"}));
}

TEST(FairQueue, AnIdleFlowEarnsNoCredit) {
  FairQueue<uint64_t> q;
  const Clock::time_point t0 = Clock::now();
  // Flow 1 alone for a long while: it takes everything.
  for (int i = 0; i < 100; ++i) q.Push(1, 1, 1);
  EXPECT_EQ(Serve(q, 100, t0)[1], 100u);
  // Flow 2 arrives later: it does not get the 100 it missed, only its half
  // from now on.
  for (int i = 0; i < 100; ++i) {
    q.Push(1, 1, 1);
    q.Push(2, 1, 1);
  }
  std::map<uint64_t, uint64_t> got = Serve(q, 100, t0 + milliseconds(10));
  EXPECT_NEAR(static_cast<double>(got[2]), 50.0, 1.0);
  EXPECT_NEAR(static_cast<double>(got[1]), 50.0, 1.0);
}

// Two flows that keep one item in flight each, as trainers waiting for each
// swap-in do: tags alone would run one of each at a time (1:1); with
// anticipation the lighter one waits while the heavier is behind.
TEST(FairQueue, FlowsWithOneItemInFlightAreServedByWeight) {
  FairQueue<uint64_t> q;
  q.SetWeight(1, 2);
  Clock::time_point now = Clock::now();
  std::map<uint64_t, int> in_flight;  // flow -> running items
  std::map<uint64_t, uint64_t> done;
  q.Push(1, 16, 16);
  q.Push(2, 16, 16);
  // A device that runs what it is given; each running item ends after 1 ms
  // of its own (so two at once take as long as one: the device has room),
  // and its flow then asks for the next at once.
  std::vector<std::pair<Clock::time_point, uint64_t>> running;
  for (int tick = 0; tick < 3000; ++tick) {
    for (;;) {
      uint64_t flow;
      Clock::time_point recheck = Clock::time_point::max();
      std::optional<uint64_t> cost = q.Pop(now, &flow, &recheck);
      if (!cost.has_value()) {
        // Something waits: never past a flow's anticipation.
        if (!q.empty()) {
          EXPECT_LE(recheck, now + FairQueue<uint64_t>::kAnticipation);
        }
        break;
      }
      running.push_back({now + milliseconds(1), flow});
    }
    now += std::chrono::microseconds(100);
    for (size_t i = 0; i < running.size();) {
      if (running[i].first <= now) {
        const uint64_t flow = running[i].second;
        q.Done(flow, now);
        done[flow] += 16;
        q.Push(flow, 16, 16);
        running.erase(running.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
  }
  ASSERT_GT(done[2], 0u);
  EXPECT_NEAR(static_cast<double>(done[1]) / static_cast<double>(done[2]), 2.0, 0.1);
}

TEST(FairQueue, FlowsOfOneWeightNeverWait) {
  FairQueue<uint64_t> q;
  const Clock::time_point now = Clock::now();
  q.Push(1, 16, 16);
  uint64_t flow;
  Clock::time_point recheck = Clock::time_point::max();
  ASSERT_TRUE(q.Pop(now, &flow, &recheck).has_value());  // flow 1 in flight
  q.Push(2, 64, 64);  // finish 64: flow 1 (16) is behind it, but not heavier
  ASSERT_TRUE(q.Pop(now, &flow, &recheck).has_value());
  EXPECT_EQ(flow, 2u);
  q.Done(1, now);
  q.Push(1, 16, 16);
  q.Done(2, now);
  q.Push(2, 16, 16);
  EXPECT_TRUE(q.Pop(now, &flow, &recheck).has_value());
  EXPECT_TRUE(q.Pop(now, &flow, &recheck).has_value());
  // Nor does a heavier flow wait for a lighter one behind it.
  q.SetWeight(1, 3);
  q.Done(1, now);
  q.Done(2, now);
  q.Push(1, 300, 300);  // flow 2 (finish 80) is behind it, and lighter
  EXPECT_TRUE(q.Pop(now, &flow, &recheck).has_value());
  EXPECT_EQ(flow, 1u);
}

TEST(FairQueue, AFlowThatStopsAskingStopsHoldingTheOthersAfterItsAnticipation) {
  FairQueue<uint64_t> q;
  q.SetWeight(1, 4);
  const Clock::time_point t0 = Clock::now();
  uint64_t flow;
  Clock::time_point recheck = Clock::time_point::max();
  q.Push(1, 16, 16);  // finish 4
  ASSERT_TRUE(q.Pop(t0, &flow, &recheck).has_value());
  q.Done(1, t0);      // and flow 1 asks for nothing more
  q.Push(2, 16, 16);  // finish 16: flow 1 (finish 4) is behind it
  recheck = Clock::time_point::max();
  EXPECT_FALSE(q.Pop(t0, &flow, &recheck).has_value());
  EXPECT_EQ(recheck, t0 + FairQueue<uint64_t>::kAnticipation);
  // Once flow 1's anticipation is over, flow 2 goes.
  recheck = Clock::time_point::max();
  ASSERT_TRUE(q.Pop(t0 + FairQueue<uint64_t>::kAnticipation, &flow, &recheck).has_value());
  EXPECT_EQ(flow, 2u);
}

TEST(FairQueue, UnknownAndForgottenFlowsHaveWeightOne) {
  FairQueue<uint64_t> q;
  EXPECT_EQ(q.weight(5), 1);
  q.SetWeight(5, 4);
  EXPECT_EQ(q.weight(5), 4);
  q.SetWeight(6, 0);  // below 1: 1
  EXPECT_EQ(q.weight(6), 1);
  q.Push(5, 1, 1);
  q.Forget(5);
  EXPECT_EQ(q.weight(5), 1);
  // Its queued item still leaves.
  ASSERT_EQ(q.size(), 1u);
  uint64_t flow;
  Clock::time_point recheck = Clock::time_point::max();
  EXPECT_EQ(q.Pop({}, &flow, &recheck), std::optional<uint64_t>(1));
  EXPECT_EQ(flow, 5u);
  q.Done(5, {});
  EXPECT_TRUE(q.empty());
  q.Forget(42);  // never seen: nothing
  EXPECT_EQ(q.weight(42), 1);
}

}  // namespace
}  // namespace offload
