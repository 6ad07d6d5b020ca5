#include "engine/session_manager.h"

#include <sys/mman.h>

#include <cstring>

#include "base/fault_injecting_env.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

class SessionManagerTest : public ::testing::Test {
 protected:
  SessionManagerTest()
      : host_("host", 64 << 20), optimizer_(OptimizerOptions{1, 1 << 16}),
        store_(&env_, &host_, 16 << 20), steps_(&optimizer_, &stats_),
        sessions_(&env_, &store_, &steps_, &stats_) {}

  SessionKey Open() {
    auto s = sessions_.Open("t");
    EXPECT_TRUE(s.ok()) << s.status();
    return s->key;
  }

  FaultInjectingEnv env_{Env::Default()};
  MemoryBudget host_;
  Stats stats_;
  Optimizer optimizer_;
  PartitionStore store_;
  StepRunner steps_;
  SessionManager sessions_;
};

TEST_F(SessionManagerTest, RegisterFetchReturnStep) {
  SessionKey key = Open();
  EXPECT_EQ(key.token.size(), SessionManager::kTokenBytes);
  auto p = sessions_.Register(key, {"w", 1000, DType::kFp32, DType::kBf16});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->params.bytes, 4000u);
  EXPECT_EQ(p->grads.bytes, 2000u);
  EXPECT_EQ(p->params.offset % 4096, 0u);
  EXPECT_EQ(host_.used(), 4096u + 4096u + 12u * 1000);

  auto fd = sessions_.DupArenaFd(key);
  ASSERT_TRUE(fd.ok());
  auto all = sessions_.Fetch(key, {});
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0].step, 0u);

  ASSERT_TRUE(sessions_.ReturnGradients(key, p->id, 1000, DType::kBf16).ok());
  auto step = sessions_.Step(key, AdamHyperparams{});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->partitions_updated, 1u);
  EXPECT_EQ(step->params_updated, 1000u);
  auto after = sessions_.Fetch(key, {p->id});
  ASSERT_TRUE(after.ok());
  EXPECT_EQ((*after)[0].step, 1u);
  // A step without new gradients is out of order.
  EXPECT_EQ(sessions_.Step(key, AdamHyperparams{}).status().code(),
            absl::StatusCode::kFailedPrecondition);

  ASSERT_TRUE(sessions_.Close(key).ok());
  EXPECT_EQ(host_.used(), 0u);
}

TEST_F(SessionManagerTest, BadRequestsGetPreciseCodes) {
  SessionKey a = Open();
  SessionKey b = Open();
  auto pa = sessions_.Register(a, {"w", 10, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(pa.ok());

  // Unknown session, wrong token.
  EXPECT_EQ(sessions_.Fetch({999, a.token}, {}).status().code(), absl::StatusCode::kNotFound);
  SessionKey forged{a.id, b.token};
  EXPECT_EQ(sessions_.Fetch(forged, {}).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(sessions_.DupArenaFd(forged).status().code(), absl::StatusCode::kPermissionDenied);
  // Fetch before register.
  auto missing = sessions_.Fetch(a, {12345});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("12345"), std::string::npos);
  // Another session's partition.
  EXPECT_EQ(sessions_.Fetch(b, {pa->id}).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(sessions_.ReturnGradients(b, pa->id, 10, DType::kFp32).code(),
            absl::StatusCode::kPermissionDenied);
  // Wrong size, dtype mismatch.
  auto wrong = sessions_.ReturnGradients(a, pa->id, 11, DType::kFp32);
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.message().find("registered with 10"), std::string::npos);
  EXPECT_EQ(sessions_.ReturnGradients(a, pa->id, 10, DType::kBf16).code(),
            absl::StatusCode::kInvalidArgument);
  // Bad registrations.
  EXPECT_EQ(sessions_.Register(a, {"z", 0, DType::kFp32, DType::kFp32}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sessions_.Register(a, {"w", 5, DType::kFp32, DType::kFp32}).status().code(),
            absl::StatusCode::kAlreadyExists);
  // Bad hyperparameters change nothing.
  ASSERT_TRUE(sessions_.ReturnGradients(a, pa->id, 10, DType::kFp32).ok());
  AdamHyperparams bad;
  bad.beta2 = 1.5f;
  EXPECT_EQ(sessions_.Step(a, bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(sessions_.Step(a, AdamHyperparams{}).ok());
  // Double close.
  ASSERT_TRUE(sessions_.Close(a).ok());
  EXPECT_EQ(sessions_.Close(a).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(sessions_.Fetch(a, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  // The other session is untouched and the closed one's partition is gone.
  EXPECT_TRUE(sessions_.Fetch(b, {}).ok());
  EXPECT_EQ(sessions_.Fetch(b, {pa->id}).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SessionManagerTest, AbandonFreesASessionNobodyElseHolds) {
  SessionKey key = Open();
  ASSERT_TRUE(sessions_.Register(key, {"w", 1000, DType::kFp32, DType::kFp32}).ok());
  EXPECT_GT(host_.used(), 0u);
  // No call in flight holds the session: it is destroyed inside Abandon,
  // which must not happen under the manager's lock (lock-order cycle).
  EXPECT_TRUE(sessions_.Abandon(key.id));
  EXPECT_EQ(host_.used(), 0u);
  EXPECT_FALSE(sessions_.Abandon(key.id));
  EXPECT_EQ(sessions_.Fetch(key, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stats_.sessions_abandoned.load(), 1);
  // Registering in another session afterwards is fine.
  SessionKey other = Open();
  EXPECT_TRUE(sessions_.Register(other, {"w", 10, DType::kFp32, DType::kFp32}).ok());
}

TEST_F(SessionManagerTest, BudgetIsEnforcedAndNothingLeaks) {
  SessionKey a = Open();
  host_.SetLimit(1 << 20);
  auto big = sessions_.Register(a, {"big", 1 << 20, DType::kFp32, DType::kFp32});
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(big.status().message().find("big"), std::string::npos);
  EXPECT_EQ(host_.used(), 0u);
  // The arena capacity (16 MiB here) bounds one session as well.
  host_.SetLimit(uint64_t{1} << 40);
  auto huge = sessions_.Register(a, {"huge", 8 << 20, DType::kFp32, DType::kFp32});
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(host_.used(), 0u);
  EXPECT_TRUE(sessions_.Register(a, {"ok", 1000, DType::kFp32, DType::kFp32}).ok());
}

TEST_F(SessionManagerTest, FirstStepTakesMasterFromWorkingCopy) {
  SessionKey key = Open();
  auto p = sessions_.Register(key, {"w", 4, DType::kBf16, DType::kFp32});
  ASSERT_TRUE(p.ok());
  auto fd = sessions_.DupArenaFd(key);
  ASSERT_TRUE(fd.ok());
  // Write the working copy and zero gradients through a second mapping.
  void* base = mmap(nullptr, 16 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, fd->get(), 0);
  ASSERT_NE(base, MAP_FAILED);
  auto* w = reinterpret_cast<uint16_t*>(static_cast<char*>(base) + p->params.offset);
  for (int i = 0; i < 4; ++i) w[i] = FloatToBf16(1.0f + static_cast<float>(i));
  ASSERT_TRUE(sessions_.ReturnGradients(key, p->id, 4, DType::kFp32).ok());
  AdamHyperparams h;
  h.weight_decay = 0.5f;  // with zero gradients only decay moves the weights
  h.lr = 0.1f;
  ASSERT_TRUE(sessions_.Step(key, h).ok());
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(w[i], FloatToBf16((1.0f + static_cast<float>(i)) * (1.0f - 0.05f))) << i;
  }
  munmap(base, 16 << 20);
}

}  // namespace
}  // namespace offload
