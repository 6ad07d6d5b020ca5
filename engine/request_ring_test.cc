// The request ring against a real session manager: the same answers as
// the gRPC path's calls, concurrent callers, a hostile mailbox, a closed
// session, a dead daemon.
#include "ipc/request_ring.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "base/env.h"
#include "base/host_memory.h"
#include "engine/engine.h"
#include "engine/request_ring_server.h"
#include "engine/session_manager.h"
#include "gtest/gtest.h"
#include "swapper/host_pool.h"
#include "swapper/swapper.h"

namespace offload {
namespace {

class RequestRingTest : public ::testing::Test {
 protected:
  RequestRingTest() : engine_(MakeEngine()), sessions_(engine_->sessions()) {
    auto opened = sessions_.Open("ring");
    EXPECT_TRUE(opened.ok());
    key_ = opened->key;
    auto fd = sessions_.DupArenaFd(key_);
    arena_fd_ = std::move(*fd);
    ring_memory_ = *HostMemory::MapShared(arena_fd_.get(), opened->ring.offset, opened->ring.bytes);
    EXPECT_EQ(opened->ring.bytes, ring::RingBytes());
    int pair[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
    ours_ = UniqueFd(pair[0]);
    daemons_ = UniqueFd(pair[1]);  // the daemon's end of the arena channel
    client_ = std::make_unique<ring::Client>(layout(), ours_.get());
    for (int i = 0; i < 3; ++i) {
      auto p =
          sessions_.Register(key_, {"p" + std::to_string(i), 1000, DType::kFp32, DType::kFp32});
      EXPECT_TRUE(p.ok());
      ids_.push_back(p->id);
      EXPECT_TRUE(sessions_.Release(key_, {p->id}).ok());
    }
  }

  ring::Layout* layout() { return reinterpret_cast<ring::Layout*>(ring_memory_.data()); }
  std::vector<ring::Item> Items(std::vector<uint64_t> ids) {
    std::vector<ring::Item> items;
    for (uint64_t id : ids) items.push_back({id, 1000, 1, 0});
    return items;
  }

  static std::unique_ptr<Engine> MakeEngine() {
    EngineOptions o;
    o.host_budget_bytes = 64 << 20;
    o.optimizer = OptimizerOptions{1, 1 << 16};
    o.session_arena_bytes = 16 << 20;
    o.state_chunk_elems = 1 << 20;
    auto engine = Engine::Create(o, Env::Default());
    EXPECT_TRUE(engine.ok()) << engine.status();
    return std::move(*engine);
  }

  std::unique_ptr<Engine> engine_;
  SessionManager& sessions_;
  SessionKey key_;
  UniqueFd arena_fd_, ours_, daemons_;
  HostMemory ring_memory_;
  std::unique_ptr<ring::Client> client_;
  std::vector<uint64_t> ids_;
};

TEST_F(RequestRingTest, AnswersAsTheSessionManagerDoes) {
  auto a = client_->Call(ring::kFetch, ring::kGrads, Items(ids_), absl::Seconds(10));
  ASSERT_TRUE(a.status.ok()) << a.status;
  ASSERT_EQ(a.locations.size(), 3u);
  auto direct = sessions_.Fetch(key_, ids_);  // held already: the same places
  ASSERT_TRUE(direct.ok());
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(a.locations[i].id, (*direct)[i].id);
    EXPECT_EQ(a.locations[i].params_offset, (*direct)[i].params.offset);
    EXPECT_EQ(a.locations[i].grads_offset, (*direct)[i].grads.offset);
    EXPECT_EQ(a.locations[i].span_bytes, (*direct)[i].span.bytes);
    EXPECT_EQ(a.locations[i].numel, 1000u);
  }
  EXPECT_EQ(sessions_.Sessions()[0].held, 3u);
  // Gradients returned, then released, in one call.
  auto r =
      client_->Call(ring::kReturnGradients, ring::kThenRelease, Items(ids_), absl::Seconds(10));
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(sessions_.Pending(key_)->partitions, 3u);
  EXPECT_EQ(sessions_.Sessions()[0].held, 0u);
  // Errors come back with their code and message.
  auto unknown = client_->Call(ring::kFetch, 0, Items({999999}), absl::Seconds(10));
  EXPECT_EQ(unknown.status.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(unknown.status.message().find("999999"), std::string::npos);
  auto not_held = client_->Call(ring::kRelease, 0, Items({ids_[0]}), absl::Seconds(10));
  EXPECT_EQ(not_held.status.code(), absl::StatusCode::kFailedPrecondition);
  auto bad_dtype =
      client_->Call(ring::kReturnGradients, 0, {{ids_[0], 1000, 7, 0}}, absl::Seconds(10));
  EXPECT_EQ(bad_dtype.status.code(), absl::StatusCode::kInvalidArgument);
  auto bad_flags = client_->Call(ring::kReturnGradients, ring::kHandOver,
                                 {{ids_[0], 1000, 1, ring::kItemStats | 2}}, absl::Seconds(10));
  EXPECT_EQ(bad_flags.status.code(), absl::StatusCode::kInvalidArgument) << bad_flags.status;
  EXPECT_NE(bad_flags.status.message().find("flags"), std::string::npos) << bad_flags.status;
  // Statistics without hand_over reach the daemon's check (the client
  // never sends them so).
  auto unhanded = client_->Call(ring::kReturnGradients, 0,
                                {{ids_[0], 1000, 1, ring::kItemStats, 1.0, 0}}, absl::Seconds(10));
  EXPECT_EQ(unhanded.status.code(), absl::StatusCode::kInvalidArgument) << unhanded.status;
  EXPECT_NE(unhanded.status.message().find("hand_over"), std::string::npos) << unhanded.status;
  auto fetch_all = client_->Call(ring::kFetch, 0, {}, absl::Seconds(10));
  EXPECT_EQ(fetch_all.status.code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(RequestRingTest, ConcurrentCallersTakeTurns) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 300; ++i) {
        auto f = client_->Call(ring::kFetch, 0, Items({ids_[t]}), absl::Seconds(10));
        if (!f.status.ok() || f.locations.size() != 1 || f.locations[0].id != ids_[t]) ++failures;
        if (!client_->Call(ring::kRelease, 0, Items({ids_[t]}), absl::Seconds(10)).status.ok()) {
          ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(sessions_.Sessions()[0].held, 0u);
}

TEST_F(RequestRingTest, AHostileMailboxGetsAnErrorAndServingGoesOn) {
  ring::Layout* l = layout();
  for (auto [op, count] : {std::pair{99u, 1u}, std::pair{1u, 100000u}, std::pair{0u, 0u}}) {
    uint32_t idle = ring::kIdle;
    ASSERT_TRUE(l->state.compare_exchange_strong(idle, ring::kClaimed));
    l->op = op;
    l->count = count;
    l->state.store(ring::kPosted);
    ring::FutexWake(&l->state);
    while (l->state.load() == ring::kPosted)
      ring::FutexWait(&l->state, ring::kPosted, absl::Milliseconds(10));
    EXPECT_EQ(l->state.load(), static_cast<uint32_t>(ring::kAnswered));
    EXPECT_EQ(l->code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
    l->state.store(ring::kIdle);
  }
  auto f = client_->Call(ring::kFetch, 0, Items({ids_[0]}), absl::Seconds(10));
  EXPECT_TRUE(f.status.ok()) << f.status;
}

TEST_F(RequestRingTest, AClosedSessionClosesItsRing) {
  ASSERT_TRUE(sessions_.Close(key_).ok());
  auto f = client_->Call(ring::kFetch, 0, Items({ids_[0]}), absl::Seconds(10));
  EXPECT_EQ(f.status.code(), absl::StatusCode::kFailedPrecondition) << f.status;
}

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

// After a call ends (ExpectCall, as the session manager does at the end of
// every call of the session) the thread polls instead of sleeping, and a
// polling thread still resets and stops at once.
TEST(RequestRing, AfterACallTheThreadPollsAndStillResetsAndStops) {
  std::shared_ptr<RingServer> server;
  std::atomic<int> calls{0};
  auto handler = [&](const RingRequest&) {
    ++calls;
    server->ExpectCall();
    return RingAnswer{absl::OkStatus(), {}};
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
        return RingAnswer{absl::OkStatus(), {}};
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
    return RingAnswer{absl::OkStatus(), {}};
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
      return RingAnswer{absl::OkStatus(), {ring::Location{}}};  // must not be delivered
    }
    return RingAnswer{absl::NotFoundError("second"), {}};
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

// Drain (offloadd keeping its sessions as it stops): a call being served
// when it begins is answered, not cut off; the next call finds the ring
// closed; Stop afterwards changes nothing.
TEST(RequestRing, DrainAnswersTheCallInFlightAndRefusesTheNext) {
  absl::Notification entered, release;
  LoneRing r([&](const RingRequest&) {
    entered.Notify();
    release.WaitForNotification();
    return RingAnswer{absl::NotFoundError("served"), {}};
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
  auto next = r.client->Call(ring::kFetch, 0, {{1, 0, 0, 0}}, absl::Seconds(1));
  EXPECT_EQ(next.status.code(), absl::StatusCode::kFailedPrecondition) << next.status;
  EXPECT_EQ(r.layout->state.load(), ring::kClosed);
}

}  // namespace
}  // namespace offload
