// What the engine's trainer-level tests share (out_of_core_test,
// partition_store_test, step_runner_test): a Trainer over a TestEngine's
// session, a gate that holds an overlapped step at a point, the
// partitions' sizes and byte counts, and the loss-scaling case that runs
// with the state in memory and on NVMe.
#ifndef OFFLOADD_ENGINE_TRAINER_TESTING_H_
#define OFFLOADD_ENGINE_TRAINER_TESTING_H_

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
#include "engine/partition_store.h"
#include "engine/session_manager.h"
#include "engine/step_runner.h"
#include "engine/test_engine.h"
#include "gtest/gtest.h"
#include "ipc/request_ring.h"
#include "nvme/fault_injection.h"
#include "nvme/io_backend_factory.h"
#include "nvme/swap_space.h"
#include "swapper/host_pool.h"
#include "swapper/swapper.h"

namespace offload::trainer_testing {

inline constexpr uint64_t kChunkElems = 4096;  // 16 KiB per kind and chunk
// Three partitions of different sizes: 5 + 2 + 1 chunks (the last partial).
inline const std::vector<uint64_t> kSizes = {5 * kChunkElems, 2 * kChunkElems - 100, 700};

inline StepControl SkipControl() {
  StepControl c;
  c.skip = true;
  return c;
}

inline StepControl OverflowControl() {
  StepControl c;
  c.overflow = true;
  return c;
}

// The hyperparameters Trainer::Step steps with: AdamW with weight decay.
inline AdamHyperparams Decaying() {
  AdamHyperparams h;
  h.lr = 1e-2;
  h.weight_decay = 0.01;
  return h;
}

inline FetchMode WithGrads() {
  FetchMode mode;
  mode.grads = true;
  return mode;
}

// Session `key`'s arena as its trainer maps it (the 64 MiB the tests use).
inline HostMemory MapArena(TestEngine& engine, const SessionKey& key) {
  auto fd = engine.sessions->DupArenaFd(key);
  EXPECT_TRUE(fd.ok()) << fd.status();
  return *HostMemory::MapShared(fd->get(), 0, 64 << 20);
}

// Holds the next overlapped step the first time it reaches `point` (by
// default after its first group of chunks): the step's thread waits there
// until Open() (or the gate's end). Counts every point the step passes.
// Destroy it after the step has ended (WaitStep).
class StepGate {
 public:
  explicit StepGate(TestEngine& engine, StepPoint point = StepPoint::kGroupDone)
      : engine_(engine), point_(point) {
    engine.steps->SetSyncPointForTesting([this](StepPoint p) {
      if (counts_[static_cast<int>(p)]++ != 0 || p != point_) return;
      reached_.Notify();
      open_.WaitForNotification();
    });
  }
  ~StepGate() {
    Open();
    engine_.steps->SetSyncPointForTesting(nullptr);
  }
  void AwaitReached() { reached_.WaitForNotification(); }
  void Open() {
    if (!open_.HasBeenNotified()) open_.Notify();
  }
  int count(StepPoint p) const { return counts_[static_cast<int>(p)].load(); }

 private:
  TestEngine& engine_;
  const StepPoint point_;
  static_assert(static_cast<int>(StepPoint::kMeasuring) < 8, "a count for every StepPoint");
  std::atomic<int> counts_[8] = {};
  absl::Notification reached_, open_;
};

// Whether a call began waiting for a step (the count moved past `before`)
// within 20 s.
inline bool AwaitAWaitForStep(TestEngine& engine, int64_t before) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (engine.stats.waits_for_step.load() == before) {
    if (absl::Now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

// The check of OverlappedStepWhereOnlyThePendingFetchWaits (void, for its
// ASSERTs).
inline void ExpectOnlyThePendingFetchWaits(TestEngine& engine, const SessionKey& key,
                                           uint64_t updated, uint64_t pending, StepGate& gate) {
  const int64_t waits = engine.stats.waits_for_step.load();
  auto got = engine.sessions->Fetch(key, {updated});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)[0].step, 1u);
  EXPECT_EQ(engine.stats.waits_for_step.load(), waits);
  absl::StatusOr<std::vector<PartitionInfo>> waited;
  std::thread fetcher([&] { waited = engine.sessions->Fetch(key, {pending}); });
  EXPECT_TRUE(AwaitAWaitForStep(engine, waits));
  gate.Open();
  fetcher.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ((*waited)[0].step, 1u);
}

// Starts an overlapped step and, with it held at `gate`: `updated`, out of
// the step, is fetched without waiting; the fetch of `pending`, still in
// it, waits until the gate opens. Both come back with the step applied.
// Returns the step's outcome.
absl::StatusOr<StepSummary> OverlappedStepWhereOnlyThePendingFetchWaits(
    TestEngine& engine, const SessionKey& key, uint64_t updated, uint64_t pending, StepGate& gate) {
  StepControl overlap;
  overlap.overlap = true;
  auto started = engine.sessions->Step(key, AdamHyperparams{}, overlap);
  if (!started.ok()) return started.status();
  gate.AwaitReached();
  ExpectOnlyThePendingFetchWaits(engine, key, updated, pending, gate);
  gate.Open();  // already open unless the check failed early
  return engine.sessions->WaitStep(key);
}

// One trainer: a session with the partitions of `sizes` (bf16 working copy,
// fp32 gradients), its arena mapped. It holds one partition at a time, as
// ZeRO-3 holds a layer's.
class Trainer {
 public:
  Trainer(TestEngine* engine, const PlacementChange& placement,
          const std::vector<uint64_t>& sizes = kSizes,
          const std::optional<LossScalingOptions>& loss_scaling = std::nullopt)
      : engine_(engine) {
    auto opened = engine->sessions->Open("t", placement, loss_scaling);
    EXPECT_TRUE(opened.ok()) << opened.status();
    key_ = opened->key;
    auto fd = engine->sessions->DupArenaFd(key_);
    // Small pages, as a client maps what the daemon counts in small pages
    // (a kernel giving shared memory huge pages unasked would otherwise
    // put them under small-page partitions here).
    arena_ = *HostMemory::MapShared(fd->get(), 0, 64 << 20, Pages::kSmall);
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    for (size_t i = 0; i < sizes.size(); ++i) {
      auto p = engine->sessions->Register(
          key_, {"p" + std::to_string(i), sizes[i], DType::kBf16, DType::kFp32});
      EXPECT_TRUE(p.ok()) << p.status();
      parts_.push_back(*p);
      // Registered partitions are held: write the initial values, release.
      auto* w = reinterpret_cast<uint16_t*>(arena_.data() + p->params.offset);
      for (uint64_t j = 0; j < p->numel; ++j) w[j] = FloatToBf16(d(rng));
      EXPECT_TRUE(engine->sessions->Release(key_, {p->id}).ok());
    }
  }

  // Writes step `step`'s gradients and returns them, partition by
  // partition: hold (with the gradient buffer), write, return, release
  // (except `keep`, which stays held).
  void ReturnGradients(int step, uint64_t keep = 0) {
    std::mt19937 rng(100 + step);
    std::normal_distribution<float> d(0.f, 0.1f);
    for (size_t i = 0; i < parts_.size(); ++i) {
      const PartitionInfo& p = parts_[i];
      auto held = engine_->sessions->Fetch(key_, {p.id}, WithGrads());
      ASSERT_TRUE(held.ok()) << held.status();
      auto* g = reinterpret_cast<float*>(arena_.data() + p.grads.offset);
      for (uint64_t j = 0; j < p.numel; ++j) g[j] = d(rng);
      const absl::Status returned = engine_->sessions->ReturnGradients(
          key_, p.id, p.numel, DType::kFp32, hand_over_, Given(i, g, p.numel));
      ASSERT_TRUE(returned.ok()) << returned;
      if (p.id != keep) {
        ASSERT_TRUE(engine_->sessions->Release(key_, {p.id}).ok());
      }
    }
  }

  // Returns gradients `grad(partition index, element)`, partition by
  // partition (one micro-batch).
  template <typename Fn>
  void ReturnGradientsOf(Fn grad) {
    for (size_t i = 0; i < parts_.size(); ++i) {
      const PartitionInfo& p = parts_[i];
      ASSERT_TRUE(engine_->sessions->Fetch(key_, {p.id}, WithGrads()).ok());
      auto* g = reinterpret_cast<float*>(arena_.data() + p.grads.offset);
      for (uint64_t j = 0; j < p.numel; ++j) g[j] = grad(i, j);
      const absl::Status returned = engine_->sessions->ReturnGradients(
          key_, p.id, p.numel, DType::kFp32, hand_over_, Given(i, g, p.numel));
      ASSERT_TRUE(returned.ok()) << returned;
      ASSERT_TRUE(engine_->sessions->Release(key_, {p.id}).ok());
    }
  }

  absl::StatusOr<PendingGradients> Pending() { return engine_->sessions->Pending(key_); }

  // Return gradients with hand_over from now on.
  void HandOver(bool on) { hand_over_ = on; }

  // From now on (null: no more), each return gives the daemon the
  // statistics `stats(partition index, gradients written)` of the buffer.
  using StatsFn = std::function<GradStats(size_t, absl::Span<const float>)>;
  void GiveStats(StatsFn stats) { give_ = std::move(stats); }

  // The code of returning gradients for partition `which` (fetched with
  // them, released after), or of its fetch if that is refused (a partition
  // a stopped step updated in part).
  absl::StatusCode ReturnGradientsStatus(size_t which = 0) {
    const PartitionInfo& p = parts_[which];
    if (auto held = engine_->sessions->Fetch(key_, {p.id}, WithGrads()); !held.ok()) {
      return held.status().code();
    }
    const absl::StatusCode code =
        engine_->sessions->ReturnGradients(key_, p.id, p.numel, DType::kFp32).code();
    EXPECT_TRUE(engine_->sessions->Release(key_, {p.id}).ok());
    return code;
  }

  absl::StatusOr<StepSummary> Step() { return engine_->sessions->Step(key_, Decaying()); }

  // The working copies, as bytes (each held while read; `keep` stays held).
  std::string Params(uint64_t keep = 0) const {
    std::string out;
    for (const PartitionInfo& p : parts_) {
      // Where the fetch says: with the delayed update the buffer changes.
      auto held = engine_->sessions->Fetch(key_, {p.id});
      EXPECT_TRUE(held.ok());
      const ArenaRegion params = (*held)[0].params;
      out.append(reinterpret_cast<const char*>(arena_.data() + params.offset), params.bytes);
      if (p.id != keep) {
        EXPECT_TRUE(engine_->sessions->Release(key_, {p.id}).ok());
      }
    }
    return out;
  }

  // One partition's working copy, as bytes (held while read).
  std::string PartitionBytes(size_t i) const {
    const PartitionInfo& p = parts_[i];
    auto held = engine_->sessions->Fetch(key_, {p.id});
    EXPECT_TRUE(held.ok());
    std::string out(reinterpret_cast<const char*>(arena_.data() + (*held)[0].params.offset),
                    p.params.bytes);
    EXPECT_TRUE(engine_->sessions->Release(key_, {p.id}).ok());
    return out;
  }

  const SessionKey& key() const { return key_; }
  const std::vector<PartitionInfo>& parts() const { return parts_; }
  const HostMemory& arena() const { return arena_; }

 private:
  TestEngine* engine_;
  SessionKey key_;
  std::vector<PartitionInfo> parts_;
  HostMemory arena_;
  bool hand_over_ = false;
  StatsFn give_;

  std::optional<GradStats> Given(size_t i, const float* g, uint64_t n) const {
    if (!give_) return std::nullopt;
    return give_(i, absl::MakeConstSpan(g, n));
  }
};

// The squared norm and non-finite count of `g`, summed in double in order
// (not the daemon's order: its kernels sum in vector lanes).
inline GradStats SerialStats(absl::Span<const float> g) {
  GradStats s;
  for (float v : g) {
    if (!std::isfinite(v)) ++s.nonfinite;
    s.sq_norm += static_cast<double>(v) * v;
  }
  return s;
}

// Master weights, exp_avg, exp_avg_sq and the gradient accumulator.
inline uint64_t StateBytes() {
  uint64_t total = 0;
  for (uint64_t n : kSizes) total += 4 * n * sizeof(float);
  return total;
}

// Parameters (bf16), gradients (fp32) and optimizer state.
inline uint64_t TotalBytes() {
  uint64_t total = StateBytes();
  for (uint64_t n : kSizes) total += n * (2 + 4);
  return total;
}

inline PlacementChange StateAt(int percent) {
  PlacementChange change;
  change[DataKind::kOptimizerState] = percent;
  return change;
}

inline std::string TmpDir(const std::string& name) {
  return std::string(getenv("TEST_TMPDIR")) + "/" + name;
}

// fp16 loss scaling in the daemon: an overflow on any rank (the trainer's
// global flag) skips the step, changes nothing and lowers the scale; the
// pending norm is the unscaled gradient's; clean steps unscale in the
// update's pass (the same bits as returning unscaled gradients).
inline void LossScalingSkipsOverflowsAndUnscales(const PlacementChange& placement,
                                                 const std::string& dir) {
  TestEngine engine(TmpDir(dir), 64 << 20);
  LossScalingOptions o;
  o.initial_scale = 1024;
  o.hysteresis = 1;
  o.growth_interval = 2;
  auto opened = engine.sessions->Open("fp16", placement, o);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const SessionKey key = opened->key;
  auto p = engine.sessions->Register(key, {"w", 3000, DType::kFp16, DType::kFp16});
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
  // The reference: the same partition in a session without loss scaling,
  // given the unscaled gradients.
  auto ref_opened = engine.sessions->Open("ref", placement);
  ASSERT_TRUE(ref_opened.ok());
  const SessionKey ref = ref_opened->key;
  auto rp = engine.sessions->Register(ref, {"w", 3000, DType::kFp16, DType::kFp16});
  ASSERT_TRUE(rp.ok());
  ASSERT_TRUE(engine.sessions->Release(ref, {rp->id}).ok());
  HostMemory arena = MapArena(engine, key), ref_arena = MapArena(engine, ref);
  auto put_to = [&](const SessionKey& k, const PartitionInfo& part, HostMemory& mem, float g) {
    ASSERT_TRUE(engine.sessions->Fetch(k, {part.id}, WithGrads()).ok());
    auto* grads = reinterpret_cast<uint16_t*>(mem.data() + part.grads.offset);
    for (uint64_t j = 0; j < part.numel; ++j) grads[j] = FloatToFp16(g);
    ASSERT_TRUE(engine.sessions->ReturnGradients(k, part.id, part.numel, DType::kFp16).ok());
    ASSERT_TRUE(engine.sessions->Release(k, {part.id}).ok());
  };
  auto put = [&](float g) { put_to(key, *p, arena, g); };
  auto params_of = [&](const SessionKey& k, const PartitionInfo& part, HostMemory& mem) {
    EXPECT_TRUE(engine.sessions->Fetch(k, {part.id}).ok());
    std::string out(reinterpret_cast<const char*>(mem.data() + part.params.offset),
                    part.params.bytes);
    EXPECT_TRUE(engine.sessions->Release(k, {part.id}).ok());
    return out;
  };
  auto params = [&] { return params_of(key, *p, arena); };
  const std::string before = params();
  put(0.5f * 1024);  // a scaled gradient of 0.5
  auto pending = engine.sessions->Pending(key);
  ASSERT_TRUE(pending.ok());
  EXPECT_EQ(pending->loss_scale, 1024);
  EXPECT_DOUBLE_EQ(pending->stats.sq_norm, 0.25 * 3000);  // unscaled
  // Another rank overflowed: skipped, nothing changes, the scale halves.
  auto skipped = engine.sessions->Step(key, AdamHyperparams{}, OverflowControl());
  ASSERT_TRUE(skipped.ok());
  EXPECT_TRUE(skipped->skipped);
  EXPECT_EQ(skipped->loss_scale, 512);
  EXPECT_EQ(params(), before);
  // An overflow here (fp16 inf) does the same without the trainer saying so.
  put(INFINITY);
  auto local = engine.sessions->Step(key, AdamHyperparams{});
  ASSERT_TRUE(local.ok());
  EXPECT_TRUE(local->skipped);
  EXPECT_EQ(local->loss_scale, 256);
  EXPECT_EQ(params(), before);
  // Two clean steps: updated with the gradient unscaled; then the scale grows.
  put(0.5f * 256);
  auto clean = engine.sessions->Step(key, AdamHyperparams{});
  ASSERT_TRUE(clean.ok());
  EXPECT_FALSE(clean->skipped);
  EXPECT_EQ(clean->loss_scale, 256);
  EXPECT_NE(params(), before);
  put_to(ref, *rp, ref_arena, 0.5f);
  ASSERT_TRUE(engine.sessions->Step(ref, AdamHyperparams{}).ok());
  EXPECT_EQ(params(), params_of(ref, *rp, ref_arena));
  put(0.5f * 256);
  EXPECT_EQ(engine.sessions->Step(key, AdamHyperparams{})->loss_scale, 512);
  put_to(ref, *rp, ref_arena, 0.5f);
  ASSERT_TRUE(engine.sessions->Step(ref, AdamHyperparams{}).ok());
  EXPECT_EQ(params(), params_of(ref, *rp, ref_arena));
  // Bad options are refused when the session opens.
  o.backoff_factor = 2;
  EXPECT_EQ(engine.sessions->Open("bad", All(100), o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace offload::trainer_testing

#endif  // OFFLOADD_ENGINE_TRAINER_TESTING_H_
