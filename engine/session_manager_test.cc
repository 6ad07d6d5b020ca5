#include "engine/session_manager.h"

#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/directory.h"
#include "base/fault_injecting_env.h"
#include "base/host_memory.h"
#include "base/span_maps.h"
#include "checkpoint/format.h"
#include "engine/engine.h"
#include "engine/test_engine.h"
#include "gtest/gtest.h"
#include "ipc/request_ring.h"

namespace offload {
namespace {

int OpenDescriptors() {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    (void)entry;
    ++n;
  }
  return n;
}

FetchMode WithGrads() {
  FetchMode mode;
  mode.grads = true;
  return mode;
}

class SessionManagerTest : public ::testing::Test {
 protected:
  SessionManagerTest()
      : engine_(MakeEngine(&env_)),
        stats_(engine_->stats()),
        pool_(engine_->pool()),
        store_(engine_->store()),
        steps_(engine_->steps()),
        sessions_(engine_->sessions()) {}

  static std::unique_ptr<Engine> MakeEngine(Env* env) {
    EngineOptions o;
    o.host_budget_bytes = 64 << 20;
    o.optimizer = OptimizerOptions{1, 1 << 16};
    o.session_arena_bytes = 16 << 20;
    o.state_chunk_elems = 1 << 20;
    auto engine = Engine::Create(o, env);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return std::move(*engine);
  }

  SessionKey Open() {
    auto s = sessions_.Open("t");
    EXPECT_TRUE(s.ok()) << s.status();
    return s->key;
  }

  // One step of partition `id` of `key` (`numel` fp32 elements, held
  // nowhere): its gradients returned, then Step with `control`.
  static void StepPartition(SessionManager& sessions, const SessionKey& key, uint64_t id,
                            uint64_t numel, const StepControl& control = {}) {
    ASSERT_TRUE(sessions.Fetch(key, {id}, WithGrads()).ok());
    ASSERT_TRUE(sessions.ReturnGradients(key, id, numel, DType::kFp32).ok());
    ASSERT_TRUE(sessions.Release(key, {id}).ok());
    ASSERT_TRUE(sessions.Step(key, AdamHyperparams{}, control).ok());
  }

  // Automatic checkpoints every `every_steps` steps into <root>/auto, `root`
  // made afresh; the options, for a manager of another offloadd too.
  SessionManager::AutoCheckpointOptions AutoCheckpointsIn(const std::string& root,
                                                          uint64_t every_steps) {
    std::filesystem::remove_all(root);
    std::filesystem::create_directories(root);
    SessionManager::AutoCheckpointOptions options;
    options.dir = root + "/auto";
    options.every_steps = every_steps;
    sessions_.SetAutoCheckpoint(options);
    return options;
  }

  // Waits (up to 20 s) until `stats` counted `n` automatic checkpoints; the
  // caller checks that it did.
  static void AwaitAutoCheckpoints(const Stats& stats, int64_t n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (stats.auto_checkpoints.load() < n && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(2));
    }
  }

  FaultInjectingEnv env_{Env::Default()};
  std::unique_ptr<Engine> engine_;
  Stats& stats_;
  HostPool& pool_;
  PartitionStoreFactory& store_;
  StepRunner& steps_;
  SessionManager& sessions_;
};

TEST_F(SessionManagerTest, RegisterFetchReturnStep) {
  SessionKey key = Open();
  EXPECT_EQ(key.token.size(), SessionManager::kTokenBytes);
  auto p = sessions_.Register(key, {"w", 1000, DType::kFp32, DType::kBf16});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->params.bytes, 4000u);
  EXPECT_EQ(p->grads.bytes, 2000u);
  EXPECT_EQ(p->params.offset % 4096, 0u);
  // Exact accounting of what is mapped: two arena pages, and master, m
  // and v (4000 bytes each) a page each; no gradient accumulator yet.
  EXPECT_EQ(pool_.used(), 4096u + 4096u + 3 * 4096u);

  auto fd = sessions_.DupArenaFd(key);
  ASSERT_TRUE(fd.ok());
  auto all = sessions_.Fetch(key, {});
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0].step, 0u);

  // Gradients are written into a held buffer, and only then returned.
  EXPECT_EQ(sessions_.ReturnGradients(key, p->id, 1000, DType::kBf16).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(sessions_.Fetch(key, {p->id}, WithGrads()).ok());
  ASSERT_TRUE(sessions_.ReturnGradients(key, p->id, 1000, DType::kBf16).ok());
  // Returned (not handed over): accumulated into an accumulator, a page,
  // made now.
  EXPECT_EQ(pool_.used(), 4096u + 4096u + 4 * 4096u);
  // Handed back: returning them again needs another hold.
  EXPECT_EQ(sessions_.ReturnGradients(key, p->id, 1000, DType::kBf16).code(),
            absl::StatusCode::kFailedPrecondition);
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
  EXPECT_EQ(pool_.used(), 0u);
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
  // A size no partition may have is the caller's mistake, told as such
  // (not the mapping budget's refusal, which counted its chunks first).
  sessions_.SetMappingBudget(HostMemory::LiveMappings() + 1000);
  for (uint64_t numel : {uint64_t{1} << 41, ~uint64_t{0}}) {
    auto past = sessions_.Register(a, {"huge", numel, DType::kFp32, DType::kFp32});
    EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument) << past.status();
    EXPECT_NE(past.status().message().find("2^40"), std::string::npos) << past.status();
  }
  sessions_.SetMappingBudget(0);
  // Restore fields that would be ignored.
  RestoreFrom both("/nonexistent");
  both.lost = true;
  EXPECT_EQ(sessions_.Open("r", {}, std::nullopt, std::nullopt, both).status().code(),
            absl::StatusCode::kInvalidArgument);
  RestoreFrom steps_alone;
  steps_alone.steps = 3;
  EXPECT_EQ(sessions_.Open("r", {}, std::nullopt, std::nullopt, steps_alone).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Releasing what is not held changes nothing.
  ASSERT_TRUE(sessions_.Release(a, {pa->id}).ok());
  EXPECT_EQ(sessions_.Release(a, {pa->id}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(sessions_.Release(b, {pa->id}).code(), absl::StatusCode::kPermissionDenied);
  // Bad hyperparameters change nothing.
  ASSERT_TRUE(sessions_.Fetch(a, {pa->id}, WithGrads()).ok());
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

// A fetch of every partition (no ids) is capped as one naming them is: its
// reply would otherwise grow with the session (issue 29: 16,000 partitions
// with long names passed the client's reply limit).
TEST(SessionManager, AFetchOfEverythingIsCappedLikeANamedOne) {
  EngineOptions o;
  o.host_budget_bytes = 256 << 20;
  o.optimizer = OptimizerOptions{1, 1 << 16};
  o.session_arena_bytes = 128 << 20;  // 4097 partitions of a few pages each
  o.state_chunk_elems = 1 << 20;
  auto engine = Engine::Create(o, Env::Default());
  ASSERT_TRUE(engine.ok()) << engine.status();
  SessionManager& sessions = (*engine)->sessions();
  auto opened = sessions.Open("many");
  ASSERT_TRUE(opened.ok()) << opened.status();
  const SessionKey a = opened->key;
  std::vector<uint64_t> ids;
  for (size_t i = 0; i <= SessionManager::kMaxFetchIds; ++i) {
    auto p = sessions.Register(a, {absl::StrCat("p", i), 1, DType::kFp32, DType::kFp32});
    ASSERT_TRUE(p.ok()) << p.status();
    ids.push_back(p->id);
  }
  ASSERT_TRUE(sessions.Release(a, {}).ok());
  auto all = sessions.Fetch(a, {});
  EXPECT_EQ(all.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(all.status().message().find("4097"), std::string::npos) << all.status();
  // In named calls of at most the cap, it works.
  auto first = sessions.Fetch(a, absl::MakeConstSpan(ids).subspan(0, SessionManager::kMaxFetchIds));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->size(), SessionManager::kMaxFetchIds);
  EXPECT_TRUE(
      sessions.Fetch(a, absl::MakeConstSpan(ids).subspan(SessionManager::kMaxFetchIds)).ok());
  EXPECT_TRUE(sessions.Release(a, {}).ok());
}

TEST_F(SessionManagerTest, AbandonFreesASessionNobodyElseHolds) {
  SessionKey key = Open();
  ASSERT_TRUE(sessions_.Register(key, {"w", 1000, DType::kFp32, DType::kFp32}).ok());
  EXPECT_GT(pool_.used(), 0u);
  // No call in flight holds the session: it is destroyed inside Abandon,
  // which must not happen under the manager's lock (lock-order cycle).
  EXPECT_TRUE(sessions_.Abandon(key.id));
  EXPECT_EQ(pool_.used(), 0u);
  EXPECT_FALSE(sessions_.Abandon(key.id));
  EXPECT_EQ(sessions_.Fetch(key, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stats_.sessions_abandoned.load(), 1);
  // Registering in another session afterwards is fine.
  SessionKey other = Open();
  EXPECT_TRUE(sessions_.Register(other, {"w", 10, DType::kFp32, DType::kFp32}).ok());
}

// Leases run out (a session no trainer attached to, one idle) until
// offloadd, stopping to keep its sessions, pauses them: then none is
// closed, however long the keeping takes.
TEST_F(SessionManagerTest, PausedLeasesCloseNothing) {
  const SessionKey a = Open();
  const auto later = std::chrono::steady_clock::now() + std::chrono::hours(1);
  auto expire = [&] {
    return sessions_.CloseExpired(later, absl::Seconds(1), absl::Seconds(1), absl::Seconds(1));
  };
  sessions_.PauseLeases();
  EXPECT_TRUE(expire().empty());
  EXPECT_TRUE(sessions_.Fetch(a, {}).ok());
  SessionManager other(Env::Default(), &store_, &steps_, &stats_);
  auto c = other.Open("c");
  ASSERT_TRUE(c.ok()) << c.status();
  const auto closed =
      other.CloseExpired(later, absl::Seconds(1), absl::Seconds(1), absl::Seconds(1));
  ASSERT_EQ(closed.size(), 1u);
  EXPECT_EQ(closed[0].id, c->key.id);
  EXPECT_EQ(closed[0].why, SessionManager::Expired::kNeverAttached);
}

TEST_F(SessionManagerTest, BudgetIsEnforcedAndNothingLeaks) {
  SessionKey a = Open();
  pool_.SetLimit(1 << 20);
  auto big = sessions_.Register(a, {"big", 1 << 20, DType::kFp32, DType::kFp32});
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(big.status().message().find("big"), std::string::npos);
  EXPECT_EQ(pool_.used(), 0u);
  // The arena capacity (16 MiB here) bounds one session as well.
  pool_.SetLimit(uint64_t{1} << 40);
  auto huge = sessions_.Register(a, {"huge", 8 << 20, DType::kFp32, DType::kFp32});
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool_.used(), 0u);
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
  ASSERT_TRUE(sessions_.Fetch(key, {p->id}, WithGrads()).ok());
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

// A batched gradient return with a malformed item (a dtype no wire value
// names) is refused whole: the items before it are not returned (a client
// that retries the batch would add them twice).
TEST_F(SessionManagerTest, AMalformedItemRefusesTheWholeGradientReturn) {
  SessionKey key = Open();
  std::vector<uint64_t> ids;
  for (int i = 0; i < 2; ++i) {
    auto p = sessions_.Register(key, {absl::StrCat("w", i), 64, DType::kFp32, DType::kFp32});
    ASSERT_TRUE(p.ok()) << p.status();
    ids.push_back(p->id);
  }
  ASSERT_TRUE(sessions_.Release(key, ids).ok());
  ASSERT_TRUE(sessions_.Fetch(key, ids, WithGrads()).ok());
  std::vector<GradientReturn> items(2);
  for (int i = 0; i < 2; ++i) {
    items[i].partition_id = ids[i];
    items[i].numel = 64;
    items[i].grad_dtype = DType::kFp32;
  }
  items[1].grad_dtype =
      absl::InvalidArgumentError("grad_dtype 9 is not fp32 (1), bf16 (2) or fp16 (3)");
  const absl::Status refused = sessions_.ReturnGradients(key, items, /*release=*/true);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_EQ(sessions_.Pending(key)->partitions, 0u);
  ASSERT_TRUE(sessions_.Release(key, ids).ok());  // (still held: nothing released either)
  ASSERT_TRUE(sessions_.Close(key).ok());
}

// An automatic checkpoint runs after the step it is due at, takes nothing
// from the trainer (its own checkpoint waits for it instead of being
// refused; WaitCheckpoint reports the trainer's), and goes with the session.
TEST_F(SessionManagerTest, AutomaticCheckpointsStayOutOfTheTrainersWay) {
  const std::string root = ::testing::TempDir() + "/auto_checkpoints";
  AutoCheckpointsIn(root, 2);
  SessionKey key = Open();
  const std::string auto_dir = sessions_.AutoCheckpointDir(key.id);
  EXPECT_EQ(auto_dir, absl::StrCat(root, "/auto/", key.id));
  auto p = sessions_.Register(key, {"w", 1 << 16, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(sessions_.Release(key, {p->id}).ok());
  auto step = [&] { StepPartition(sessions_, key, p->id, 1 << 16); };
  step();
  EXPECT_FALSE(std::filesystem::exists(auto_dir));  // not due after one step
  step();                                           // due: begins in the background
  // The trainer's own checkpoint right after it: waits, then runs.
  auto mine = sessions_.Checkpoint(key, root + "/mine", /*background=*/true);
  ASSERT_TRUE(mine.ok()) << mine.status();
  auto waited = sessions_.WaitCheckpoint(key);
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_TRUE(absl::StrContains(waited->summary.manifest, root + "/mine"))
      << waited->summary.manifest;
  EXPECT_EQ(stats_.auto_checkpoints.load(), 1);
  EXPECT_EQ(stats_.auto_checkpoint_failures.load(), 0);
  EXPECT_TRUE(std::filesystem::exists(auto_dir));
  ASSERT_TRUE(sessions_.Close(key).ok());
  EXPECT_FALSE(std::filesystem::exists(auto_dir));       // closed: not wanted
  EXPECT_TRUE(std::filesystem::exists(root + "/mine"));  // the trainer's stays
  // The automatic ones' directory is offloadd's: a trainer's checkpoint
  // there (another session's directory, or the root itself) is refused.
  SessionKey other = Open();
  for (const std::string& dir :
       {root + "/auto", root + "/auto/" + std::to_string(key.id), root + "/mine/../auto/x"}) {
    EXPECT_EQ(sessions_.Checkpoint(other, dir, false).status().code(),
              absl::StatusCode::kInvalidArgument)
        << dir;
  }
  EXPECT_TRUE(sessions_.Checkpoint(other, root + "/autumn", false).ok());
  // So is the kept sessions' (<data_dir>/preserved).
  sessions_.SetKeptDirectory(root + "/preserved");
  EXPECT_EQ(sessions_.Checkpoint(other, root + "/preserved/7", false).status().code(),
            absl::StatusCode::kInvalidArgument);
  sessions_.SetKeptDirectory("");
  ASSERT_TRUE(sessions_.Close(other).ok());
  sessions_.SetAutoCheckpoint({});
}

// A job of several ranks decides its automatic checkpoints itself: the
// pending gradients say whether this session's is due (by offloadd's clock
// or step count), and a Step that says true takes it at that step whatever
// the clock says (waiting for one still being written), false not even
// when due (it stays due). Each rank's clock alone put a job's checkpoints
// steps apart.
TEST_F(SessionManagerTest, AJobDecidesItsAutomaticCheckpointsAtOneStep) {
  const std::string root = ::testing::TempDir() + "/auto_decided";
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);
  SessionManager::AutoCheckpointOptions options;
  options.dir = root + "/auto";
  options.interval = absl::Hours(1);
  sessions_.SetAutoCheckpoint(options);
  SessionKey key = Open();
  auto p = sessions_.Register(key, {"w", 1 << 12, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(sessions_.Release(key, {p->id}).ok());
  StepControl now, not_now, own;
  now.auto_checkpoint = true;
  not_now.auto_checkpoint = false;
  ASSERT_NO_FATAL_FAILURE(StepPartition(sessions_, key, p->id, 1 << 12, own));
  EXPECT_FALSE(sessions_.Pending(key)->auto_checkpoint_due);  // an hour to go
  // Another rank's was due: taken here too, twice in a row (the second
  // waits for the first).
  ASSERT_NO_FATAL_FAILURE(StepPartition(sessions_, key, p->id, 1 << 12, now));
  ASSERT_NO_FATAL_FAILURE(StepPartition(sessions_, key, p->id, 1 << 12, now));
  AwaitAutoCheckpoints(stats_, 2);
  EXPECT_EQ(stats_.auto_checkpoints.load(), 2);
  // Due by the clock (a nanosecond), but the job said not now: none, and it
  // stays due.
  options.interval = absl::Nanoseconds(1);
  sessions_.SetAutoCheckpoint(options);
  EXPECT_TRUE(sessions_.Pending(key)->auto_checkpoint_due);
  ASSERT_NO_FATAL_FAILURE(StepPartition(sessions_, key, p->id, 1 << 12, not_now));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(stats_.auto_checkpoints.load(), 2);
  EXPECT_TRUE(sessions_.Pending(key)->auto_checkpoint_due);
  // Unsaid: as the clock says.
  ASSERT_NO_FATAL_FAILURE(StepPartition(sessions_, key, p->id, 1 << 12, own));
  AwaitAutoCheckpoints(stats_, 3);
  EXPECT_EQ(stats_.auto_checkpoints.load(), 3);
  ASSERT_TRUE(sessions_.Close(key).ok());
  sessions_.SetAutoCheckpoint({});
}

// What a session left in its automatic checkpoints when its offloadd died
// is found by its name: the latest, or the kept previous one at the step a
// job's ranks share; one closed before it stepped leaves it for that, one
// that stepped takes it away; an open session's own is never taken.
TEST_F(SessionManagerTest, ALostSessionIsFoundByNameAtAStepItsRanksShare) {
  const std::string root = ::testing::TempDir() + "/lost";
  const SessionManager::AutoCheckpointOptions options = AutoCheckpointsIn(root, 1);
  const auto opened = sessions_.Open("job/rank0");
  ASSERT_TRUE(opened.ok()) << opened.status();
  const SessionKey key = opened->key;
  const std::string auto_dir = sessions_.AutoCheckpointDir(key.id);
  auto p = sessions_.Register(key, {"w", 1 << 12, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(sessions_.Release(key, {p->id}).ok());
  for (int i = 1; i <= 3; ++i) {
    ASSERT_NO_FATAL_FAILURE(StepPartition(sessions_, key, p->id, 1 << 12));
    AwaitAutoCheckpoints(stats_, i);
    ASSERT_EQ(stats_.auto_checkpoints.load(), i);
  }
  // The same name while its session is open: nothing lost to find.
  RestoreFrom lost;
  lost.lost = true;
  auto alive = sessions_.Open("job/rank0", {}, std::nullopt, std::nullopt, lost);
  ASSERT_TRUE(alive.ok()) << alive.status();
  EXPECT_EQ(alive->restored_from, "");
  ASSERT_TRUE(sessions_.Close(alive->key).ok());

  // A restarted offloadd (the first one's session never closed: it died).
  std::unique_ptr<Engine> restarted = MakeEngine(&env_);
  SessionManager& next = restarted->sessions();
  next.SetAutoCheckpoint(options);
  auto latest = next.Open("job/rank0", {}, std::nullopt, std::nullopt, lost);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->restored_from, auto_dir);
  EXPECT_EQ(latest->restorable_steps, (std::vector<uint64_t>{3, 2}));
  auto q = next.Register(latest->key, {"w", 1 << 12, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(q->restored);
  EXPECT_EQ(q->step, 3u);
  // Its other rank has only step 2: closed before a step, it leaves the
  // directory for the session that opens at step 2.
  ASSERT_TRUE(next.Close(latest->key).ok());
  EXPECT_TRUE(std::filesystem::exists(auto_dir));
  lost.steps = 2;
  auto shared = next.Open("job/rank0", {}, std::nullopt, std::nullopt, lost);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_EQ(shared->restored_from, auto_dir);
  q = next.Register(shared->key, {"w", 1 << 12, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->step, 2u);
  // Taken by an open session: not found again; a step nobody kept is
  // NOT_FOUND; another name has nothing lost.
  lost.steps.reset();
  auto again = next.Open("job/rank0", {}, std::nullopt, std::nullopt, lost);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->restored_from, "");
  ASSERT_TRUE(next.Close(again->key).ok());
  lost.steps = 1;
  EXPECT_EQ(next.Open("job/rank0", {}, std::nullopt, std::nullopt, lost).status().code(),
            absl::StatusCode::kNotFound);
  lost.steps.reset();
  auto other = next.Open("job/rank1", {}, std::nullopt, std::nullopt, lost);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->restored_from, "");
  EXPECT_TRUE(other->restorable_steps.empty());
  ASSERT_TRUE(next.Close(other->key).ok());
  // Once two of its own automatic checkpoints are committed, the session
  // that restored it takes it away (at its next step).
  ASSERT_TRUE(next.Release(shared->key, {q->id}).ok());
  Stats& next_stats = restarted->stats();
  for (int i = 1; i <= 3; ++i) {
    ASSERT_NO_FATAL_FAILURE(StepPartition(next, shared->key, q->id, 1 << 12));
    EXPECT_EQ(std::filesystem::exists(auto_dir), i < 3) << i;
    AwaitAutoCheckpoints(next_stats, i);
    ASSERT_EQ(next_stats.auto_checkpoints.load(), i);
  }
  EXPECT_FALSE(std::filesystem::exists(auto_dir));
  ASSERT_TRUE(next.Close(shared->key).ok());
  ASSERT_TRUE(sessions_.Close(key).ok());
  sessions_.SetAutoCheckpoint({});
}

// Where offloadd serves other users (server.socket_group), a lost session
// is found by its name and by the user who opened it: another user's job of
// the same name neither restores its checkpoints nor removes them (nor does
// one that names their directory, which it may restore).
TEST_F(SessionManagerTest, ALostSessionIsFoundOnlyByTheUserWhoOpenedIt) {
  const std::string root = ::testing::TempDir() + "/lost_by_user";
  const SessionManager::AutoCheckpointOptions options = AutoCheckpointsIn(root, 1);
  constexpr uid_t kAlice = 1001, kBob = 1002;
  auto opened = sessions_.Open("job/rank0", {}, std::nullopt, std::nullopt, {}, kAlice);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::string auto_dir = sessions_.AutoCheckpointDir(opened->key.id);
  auto p = sessions_.Register(opened->key, {"w", 1 << 12, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(sessions_.Release(opened->key, {p->id}).ok());
  ASSERT_NO_FATAL_FAILURE(StepPartition(sessions_, opened->key, p->id, 1 << 12));
  AwaitAutoCheckpoints(stats_, 1);
  ASSERT_EQ(stats_.auto_checkpoints.load(), 1);

  // A restarted offloadd (the session never closed: it died).
  std::unique_ptr<Engine> restarted = MakeEngine(&env_);
  SessionManager& next = restarted->sessions();
  next.SetAutoCheckpoint(options);
  RestoreFrom lost;
  lost.lost = true;
  lost.steps = 0;  // (the final choice "none": every lost one of the name would go)
  for (std::optional<uid_t> other : {std::optional<uid_t>(kBob), std::optional<uid_t>()}) {
    auto theirs = next.Open("job/rank0", {}, std::nullopt, std::nullopt, lost, other);
    ASSERT_TRUE(theirs.ok()) << theirs.status();
    EXPECT_EQ(theirs->restored_from, "");
    EXPECT_TRUE(theirs->restorable_steps.empty());
    ASSERT_TRUE(next.Close(theirs->key).ok());
    EXPECT_TRUE(std::filesystem::exists(auto_dir));
  }
  // Its directory named (restore_from: members may read each other's
  // checkpoints), another user's session restores it, and never removes it.
  auto named = next.Open("job/rank0", {}, std::nullopt, std::nullopt, RestoreFrom(auto_dir), kBob);
  ASSERT_TRUE(named.ok()) << named.status();
  auto q = next.Register(named->key, {"w", 1 << 12, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(q->restored);
  ASSERT_TRUE(next.Release(named->key, {q->id}).ok());
  ASSERT_NO_FATAL_FAILURE(StepPartition(next, named->key, q->id, 1 << 12));
  ASSERT_TRUE(next.Close(named->key).ok());
  EXPECT_TRUE(std::filesystem::exists(auto_dir));
  lost.steps.reset();
  auto mine = next.Open("job/rank0", {}, std::nullopt, std::nullopt, lost, kAlice);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(mine->restored_from, auto_dir);
  EXPECT_EQ(mine->restorable_steps, (std::vector<uint64_t>{1}));
  ASSERT_TRUE(next.Close(mine->key).ok());
  ASSERT_TRUE(sessions_.Close(opened->key).ok());
  sessions_.SetAutoCheckpoint({});
}

// A lost session is looked for once its user's session of the name that
// went unfinished has written its last step; another user's of the same
// name delays no one (before: up to 8 minutes, then UNAVAILABLE).
TEST_F(SessionManagerTest, AnotherUsersUnfinishedSessionOfTheNameDelaysNoOne) {
  const std::string root = ::testing::TempDir() + "/finalizing_by_user";
  AutoCheckpointsIn(root, 1);
  constexpr uid_t kAlice = 1001, kBob = 1002;
  RestoreFrom keep;
  keep.keep_for_resume = true;
  auto alice = sessions_.Open("job/rank0", {}, std::nullopt, std::nullopt, keep, kAlice);
  ASSERT_TRUE(alice.ok()) << alice.status();
  auto p = sessions_.Register(alice->key, {"w", 1 << 10, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(sessions_.Release(alice->key, {p->id}).ok());
  ASSERT_NO_FATAL_FAILURE(StepPartition(sessions_, alice->key, p->id, 1 << 10));
  AwaitAutoCheckpoints(stats_, 1);
  {
    SessionManager::Teardowns later;  // Alice's last step written when it goes
    ASSERT_TRUE(sessions_.Abandon(alice->key.id, &later));
    RestoreFrom lost;
    lost.lost = true;
    const absl::Time start = absl::Now();
    auto bobs = sessions_.Open("job/rank0", {}, std::nullopt, std::nullopt, lost, kBob);
    ASSERT_TRUE(bobs.ok()) << bobs.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
    EXPECT_EQ(bobs->restored_from, "");
    ASSERT_TRUE(sessions_.Close(bobs->key).ok());
  }
  sessions_.SetAutoCheckpoint({});
}

// A session kept for a resume leaves its automatic checkpoints when it goes
// unfinished (an unfinished Close, its trainer gone), for a session of the
// same name to find (resume_lost); a finished Close removes them.
TEST_F(SessionManagerTest, ASessionKeptForAResumeLeavesItsCheckpointsUnlessFinished) {
  const std::string root = ::testing::TempDir() + "/kept_for_resume";
  AutoCheckpointsIn(root, 1);
  RestoreFrom keep;
  keep.keep_for_resume = true;
  int64_t checkpoints = stats_.auto_checkpoints.load();
  // Opens `name`, one partition, one step, its automatic checkpoint in.
  auto stepped = [&](const std::string& name, const RestoreFrom& from) {
    auto opened = sessions_.Open(name, {}, std::nullopt, std::nullopt, from);
    EXPECT_TRUE(opened.ok()) << opened.status();
    auto p = sessions_.Register(opened->key, {"w", 1 << 10, DType::kFp32, DType::kFp32});
    EXPECT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(sessions_.Release(opened->key, {p->id}).ok());
    StepPartition(sessions_, opened->key, p->id, 1 << 10);
    AwaitAutoCheckpoints(stats_, ++checkpoints);
    return opened->key;
  };
  // Closed unfinished: kept, and found by name.
  SessionKey a = stepped("job/rank0", keep);
  const std::string a_dir = sessions_.AutoCheckpointDir(a.id);
  ASSERT_TRUE(sessions_.Close(a, /*finished=*/false).ok());
  EXPECT_TRUE(std::filesystem::exists(a_dir));
  // Its trainer gone: kept too.
  SessionKey b = stepped("job/rank1", keep);
  const std::string b_dir = sessions_.AutoCheckpointDir(b.id);
  ASSERT_TRUE(sessions_.Abandon(b.id));
  EXPECT_TRUE(std::filesystem::exists(b_dir));
  RestoreFrom lost = keep;
  lost.lost = true;
  auto found = sessions_.Open("job/rank0", {}, std::nullopt, std::nullopt, lost);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->restored_from, a_dir);
  // Finished (the job ended): what it restored goes with its own.
  ASSERT_TRUE(sessions_.Close(found->key).ok());
  EXPECT_TRUE(std::filesystem::exists(a_dir));  // (it closed before a step: left)
  SessionKey c = stepped("job/rank0", lost);
  ASSERT_TRUE(sessions_.Close(c).ok());
  EXPECT_FALSE(std::filesystem::exists(a_dir));
  // A session not kept for a resume: gone unfinished, its checkpoints go.
  SessionKey d = stepped("other", RestoreFrom{});
  const std::string d_dir = sessions_.AutoCheckpointDir(d.id);
  ASSERT_TRUE(sessions_.Close(d, /*finished=*/false).ok());
  EXPECT_FALSE(std::filesystem::exists(d_dir));
  std::filesystem::remove_all(b_dir);
  sessions_.SetAutoCheckpoint({});
}

// A session kept for a resume that goes unfinished after steps no automatic
// checkpoint holds writes its state at its last step boundary as one more
// (the gradients of the iteration its trainer did not finish dropped); a
// new session of its name (the job restarted) takes over one whose trainer
// went away and waits on its reconnect lease: its memory is freed and what
// it held is found by name.
TEST_F(SessionManagerTest, ARestartedJobTakesOverItsDetachedSessionsAtTheirLastStep) {
  const std::string root = ::testing::TempDir() + "/take_over";
  const SessionManager::AutoCheckpointOptions options =
      AutoCheckpointsIn(root, 2);  // step 3 is in no automatic checkpoint
  RestoreFrom keep;
  keep.keep_for_resume = true;
  constexpr uint64_t kNumel = 1 << 10;
  auto opened = sessions_.Open("job/rank0", {}, std::nullopt, std::nullopt, keep);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const SessionKey old = opened->key;
  auto p = sessions_.Register(old, {"w", kNumel, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(sessions_.Release(old, {p->id}).ok());
  for (int i = 1; i <= 3; ++i)
    ASSERT_NO_FATAL_FAILURE(StepPartition(sessions_, old, p->id, kNumel));
  AwaitAutoCheckpoints(stats_, 1);
  ASSERT_EQ(stats_.auto_checkpoints.load(), 1);
  std::vector<float> m(kNumel), v(kNumel);
  ASSERT_EQ(*sessions_.ReadMoments(old, p->id, 0, kNumel, m.data(), v.data()), 3u);
  // Half an iteration, then the trainer dies (a reconnect lease keeps it).
  ASSERT_TRUE(sessions_.Fetch(old, {p->id}, WithGrads()).ok());
  ASSERT_TRUE(sessions_.ReturnGradients(old, p->id, kNumel, DType::kFp32).ok());
  ASSERT_TRUE(sessions_.Detach(old.id));
  const int64_t abandoned = stats_.sessions_abandoned.load();

  // The restarted job's rank looks for what it left: the detached session
  // is closed, its step 3 written, and found with the automatic one.
  RestoreFrom lost = keep;
  lost.lost = true;
  auto looked = sessions_.Open("job/rank0", {}, std::nullopt, std::nullopt, lost);
  ASSERT_TRUE(looked.ok()) << looked.status();
  EXPECT_EQ(stats_.sessions_abandoned.load(), abandoned + 1);
  EXPECT_EQ(stats_.auto_checkpoints.load(), 2);
  EXPECT_EQ(looked->restorable_steps, (std::vector<uint64_t>{3, 2}));
  // (In a directory of its own: its automatic pair stays beside it.)
  EXPECT_TRUE(absl::StartsWith(looked->restored_from, options.dir + "/")) << looked->restored_from;
  EXPECT_NE(looked->restored_from, sessions_.AutoCheckpointDir(old.id));
  EXPECT_TRUE(std::filesystem::exists(sessions_.AutoCheckpointDir(old.id)));
  EXPECT_EQ(sessions_.Sessions().size(), 1u);
  EXPECT_EQ(sessions_.Fetch(old, {p->id}).status().code(), absl::StatusCode::kFailedPrecondition);
  auto q = sessions_.Register(looked->key, {"w", kNumel, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(q->restored);
  EXPECT_EQ(q->step, 3u);
  std::vector<float> m2(kNumel), v2(kNumel);
  ASSERT_EQ(*sessions_.ReadMoments(looked->key, q->id, 0, kNumel, m2.data(), v2.data()), 3u);
  EXPECT_EQ(m2, m);
  EXPECT_EQ(v2, v);
  // The unfinished iteration's gradients did not come with it.
  auto pending = sessions_.Pending(looked->key);
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_EQ(pending->partitions, 0u);
  ASSERT_TRUE(sessions_.Close(looked->key, /*finished=*/false).ok());
  // Closed unfinished at a step it restored: nothing new is written.
  EXPECT_EQ(stats_.auto_checkpoints.load(), 2);

  // Only a session kept for a resume is taken over, by one kept for a
  // resume too (a job's restart, not any session that shares the name),
  // not while its trainer resumes it, and never a nameless one.
  struct Case {
    std::string name;
    bool gone_keeps, next_keeps, resuming, taken;
  };
  for (const Case& c :
       {Case{"fresh", false, false, false, false}, Case{"fresh", true, false, false, false},
        Case{"fresh", false, true, false, false}, Case{"fresh", true, true, true, false},
        Case{"", true, true, false, false}, Case{"fresh", true, true, false, true}}) {
    SCOPED_TRACE(absl::StrCat("'", c.name, "' ", c.gone_keeps, c.next_keeps, c.resuming));
    auto gone =
        sessions_.Open(c.name, {}, std::nullopt, std::nullopt, c.gone_keeps ? keep : RestoreFrom{});
    ASSERT_TRUE(gone.ok()) << gone.status();
    ASSERT_TRUE(sessions_.Detach(gone->key.id));
    if (c.resuming) {
      ASSERT_TRUE(sessions_.Resume(gone->key).ok());
    }
    auto next =
        sessions_.Open(c.name, {}, std::nullopt, std::nullopt, c.next_keeps ? keep : RestoreFrom{});
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_NE(sessions_.Fetch(gone->key, {}).ok(), c.taken);
    ASSERT_TRUE(sessions_.Close(next->key).ok());
    sessions_.Close(gone->key).IgnoreError();
  }

  // Its trainer gone without a lease: the teardown (the arena channel's
  // closing thread) writes its last step while the restarted job already
  // looks for it; the look waits for the write.
  auto opened2 = sessions_.Open("job/rank1", {}, std::nullopt, std::nullopt, keep);
  ASSERT_TRUE(opened2.ok()) << opened2.status();
  auto p2 = sessions_.Register(opened2->key, {"w", kNumel, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p2.ok()) << p2.status();
  ASSERT_TRUE(sessions_.Release(opened2->key, {p2->id}).ok());
  for (int i = 1; i <= 3; ++i) {
    ASSERT_NO_FATAL_FAILURE(StepPartition(sessions_, opened2->key, p2->id, kNumel));
  }
  AwaitAutoCheckpoints(stats_, 3);  // step 2's
  ASSERT_EQ(stats_.auto_checkpoints.load(), 3);
  std::optional<SessionManager::Teardowns> later(std::in_place);
  ASSERT_TRUE(sessions_.Abandon(opened2->key.id, &*later));
  std::atomic<bool> answered{false};
  absl::StatusOr<OpenedSession> found;
  std::thread restarted([&] {
    found = sessions_.Open("job/rank1", {}, std::nullopt, std::nullopt, lost);
    answered = true;
  });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(answered.load());
  later.reset();  // runs it
  restarted.join();
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->restorable_steps, (std::vector<uint64_t>{3, 2}));
  ASSERT_TRUE(sessions_.Close(found->key).ok());
  sessions_.SetAutoCheckpoint({});
  std::filesystem::remove_all(root);
}

// With overlapped steps the automatic checkpoint is taken at the next Step,
// at the boundary after the previous update: its manifest holds that step
// count, and the trainer's WaitStep and next steps are unaffected.
TEST_F(SessionManagerTest, AutomaticCheckpointsOfOverlappedStepsComeAtTheNextStep) {
  const std::string root = ::testing::TempDir() + "/auto_overlap";
  std::filesystem::remove_all(root);
  SessionManager::AutoCheckpointOptions options;
  options.dir = root;
  options.every_steps = 1;
  sessions_.SetAutoCheckpoint(options);
  SessionKey key = Open();
  auto p = sessions_.Register(key, {"w", 1 << 16, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(sessions_.Release(key, {p->id}).ok());
  StepControl overlap;
  overlap.overlap = true;
  for (int i = 0; i < 3; ++i) {
    // Step i + 1's call takes the checkpoint due after step i (none before
    // the first), then starts its own update.
    ASSERT_NO_FATAL_FAILURE(StepPartition(sessions_, key, p->id, 1 << 16, overlap));
    auto done = sessions_.WaitStep(key);
    ASSERT_TRUE(done.ok()) << done.status();
    AwaitAutoCheckpoints(stats_, i);
    EXPECT_EQ(stats_.auto_checkpoints.load(), i);
  }
  auto manifests = checkpoint::ReadManifests(sessions_.AutoCheckpointDir(key.id));
  ASSERT_TRUE(manifests.ok()) << manifests.status();
  ASSERT_EQ(manifests->size(), 1u);
  EXPECT_EQ(manifests->front().second.steps(), 2u);
  ASSERT_TRUE(sessions_.Close(key).ok());
  sessions_.SetAutoCheckpoint({});
}

// Each Env call the manager makes can fail; the caller gets the errno's code
// with context, nothing leaks, and the next call works.
TEST_F(SessionManagerTest, OpenFailuresLeaveNothingBehind) {
  env_.FailNth(EnvOp::kRandomBytes, 1, EIO);
  auto no_token = sessions_.Open("t");
  EXPECT_EQ(no_token.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(no_token.status().message().find("getrandom"), std::string::npos);

  env_.FailNth(EnvOp::kCreateMemfd, 1, EMFILE);
  auto no_memfd = sessions_.Open("t");
  EXPECT_EQ(no_memfd.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(no_memfd.status().message().find("memfd_create"), std::string::npos);

  // A failed mapping of the request ring: nothing left behind either.
  env_.FailNth(EnvOp::kMapShared, 1, ENOMEM);
  auto no_ring = sessions_.Open("t");
  EXPECT_EQ(no_ring.status().code(), absl::StatusCode::kResourceExhausted);

  // Opening maps only the request ring (partitions are mapped one by one),
  // so address space is no limit on sessions.
  const int64_t maps = env_.calls(EnvOp::kMapShared);
  const int fds_before = OpenDescriptors();
  SessionKey opened = Open();
  EXPECT_EQ(env_.calls(EnvOp::kMapShared), maps + 1);
  ASSERT_TRUE(sessions_.Close(opened).ok());
  EXPECT_EQ(OpenDescriptors(), fds_before);  // its memfd was closed again

  EXPECT_TRUE(sessions_.Sessions().empty());
  EXPECT_EQ(stats_.sessions_opened.load(), 1);
  SessionKey key = Open();
  EXPECT_TRUE(sessions_.Register(key, {"w", 10, DType::kFp32, DType::kFp32}).ok());
}

// A checkpoint in the background whose thread cannot be had (a limit on
// threads reached) is an error at once; none is left marked running (the
// next one would be refused and a stop would wait for it for ever), and
// its data file goes.
TEST_F(SessionManagerTest, ABackgroundCheckpointWithoutAThreadLeavesNoneRunning) {
  const std::string dir = ::testing::TempDir() + "/no_thread";
  SessionKey key = Open();
  auto p = sessions_.Register(key, {"w", 1 << 10, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(sessions_.Release(key, {p->id}).ok());
  env_.FailNth(EnvOp::kStartThread, 1, EAGAIN);
  auto refused = sessions_.Checkpoint(key, dir, /*background=*/true);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "not started")) << refused.status();
  EXPECT_TRUE(ListDirectory(dir).empty());
  auto waited = sessions_.WaitCheckpoint(key);  // says what happened, at once
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kUnavailable) << waited.status();
  auto again = sessions_.Checkpoint(key, dir, /*background=*/true);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(sessions_.WaitCheckpoint(key).ok());
  ASSERT_TRUE(sessions_.Close(key).ok());
}

// The operator's checkpoint into a directory where another job's
// checkpoint holds elements of the same tensors is refused (both were
// written, and neither restored: "holds elements of tensor 'w' twice"); its
// own again, and a rank of the same job beside it, are not.
TEST_F(SessionManagerTest, ACheckpointBesideAnotherJobsOfTheSameTensorsIsRefused) {
  const std::string dir = ::testing::TempDir() + "/shared_checkpoint_dir";
  auto checkpointed = [&](const std::string& name) -> absl::Status {
    auto opened = sessions_.Open(name);
    if (!opened.ok()) return opened.status();
    const SessionKey key = opened->key;
    auto p = sessions_.Register(key, {"w", 1 << 10, DType::kFp32, DType::kFp32});
    if (!p.ok()) return p.status();
    if (absl::Status s = sessions_.Release(key, {p->id}); !s.ok()) return s;
    // (As the operator: offloadctl checkpoint ID DIR.)
    absl::Status done =
        sessions_.Checkpoint(SessionKey{key.id, ""}, dir, /*background=*/false).status();
    if (absl::Status s = sessions_.Close(key); !s.ok()) return s;
    return done;
  };
  ASSERT_TRUE(checkpointed("job/rank0").ok());
  ASSERT_TRUE(checkpointed("job/rank0").ok());  // its own, replaced
  const absl::Status other = checkpointed("other/rank0");
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition) << other;
  EXPECT_TRUE(absl::StrContains(other.message(), "holds session 'job/rank0''s checkpoint"))
      << other;
  EXPECT_TRUE(checkpointed("job/rank1").ok());  // (a rank of the same job: not compared)
}

// With fp16 loss scaling, a non-finite gradient skips the step and lowers
// the scale even with optimizer.check_finite off (which decides only for
// sessions without a scaler): applied, it made the master weights NaN and
// counted as a clean step.
TEST_F(SessionManagerTest, LossScalingSkipsOverflowsWithoutTheOptimizersCheck) {
  engine_->optimizer().SetCheckFinite(false);
  LossScalingOptions scaling;
  scaling.initial_scale = 1024;
  scaling.hysteresis = 1;
  auto opened = sessions_.Open("fp16", {}, scaling);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const SessionKey key = opened->key;
  auto p = sessions_.Register(key, {"w", 4, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok()) << p.status();
  auto fd = sessions_.DupArenaFd(key);
  ASSERT_TRUE(fd.ok());
  HostMemory arena = *HostMemory::MapShared(fd->get(), 0, 16 << 20);
  ASSERT_TRUE(sessions_.Release(key, {p->id}).ok());
  ASSERT_TRUE(sessions_.Fetch(key, {p->id}, WithGrads()).ok());
  auto* g = reinterpret_cast<float*>(arena.data() + p->grads.offset);
  g[0] = std::numeric_limits<float>::infinity();
  g[1] = g[2] = g[3] = 1.0f;
  ASSERT_TRUE(sessions_.ReturnGradients(key, p->id, 4, DType::kFp32).ok());
  ASSERT_TRUE(sessions_.Release(key, {p->id}).ok());
  auto stepped = sessions_.Step(key, AdamHyperparams{});
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_TRUE(stepped->skipped);
  EXPECT_EQ(stepped->loss_scale, 512.0);
  EXPECT_EQ(sessions_.Sessions()[0].steps, 0u);
  engine_->optimizer().SetCheckFinite(true);
}

TEST_F(SessionManagerTest, RegisterFailuresGiveTheBudgetBack) {
  SessionKey key = Open();
  ASSERT_TRUE(sessions_.Register(key, {"first", 1000, DType::kFp32, DType::kFp32}).ok());
  const uint64_t used = pool_.used();
  // Master, exp_avg and exp_avg_sq are three allocations (mappings of their
  // own: blocks larger than the pool's shared slots); fail each in turn.
  constexpr uint64_t kLarge = HostPool::kSlabLeaseMaxBytes / sizeof(float) * 2;
  for (int n = 1; n <= 3; ++n) {
    env_.FailNth(EnvOp::kAllocate, n, ENOMEM);
    auto failed = sessions_.Register(key, {"w", kLarge, DType::kBf16, DType::kBf16});
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << n;
    EXPECT_NE(failed.status().message().find("allocating partition 'w'"), std::string::npos)
        << failed.status();
    EXPECT_EQ(pool_.used(), used) << n;
  }
  // A span of its own (small ones are views of the window "first" mapped).
  constexpr uint64_t kOwnSpan = SpanMaps::kSharedMaxBytes / 2;
  env_.FailNth(EnvOp::kMapShared, 1, ENOMEM);
  auto no_map = sessions_.Register(key, {"w", kOwnSpan, DType::kBf16, DType::kBf16});
  EXPECT_EQ(no_map.status().code(), absl::StatusCode::kResourceExhausted) << no_map.status();
  EXPECT_EQ(pool_.used(), used);
  // (Larger than what the failures above gave back, the span of its own's
  // 12 MiB: the arena's file grows only past its size.)
  env_.FailNth(EnvOp::kResizeFile, 1, ENOSPC);
  auto no_arena = sessions_.Register(key, {"w", kOwnSpan * 5 / 4, DType::kBf16, DType::kBf16});
  EXPECT_EQ(no_arena.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(no_arena.status().message().find("growing session arena"), std::string::npos)
      << no_arena.status();
  EXPECT_EQ(pool_.used(), used);
  // The name was never taken, and only the first partition exists.
  auto all = sessions_.Fetch(key, {});
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 1u);
  auto last = sessions_.Register(key, {"w", kLarge, DType::kBf16, DType::kBf16});
  EXPECT_TRUE(last.ok()) << last.status();
}

// Holds a step at a StepPoint until released, so that other calls can be
// made at exactly that moment.
class StepGate {
 public:
  explicit StepGate(StepPoint at) : at_(at) {}
  void operator()(StepPoint point) {
    if (point != at_) return;
    reached_.Notify();
    release_.WaitForNotification();
  }
  void AwaitReached() { reached_.WaitForNotification(); }
  void Release() { release_.Notify(); }

 private:
  const StepPoint at_;
  absl::Notification reached_, release_;
};

// An overlapped step holds a call's reference to its session, whose end
// locks the session manager: the manager, going (the daemon stopping while
// training), waits for the step runner to let every such step go
// (StepRunner::Quiesce); before, the runner's worker ran the step to its
// end after the manager was freed.
TEST(SessionManagerEnd, WaitsForTheOverlappedStepsItStarted) {
  const std::string tmp = getenv("TEST_TMPDIR");
  TestEngine engine(tmp + "/nvme_quiesce", 64 << 20);
  SessionManager& sessions = *engine.sessions;
  auto opened = sessions.Open("t");
  ASSERT_TRUE(opened.ok()) << opened.status();
  const SessionKey key = opened->key;
  auto p = sessions.Register(key, {"w", 4096, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok()) << p.status();
  FetchMode with_grads;
  with_grads.grads = true;
  ASSERT_TRUE(sessions.Fetch(key, {p->id}, with_grads).ok());
  ASSERT_TRUE(sessions.ReturnGradients(key, p->id, 4096, DType::kFp32).ok());
  ASSERT_TRUE(sessions.Release(key, {p->id}).ok());
  StepGate gate(StepPoint::kOptimized);
  engine.steps->SetSyncPointForTesting([&gate](StepPoint point) { gate(point); });
  StepControl overlapped;
  overlapped.overlap = true;
  ASSERT_TRUE(sessions.Step(key, AdamHyperparams{}, overlapped).ok());
  gate.AwaitReached();
  std::atomic<bool> quiet{false};
  std::thread waiter([&] {
    engine.steps->Quiesce();
    quiet = true;
  });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(quiet.load()) << "quiet while a step ran";
  gate.Release();
  waiter.join();
  EXPECT_TRUE(quiet.load());
  engine.steps->SetSyncPointForTesting(nullptr);
  ASSERT_TRUE(sessions.WaitStep(key).ok());
}

class SessionManagerRaceTest : public SessionManagerTest {
 protected:
  // Registers "w" with gradients returned and starts a step that stops at
  // kPinned (after the partition is pinned, before the optimizer runs).
  void StartHeldStep() {
    key_ = Open();
    auto p = sessions_.Register(key_, {"w", 4096, DType::kFp32, DType::kFp32});
    ASSERT_TRUE(p.ok());
    id_ = p->id;
    ASSERT_TRUE(sessions_.Fetch(key_, {id_}, WithGrads()).ok());
    ASSERT_TRUE(sessions_.ReturnGradients(key_, id_, 4096, DType::kFp32).ok());
    steps_.SetSyncPointForTesting([this](StepPoint point) { gate_(point); });
    stepper_ = std::thread([this] { step_result_ = sessions_.Step(key_, AdamHyperparams{}); });
    gate_.AwaitReached();
  }
  // Until `n` calls have found a partition in the step and begun waiting
  // (the counter is incremented just before the wait). Yields, no sleeps.
  void AwaitWaiters(int64_t n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (stats_.waits_for_step.load() < n) {
      ASSERT_LT(absl::Now(), deadline) << "no call waited for the step";
      std::this_thread::yield();
    }
  }
  // key_: a new session with one partition "w" of 4096 fp32 values (id_),
  // released.
  void OpenWithOnePartition() {
    key_ = Open();
    auto p = sessions_.Register(key_, {"w", 4096, DType::kFp32, DType::kFp32});
    ASSERT_TRUE(p.ok()) << p.status();
    id_ = p->id;
    ASSERT_TRUE(sessions_.Release(key_, {id_}).ok());
  }
  void FinishStep() {
    gate_.Release();
    stepper_.join();
    steps_.SetSyncPointForTesting(nullptr);
  }

  SessionKey key_;
  uint64_t id_ = 0;
  StepGate gate_{StepPoint::kPinned};
  std::thread stepper_;
  absl::StatusOr<StepSummary> step_result_;
};

TEST_F(SessionManagerRaceTest, CloseDuringStepReturnsAtOnceAndFreesAfterIt) {
  StartHeldStep();
  // No lock is held across the step: Close does not wait for it.
  ASSERT_TRUE(sessions_.Close(key_).ok());
  EXPECT_EQ(sessions_.Fetch(key_, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_GT(pool_.used(), 0u);  // the running step still holds the session
  FinishStep();
  EXPECT_TRUE(step_result_.ok()) << step_result_.status();
  EXPECT_EQ(pool_.used(), 0u);
  // The step took its optimizer turn after the close: its share's
  // accounting went with the session all the same.
  EXPECT_EQ(steps_.shares().UsageOf(key_.id).elems, 0u);
}

// A session closed while its step runs, an automatic checkpoint due at
// that step: none is started, and the directory the close put aside is not
// made again (nobody would remove it; a later start would report a lost
// session).
TEST_F(SessionManagerRaceTest, ASessionClosedMidStepLeavesNoAutomaticCheckpoint) {
  const std::string root = ::testing::TempDir() + "/closed_mid_step";
  AutoCheckpointsIn(root, 1);
  ASSERT_NO_FATAL_FAILURE(OpenWithOnePartition());
  StepPartition(sessions_, key_, id_, 4096);  // its first automatic checkpoint
  AwaitAutoCheckpoints(stats_, 1);
  ASSERT_EQ(stats_.auto_checkpoints.load(), 1);
  const std::string auto_dir = sessions_.AutoCheckpointDir(key_.id);
  ASSERT_TRUE(std::filesystem::exists(auto_dir));
  // The next step, held; the session closed meanwhile.
  ASSERT_TRUE(sessions_.Fetch(key_, {id_}, WithGrads()).ok());
  ASSERT_TRUE(sessions_.ReturnGradients(key_, id_, 4096, DType::kFp32).ok());
  steps_.SetSyncPointForTesting([this](StepPoint point) { gate_(point); });
  stepper_ = std::thread([this] { step_result_ = sessions_.Step(key_, AdamHyperparams{}); });
  gate_.AwaitReached();
  ASSERT_TRUE(sessions_.Close(key_).ok());
  FinishStep();
  EXPECT_TRUE(step_result_.ok()) << step_result_.status();
  EXPECT_EQ(pool_.used(), 0u);  // the session is gone
  EXPECT_FALSE(std::filesystem::exists(auto_dir));
  EXPECT_EQ(stats_.auto_checkpoints.load(), 1);
  EXPECT_EQ(stats_.auto_checkpoint_failures.load(), 0);
  sessions_.SetAutoCheckpoint({});
}

TEST_F(SessionManagerRaceTest, AbandonDuringStepFreesAfterIt) {
  StartHeldStep();
  EXPECT_TRUE(sessions_.Abandon(key_.id));
  EXPECT_GT(pool_.used(), 0u);
  FinishStep();
  EXPECT_TRUE(step_result_.ok()) << step_result_.status();
  EXPECT_EQ(pool_.used(), 0u);
  EXPECT_EQ(stats_.sessions_abandoned.load(), 1);
}

// The delayed update switches on after its warm-up of steps counted when
// they end: a Step that comes while the overlapped step before it is
// finishing (its partitions out of it, the trainer's next gradients in,
// its end not yet counted) waits for it, and switches on as a synchronous
// one would.
TEST_F(SessionManagerRaceTest, TheDelayedUpdateSwitchesOnAfterOverlappedStepsEnd) {
  auto opened = sessions_.Open("warm_up", {}, std::nullopt, /*delayed_update_after=*/1);
  ASSERT_TRUE(opened.ok()) << opened.status();
  key_ = opened->key;
  auto p = sessions_.Register(key_, {"w", 4096, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok());
  id_ = p->id;
  ASSERT_TRUE(sessions_.Release(key_, {id_}).ok());
  ASSERT_TRUE(sessions_.Fetch(key_, {id_}, WithGrads()).ok());
  ASSERT_TRUE(sessions_.ReturnGradients(key_, id_, 4096, DType::kFp32).ok());
  ASSERT_TRUE(sessions_.Release(key_, {id_}).ok());
  StepGate ending(StepPoint::kOptimized);  // the partition left the step; its end not counted
  std::atomic<bool> held{false};
  steps_.SetSyncPointForTesting([&ending, &held](StepPoint point) {
    if (point == StepPoint::kOptimized && !held.exchange(true)) ending(point);  // the first's
  });
  StepControl overlap;
  overlap.overlap = true;
  auto first = sessions_.Step(key_, AdamHyperparams{}, overlap);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->delayed_update);
  ending.AwaitReached();
  ASSERT_TRUE(sessions_.Fetch(key_, {id_}, WithGrads()).ok());
  ASSERT_TRUE(sessions_.ReturnGradients(key_, id_, 4096, DType::kFp32).ok());
  ASSERT_TRUE(sessions_.Release(key_, {id_}).ok());
  absl::StatusOr<StepSummary> second;
  std::thread stepper([&] { second = sessions_.Step(key_, AdamHyperparams{}, overlap); });
  absl::SleepFor(absl::Milliseconds(100));  // (it waits, or decides without the first's end)
  ending.Release();
  stepper.join();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(second->delayed_update);
  ASSERT_TRUE(sessions_.WaitStep(key_).ok());
  steps_.SetSyncPointForTesting(nullptr);
}

// An automatic checkpoint due after an overlapped step is taken at the
// next Step even when that Step comes while the step is ending (its end
// not yet counted): it goes by the steps ended, as the switch above.
TEST_F(SessionManagerRaceTest, AnAutomaticCheckpointDueAfterAnOverlappedStepIsNotLate) {
  const std::string root = ::testing::TempDir() + "/auto_overlapped";
  AutoCheckpointsIn(root, 1);
  ASSERT_NO_FATAL_FAILURE(OpenWithOnePartition());
  auto give = [&] {
    ASSERT_TRUE(sessions_.Fetch(key_, {id_}, WithGrads()).ok());
    ASSERT_TRUE(sessions_.ReturnGradients(key_, id_, 4096, DType::kFp32).ok());
    ASSERT_TRUE(sessions_.Release(key_, {id_}).ok());
  };
  give();
  StepGate ending(StepPoint::kOptimized);
  std::atomic<bool> held{false};
  steps_.SetSyncPointForTesting([&ending, &held](StepPoint point) {
    if (point == StepPoint::kOptimized && !held.exchange(true)) ending(point);  // the first's
  });
  StepControl overlap;
  overlap.overlap = true;
  ASSERT_TRUE(sessions_.Step(key_, AdamHyperparams{}, overlap).ok());
  ending.AwaitReached();
  give();
  absl::StatusOr<StepSummary> second;
  std::thread stepper([&] { second = sessions_.Step(key_, AdamHyperparams{}, overlap); });
  absl::SleepFor(absl::Milliseconds(100));
  ending.Release();
  stepper.join();
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE(sessions_.WaitStep(key_).ok());
  AwaitAutoCheckpoints(stats_, 1);
  EXPECT_EQ(stats_.auto_checkpoints.load(), 1);  // the first step's, taken at the second
  steps_.SetSyncPointForTesting(nullptr);
  ASSERT_TRUE(sessions_.Close(key_).ok());
  sessions_.SetAutoCheckpoint({});
}

TEST_F(SessionManagerRaceTest, FetchOfAPartitionInAStepSeesTheUpdatedVersion) {
  StartHeldStep();
  // Other work on the session proceeds during the step.
  auto other = sessions_.Register(key_, {"other", 16, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(other.ok()) << other.status();
  auto other_fetched = sessions_.Fetch(key_, {other->id});
  ASSERT_TRUE(other_fetched.ok());
  // A fetch of the pinned partition waits for the step: it must return the
  // version after it (step 1), never the one before.
  absl::StatusOr<std::vector<PartitionInfo>> fetched;
  std::thread fetcher([&] { fetched = sessions_.Fetch(key_, {id_}); });
  AwaitWaiters(1);
  FinishStep();
  fetcher.join();
  ASSERT_TRUE(fetched.ok());
  EXPECT_EQ((*fetched)[0].step, 1u);
}

TEST_F(SessionManagerRaceTest, GradientsReturnedDuringAStepAreForTheNextOne) {
  StartHeldStep();
  absl::Status returned;
  std::thread returner([&] {
    // Holding the buffer waits for the step (its gradients are the step's).
    returned = sessions_.Fetch(key_, {id_}, WithGrads()).status();
    if (returned.ok()) returned = sessions_.ReturnGradients(key_, id_, 4096, DType::kFp32);
  });
  AwaitWaiters(1);
  FinishStep();
  returner.join();
  ASSERT_TRUE(returned.ok());
  ASSERT_TRUE(step_result_.ok());
  // Not consumed by the step that was running: the next step has them.
  auto next = sessions_.Step(key_, AdamHyperparams{});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->partitions_updated, 1u);
}

// Status (GetStats) does not wait for a running step: no lock is held
// across the optimizer (issue 11 measured p50 277 ms under load before).
TEST_F(SessionManagerRaceTest, SessionsAreListedDuringAStep) {
  StartHeldStep();
  auto listed = sessions_.Sessions();  // would block until the step ends
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].partitions, 1u);
  EXPECT_EQ(listed[0].steps, 0u);  // the held step has not ended
  FinishStep();
  EXPECT_EQ(sessions_.Sessions()[0].steps, 1u);
}

TEST_F(SessionManagerRaceTest, ASecondStepWaitsForTheFirst) {
  StartHeldStep();
  absl::StatusOr<StepSummary> second;
  std::thread other([&] { second = sessions_.Step(key_, AdamHyperparams{}); });
  FinishStep();
  other.join();
  ASSERT_TRUE(step_result_.ok());
  // It ran after the first had consumed the gradients.
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
}

// Names that would forge offloadctl's rows, or flood an error message, are
// refused without being echoed; fetches are bounded.
TEST_F(SessionManagerTest, HostileNamesAndHugeFetchesAreRefused) {
  EXPECT_EQ(sessions_.Open("rank0\nsession 99 forged").status().code(),
            absl::StatusCode::kInvalidArgument);
  auto huge = sessions_.Open(std::string(100000, 'x'));
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(huge.status().message().size(), 200u);
  SessionKey key = Open();
  auto bad = sessions_.Register(key, {std::string(100000, 'y'), 0, DType::kFp32, DType::kFp32});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(bad.status().message().size(), 200u);  // the name is not echoed
  EXPECT_EQ(sessions_.Register(key, {"w\x1b[2J", 10, DType::kFp32, DType::kFp32}).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto p = sessions_.Register(key, {"w", 10, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok());
  std::vector<uint64_t> many(SessionManager::kMaxFetchIds + 1, p->id);
  EXPECT_EQ(sessions_.Fetch(key, many).status().code(), absl::StatusCode::kInvalidArgument);
  many.pop_back();
  EXPECT_TRUE(sessions_.Fetch(key, many).ok());
}

// The node's GPU-tier totals add what each trainer's tier reports it did
// (all of it where its counts went down: a new tier); a report can push a
// total to INT64_MAX, never past it into the negative, which every
// operator's stats would show.
TEST_F(SessionManagerTest, TheTrainersGpuTierCountsAddUpWithoutWrapping) {
  SessionKey key = Open();
  GpuTierReport r;
  r.h2d_bytes = 1000;
  ASSERT_TRUE(sessions_.ReportGpuTier(key, r).ok());
  r.h2d_bytes = 1500;
  ASSERT_TRUE(sessions_.ReportGpuTier(key, r).ok());
  EXPECT_EQ(stats_.gpu_h2d_bytes.load(), 1500);
  r.h2d_bytes = 100;  // a new tier on the same session
  ASSERT_TRUE(sessions_.ReportGpuTier(key, r).ok());
  EXPECT_EQ(stats_.gpu_h2d_bytes.load(), 1600);
  for (uint64_t v : {uint64_t{INT64_MAX}, uint64_t{0}, uint64_t{INT64_MAX}}) {
    r.h2d_bytes = v;
    ASSERT_TRUE(sessions_.ReportGpuTier(key, r).ok());
    EXPECT_EQ(stats_.gpu_h2d_bytes.load(), INT64_MAX) << v;
  }
}

// offloadd keeping its sessions as it stops drains every request ring to
// one deadline at once: a trainer that leaves each of its mailboxes claimed
// (a call begun, never posted) holds the stop for one patience, not one a
// session (eight here: 2.4 s one after another, past what the service
// manager waits for many sessions).
TEST_F(SessionManagerTest, RingsLeftMidCallHoldTheStopForOnePatienceInAll) {
  std::vector<void*> maps;
  const size_t bytes = ring::RingBytes();
  for (int i = 0; i < 8; ++i) {
    auto opened = sessions_.Open(absl::StrCat("claimed", i));
    ASSERT_TRUE(opened.ok()) << opened.status();
    auto fd = sessions_.DupArenaFd(opened->key);
    ASSERT_TRUE(fd.ok()) << fd.status();
    void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd->get(),
                     static_cast<off_t>(opened->ring.offset));
    ASSERT_NE(map, MAP_FAILED) << errno;
    maps.push_back(map);
    static_cast<ring::Layout*>(map)->state.store(ring::kClaimed);
  }
  const absl::Time start = absl::Now();
  sessions_.DrainRings(absl::Milliseconds(300));
  const absl::Duration took = absl::Now() - start;
  EXPECT_LT(took, absl::Milliseconds(1500)) << took;
  for (void* map : maps) {
    EXPECT_EQ(static_cast<ring::Layout*>(map)->state.load(), ring::kClosed);
    munmap(map, bytes);
  }
}

// A trainer that presents the key of a session opened before offloadd
// restarted is told that, not that its session belongs to another client.
TEST_F(SessionManagerTest, ASessionFromBeforeARestartIsToldSo) {
  SessionKey old = Open();
  SessionManager restarted(&env_, &store_, &steps_, &stats_);
  auto opened = restarted.Open("t");
  ASSERT_TRUE(opened.ok());
  EXPECT_NE(opened->key.id, old.id);
  auto stale = restarted.Fetch(old, {});
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(stale.status().message().find("restarted"), std::string::npos) << stale.status();
  EXPECT_TRUE(restarted.Fetch(opened->key, {}).ok());
}

TEST_F(SessionManagerTest, ClosedAndNeverOpenedAreToldApartWithoutRememberingIds) {
  SessionKey a = Open();
  ASSERT_TRUE(sessions_.Close(a).ok());
  EXPECT_EQ(sessions_.Fetch(a, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(sessions_.Fetch({a.id + 1, a.token}, {}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(sessions_.Fetch({0, a.token}, {}).status().code(), absl::StatusCode::kNotFound);
}

// The pool's slabs are reserved by small chunk, not by partition: a
// partition of many chunks each small enough for the slabs (small state
// chunks) reserves a slab's mapping for every 16 of its chunks, so the
// budget refuses it where 16 one-chunk partitions would pass; refused, it
// gives its share back and is refused again.
TEST(SessionManagerBudget, SmallChunksReserveTheirSlabsByChunk) {
  const std::string tmp = getenv("TEST_TMPDIR");
  TestEngine engine(tmp + "/nvme_chunks", 64 << 20, 8, /*chunk_elems=*/4096);
  SessionManager& sessions = *engine.sessions;
  auto opened = sessions.Open("chunks");
  ASSERT_TRUE(opened.ok()) << opened.status();
  const SessionKey key = opened->key;
  // Room for about 10 more mappings than are held now.
  sessions.SetMappingBudget(HostMemory::LiveMappings() + 12);
  constexpr uint64_t kChunks = 320;  // 20 slabs' worth of small chunks
  auto refused = sessions.Register(key, {"many", kChunks * 4096, DType::kFp32, DType::kFp32});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_EQ(
      sessions.Register(key, {"many", kChunks * 4096, DType::kFp32, DType::kFp32}).status().code(),
      absl::StatusCode::kResourceExhausted);
  // One chunk's partitions fit, 16 to a slab.
  for (int i = 0; i < 32; ++i) {
    auto p = sessions.Register(key, {absl::StrCat("one", i), 4096, DType::kFp32, DType::kFp32});
    ASSERT_TRUE(p.ok()) << i << ": " << p.status();
  }
}

}  // namespace
}  // namespace offload
