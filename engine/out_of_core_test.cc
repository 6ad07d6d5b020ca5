// Optimizer state on the NVMe tier: a session whose state does not fit the
// host pool trains to the same bits as one whose state is all in memory.
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/env.h"
#include "engine/partition_store.h"
#include "engine/session_manager.h"
#include "engine/step_runner.h"
#include "gtest/gtest.h"
#include "nvme/fault_injection.h"
#include "nvme/io_backend_factory.h"
#include "nvme/swap_space.h"
#include "swapper/host_pool.h"
#include "swapper/swapper.h"

namespace offload {
namespace {

constexpr uint64_t kChunkElems = 4096;  // 16 KiB per kind and chunk
// Three partitions of different sizes: 5 + 2 + 1 chunks (the last partial).
const std::vector<uint64_t> kSizes = {5 * kChunkElems, 2 * kChunkElems - 100, 700};

// A daemon's engine: pool, swapper (over an NVMe tier that may fail on
// demand), store, step runner and session manager.
class Engine {
 public:
  Engine(const std::string& dir, uint64_t pool_bytes, int64_t prefetch_depth = 8) {
    mkdir(dir.c_str(), 0700);
    auto inner = MakeIoBackend(IoOptions{});
    EXPECT_TRUE(inner.ok()) << inner.status();
    auto faulty = std::make_unique<FaultInjectingBackend>(std::move(*inner));
    faults = faulty.get();
    backend_ = std::move(faulty);
    NvmeOptions n;
    n.dirs = dir;
    n.bytes_per_dir = int64_t{64} << 20;
    space_ = *SwapSpace::Create(n, backend_.get());
    pool = std::make_unique<HostPool>(Env::Default(), pool_bytes, false);
    SwapperOptions so;
    so.prefetch_depth = prefetch_depth;
    swapper = *Swapper::Create(so, pool.get(), space_.get());
    store_ = std::make_unique<PartitionStore>(Env::Default(), swapper.get(), &stats, 64 << 20, 100,
                                              kChunkElems);
    steps_ = std::make_unique<StepRunner>(&optimizer_, pool.get(), &stats);
    sessions = std::make_unique<SessionManager>(Env::Default(), store_.get(), steps_.get(), &stats);
  }

  // In the order they are built, so that they are destroyed in reverse: the
  // swapper (and the sessions' blocks) before the swap space it writes to.
 private:
  std::unique_ptr<IoBackend> backend_;
  std::unique_ptr<SwapSpace> space_;
  Optimizer optimizer_{OptimizerOptions{}};

 public:
  FaultInjectingBackend* faults = nullptr;
  Stats stats;
  std::unique_ptr<HostPool> pool;
  std::unique_ptr<Swapper> swapper;

 private:
  std::unique_ptr<PartitionStore> store_;
  std::unique_ptr<StepRunner> steps_;

 public:
  std::unique_ptr<SessionManager> sessions;
};

// One trainer: a session with the partitions of kSizes (bf16 working copy,
// fp32 gradients), its arena mapped.
class Trainer {
 public:
  Trainer(Engine* engine, int state_host_percent) : engine_(engine) {
    auto opened = engine->sessions->Open("t", state_host_percent);
    EXPECT_TRUE(opened.ok()) << opened.status();
    key_ = opened->key;
    for (size_t i = 0; i < kSizes.size(); ++i) {
      auto p = engine->sessions->Register(
          key_, {"p" + std::to_string(i), kSizes[i], DType::kBf16, DType::kFp32});
      EXPECT_TRUE(p.ok()) << p.status();
      parts_.push_back(*p);
    }
    auto fd = engine->sessions->DupArenaFd(key_);
    arena_ = *HostMemory::MapShared(fd->get(), 0, 64 << 20);
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    for (const PartitionInfo& p : parts_) {
      auto* w = reinterpret_cast<uint16_t*>(arena_.data() + p.params.offset);
      for (uint64_t j = 0; j < p.numel; ++j) w[j] = FloatToBf16(d(rng));
    }
  }

  // Writes step `step`'s gradients and returns them.
  void ReturnGradients(int step) {
    std::mt19937 rng(100 + step);
    std::normal_distribution<float> d(0.f, 0.1f);
    for (const PartitionInfo& p : parts_) {
      auto* g = reinterpret_cast<float*>(arena_.data() + p.grads.offset);
      for (uint64_t j = 0; j < p.numel; ++j) g[j] = d(rng);
      ASSERT_TRUE(engine_->sessions->ReturnGradients(key_, p.id, p.numel, DType::kFp32).ok());
    }
  }

  // Returns the first partition's gradients again; the status code.
  absl::StatusCode ReturnGradientsStatus() {
    const PartitionInfo& p = parts_[0];
    return engine_->sessions->ReturnGradients(key_, p.id, p.numel, DType::kFp32).code();
  }

  absl::StatusOr<StepSummary> Step() {
    AdamHyperparams h;
    h.lr = 1e-2;
    h.weight_decay = 0.01;
    return engine_->sessions->Step(key_, h);
  }

  // The working copies, as bytes.
  std::string Params() const {
    std::string out;
    for (const PartitionInfo& p : parts_) {
      out.append(reinterpret_cast<const char*>(arena_.data() + p.params.offset), p.params.bytes);
    }
    return out;
  }

  const SessionKey& key() const { return key_; }

 private:
  Engine* engine_;
  SessionKey key_;
  std::vector<PartitionInfo> parts_;
  HostMemory arena_;
};

uint64_t StateBytes() {
  uint64_t total = 0;
  for (uint64_t n : kSizes) total += 3 * n * sizeof(float);
  return total;
}

std::string TmpDir(const std::string& name) { return std::string(getenv("TEST_TMPDIR")) + "/" + name; }

TEST(OutOfCore, StateOnNvmeTrainsBitForBitLikeStateInMemory) {
  Engine in_memory(TmpDir("a"), 64 << 20);
  Trainer reference(&in_memory, 100);
  // The pool holds the arena pages (params and grads) plus a quarter of the
  // optimizer state.
  const uint64_t arena = 2 * (RoundUpToPage(kSizes[0] * 4) + RoundUpToPage(kSizes[1] * 4) +
                              RoundUpToPage(kSizes[2] * 4));
  Engine small(TmpDir("b"), arena + RoundUpToPage(StateBytes() / 4));
  Trainer out_of_core(&small, 0);
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
  EXPECT_EQ(s.nvme_home_bytes, StateBytes());
  EXPECT_GT(s.swap_outs, 0u);
  EXPECT_GT(s.swap_ins, 0u);
  EXPECT_EQ(s.io_errors, 0u);
  // Steps after the first follow the learned order: the prefetch is used.
  EXPECT_GT(s.prefetch_used, 0u);
  auto sessions = small.sessions->Sessions();
  ASSERT_EQ(sessions.size(), 1u);
  EXPECT_EQ(sessions[0].state_nvme_bytes, StateBytes());
  EXPECT_EQ(sessions[0].state_host_bytes, 0u);
}

TEST(OutOfCore, FractionalPlacementKeepsThatShareOnTheHost) {
  Engine engine(TmpDir("c"), 64 << 20);
  Trainer quarter(&engine, 25);
  auto sessions = engine.sessions->Sessions();
  ASSERT_EQ(sessions.size(), 1u);
  const double host = static_cast<double>(sessions[0].state_host_bytes);
  const double total = host + static_cast<double>(sessions[0].state_nvme_bytes);
  EXPECT_EQ(total, static_cast<double>(StateBytes()));
  // Whole partitions go one way or the other, never above the share.
  EXPECT_LE(host / total, 0.25);
  EXPECT_GT(host, 0.0);  // the smallest partitions fit under it
}

TEST(OutOfCore, ASwapInErrorStopsTheStepAndTheRetryResumesExactly) {
  Engine in_memory(TmpDir("d"), 64 << 20);
  Trainer reference(&in_memory, 100);
  const uint64_t arena = 2 * (RoundUpToPage(kSizes[0] * 4) + RoundUpToPage(kSizes[1] * 4) +
                              RoundUpToPage(kSizes[2] * 4));
  // No prefetch: every read is the step's own, so the failing one is too (a
  // failed prefetch is simply read again by the step).
  Engine small(TmpDir("e"), arena + RoundUpToPage(StateBytes() / 4), /*prefetch_depth=*/0);
  Trainer out_of_core(&small, 0);
  for (int step = 1; step <= 3; ++step) {
    reference.ReturnGradients(step);
    out_of_core.ReturnGradients(step);
    ASSERT_TRUE(reference.Step().ok());
    if (step == 3) {
      // Fail the eighth swap-in of this step: the first group of chunks of
      // partition 1 (two chunks of master, m, v) is updated, then
      // the step stops with the read's error.
      FaultRule eio;
      eio.any_op = false;
      eio.op = IoOp::kRead;
      eio.skip = 7;
      eio.error = EIO;
      small.faults->AddRule(eio);
      auto failed = out_of_core.Step();
      EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
      EXPECT_NE(failed.status().message().find("resumes there"), std::string::npos);
      small.faults->ClearRules();
      // New gradients cannot be mixed into the half-applied step.
      EXPECT_EQ(out_of_core.ReturnGradientsStatus(), absl::StatusCode::kFailedPrecondition);
    }
    auto b = out_of_core.Step();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(reference.Params(), out_of_core.Params()) << "step " << step;
  }
}

// Moving a session's state between the tiers while it trains, both ways,
// returns at once and loses nothing: training stays bit-for-bit that of
// state kept in memory throughout.
TEST(OutOfCore, LivePlacementChangesMoveStateAndKeepTrainingExact) {
  Engine in_memory(TmpDir("f"), 64 << 20);
  Trainer reference(&in_memory, 100);
  Engine engine(TmpDir("g"), 64 << 20);
  Trainer moved(&engine, 100);
  const uint64_t arena = 2 * (RoundUpToPage(kSizes[0] * 4) + RoundUpToPage(kSizes[1] * 4) +
                              RoundUpToPage(kSizes[2] * 4));
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
  // To NVMe, then shrink the pool so that the state must leave memory.
  ASSERT_TRUE(engine.sessions->SetPlacement(moved.key(), 0).ok());
  EXPECT_EQ(engine.swapper->Stats().nvme_home_bytes, StateBytes());
  engine.pool->SetLimit(arena + RoundUpToPage(StateBytes() / 4));
  engine.swapper->Trim();
  engine.swapper->WaitIdle();
  EXPECT_LE(engine.pool->used(), engine.pool->limit());
  EXPECT_GT(engine.swapper->Stats().swap_outs, 0u);
  step_both(3);
  step_both(4);
  EXPECT_GT(engine.swapper->Stats().swap_outs, 0u);
  // Back to the host: the swapper reads it all in, in the background.
  engine.pool->SetLimit(64 << 20);
  ASSERT_TRUE(engine.sessions->SetPlacement(moved.key(), 100).ok());
  engine.swapper->WaitIdle();
  const SwapperStats s = engine.swapper->Stats();
  EXPECT_EQ(s.host_home_bytes, StateBytes());
  EXPECT_EQ(s.resident_bytes, StateBytes());  // every chunk is in memory again
  step_both(5);
  EXPECT_EQ(engine.sessions->SetPlacement(moved.key(), 101).code(),
            absl::StatusCode::kInvalidArgument);
}

// Two sessions whose state is on NVMe share one small pool, stepping at the
// same time from two threads: each trains bit-for-bit like its own copy with
// state in memory (their traces are separate; eviction weighs both).
TEST(OutOfCore, TwoSessionsShareASmallPool) {
  Engine in_memory(TmpDir("h"), 64 << 20);
  Trainer ref_a(&in_memory, 100), ref_b(&in_memory, 100);
  const uint64_t arena = 2 * (RoundUpToPage(kSizes[0] * 4) + RoundUpToPage(kSizes[1] * 4) +
                              RoundUpToPage(kSizes[2] * 4));
  Engine shared(TmpDir("i"), 2 * arena + RoundUpToPage(StateBytes() / 2));
  Trainer a(&shared, 0), b(&shared, 0);
  for (int step = 1; step <= 5; ++step) {
    for (Trainer* t : {&ref_a, &ref_b, &a, &b}) t->ReturnGradients(step);
    ASSERT_TRUE(ref_a.Step().ok());
    ASSERT_TRUE(ref_b.Step().ok());
    absl::StatusOr<StepSummary> sa, sb;
    std::thread other([&] { sb = b.Step(); });
    sa = a.Step();
    other.join();
    ASSERT_TRUE(sa.ok()) << sa.status();
    ASSERT_TRUE(sb.ok()) << sb.status();
    ASSERT_EQ(ref_a.Params(), a.Params()) << "step " << step;
    ASSERT_EQ(ref_b.Params(), b.Params()) << "step " << step;
    EXPECT_LE(shared.pool->used(), shared.pool->limit());
  }
  EXPECT_GT(shared.swapper->Stats().swap_outs, 0u);
}

TEST(OutOfCore, PlacementOnNvmeNeedsAnNvmeTier) {
  HostPool pool(Env::Default(), 1 << 20, false);
  auto swapper = *Swapper::Create(SwapperOptions{}, &pool, nullptr);
  Stats stats;
  PartitionStore store(Env::Default(), swapper.get(), &stats, 1 << 20, 100, kChunkElems);
  EXPECT_EQ(store.CreateSet(1, 50).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store.CreateSet(1, 101).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(store.CreateSet(1, 100).ok());
}

}  // namespace
}  // namespace offload
