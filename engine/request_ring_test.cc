// The request ring's transport: a dead daemon, the serving thread's
// polling, resets and drains (the ring service's calls:
// daemon/ring_service_test.cc).
#include "ipc/request_ring.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "base/host_memory.h"
#include "base/unique_fd.h"
#include "engine/request_ring_server.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

// No daemon thread answers and the daemon's end of the connection closes:
// the waiting caller learns it at once, not at its deadline.
TEST(RequestRing, ADeadDaemonIsUnavailable) {
  HostMemory memory = *HostMemory::Allocate(ring::RingBytes(), Pages::kSystemDefault);
  auto* l = reinterpret_cast<ring::Layout*>(memory.data());
  l->state.store(ring::kIdle);
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  UniqueFd ours(pair[0]);
  std::thread dies([fd = pair[1]] {
    absl::SleepFor(absl::Milliseconds(100));
    close(fd);
  });
  ring::Client client(l, ours.get());
  const absl::Time start = absl::Now();
  auto f = client.Call(ring::kFetch, 0, {{1, 0, 0, 0}}, absl::Seconds(30));
  dies.join();
  EXPECT_EQ(f.status.code(), absl::StatusCode::kUnavailable) << f.status;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace offload

namespace offload {
namespace {

// A ring served by `handler`, and a client of it.
struct LoneRing {
  explicit LoneRing(RingServer::Handler handler, absl::Duration spin = absl::ZeroDuration(),
                    std::shared_ptr<PollBudget> budget = std::make_shared<PollBudget>(1)) {
    int pair[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
    ours = UniqueFd(pair[0]);
    theirs = UniqueFd(pair[1]);
    HostMemory memory = *HostMemory::Allocate(ring::RingBytes(), Pages::kSystemDefault);
    layout = reinterpret_cast<ring::Layout*>(memory.data());
    server = RingServer::Start(std::move(memory), std::move(handler), spin, std::move(budget));
    client = std::make_unique<ring::Client>(layout, ours.get());
  }
  ~LoneRing() { server->Stop(); }
  UniqueFd ours, theirs;
  ring::Layout* layout;
  std::shared_ptr<RingServer> server;
  std::unique_ptr<ring::Client> client;
};

// A payload (the step calls' response messages) reaches the client whole;
// one past the mailbox is INTERNAL, not cut short; an error carries no
// payload. The mailbox says it serves the step calls.
TEST(RequestRing, APayloadArrivesWholeOrNotAtAll) {
  std::string next;
  LoneRing ring([&](const RingRequest&) {
    if (next == "error") return RingAnswer{absl::NotFoundError("no such step"), {}, "ignored"};
    return RingAnswer{absl::OkStatus(), {}, next};
  });
  EXPECT_EQ(ring.layout->features & ring::kStepCalls, ring::kStepCalls);
  next = std::string("\x08\x01\x10\x00serialized", 14);
  auto a = ring.client->Call(ring::kPendingGradients, 0, {}, absl::Seconds(10));
  ASSERT_TRUE(a.status.ok()) << a.status;
  EXPECT_EQ(a.payload, next);
  next = std::string(ring::kMessageBytes, 'x');
  auto full = ring.client->Call(ring::kWaitStep, 0, {}, absl::Seconds(10));
  ASSERT_TRUE(full.status.ok()) << full.status;
  EXPECT_EQ(full.payload.size(), ring::kMessageBytes);
  next.push_back('y');
  auto over = ring.client->Call(ring::kWaitStep, 0, {}, absl::Seconds(10));
  EXPECT_EQ(over.status.code(), absl::StatusCode::kInternal) << over.status;
  EXPECT_TRUE(over.payload.empty());
  next = "error";
  auto error = ring.client->Call(ring::kWaitStep, 0, {}, absl::Seconds(10));
  EXPECT_EQ(error.status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(error.status.message(), "no such step");
  EXPECT_TRUE(error.payload.empty());
}

// After a call ends (ExpectCall, as the session manager does at the end of
// every call of the session) the thread polls instead of sleeping, and a
// polling thread still resets and stops at once.
TEST(RequestRing, AfterACallTheThreadPollsAndStillResetsAndStops) {
  std::shared_ptr<RingServer> server;
  std::atomic<int> calls{0};
  auto handler = [&](const RingRequest&) {
    ++calls;
    server->ExpectCall();
    return RingAnswer{absl::OkStatus(), {}, {}};
  };
  // Sleeping after each call: at least one sleep per call.
  {
    LoneRing sleeper(handler);
    server = sleeper.server;
    for (int i = 0; i < 20; ++i) {
      ASSERT_TRUE(sleeper.client->Call(ring::kRelease, 0, {}, absl::Seconds(10)).status.ok());
    }
    absl::SleepFor(absl::Milliseconds(20));
    EXPECT_GE(server->sleeps(), 20u);
  }
  LoneRing poller(handler, absl::Seconds(60));
  server = poller.server;
  ASSERT_TRUE(poller.client->Call(ring::kRelease, 0, {}, absl::Seconds(10)).status.ok());
  const uint64_t before = server->sleeps();
  for (int i = 0; i < 20; ++i) {
    absl::SleepFor(absl::Milliseconds(1));  // longer than a wake-up: it would sleep
    ASSERT_TRUE(poller.client->Call(ring::kRelease, 0, {}, absl::Seconds(10)).status.ok());
  }
  EXPECT_EQ(server->sleeps(), before);  // it never slept: it polled
  std::atomic<bool> reset{false};
  server->Reset([&] { reset = true; });
  EXPECT_TRUE(server->WaitForReset(absl::Seconds(5)));
  EXPECT_TRUE(reset.load());
  EXPECT_TRUE(poller.client->Call(ring::kRelease, 0, {}, absl::Seconds(10)).status.ok());
  const absl::Time start = absl::Now();
  server->Stop();  // inside its 60 s window
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(calls.load(), 42);
}

// Polling only where cores are idle: while more rings expect a call than
// the budget allows, a ring sleeps after each call, however long its window.
TEST(RequestRing, WithMoreRingsExpectingCallsThanTheBudgetTheThreadSleeps) {
  auto budget = std::make_shared<PollBudget>(1);
  budget->Enter();  // another ring expects a call
  std::shared_ptr<RingServer> server;
  LoneRing r(
      [&](const RingRequest&) {
        server->ExpectCall();
        return RingAnswer{absl::OkStatus(), {}, {}};
      },
      absl::Seconds(60), budget);
  server = r.server;
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(r.client->Call(ring::kRelease, 0, {}, absl::Seconds(10)).status.ok());
  }
  absl::SleepFor(absl::Milliseconds(20));
  const uint64_t sleeps = server->sleeps();
  EXPECT_GE(sleeps, 20u);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_LE(server->sleeps(), sleeps + 1);  // asleep, not looping
  EXPECT_EQ(budget->expecting(), 2);
  server->Stop();
  EXPECT_EQ(budget->expecting(), 1);  // it left
}

TEST(RequestRing, ACallerThatGivesUpLeavesTheRingUsable) {
  std::atomic<int> calls{0};
  LoneRing r([&](const RingRequest&) {
    if (calls++ == 0) absl::SleepFor(absl::Milliseconds(300));  // the first call is slow
    return RingAnswer{absl::OkStatus(), {}, {}};
  });
  auto slow = r.client->Call(ring::kRelease, 0, {}, absl::Milliseconds(100));
  EXPECT_EQ(slow.status.code(), absl::StatusCode::kDeadlineExceeded) << slow.status;
  // The next call waits for the mailbox the daemon frees when it answers
  // the abandoned one, then goes through.
  auto next = r.client->Call(ring::kRelease, 0, {}, absl::Seconds(10));
  EXPECT_TRUE(next.status.ok()) << next.status;
  EXPECT_EQ(calls.load(), 2);
}

TEST(RequestRing, AResetCallIsAbortedUnansweredAndTheRingServesOn) {
  absl::Notification entered, release;
  std::atomic<int> calls{0};
  LoneRing r([&](const RingRequest&) {
    if (calls++ == 0) {
      entered.Notify();
      release.WaitForNotification();
      return RingAnswer{absl::OkStatus(), {ring::Location{}}, {}};  // must not be delivered
    }
    return RingAnswer{absl::NotFoundError("second"), {}, {}};
  });
  ring::Client::Answer first;
  std::thread caller([&] {
    first = r.client->Call(ring::kFetch, 0, {{1, 0, 0, 0}}, absl::Seconds(10));
  });
  entered.WaitForNotification();
  std::atomic<bool> then_ran{false};
  r.server->Reset([&] { then_ran = true; });  // its trainer went away
  // A resuming trainer waits for the reset, which waits for the call.
  EXPECT_FALSE(r.server->WaitForReset(absl::Milliseconds(50)));
  release.Notify();
  caller.join();
  EXPECT_TRUE(r.server->WaitForReset(absl::Seconds(5)));
  EXPECT_EQ(first.status.code(), absl::StatusCode::kAborted) << first.status;
  EXPECT_TRUE(first.locations.empty());
  // The reset ran after the call ended, then the next call got its own answer.
  auto second = r.client->Call(ring::kFetch, 0, {{1, 0, 0, 0}}, absl::Seconds(10));
  EXPECT_TRUE(then_ran.load());
  EXPECT_EQ(second.status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(second.status.message(), "second");
}

// A resuming trainer waiting for the reset while the session is closed
// (its ring stopped) is told at once, not at the end of its wait.
TEST(RequestRing, AStopWakesAWaitForTheReset) {
  absl::Notification entered, release;
  LoneRing r([&](const RingRequest&) {
    entered.Notify();
    release.WaitForNotification();
    return RingAnswer{absl::OkStatus(), {}, {}};
  });
  ring::Client::Answer first;
  std::thread caller([&] {
    first = r.client->Call(ring::kFetch, 0, {{1, 0, 0, 0}}, absl::Seconds(30));
  });
  entered.WaitForNotification();
  r.server->Reset([] {});
  absl::Notification woke;
  std::thread waiter([&] {
    r.server->WaitForReset(absl::Seconds(20));
    woke.Notify();
  });
  absl::SleepFor(absl::Milliseconds(50));
  std::thread stopper([&] { r.server->Stop(); });  // (joins the call's thread: after it)
  EXPECT_TRUE(woke.WaitForNotificationWithTimeout(absl::Seconds(5)))
      << "the wait slept on while the ring stopped";
  release.Notify();
  caller.join();
  stopper.join();
  waiter.join();
}

// Drain (offloadd keeping its sessions as it stops): a call being served
// when it begins is answered, not cut off; the next call finds the ring
// closed; Stop afterwards changes nothing.
TEST(RequestRing, DrainAnswersTheCallInFlightAndRefusesTheNext) {
  absl::Notification entered, release;
  LoneRing r([&](const RingRequest&) {
    entered.Notify();
    release.WaitForNotification();
    return RingAnswer{absl::NotFoundError("served"), {}, {}};
  });
  ring::Client::Answer first;
  std::thread caller([&] {
    first = r.client->Call(ring::kFetch, 0, {{1, 0, 0, 0}}, absl::Seconds(10));
  });
  entered.WaitForNotification();
  std::thread drainer([&] { r.server->Drain(absl::Seconds(5)); });
  absl::SleepFor(absl::Milliseconds(50));  // Drain has begun, the call still runs
  release.Notify();
  caller.join();
  drainer.join();
  EXPECT_EQ(first.status.code(), absl::StatusCode::kNotFound) << first.status;
  EXPECT_EQ(first.status.message(), "served");
  // A drain is offloadd stopping: UNAVAILABLE, as its gRPC calls then.
  auto next = r.client->Call(ring::kFetch, 0, {{1, 0, 0, 0}}, absl::Seconds(1));
  EXPECT_EQ(next.status.code(), absl::StatusCode::kUnavailable) << next.status;
  EXPECT_EQ(r.layout->state.load(), ring::kClosed);
}

}  // namespace
}  // namespace offload
