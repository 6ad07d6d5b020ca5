// Data on the NVMe tier: a session whose parameters, gradients and optimizer
// state do not fit the host pool trains to the same bits as one whose data
// is all in memory, following the residency contract (hold, write or read,
// release); swap-in failures lose nothing.
#include <sys/mman.h>
#include <sys/stat.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/env.h"
#include "engine/kept_sessions.h"
#include "engine/partition_store.h"
#include "engine/session_manager.h"
#include "engine/step_runner.h"
#include "engine/test_engine.h"
#include "engine/trainer_testing.h"
#include "gtest/gtest.h"
#include "ipc/request_ring.h"
#include "nvme/fault_injection.h"
#include "nvme/io_backend_factory.h"
#include "nvme/swap_space.h"
#include "swapper/host_pool.h"
#include "swapper/swapper.h"

namespace offload {
namespace {

using namespace ::offload::trainer_testing;  // NOLINT: the tests' shared vocabulary

// An engine whose pool holds the working copies (twice: the delayed
// update's) and a quarter of the optimizer state: a step with the state on
// NVMe reads it in. No prefetch: every read is the step's own, so a
// failing one is too (a failed prefetch is simply read again by the step).
std::unique_ptr<TestEngine> SmallEngine(const std::string& name) {
  const uint64_t arena = 2 * (RoundUpToPage(kSizes[0] * 4) + RoundUpToPage(kSizes[1] * 4) +
                              RoundUpToPage(kSizes[2] * 4));
  return std::make_unique<TestEngine>(TmpDir(name), arena + RoundUpToPage(StateBytes() / 4),
                                      /*prefetch_depth=*/0);
}

// The NVMe tier's read after the next `skip` fails with EIO.
void FailRead(TestEngine& engine, int skip) {
  FaultRule eio;
  eio.any_op = false;
  eio.op = IoOp::kRead;
  eio.skip = skip;
  eio.error = EIO;
  engine.faults->AddRule(eio);
}

// A trainer with its optimizer state on NVMe, on a SmallEngine (every step
// reads it in), beside the same trainer all in memory: its reference.
struct BesideReference {
  explicit BesideReference(const std::string& name)
      : in_memory(TmpDir(name + "_in_memory"), 64 << 20),
        reference(&in_memory, All(100)),
        engine(SmallEngine(name)),
        small(*engine),
        out_of_core(&small, StateAt(0)) {}
  TestEngine in_memory;
  Trainer reference;
  std::unique_ptr<TestEngine> engine;
  TestEngine& small;
  Trainer out_of_core;
};

// Step 1 in both; step 2 in the reference, and in the out-of-core trainer
// stopped at its 17th swap-in: partition 0 finished, partition 1 midway,
// partition 2 not begun.
void StopStepTwoMidway(BesideReference& t) {
  for (int step = 1; step <= 2; ++step) {
    t.reference.ReturnGradients(step);
    t.out_of_core.ReturnGradients(step);
    ASSERT_TRUE(t.reference.Step().ok());
    if (step == 1) {
      ASSERT_TRUE(t.out_of_core.Step().ok());
    }
  }
  FailRead(t.small, 16);
  auto failed = t.out_of_core.Step();
  t.small.faults->ClearRules();
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
}

// The case: parameters, gradients and optimizer state all on NVMe,
// four times the pool.
TEST(OutOfCore, EverythingOnNvmeTrainsBitForBitLikeEverythingInMemory) {
  TestEngine in_memory(TmpDir("a"), 64 << 20);
  Trainer reference(&in_memory, All(100));
  TestEngine small(TmpDir("b"), RoundUpToPage(TotalBytes() / 4));
  Trainer out_of_core(&small, All(0));
  ASSERT_EQ(reference.Params(), out_of_core.Params());
  for (int step = 1; step <= 6; ++step) {
    reference.ReturnGradients(step);
    out_of_core.ReturnGradients(step);
    auto a = reference.Step();
    auto b = out_of_core.Step();
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->partitions_updated, kSizes.size());
    ASSERT_EQ(reference.Params(), out_of_core.Params()) << "step " << step;
    EXPECT_LE(small.pool->used(), small.pool->limit());
  }
  const SwapperStats s = small.swapper->Stats();
  EXPECT_EQ(s.nvme_home_bytes, TotalBytes());
  EXPECT_GT(s.swap_outs, 0u);
  EXPECT_GT(s.swap_ins, 0u);
  EXPECT_EQ(s.io_errors, 0u);
  // Consumed gradients were dropped, not written back.
  EXPECT_GT(s.discards, 0u);
  // The arena is on small pages: parameters and gradients moved through its
  // file and the swapper's staging buffers, not by direct I/O into it
  // (where writes through the file get small pages too).
  if (!SharedFileWritesMayGetLargePages()) {
    EXPECT_GT(s.staged_bytes, 0u);
  }
  EXPECT_LT(s.staged_bytes, s.bytes_in + s.bytes_out);  // optimizer state went directly
  // Iterations after the first follow the learned order: prefetch is used.
  EXPECT_GT(s.prefetch_used, 0u);
  auto sessions = small.sessions->Sessions();
  ASSERT_EQ(sessions.size(), 1u);
  EXPECT_EQ(sessions[0].held, 0u);
  const int state = static_cast<int>(DataKind::kOptimizerState);
  EXPECT_EQ(sessions[0].nvme_bytes[state], StateBytes());
  EXPECT_EQ(sessions[0].host_bytes[state], 0u);
  EXPECT_EQ(sessions[0].nvme_bytes[static_cast<int>(DataKind::kParams)], TotalBytes() / 22 * 2);
}

// Large partitions laid out for huge pages (each region on whole 2 MiB
// pages, asked of the kernel where it gives shared memory huge pages) train
// to the same bits as with small pages, with their parameters and gradients
// swapped through NVMe, and the arena's pages never exceed what the pool
// counts for them.
TEST(OutOfCore, PartitionsLaidOutForHugePagesTrainBitForBitWithinThePool) {
  constexpr uint64_t kHuge = 2 << 20, kChunk = 1 << 20;  // 2 MiB of bf16 per chunk
  const std::vector<uint64_t> sizes = {2 * kChunk, kChunk, 700};
  // State on the host (16 bytes per parameter), params and grads on NVMe,
  // with room for about one large partition's.
  const uint64_t state = 16 * (3 * kChunk) + 4 * HostPool::Charge(700 * 4);
  const uint64_t pool = state + 14 * (1 << 20);
  PlacementChange on_nvme = All(0);
  on_nvme[DataKind::kOptimizerState] = 100;
  TestEngine small_pages(TmpDir("small"), pool, 8, kChunk, 0);
  TestEngine huge_pages(TmpDir("huge"), pool, 8, kChunk, kHuge);
  Trainer reference(&small_pages, on_nvme, sizes);
  Trainer trainer(&huge_pages, on_nvme, sizes);
  for (size_t i = 0; i < sizes.size(); ++i) {
    const PartitionInfo& p = trainer.parts()[i];
    const bool large = p.numel >= kChunk;
    EXPECT_EQ(p.huge_pages, large) << i;
    EXPECT_FALSE(reference.parts()[i].huge_pages) << i;
    if (!large) continue;
    EXPECT_EQ(p.span.offset % kHuge, 0u);
    EXPECT_EQ(p.grads.offset % kHuge, 0u);
    EXPECT_EQ(p.span.bytes % kHuge, 0u);
  }
  // The arena's pages, as the kernel counts them, against what the pool
  // counts for the arena (its use less the state's leases), plus the
  // session's request-ring mailbox (a fixed overhead, not pool memory).
  struct stat st;
  auto arena_fd = huge_pages.sessions->DupArenaFd(trainer.key());
  ASSERT_TRUE(arena_fd.ok());
  auto check_bound = [&](int step) {
    huge_pages.swapper->WaitIdle();
    ASSERT_EQ(fstat(arena_fd->get(), &st), 0);
    const uint64_t populated = static_cast<uint64_t>(st.st_blocks) * 512;
    const uint64_t counted = huge_pages.pool->used() - state + RoundUpToPage(ring::RingBytes());
    EXPECT_LE(populated, counted) << "step " << step;
  };
  ASSERT_EQ(reference.Params(), trainer.Params());
  for (int step = 1; step <= 6; ++step) {
    if (step == 4) {
      // The delayed update's second working-copy buffer, laid out alike.
      ASSERT_TRUE(small_pages.sessions->SetDelayedUpdate(reference.key(), true).ok());
      ASSERT_TRUE(huge_pages.sessions->SetDelayedUpdate(trainer.key(), true).ok());
    }
    reference.ReturnGradients(step);
    trainer.ReturnGradients(step);
    check_bound(step);
    auto a = reference.Step();
    auto b = trainer.Step();
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(reference.Params(), trainer.Params()) << "step " << step;
    check_bound(step);
  }
  const SwapperStats s = huge_pages.swapper->Stats();
  EXPECT_GT(s.swap_ins, 0u);
  EXPECT_EQ(s.io_errors, 0u);
}

// A swap-in that fails (EIO) fails the hold with DATA_LOSS and holds
// nothing; the NVMe copy is intact, and the next hold reads it.
TEST(OutOfCore, AFailedSwapInFailsTheFetchAndKeepsTheCopy) {
  TestEngine small(TmpDir("m"), RoundUpToPage(TotalBytes() / 4), /*prefetch_depth=*/0);
  Trainer t(&small, All(0));
  const std::string before = t.Params();
  const PartitionInfo& p = t.parts()[0];
  // Out of the pool's cache: to NVMe.
  const uint64_t limit = small.pool->limit();
  small.pool->SetLimit(4096);
  small.swapper->Trim();
  small.swapper->WaitIdle();
  small.pool->SetLimit(limit);
  ASSERT_EQ(
      small.swapper->State(PartitionStore::BlockOf(p.id, 0, PartitionStore::kParamsBlock)).value(),
      BlockState::kOnNvme);
  FaultRule eio;
  eio.any_op = false;
  eio.op = IoOp::kRead;
  eio.error = EIO;
  small.faults->AddRule(eio);
  auto failed = small.sessions->Fetch(t.key(), {p.id});
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
  EXPECT_NE(failed.status().message().find("'p0'"), std::string::npos) << failed.status();
  small.faults->ClearRules();
  EXPECT_EQ(small.sessions->Sessions()[0].held, 0u);
  EXPECT_EQ(small.swapper->Stats().pinned_bytes, 0u);
  EXPECT_EQ(t.Params(), before);
}

TEST(OutOfCore, ASwapInErrorStopsTheStepAndTheRetryResumesExactly) {
  // Only the state on NVMe: every read of the step is a state chunk's.
  BesideReference t("e");
  for (int step = 1; step <= 3; ++step) {
    t.reference.ReturnGradients(step);
    t.out_of_core.ReturnGradients(step);
    ASSERT_TRUE(t.reference.Step().ok());
    if (step == 3) {
      // Fail the eighth swap-in of this step: the first group of chunks of
      // partition 1 (two chunks of master, m, v) is updated, then
      // the step stops with the read's error.
      FailRead(t.small, 7);
      auto failed = t.out_of_core.Step();
      EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
      EXPECT_NE(failed.status().message().find("resumes there"), std::string::npos);
      t.small.faults->ClearRules();
      // New gradients cannot be mixed into the half-applied step, nor can
      // it be skipped, nor the delayed update switched under it.
      EXPECT_EQ(t.out_of_core.ReturnGradientsStatus(), absl::StatusCode::kFailedPrecondition);
      EXPECT_EQ(t.small.sessions->Step(t.out_of_core.key(), AdamHyperparams{}, SkipControl())
                    .status()
                    .code(),
                absl::StatusCode::kFailedPrecondition);
      EXPECT_EQ(t.small.sessions->SetDelayedUpdate(t.out_of_core.key(), true).code(),
                absl::StatusCode::kFailedPrecondition);
    }
    auto b = t.out_of_core.Step();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(t.reference.Params(), t.out_of_core.Params()) << "step " << step;
  }
}

// A step that stops after finishing some partitions (0 here), midway
// through one (1) and before another (2): the ones it has not finished
// take no new gradients (they would be added to the ones it still has to
// apply), the Step that resumes it finishes those alone (a finished
// partition's next gradients wait for the next Step), and the session's
// step count goes up once, when it is finished.
TEST(OutOfCore, AStepThatStopsFinishesAloneAndCountsOnce) {
  BesideReference t("s2");
  ASSERT_NO_FATAL_FAILURE(StopStepTwoMidway(t));
  EXPECT_EQ(t.out_of_core.ReturnGradientsStatus(1), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.out_of_core.ReturnGradientsStatus(2), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.small.sessions->Sessions()[0].steps, 1u);
  // Partition 0 takes its next gradients (the buffer as it is); the Step
  // that resumes leaves them for the next, and applies what the stopped
  // step was decided with: an overflow it is told of now (the next
  // iteration's) does not make it a skip, which a half-applied step
  // cannot be.
  EXPECT_EQ(t.out_of_core.ReturnGradientsStatus(0), absl::StatusCode::kOk);
  StepControl overflow;
  overflow.overflow = true;
  auto resumed = t.small.sessions->Step(t.out_of_core.key(), Decaying(), overflow);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(t.small.sessions->Sessions()[0].steps, 2u);
  EXPECT_EQ(t.reference.Params(), t.out_of_core.Params());
  EXPECT_EQ(t.small.sessions->Pending(t.out_of_core.key())->partitions, 1u);
}

// The Step that resumes a stopped step applies the hyperparameters and
// gradient scale that step was decided with, not its own: a trainer that
// computes its clipping coefficient again sees only the gradients still
// pending, and a scheduler may have moved the lr meanwhile; the partitions
// of one step must not differ.
TEST(OutOfCore, AResumedStepAppliesTheHyperparametersItWasDecidedWith) {
  BesideReference t("h2");
  ASSERT_NO_FATAL_FAILURE(StopStepTwoMidway(t));
  AdamHyperparams other = Decaying();
  other.lr *= 10;
  other.weight_decay = 0.5;
  other.grad_scale = 0.25;
  auto resumed = t.small.sessions->Step(t.out_of_core.key(), other);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(t.reference.Params(), t.out_of_core.Params());
  // The next step is decided anew, with what it is given.
  t.reference.ReturnGradients(3);
  t.out_of_core.ReturnGradients(3);
  ASSERT_TRUE(t.in_memory.sessions->Step(t.reference.key(), other).ok());
  ASSERT_TRUE(t.small.sessions->Step(t.out_of_core.key(), other).ok());
  EXPECT_EQ(t.reference.Params(), t.out_of_core.Params());
}

// A partition a stopped step updated in part is not fetched (its
// parameters are of two steps) until a Step finishes it; the ones it
// finished or never began are.
TEST(OutOfCore, AStepStoppedMidwayLendsNoHalfUpdatedParameters) {
  BesideReference t("f2");
  for (int step = 1; step <= 2; ++step) {
    t.reference.ReturnGradients(step);
    t.out_of_core.ReturnGradients(step);
    ASSERT_TRUE(t.reference.Step().ok());
    if (step == 2) FailRead(t.small, 7);  // the first group of the first partition's chunks applied
    auto stepped = t.out_of_core.Step();
    t.small.faults->ClearRules();
    ASSERT_EQ(stepped.ok(), step == 1) << stepped.status();
  }
  const auto& parts = t.out_of_core.parts();
  auto half = t.small.sessions->Fetch(t.out_of_core.key(), {parts[0].id});
  EXPECT_EQ(half.status().code(), absl::StatusCode::kFailedPrecondition) << half.status();
  EXPECT_NE(half.status().message().find("updated in part"), std::string::npos) << half.status();
  for (size_t i : {size_t{1}, size_t{2}}) {  // not begun: whole
    ASSERT_TRUE(t.small.sessions->Fetch(t.out_of_core.key(), {parts[i].id}).ok()) << i;
    ASSERT_TRUE(t.small.sessions->Release(t.out_of_core.key(), {parts[i].id}).ok());
  }
  EXPECT_EQ(t.small.sessions->Sessions()[0].held, 0u);
  ASSERT_TRUE(t.small.sessions->Step(t.out_of_core.key(), Decaying()).ok());
  EXPECT_TRUE(t.small.sessions->Fetch(t.out_of_core.key(), {parts[0].id}).ok());
  ASSERT_TRUE(t.small.sessions->Release(t.out_of_core.key(), {parts[0].id}).ok());
  EXPECT_EQ(t.reference.Params(), t.out_of_core.Params());
}

// A session whose step stopped midway (its trainer backing off on a full
// pool, or gone) is kept at a stop all the same: the step is finished
// first, as it was decided, and the next offloadd's session is the
// finished step's, as the in-memory reference.
TEST(OutOfCore, AStepStoppedMidwayIsFinishedBeforeItsSessionIsKept) {
  BesideReference t("k2");
  ASSERT_NO_FATAL_FAILURE(StopStepTwoMidway(t));
  const std::string dir = TmpDir("k3");
  EXPECT_EQ(KeepSessions(*t.small.sessions, dir), 1);
  EXPECT_EQ(t.small.sessions->Sessions()[0].steps, 2u);
  EXPECT_EQ(t.reference.Params(), t.out_of_core.Params());
}

// The same with the delayed update on and a partition the step finished
// held by the trainer (its next forward): the holds go first, as when the
// trainer goes away, so that the step's resumption can make its newer
// buffer current; the session is kept.
TEST(OutOfCore, AStepStoppedMidwayWithTheDelayedUpdateIsFinishedOverTheTrainersHolds) {
  BesideReference t("kd");
  ASSERT_TRUE(t.in_memory.sessions->SetDelayedUpdate(t.reference.key(), true).ok());
  ASSERT_TRUE(t.small.sessions->SetDelayedUpdate(t.out_of_core.key(), true).ok());
  ASSERT_NO_FATAL_FAILURE(StopStepTwoMidway(t));
  ASSERT_TRUE(t.small.sessions->Fetch(t.out_of_core.key(), {t.out_of_core.parts()[0].id}).ok());
  const std::string dir = TmpDir("kd2");
  EXPECT_EQ(KeepSessions(*t.small.sessions, dir), 1);
  EXPECT_EQ(t.small.sessions->Sessions()[0].steps, 2u);
  // Both drained (the newest weights current): the same.
  ASSERT_TRUE(t.in_memory.sessions->SetDelayedUpdate(t.reference.key(), false).ok());
  ASSERT_TRUE(t.small.sessions->SetDelayedUpdate(t.out_of_core.key(), false).ok());
  EXPECT_TRUE(t.reference.Params() == t.out_of_core.Params());
}

// A stop keeping a session cancels its automatic checkpoint being written
// (one thread, beside training) instead of waiting for it: the keep writes
// the same state, and the previous automatic checkpoint stays.
TEST(OutOfCore, KeepingASessionCancelsItsAutomaticCheckpointUnderWay) {
  auto engine = SmallEngine("c1");
  TestEngine& small = *engine;
  SessionManager::AutoCheckpointOptions automatic;
  automatic.dir = TmpDir("c2");
  automatic.every_steps = 2;
  small.sessions->SetAutoCheckpoint(automatic);
  Trainer t(&small, StateAt(0));
  t.ReturnGradients(1);
  ASSERT_TRUE(t.Step().ok());  // not due
  // Once step 2's update is done, the next read from NVMe (its automatic
  // checkpoint's, of state the step left there) is held.
  absl::Notification reading, go_on;
  std::atomic<bool> armed{false};
  small.swapper->SetIoHookForTesting([&](Swapper::BlockId, bool is_write) {
    if (is_write || !armed.load() || reading.HasBeenNotified()) return;
    reading.Notify();
    go_on.WaitForNotification();
  });
  small.steps->SetSyncPointForTesting([&armed](StepPoint point) {
    if (point == StepPoint::kOptimized) armed = true;
  });
  t.ReturnGradients(2);
  ASSERT_TRUE(t.Step().ok());  // due: begins in the background
  small.steps->SetSyncPointForTesting(nullptr);
  reading.WaitForNotification();
  std::thread keeper([&] { EXPECT_TRUE(small.sessions->QuiesceForKeeping(t.key().id).ok()); });
  absl::SleepFor(absl::Milliseconds(50));
  go_on.Notify();
  keeper.join();
  small.swapper->SetIoHookForTesting(nullptr);
  EXPECT_EQ(small.stats.auto_checkpoints.load(), 0);  // cancelled, not committed
  EXPECT_EQ(small.stats.auto_checkpoint_failures.load(), 0);
}

// With loss scaling, an overlapped step counts for the scale when it is
// decided; should it stop midway, the Step that finishes it does not
// count it again (the scale would grow a step early).
TEST(OutOfCore, AnOverlappedStepThatStopsCountsOnceForTheLossScale) {
  auto engine = SmallEngine("s3");
  TestEngine& small = *engine;
  LossScalingOptions scaling;
  scaling.initial_scale = 1024;
  scaling.growth_interval = 1;  // every clean step doubles it
  Trainer t(&small, StateAt(0), kSizes, scaling);
  t.ReturnGradients(1);
  ASSERT_TRUE(t.Step().ok());  // 2048; its state written out: the next step reads it
  t.ReturnGradients(2);
  FailRead(small, 16);
  StepControl overlap;
  overlap.overlap = true;
  auto started = small.sessions->Step(t.key(), Decaying(), overlap);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(started->loss_scale, 4096.0);
  EXPECT_EQ(small.sessions->WaitStep(t.key()).status().code(), absl::StatusCode::kDataLoss);
  small.faults->ClearRules();
  auto finished = t.Step();
  ASSERT_TRUE(finished.ok()) << finished.status();
  EXPECT_EQ(finished->loss_scale, 4096.0);
  t.ReturnGradients(3);
  auto next = t.Step();
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->loss_scale, 8192.0);
}

// An overlapped step that stopped midway (its call returned before): the
// next forward's fetch of a partition it updated in part is refused with
// the reason the step stopped, the trainer's first word of it.
TEST(OutOfCore, AFetchRefusedAfterAnOverlappedStepStoppedSaysWhy) {
  auto engine = SmallEngine("s4");
  TestEngine& small = *engine;
  Trainer t(&small, StateAt(0));
  t.ReturnGradients(1);
  ASSERT_TRUE(t.Step().ok());
  t.ReturnGradients(2);
  FailRead(small, 7);  // the first group of the first partition's chunks applied
  StepControl overlap;
  overlap.overlap = true;
  ASSERT_TRUE(small.sessions->Step(t.key(), Decaying(), overlap).ok());
  EXPECT_EQ(small.sessions->WaitStep(t.key()).status().code(), absl::StatusCode::kDataLoss);
  small.faults->ClearRules();
  const absl::Status refused = small.sessions->Fetch(t.key(), {t.parts()[0].id}).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("The overlapped step stopped on: DATA_LOSS"), std::string::npos)
      << refused;
  ASSERT_TRUE(t.Step().ok());  // finishes it
  EXPECT_TRUE(small.sessions->Fetch(t.key(), {t.parts()[0].id}).ok());
}

// Moving a session's data between the tiers while it trains, both ways,
// returns at once and loses nothing: every partition's bytes are the same
// before and after, and training stays bit-for-bit that of data kept in
// memory throughout.
TEST(OutOfCore, LivePlacementChangesMoveDataAndKeepTrainingExact) {
  TestEngine in_memory(TmpDir("f"), 64 << 20);
  Trainer reference(&in_memory, All(100));
  TestEngine engine(TmpDir("g"), 64 << 20);
  Trainer moved(&engine, All(100));
  auto step_both = [&](int step) {
    reference.ReturnGradients(step);
    moved.ReturnGradients(step);
    ASSERT_TRUE(reference.Step().ok());
    auto b = moved.Step();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(reference.Params(), moved.Params()) << "step " << step;
  };
  step_both(1);
  step_both(2);
  // To NVMe, then shrink the pool so that the data must leave memory.
  const std::string before = moved.Params();
  ASSERT_TRUE(engine.sessions->SetPlacement(moved.key(), All(0)).ok());
  EXPECT_EQ(engine.swapper->Stats().nvme_home_bytes, TotalBytes());
  engine.pool->SetLimit(RoundUpToPage(TotalBytes() / 4));
  engine.swapper->Trim();
  engine.swapper->WaitIdle();
  EXPECT_LE(engine.pool->used(), engine.pool->limit());
  EXPECT_GT(engine.swapper->Stats().swap_outs, 0u);
  EXPECT_EQ(moved.Params(), before);
  step_both(3);
  step_both(4);
  EXPECT_GT(engine.swapper->Stats().swap_outs, 0u);
  // Back to the host: the swapper reads it all in, in the background.
  engine.pool->SetLimit(64 << 20);
  const std::string on_nvme = moved.Params();
  ASSERT_TRUE(engine.sessions->SetPlacement(moved.key(), All(100)).ok());
  engine.swapper->WaitIdle();
  const SwapperStats s = engine.swapper->Stats();
  EXPECT_EQ(s.host_home_bytes, TotalBytes());
  EXPECT_EQ(s.resident_bytes, TotalBytes());  // every chunk is in memory again
  EXPECT_EQ(moved.Params(), on_nvme);
  step_both(5);
  // One kind at a time, and a bad value changes nothing.
  PlacementChange grads_only;
  grads_only[DataKind::kGrads] = 0;
  ASSERT_TRUE(engine.sessions->SetPlacement(moved.key(), grads_only).ok());
  EXPECT_EQ(engine.sessions->Sessions()[0].nvme_bytes[static_cast<int>(DataKind::kGrads)],
            TotalBytes() / 22 * 4);
  step_both(6);
  EXPECT_EQ(engine.sessions->SetPlacement(moved.key(), StateAt(101)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(OutOfCore, LossScalingWithStateOnNvme) {
  LossScalingSkipsOverflowsAndUnscales(StateAt(0), "scale_nvme");
}

}  // namespace
}  // namespace offload
