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

}  // namespace
}  // namespace offload
