#include "daemon/teardown_queue.h"

#include <atomic>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

// The sessions of a job whose ranks went away at once are torn down side by
// side: each teardown here waits until all of them have started, which one
// thread running them in turn never gets to (it used to be one thread).
TEST(TeardownQueue, TheSessionsOfOneBatchAreTornDownSideBySide) {
  constexpr int kSessions = 3;
  std::atomic<int> started{0}, together{0};
  absl::Notification all_done;
  std::atomic<int> done{0};
  TeardownQueue queue(kSessions);  // last: gone before what its tasks touch
  SessionManager::Teardowns work;
  for (int i = 0; i < kSessions; ++i) {
    work.Add([&] {
      started.fetch_add(1);
      const absl::Time deadline = absl::Now() + absl::Seconds(10);
      while (started.load() < kSessions && absl::Now() < deadline)
        absl::SleepFor(absl::Milliseconds(1));
      if (started.load() == kSessions) together.fetch_add(1);
      if (done.fetch_add(1) + 1 == kSessions) all_done.Notify();
    });
  }
  queue.Add(std::move(work), {"three sessions closed"});
  ASSERT_TRUE(all_done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(together.load(), kSessions);
}

// What is queued when the queue goes is run first, batches of nothing
// among them.
TEST(TeardownQueue, RunsWhatIsQueuedBeforeItGoes) {
  std::atomic<int> ran{0};
  {
    TeardownQueue queue(2);
    for (int b = 0; b < 10; ++b) {
      SessionManager::Teardowns work;
      for (int i = 0; i < 5; ++i) {
        work.Add([&] {
          absl::SleepFor(absl::Milliseconds(1));
          ran.fetch_add(1);
        });
      }
      queue.Add(std::move(work), {});
    }
    queue.Add(SessionManager::Teardowns(), {"nothing to tear down"});
  }
  EXPECT_EQ(ran.load(), 50);
}

}  // namespace
}  // namespace offload
