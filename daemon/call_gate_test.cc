#include "daemon/call_gate.h"

#include <thread>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(CallGate, DrainWaitsForCallsInFlightAndRefusesNewOnes) {
  CallGate gate;
  absl::Notification entered, release;
  std::thread call([&] {
    CallScope scope(&gate);
    ASSERT_TRUE(scope.entered());
    entered.Notify();
    release.WaitForNotification();
  });
  entered.WaitForNotification();
  std::thread closer([&] { EXPECT_TRUE(gate.CloseAndDrain(absl::Seconds(60))); });
  // New calls are refused once the gate closes; the running one may finish.
  while (true) {
    CallScope probe(&gate);
    if (!probe.entered()) break;
  }
  release.Notify();
  call.join();
  closer.join();
}

TEST(CallGate, DrainTimesOutOnAStuckCall) {
  CallGate gate;
  ASSERT_TRUE(gate.Enter());
  EXPECT_FALSE(gate.CloseAndDrain(absl::Milliseconds(10)));
  gate.Exit();
  EXPECT_TRUE(gate.CloseAndDrain(absl::ZeroDuration()));
}

// A socket group's member holds at most its share of calls in flight; the
// others' (and its own, as its calls end) are untouched.
TEST(UserCallLimit, EachUserHoldsAtMostItsShare) {
  UserCallLimit limit(2);
  EXPECT_TRUE(limit.Enter(1000));
  EXPECT_TRUE(limit.Enter(1000));
  EXPECT_FALSE(limit.Enter(1000));
  EXPECT_TRUE(limit.Enter(1001));  // another user
  limit.Exit(1000);
  EXPECT_TRUE(limit.Enter(1000));
  EXPECT_FALSE(limit.Enter(1000));
  limit.Exit(1000);
  limit.Exit(1000);
  limit.Exit(1001);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(limit.Enter(1000));
}

}  // namespace
}  // namespace offload
