// The ring service against a real session manager: the same answers as
// the gRPC path's calls, concurrent callers, a hostile mailbox, a closed
// session; and a session manager without a ring service.
#include "daemon/ring_service.h"

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "base/env.h"
#include "base/host_memory.h"
#include "base/unique_fd.h"
#include "daemon/call_gate.h"
#include "engine/engine.h"
#include "engine/session_manager.h"
#include "gtest/gtest.h"
#include "ipc/request_ring.h"
#include "proto/convert.h"
#include "proto/offload.pb.h"

namespace offload {
namespace {

class RingServiceTest : public ::testing::Test {
 protected:
  RingServiceTest()
      : ring_service_(nullptr), engine_(MakeEngine()), sessions_(engine_->sessions()) {
    ring_service_ = std::make_unique<RingService>(&sessions_, &engine_->stats(), &gate_);
    sessions_.SetRingCalls(ring_service_.get());
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

  // Outlive the engine, whose ring threads call them.
  CallGate gate_;
  std::unique_ptr<RingService> ring_service_;
  std::unique_ptr<Engine> engine_;
  SessionManager& sessions_;
  SessionKey key_;
  UniqueFd arena_fd_, ours_, daemons_;
  HostMemory ring_memory_;
  std::unique_ptr<ring::Client> client_;
  std::vector<uint64_t> ids_;
};

TEST_F(RingServiceTest, AnswersAsTheSessionManagerDoes) {
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

// The step protocol's calls (pending gradients, the step, waiting for an
// overlapped one): the gRPC messages, serialized, answered as the session
// manager answers them; no items nor flags; a step's request refused whole
// where it is not a StepRequest with hyperparameters.
TEST_F(RingServiceTest, PendingGradientsAndWaitStepAnswerTheGrpcMessages) {
  auto held = client_->Call(ring::kFetch, ring::kGrads, Items(ids_), absl::Seconds(10));
  ASSERT_TRUE(held.status.ok()) << held.status;
  std::vector<ring::Item> given = Items(ids_);
  for (size_t i = 0; i < given.size(); ++i) {
    given[i].flags = ring::kItemStats;
    given[i].sq_norm = 1.5 * static_cast<double>(i + 1);
  }
  given[1].nonfinite = 2;
  ASSERT_TRUE(client_
                  ->Call(ring::kReturnGradients, ring::kThenRelease | ring::kHandOver, given,
                         absl::Seconds(10))
                  .status.ok());
  auto pending = client_->Call(ring::kPendingGradients, 0, {}, absl::Seconds(10));
  ASSERT_TRUE(pending.status.ok()) << pending.status;
  v1::GetPendingGradientsResponse p;
  ASSERT_TRUE(p.ParseFromString(pending.payload));
  auto direct = sessions_.Pending(key_);
  ASSERT_TRUE(direct.ok());
  EXPECT_EQ(p.sq_norm(), direct->stats.sq_norm);
  EXPECT_EQ(p.sq_norm(), 9.0);
  EXPECT_EQ(p.nonfinite(), 2u);
  EXPECT_EQ(p.partitions(), 3u);
  EXPECT_EQ(p.micro_batches(), direct->micro_batches);
  EXPECT_EQ(p.loss_scale(), direct->loss_scale);
  EXPECT_FALSE(p.delayed_update());
  // The session's delayed update, as it is now.
  ASSERT_TRUE(sessions_.SetDelayedUpdate(key_, true).ok());
  pending = client_->Call(ring::kPendingGradients, 0, {}, absl::Seconds(10));
  ASSERT_TRUE(pending.status.ok()) << pending.status;
  ASSERT_TRUE(p.ParseFromString(pending.payload));
  EXPECT_TRUE(p.delayed_update());
  ASSERT_TRUE(sessions_.SetDelayedUpdate(key_, false).ok());
  // No overlapped step yet: the session manager's error, through the ring.
  auto none = client_->Call(ring::kWaitStep, 0, {}, absl::Seconds(10));
  EXPECT_EQ(none.status.code(), absl::StatusCode::kFailedPrecondition) << none.status;
  // The step itself: its request the gRPC message's bytes.
  v1::StepRequest step;
  auto no_hyperparams = client_->Call(ring::kStep, step.SerializeAsString(), absl::Seconds(10));
  EXPECT_EQ(no_hyperparams.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_hyperparams.status.message().find("hyperparams"), std::string::npos);
  auto garbage = client_->Call(ring::kStep, std::string("\xff\xff\xff\xff", 4), absl::Seconds(10));
  EXPECT_EQ(garbage.status.code(), absl::StatusCode::kInvalidArgument) << garbage.status;
  auto too_big =
      client_->Call(ring::kStep, std::string(ring::kMaxRequestBytes + 1, 'x'), absl::Seconds(10));
  EXPECT_EQ(too_big.status.code(), absl::StatusCode::kInvalidArgument) << too_big.status;
  EXPECT_EQ(sessions_.Pending(key_)->partitions, 3u) << "the refused calls changed nothing";
  ToProto(AdamHyperparams{}, step.mutable_hyperparams());
  step.set_overlap(true);
  step.set_skip(true);  // (the nonfinite gradients: a skipped step either way)
  auto started = client_->Call(ring::kStep, step.SerializeAsString(), absl::Seconds(10));
  ASSERT_TRUE(started.status.ok()) << started.status;
  v1::StepResponse decided;
  ASSERT_TRUE(decided.ParseFromString(started.payload));
  EXPECT_TRUE(decided.skipped());
  auto waited = client_->Call(ring::kWaitStep, 0, {}, absl::Seconds(10));
  ASSERT_TRUE(waited.status.ok()) << waited.status;
  v1::StepResponse w;
  ASSERT_TRUE(w.ParseFromString(waited.payload));
  EXPECT_TRUE(w.skipped());
  EXPECT_FALSE(w.running());
  EXPECT_EQ(w.params_updated(), 0u);
  // Items or flags are refused, naming the op.
  auto with_items = client_->Call(ring::kPendingGradients, 0, Items({ids_[0]}), absl::Seconds(10));
  EXPECT_EQ(with_items.status.code(), absl::StatusCode::kInvalidArgument) << with_items.status;
  auto with_flags = client_->Call(ring::kWaitStep, ring::kGrads, {}, absl::Seconds(10));
  EXPECT_EQ(with_flags.status.code(), absl::StatusCode::kInvalidArgument) << with_flags.status;
  EXPECT_NE(with_flags.status.message().find("op 5"), std::string::npos) << with_flags.status;
  auto unknown_op = client_->Call(static_cast<ring::Op>(6), 0, {}, absl::Seconds(10));
  EXPECT_EQ(unknown_op.status.code(), absl::StatusCode::kInvalidArgument) << unknown_op.status;
}

TEST_F(RingServiceTest, ConcurrentCallersTakeTurns) {
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

TEST_F(RingServiceTest, AHostileMailboxGetsAnErrorAndServingGoesOn) {
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
  // Flags an op does not know (a newer client's) are refused, not dropped.
  for (auto [op, flags] : {std::pair{ring::kFetch, 0x20u}, std::pair{ring::kRelease, 1u},
                           std::pair{ring::kReturnGradients, ring::kGrads}}) {
    auto refused = client_->Call(op, flags, Items({ids_[0]}), absl::Seconds(10));
    EXPECT_EQ(refused.status.code(), absl::StatusCode::kInvalidArgument) << op;
  }
  EXPECT_TRUE(client_->Call(ring::kRelease, 0, Items({ids_[0]}), absl::Seconds(10)).status.ok());
}

TEST_F(RingServiceTest, AClosedSessionClosesItsRing) {
  ASSERT_TRUE(sessions_.Close(key_).ok());
  auto f = client_->Call(ring::kFetch, 0, Items({ids_[0]}), absl::Seconds(10));
  EXPECT_EQ(f.status.code(), absl::StatusCode::kFailedPrecondition) << f.status;
}

// As gRPC's calls: once offloadd stops, a ring's call is UNAVAILABLE and
// does not happen; when its ring closes for the stop, UNAVAILABLE too.
TEST_F(RingServiceTest, StoppingRefusesCallsWithUnavailable) {
  ASSERT_TRUE(gate_.CloseAndDrain(absl::Seconds(10)));
  auto f = client_->Call(ring::kFetch, 0, Items({ids_[0]}), absl::Seconds(10));
  EXPECT_EQ(f.status.code(), absl::StatusCode::kUnavailable) << f.status;
  EXPECT_EQ(sessions_.Sessions()[0].held, 0u);  // nothing happened
  engine_.reset();                              // the daemon's end: its rings close as it stops
  auto closed = client_->Call(ring::kFetch, 0, Items({ids_[0]}), absl::Seconds(10));
  EXPECT_EQ(closed.status.code(), absl::StatusCode::kUnavailable) << closed.status;
  EXPECT_NE(closed.status.message().find("stopping"), std::string::npos) << closed.status;
}

TEST(RingService, WithoutOneARingsCallsAreUnimplemented) {
  EngineOptions o;
  o.host_budget_bytes = 64 << 20;
  o.optimizer = OptimizerOptions{1, 1 << 16};
  o.session_arena_bytes = 16 << 20;
  auto engine = Engine::Create(o, Env::Default());
  ASSERT_TRUE(engine.ok()) << engine.status();
  SessionManager& sessions = (*engine)->sessions();
  auto opened = sessions.Open("no ring service");
  ASSERT_TRUE(opened.ok()) << opened.status();
  auto fd = sessions.DupArenaFd(opened->key);
  ASSERT_TRUE(fd.ok());
  HostMemory memory = *HostMemory::MapShared(fd->get(), opened->ring.offset, opened->ring.bytes);
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  UniqueFd ours(pair[0]), theirs(pair[1]);
  ring::Client client(reinterpret_cast<ring::Layout*>(memory.data()), ours.get());
  auto f = client.Call(ring::kFetch, 0, {{1, 0, 0, 0}}, absl::Seconds(10));
  EXPECT_EQ(f.status.code(), absl::StatusCode::kUnimplemented) << f.status;
}

}  // namespace
}  // namespace offload
