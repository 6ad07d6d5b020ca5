// The step runner and the step protocol: micro-batches, non-finite
// gradients, clipping across ranks, loss scaling, the overlapped step,
// param groups, the delayed update, gradients handed over and their
// statistics.
#include "engine/step_runner.h"

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

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/env.h"
#include "engine/partition_store.h"
#include "engine/session_manager.h"
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

// Starts an overlapped step of `key`'s session with `h` and returns once
// `gate` holds it (at its stopping point, midway).
void StartHeldStep(TestEngine& engine, const SessionKey& key, StepGate& gate,
                   const AdamHyperparams& h = {}) {
  StepControl overlap;
  overlap.overlap = true;
  ASSERT_TRUE(engine.sessions->Step(key, h, overlap).ok());
  gate.AwaitReached();
}

// Gradient accumulation: four micro-batches returned one after another
// train to the same bits as their sum returned once (added in fp32 in the
// same order, as torch accumulates .grad), with the data in memory and on
// NVMe; the pending norm is the same bits too, and is the sum's.
TEST(OutOfCore, FourMicroBatchesEqualOneBigBatch) {
  int dir = 0;
  for (const PlacementChange& placement : {All(100), All(0)}) {
    const bool on_nvme =
        !placement[DataKind::kParams].has_value() || *placement[DataKind::kParams] == 0;
    TestEngine engine(TmpDir("acc" + std::to_string(dir++)),
                      on_nvme ? RoundUpToPage(TotalBytes() / 2) : 64 << 20);
    Trainer micro(&engine, placement), big(&engine, placement);
    auto g = [](int step, int mb, size_t part, uint64_t j) {
      return 0.01f * std::sin(0.1f * static_cast<float>(j) + 1.3f * static_cast<float>(mb) +
                              0.7f * static_cast<float>(part) + static_cast<float>(step));
    };
    for (int step = 1; step <= 3; ++step) {
      for (int mb = 0; mb < 4; ++mb) {
        micro.ReturnGradientsOf([&](size_t part, uint64_t j) { return g(step, mb, part, j); });
      }
      big.ReturnGradientsOf([&](size_t part, uint64_t j) {
        float sum = g(step, 0, part, j);
        for (int mb = 1; mb < 4; ++mb) sum += g(step, mb, part, j);
        return sum;
      });
      auto pm = micro.Pending(), pb = big.Pending();
      ASSERT_TRUE(pm.ok() && pb.ok());
      EXPECT_EQ(pm->micro_batches, 4u);
      EXPECT_EQ(pb->micro_batches, 1u);
      EXPECT_EQ(pm->partitions, kSizes.size());
      EXPECT_EQ(pm->stats.sq_norm, pb->stats.sq_norm) << "step " << step;
      EXPECT_GT(pm->stats.sq_norm, 0.0);
      EXPECT_EQ(pm->stats.nonfinite, 0u);
      ASSERT_TRUE(micro.Step().ok());
      ASSERT_TRUE(big.Step().ok());
      ASSERT_EQ(micro.Params(), big.Params()) << "step " << step << (on_nvme ? " on NVMe" : "");
      auto after = micro.Pending();
      EXPECT_EQ(after->partitions, 0u);  // consumed
    }
  }
}

// `t`'s pending gradients count `nonfinite` non-finite values; its step
// skips, and its parameters stay `before`.
void ExpectPendingNonFiniteSkipTheStep(Trainer& t, uint64_t nonfinite, const std::string& before) {
  auto pending = t.Pending();
  ASSERT_TRUE(pending.ok());
  EXPECT_EQ(pending->stats.nonfinite, nonfinite);
  auto skipped = t.Step();
  ASSERT_TRUE(skipped.ok());
  EXPECT_TRUE(skipped->skipped);
  EXPECT_EQ(skipped->nonfinite, nonfinite);
  EXPECT_TRUE(t.Params() == before);
}

// A NaN in one micro-batch makes the accumulated gradient non-finite: the
// step is skipped and changes nothing; an explicit skip consumes the
// gradients too and changes nothing.
TEST(OutOfCore, NonFiniteMicroBatchesAndExplicitSkipsChangeNothing) {
  TestEngine engine(TmpDir("skip"), 64 << 20);
  Trainer t(&engine, All(100));
  const std::string before = t.Params();
  t.ReturnGradientsOf([](size_t, uint64_t j) { return 0.01f * static_cast<float>(j % 7); });
  t.ReturnGradientsOf(
      [](size_t part, uint64_t j) { return part == 1 && j == 5 ? std::nanf("") : 0.001f; });
  ExpectPendingNonFiniteSkipTheStep(t, 1, before);
  EXPECT_EQ(t.Pending()->partitions, 0u);
  t.ReturnGradientsOf([](size_t, uint64_t) { return 0.5f; });
  auto explicit_skip = engine.sessions->Step(t.key(), AdamHyperparams{}, SkipControl());
  ASSERT_TRUE(explicit_skip.ok());
  EXPECT_TRUE(explicit_skip->skipped);
  EXPECT_EQ(t.Params(), before);
  EXPECT_EQ(engine.sessions->Step(t.key(), AdamHyperparams{}).status().code(),
            absl::StatusCode::kFailedPrecondition);  // nothing left to step
  // Another rank overflowed: skipped here too, without loss scaling.
  t.ReturnGradientsOf([](size_t, uint64_t) { return 0.5f; });
  auto overflowed = engine.sessions->Step(t.key(), AdamHyperparams{}, OverflowControl());
  ASSERT_TRUE(overflowed.ok());
  EXPECT_TRUE(overflowed->skipped);
  EXPECT_TRUE(t.Params() == before);
  t.ReturnGradientsOf([](size_t, uint64_t) { return 0.5f; });
  ASSERT_TRUE(t.Step().ok());
  EXPECT_NE(t.Params(), before);
}

// Global clipping across ranks: two sessions report their pending squared
// norms, the "trainer" combines them as its collective would and commits
// both with clip_grad_norm_'s coefficient; each trains to the same bits as
// a reference that clipped its gradients before returning them (what
// torch.nn.utils.clip_grad_norm_ does in place), with the norm of the
// concatenated gradients.
TEST(OutOfCore, ClippingOverTwoRanksIsClipGradNormOfTheConcatenation) {
  TestEngine engine(TmpDir("clip"), 64 << 20), reference(TmpDir("clipref"), 64 << 20);
  Trainer a(&engine, All(0)), b(&engine, All(0));
  Trainer ra(&reference, All(100)), rb(&reference, All(100));
  auto grad = [](int rank, int step, size_t part, uint64_t j) {
    return 0.3f * std::cos(0.05f * static_cast<float>(j) + static_cast<float>(part + 3 * rank) +
                           0.5f * static_cast<float>(step));
  };
  const double max_norm = 1.0;
  for (int step = 1; step <= 3; ++step) {
    a.ReturnGradientsOf([&](size_t p, uint64_t j) { return grad(0, step, p, j); });
    b.ReturnGradientsOf([&](size_t p, uint64_t j) { return grad(1, step, p, j); });
    const double total = std::sqrt(a.Pending()->stats.sq_norm + b.Pending()->stats.sq_norm);
    // The same norm computed here over every gradient of both ranks.
    double sq = 0;
    for (int rank = 0; rank < 2; ++rank) {
      for (size_t p = 0; p < kSizes.size(); ++p) {
        for (uint64_t j = 0; j < kSizes[p]; ++j) {
          const double x = grad(rank, step, p, j);
          sq += x * x;
        }
      }
    }
    // fp32 lane sums, as torch's fp32 norms: within about 1e-6.
    EXPECT_NEAR(total, std::sqrt(sq), 1e-6 * std::sqrt(sq));
    ASSERT_GT(total, max_norm);  // so that clipping does something
    // clip_grad_norm_: coefficient max_norm / (total + 1e-6), at most 1,
    // multiplied into the gradients in fp32.
    const float coef = static_cast<float>(std::min(1.0, max_norm / (total + 1e-6)));
    AdamHyperparams h;
    h.lr = 1e-2;
    h.weight_decay = 0.01;
    h.grad_scale = coef;
    ASSERT_TRUE(engine.sessions->Step(a.key(), h).ok());
    ASSERT_TRUE(engine.sessions->Step(b.key(), h).ok());
    ra.ReturnGradientsOf([&](size_t p, uint64_t j) { return grad(0, step, p, j) * coef; });
    rb.ReturnGradientsOf([&](size_t p, uint64_t j) { return grad(1, step, p, j) * coef; });
    h.grad_scale = 1.0;
    ASSERT_TRUE(reference.sessions->Step(ra.key(), h).ok());
    ASSERT_TRUE(reference.sessions->Step(rb.key(), h).ok());
    ASSERT_EQ(a.Params(), ra.Params()) << "step " << step;
    ASSERT_EQ(b.Params(), rb.Params()) << "step " << step;
  }
}

TEST(OutOfCore, LossScalingSkipsOverflowsAndUnscales) {
  LossScalingSkipsOverflowsAndUnscales(All(100), "scale");
}

// The overlapped step: Step returns once decided; the next iteration's
// fetches proceed while the update runs, each waiting only for its own
// partition; the result is bit for bit that of synchronous steps, in
// memory and on NVMe.
TEST(OutOfCore, OverlappedStepsTrainLikeSynchronousOnes) {
  int dir = 0;
  for (const PlacementChange& placement : {All(100), All(0)}) {
    const bool on_nvme = *placement[DataKind::kParams] == 0;
    TestEngine sync_engine(TmpDir("ov" + std::to_string(dir++)), 64 << 20);
    TestEngine engine(TmpDir("ov" + std::to_string(dir++)),
                      on_nvme ? RoundUpToPage(TotalBytes() / 2) : 64 << 20);
    Trainer sync(&sync_engine, placement), overlapped(&engine, placement);
    for (int step = 1; step <= 4; ++step) {
      sync.ReturnGradients(step);
      overlapped.ReturnGradients(step);
      ASSERT_TRUE(sync.Step().ok());
      AdamHyperparams h;
      h.lr = 1e-2;
      h.weight_decay = 0.01;
      StepControl overlap;
      overlap.overlap = true;
      auto started = engine.sessions->Step(overlapped.key(), h, overlap);
      ASSERT_TRUE(started.ok()) << started.status();
      EXPECT_TRUE(started->running);
      // The next iteration's fetches (Params holds each in turn) see the
      // updated parameters.
      ASSERT_EQ(sync.Params(), overlapped.Params()) << "step " << step;
      auto outcome = engine.sessions->WaitStep(overlapped.key());
      ASSERT_TRUE(outcome.ok()) << outcome.status();
      EXPECT_FALSE(outcome->running);
      EXPECT_EQ(outcome->partitions_updated, kSizes.size());
    }
  }
}

TEST(OutOfCore, AFetchDuringAnOverlappedStepWaitsOnlyForItsOwnPartition) {
  // A small pool: groups of two chunks, so that the first partition (one
  // chunk, fetched first) is done after the first group.
  TestEngine engine(TmpDir("ovw"), 1 << 20);
  Trainer t(&engine, All(100));
  // This iteration fetches p2 (the smallest) first, then p0, then p1: the
  // step updates them in that order.
  const uint64_t first = t.parts()[2].id, last = t.parts()[0].id;
  for (size_t i : {2, 0, 1}) {
    const PartitionInfo& p = t.parts()[i];
    ASSERT_TRUE(engine.sessions->Fetch(t.key(), {p.id}, WithGrads()).ok());
    auto* g = reinterpret_cast<float*>(t.arena().data() + p.grads.offset);
    for (uint64_t j = 0; j < p.numel; ++j) g[j] = 0.001f * static_cast<float>(j % 13);
    ASSERT_TRUE(engine.sessions->ReturnGradients(t.key(), p.id, p.numel, DType::kFp32).ok());
    ASSERT_TRUE(engine.sessions->Release(t.key(), {p.id}).ok());
  }
  StepGate gate(engine);
  // The first group updated the partition fetched first: it is out of the
  // step, and fetching it does not wait; the last one is still in the step.
  auto outcome = OverlappedStepWhereOnlyThePendingFetchWaits(engine, t.key(), first, last, gate);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(outcome->partitions_updated, kSizes.size());
}

// Within one group of pinned chunks, each partition leaves the step as
// soon as its own update is done (one optimizer call per partition of at
// least a million values), not when the whole group is: a fetch of the
// first waits for nothing while the last is still to be updated.
TEST(OutOfCore, APartitionLeavesTheStepBeforeTheRestOfItsGroup) {
  TestEngine engine(TmpDir("run"), uint64_t{1} << 30);
  const uint64_t n = uint64_t{1} << 20;
  Trainer t(&engine, All(100), {n, n, n});
  t.ReturnGradients(1);  // fetched in order: the step updates p0, p1, p2
  const uint64_t first = t.parts()[0].id, last = t.parts()[2].id;
  StepGate gate(engine, StepPoint::kRunDone);
  auto outcome = OverlappedStepWhereOnlyThePendingFetchWaits(engine, t.key(), first, last, gate);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(outcome->partitions_updated, 3u);
  EXPECT_EQ(gate.count(StepPoint::kGroupPinned), 1);  // all three were pinned as one group
  EXPECT_EQ(gate.count(StepPoint::kRunDone), 3);
}

// Param groups: one step gives partition 1 its own lr and no weight decay,
// the others the step's; each trains to the bits of a session stepped with
// only its own hyperparameters.
TEST(OutOfCore, ParamGroupsGiveEachPartitionItsHyperparameters) {
  TestEngine engine(TmpDir("groups"), 64 << 20);
  Trainer grouped(&engine, StateAt(0)), base(&engine, All(100)), other(&engine, All(100));
  AdamHyperparams h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  AdamHyperparams no_decay = h;
  no_decay.lr = 3e-2;
  no_decay.weight_decay = 0;
  StepControl control;
  control.groups.push_back({{grouped.parts()[1].id}, no_decay});
  for (int step = 1; step <= 3; ++step) {
    for (Trainer* t : {&grouped, &base, &other}) t->ReturnGradients(step);
    ASSERT_TRUE(engine.sessions->Step(grouped.key(), h, control).ok());
    ASSERT_TRUE(engine.sessions->Step(base.key(), h).ok());
    ASSERT_TRUE(engine.sessions->Step(other.key(), no_decay).ok());
    EXPECT_EQ(grouped.PartitionBytes(0), base.PartitionBytes(0)) << step;
    EXPECT_EQ(grouped.PartitionBytes(1), other.PartitionBytes(1)) << step;
    EXPECT_NE(grouped.PartitionBytes(1), base.PartitionBytes(1)) << step;
    EXPECT_EQ(grouped.PartitionBytes(2), base.PartitionBytes(2)) << step;
  }
  // A partition in two groups, an unknown one, bad hyperparameters: refused,
  // nothing pinned or consumed.
  grouped.ReturnGradients(9);
  StepControl twice;
  twice.groups = {{{grouped.parts()[0].id}, h}, {{grouped.parts()[0].id}, h}};
  EXPECT_EQ(engine.sessions->Step(grouped.key(), h, twice).status().code(),
            absl::StatusCode::kInvalidArgument);
  StepControl unknown;
  unknown.groups = {{{base.parts()[0].id}, h}};
  EXPECT_EQ(engine.sessions->Step(grouped.key(), h, unknown).status().code(),
            absl::StatusCode::kNotFound);
  StepControl bad;
  AdamHyperparams negative = h;
  negative.lr = -1;
  bad.groups = {{{grouped.parts()[0].id}, negative}};
  EXPECT_EQ(engine.sessions->Step(grouped.key(), h, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(engine.sessions->Step(grouped.key(), h).ok());
}

// The delayed parameter update: with DPU on from the first step, the
// trainer's iteration i+1 reads the parameters of step i-1 (never a mix),
// and the sequence of parameters is bit for bit that of a reference that
// applies one-step-stale gradients (computed from the parameters read an
// iteration earlier); switching DPU off drains to the reference's newest
// parameters. In memory, and with everything on NVMe.
TEST(OutOfCore, DelayedUpdateIsExactlyOneStepStale) {
  int dir = 0;
  for (const PlacementChange& placement : {All(100), All(0)}) {
    const bool on_nvme = *placement[DataKind::kParams] == 0;
    TestEngine engine(TmpDir("dpu" + std::to_string(dir++)),
                      on_nvme ? RoundUpToPage(TotalBytes() / 2) : 64 << 20);
    Trainer dpu(&engine, placement), ref(&engine, placement);
    ASSERT_TRUE(engine.sessions->SetDelayedUpdate(dpu.key(), true).ok());
    // Gradients as a function of the parameters a trainer read.
    auto grads_from = [](const std::string& params) {
      return [params](size_t part, uint64_t j) {
        size_t at = 0;
        for (size_t q = 0; q < part; ++q) at += kSizes[q] * 2;
        uint16_t w;
        std::memcpy(&w, params.data() + at + j * 2, 2);
        return 0.05f * Bf16ToFloat(w) + 0.001f * static_cast<float>(j % 5);
      };
    };
    std::vector<std::string> dpu_reads, ref_reads;
    std::string ref_previous;
    for (int step = 1; step <= 5; ++step) {
      dpu_reads.push_back(dpu.Params());
      ref_reads.push_back(ref.Params());
      dpu.ReturnGradientsOf(grads_from(dpu_reads.back()));
      // The reference uses the parameters of the iteration before (the
      // first iteration: its own).
      ref.ReturnGradientsOf(grads_from(step == 1 ? ref_reads.back() : ref_previous));
      ref_previous = ref_reads.back();
      ASSERT_TRUE(dpu.Step().ok());
      ASSERT_TRUE(ref.Step().ok());
    }
    // Iteration k+1 of the DPU trainer saw what iteration k of the
    // reference saw: one step stale, exactly.
    // (EXPECT_TRUE on equality: a mismatch would print megabytes.)
    EXPECT_TRUE(dpu_reads[0] == ref_reads[0]);
    for (size_t k = 1; k + 1 < dpu_reads.size(); ++k) {
      EXPECT_TRUE(dpu_reads[k + 1] == ref_reads[k])
          << "iteration " << k + 2 << (on_nvme ? " on NVMe" : "");
    }
    for (size_t a = 0; a < dpu_reads.size(); ++a) {
      std::string row;
      for (size_t b = 0; b < ref_reads.size(); ++b) row += dpu_reads[a] == ref_reads[b] ? '1' : '.';
      std::printf("dpu read %zu vs ref reads: %s\n", a, row.c_str());
    }
    EXPECT_TRUE(dpu_reads[2] != dpu_reads[3]);  // it does move
    // Off: drains to the newest parameters, the reference's current ones.
    ASSERT_TRUE(engine.sessions->SetDelayedUpdate(dpu.key(), false).ok());
    EXPECT_TRUE(dpu.Params() == ref.Params());
  }
}

// With DPU and the overlapped step, fetches during the update are served
// at once with one whole version (the previous one), never a mix; the
// update's version appears whole at the next commit.
TEST(OutOfCore, DelayedUpdateFetchesDuringTheStepSeeOneWholeVersion) {
  TestEngine engine(TmpDir("dpuw"), 64 << 20);
  Trainer t(&engine, All(100));
  ASSERT_TRUE(engine.sessions->SetDelayedUpdate(t.key(), true).ok());
  t.ReturnGradients(1);
  ASSERT_TRUE(t.Step().ok());  // step 1: its version is pending
  const std::string v0 = t.Params();
  t.ReturnGradients(2);
  StepGate gate(engine);
  StartHeldStep(engine, t.key(), gate);  // step 2 is midway
  const int64_t waits = engine.stats.waits_for_step.load();
  const std::string during = t.Params();  // every partition, no waiting
  EXPECT_EQ(engine.stats.waits_for_step.load(), waits);
  EXPECT_TRUE(during != v0);  // step 1's version became current at this commit
  gate.Open();
  ASSERT_TRUE(engine.sessions->WaitStep(t.key()).ok());
  EXPECT_TRUE(t.Params() == during);  // step 2's version waits for the next commit
  // Holding a partition whose newer version must become current is refused.
  t.ReturnGradients(3);
  ASSERT_TRUE(engine.sessions->Fetch(t.key(), {t.parts()[0].id}).ok());
  EXPECT_EQ(t.Step().status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(engine.sessions->Release(t.key(), {t.parts()[0].id}).ok());
  EXPECT_TRUE(t.Step().ok());
}

// With DPU the next iteration's fetches do not wait for the update, but
// returning a partition's gradients waits until the update has consumed its
// accumulator; so the update runs in the order gradients came back (ZeRO-3's
// backward pass returns the last layer first), not in fetch order, which
// would make the first return of the backward pass wait for all of it.
TEST(OutOfCore, DelayedUpdateRunsInTheOrderGradientsCameBack) {
  // A small pool: groups of two chunks, so that p2 (one chunk) is done after
  // the first group if it comes first, and p0 (five) is not.
  TestEngine engine(TmpDir("dpuo"), 1 << 20);
  Trainer t(&engine, All(100));
  ASSERT_TRUE(engine.sessions->SetDelayedUpdate(t.key(), true).ok());
  auto give = [&](size_t i, bool fetch) {
    const PartitionInfo& p = t.parts()[i];
    if (fetch) {
      ASSERT_TRUE(engine.sessions->Fetch(t.key(), {p.id}, WithGrads()).ok());
    }
    auto* g = reinterpret_cast<float*>(t.arena().data() + p.grads.offset);
    for (uint64_t j = 0; j < p.numel; ++j) g[j] = 0.001f * static_cast<float>(j % 13);
    ASSERT_TRUE(engine.sessions->ReturnGradients(t.key(), p.id, p.numel, DType::kFp32).ok());
  };
  // Forward: fetched 0, 1, 2. Backward: gradients back 2, 0, 1.
  for (size_t i : {0, 1, 2}) {
    ASSERT_TRUE(engine.sessions->Fetch(t.key(), {t.parts()[i].id}, WithGrads()).ok());
  }
  for (size_t i : {2, 0, 1}) give(i, /*fetch=*/false);
  for (size_t i : {0, 1, 2}) ASSERT_TRUE(engine.sessions->Release(t.key(), {t.parts()[i].id}).ok());
  StepGate gate(engine);
  StartHeldStep(engine, t.key(), gate);
  // The partition returned first is updated first: the next iteration
  // returns its gradients without waiting.
  const int64_t waits = engine.stats.waits_for_step.load();
  give(2, /*fetch=*/true);
  EXPECT_EQ(engine.stats.waits_for_step.load(), waits);
  ASSERT_TRUE(engine.sessions->Release(t.key(), {t.parts()[2].id}).ok());
  // The one returned last is still in the update: fetching it does not wait
  // (DPU), returning its gradients does.
  std::thread returner([&] { give(1, /*fetch=*/true); });
  ASSERT_TRUE(AwaitAWaitForStep(engine, waits));
  gate.Open();
  returner.join();
  ASSERT_TRUE(engine.sessions->Release(t.key(), {t.parts()[1].id}).ok());
  auto outcome = engine.sessions->WaitStep(t.key());
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(outcome->partitions_updated, kSizes.size());
}

// Runs `body(engine, handing, other, where)` in memory and with everything
// on NVMe (four times the pool), each without and with the delayed update
// on both trainers; `handing` returns its gradients with hand_over.
template <typename Body>
void InEveryPlacementWithAndWithoutDelayedUpdate(const std::string& name, Body body) {
  int dir = 0;
  for (const PlacementChange& placement : {All(100), All(0)}) {
    const bool on_nvme = *placement[DataKind::kParams] == 0;
    for (bool dpu : {false, true}) {
      TestEngine engine(TmpDir(name + std::to_string(dir++)),
                        on_nvme ? RoundUpToPage(TotalBytes() / 2) : 64 << 20);
      Trainer handing(&engine, placement), other(&engine, placement);
      handing.HandOver(true);
      if (dpu) {
        for (Trainer* t : {&handing, &other}) {
          ASSERT_TRUE(engine.sessions->SetDelayedUpdate(t->key(), true).ok());
        }
      }
      body(engine, handing, other,
           absl::StrCat(on_nvme ? "on NVMe" : "in memory", dpu ? ", delayed update" : ""));
    }
  }
}

// Gradients handed over (the step reads them in the trainer's buffer, and
// the return only measures them) train bit for bit like accumulated ones:
// in memory and with everything on NVMe (the buffer swapped out and in
// between return and step), with synchronous steps and with the delayed
// update; the pending statistics are the same bits.
TEST(OutOfCore, HandedOverGradientsTrainBitForBitLikeAccumulatedOnes) {
  InEveryPlacementWithAndWithoutDelayedUpdate(
      "handover", [](TestEngine&, Trainer& handed, Trainer& kept, const std::string& where) {
        for (int step = 1; step <= 4; ++step) {
          handed.ReturnGradients(step);
          kept.ReturnGradients(step);
          auto a = handed.Pending(), b = kept.Pending();
          ASSERT_TRUE(a.ok() && b.ok());
          EXPECT_EQ(std::memcmp(&a->stats.sq_norm, &b->stats.sq_norm, sizeof(double)), 0)
              << where << " step " << step << ": " << a->stats.sq_norm << " vs " << b->stats.sq_norm
              << " over " << a->partitions << "/" << b->partitions;
          EXPECT_EQ(a->stats.nonfinite, b->stats.nonfinite);
          ASSERT_TRUE(handed.Step().ok()) << where;
          ASSERT_TRUE(kept.Step().ok()) << where;
          EXPECT_TRUE(handed.Params() == kept.Params()) << where << " step " << step;
        }
      });
}

// A gradient buffer handed over is the step's until the partition's update
// has read it. Before the step, fetching it with grads takes it back (its
// gradients go into the accumulator, and a further micro-batch adds to
// them), and a checkpoint takes the others back; during an overlapped step
// the fetch waits for that partition's update only.
TEST(OutOfCore, AHandedOverBufferIsTheStepsUntilItsUpdateReadsIt) {
  // Groups of two chunks (see AFetchDuringAnOverlappedStepWaitsOnlyForItsOwnPartition).
  TestEngine engine(TmpDir("handwait"), 1 << 20), ref_engine(TmpDir("handwait_ref"), 64 << 20);
  Trainer t(&engine, All(100)), ref(&ref_engine, All(100));
  // A second micro-batch for partition 0, written into its held buffer.
  auto second = [](TestEngine& e, Trainer& tr) {
    const PartitionInfo& p = tr.parts()[0];
    auto held = e.sessions->Fetch(tr.key(), {p.id}, WithGrads());
    ASSERT_TRUE(held.ok()) << held.status();
    auto* g = reinterpret_cast<float*>(tr.arena().data() + (*held)[0].grads.offset);
    for (uint64_t j = 0; j < p.numel; ++j) g[j] = 0.002f * static_cast<float>(j % 11);
    ASSERT_TRUE(e.sessions->ReturnGradients(tr.key(), p.id, p.numel, DType::kFp32).ok());
    ASSERT_TRUE(e.sessions->Release(tr.key(), {p.id}).ok());
  };
  t.HandOver(true);
  t.ReturnGradients(1);
  ref.ReturnGradients(1);
  second(engine, t);
  second(ref_engine, ref);
  auto a = t.Pending(), b = ref.Pending();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->micro_batches, 2u);
  EXPECT_EQ(std::memcmp(&a->stats.sq_norm, &b->stats.sq_norm, sizeof(double)), 0);
  auto checkpoint = engine.sessions->Checkpoint(t.key(), TmpDir("handwait_ckpt"), false);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
  ASSERT_TRUE(t.Step().ok());
  ASSERT_TRUE(ref.Step().ok());
  EXPECT_TRUE(t.Params() == ref.Params());

  // An overlapped step, stopped after its first group (partition 0's first
  // two chunks; partition 0 has five).
  t.ReturnGradients(2);
  ref.ReturnGradients(2);
  StepGate gate(engine);
  StartHeldStep(engine, t.key(), gate, Decaying());
  const PartitionInfo& p0 = t.parts()[0];
  const int64_t waits = engine.stats.waits_for_step.load();
  absl::StatusOr<std::vector<PartitionInfo>> waited;
  std::thread fetcher([&] { waited = engine.sessions->Fetch(t.key(), {p0.id}, WithGrads()); });
  ASSERT_TRUE(AwaitAWaitForStep(engine, waits));
  gate.Open();
  fetcher.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ((*waited)[0].step, 2u);
  ASSERT_TRUE(engine.sessions->Release(t.key(), {p0.id}).ok());
  ASSERT_TRUE(engine.sessions->WaitStep(t.key()).ok());
  ASSERT_TRUE(ref.Step().ok());
  EXPECT_TRUE(t.Params() == ref.Params());
}

// Handed-over gradients are measured in the background: the return does
// not wait for it; Pending (and so the trainer's clipping decision) and a
// fetch of the buffer (which then takes it back) do.
TEST(OutOfCore, HandedOverGradientsAreMeasuredAfterTheCallReturns) {
  TestEngine engine(TmpDir("handbg"), 64 << 20);
  Trainer t(&engine, All(100)), ref(&engine, All(100));
  absl::Notification measuring, go;
  engine.steps->SetSyncPointForTesting([&](StepPoint point) {
    if (point != StepPoint::kMeasuring || measuring.HasBeenNotified()) return;
    measuring.Notify();
    go.WaitForNotification();  // the first measurement waits here
  });
  t.HandOver(true);
  t.ReturnGradients(1);  // returns although no measurement has finished
  ref.ReturnGradients(1);
  measuring.WaitForNotification();
  std::atomic<bool> pending_done{false};
  absl::StatusOr<PendingGradients> pending;
  std::thread asker([&] {
    pending = t.Pending();
    pending_done = true;
  });
  const int64_t waits = engine.stats.waits_for_step.load();
  absl::StatusOr<std::vector<PartitionInfo>> fetched;
  std::thread fetcher(
      [&] { fetched = engine.sessions->Fetch(t.key(), {t.parts()[0].id}, WithGrads()); });
  ASSERT_TRUE(AwaitAWaitForStep(engine, waits));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(pending_done.load());
  go.Notify();
  asker.join();
  fetcher.join();
  engine.steps->SetSyncPointForTesting(nullptr);
  ASSERT_TRUE(pending.ok());
  auto want = ref.Pending();
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(pending->partitions, kSizes.size());
  EXPECT_EQ(std::memcmp(&pending->stats.sq_norm, &want->stats.sq_norm, sizeof(double)), 0);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  ASSERT_TRUE(engine.sessions->Release(t.key(), {t.parts()[0].id}).ok());
  ASSERT_TRUE(t.Step().ok());
  ASSERT_TRUE(ref.Step().ok());
  EXPECT_TRUE(t.Params() == ref.Params());
}

// A measurement in the background that finds the pool full (the handed-over
// buffer written out meanwhile, the pool pinned by others' holds) waits for
// room rather than lose the gradients: once the holds go, it measures, and
// the step is the one without a hand-over.
TEST(OutOfCore, AMeasurementThatFindsThePoolFullWaitsForRoom) {
  TestEngine engine(TmpDir("measureroom"), 4 << 20);
  PlacementChange grads_on_nvme = All(100);
  grads_on_nvme[DataKind::kGrads] = 0;
  Trainer t(&engine, grads_on_nvme), ref(&engine, All(100));
  absl::Notification measuring, go;
  engine.steps->SetSyncPointForTesting([&](StepPoint point) {
    if (point != StepPoint::kMeasuring || measuring.HasBeenNotified()) return;
    measuring.Notify();
    go.WaitForNotification();
  });
  t.HandOver(true);
  t.ReturnGradients(1);
  ref.ReturnGradients(1);
  measuring.WaitForNotification();
  // (An assertion failing below still lets the measurement go: the engine's
  // end waits for it.)
  auto let_go = absl::MakeCleanup([&] {
    if (!go.HasBeenNotified()) go.Notify();
  });
  // The pool filled with blocks of no session's, held: the handed-over
  // buffers (homed on NVMe, released) are written out to make room. They
  // go 300 ms after the measurement begins.
  constexpr uint64_t kFillerTrace = 1ull << 60;
  std::vector<Swapper::Pin> filler;
  uint64_t next_id = ~uint64_t{0};
  for (uint64_t bytes : {64 << 10, 4 << 10}) {  // (then the last pages)
    for (;;) {
      const uint64_t id = next_id--;
      const absl::Status added = engine.swapper->Add(id, bytes, Tier::kHost, kFillerTrace);
      if (!added.ok()) {
        ASSERT_TRUE(absl::IsResourceExhausted(added)) << added;
        break;
      }
      absl::StatusOr<Swapper::Pin> pin = engine.swapper->Acquire(id, /*for_write=*/true);
      if (!pin.ok()) {
        ASSERT_TRUE(absl::IsResourceExhausted(pin.status())) << pin.status();
        engine.swapper->Remove(id);
        break;
      }
      filler.push_back(*std::move(pin));
      ASSERT_LT(filler.size(), 2000u);
    }
  }
  std::thread releaser([&] {
    absl::SleepFor(absl::Milliseconds(300));
    filler.clear();
    for (uint64_t id = ~uint64_t{0}; id > next_id; --id) engine.swapper->Remove(id);
  });
  std::move(let_go).Invoke();
  absl::StatusOr<PendingGradients> pending = t.Pending();  // waits for the measurement
  releaser.join();
  engine.steps->SetSyncPointForTesting(nullptr);
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_EQ(pending->partitions, kSizes.size());
  ASSERT_TRUE(t.Step().ok());
  ASSERT_TRUE(ref.Step().ok());
  EXPECT_TRUE(t.Params() == ref.Params());
}

// The trainer's own statistics of handed-over buffers (computed where it
// made the gradients: on a GPU, before the copy to the host) are taken as
// measured: nothing measures the buffers, Pending adds up the given values,
// and the update reads the buffers as it reads measured ones, training bit
// for bit alike. In memory and on NVMe, with and without the delayed update.
TEST(OutOfCore, GradientStatsFromTheTrainerAreTakenAsMeasured) {
  InEveryPlacementWithAndWithoutDelayedUpdate(
      "given", [](TestEngine& engine, Trainer& given, Trainer& measured, const std::string& where) {
        std::vector<GradStats> gave(kSizes.size());
        given.GiveStats(
            [&gave](size_t i, absl::Span<const float> g) { return gave[i] = SerialStats(g); });
        measured.HandOver(true);
        std::atomic<int> measurings{0};
        engine.steps->SetSyncPointForTesting([&measurings](StepPoint point) {
          if (point == StepPoint::kMeasuring) ++measurings;
        });
        for (int step = 1; step <= 3; ++step) {
          measured.ReturnGradients(step);
          auto b = measured.Pending();  // after its measuring
          ASSERT_TRUE(b.ok());
          const int measurings_before = measurings.load();
          const int64_t given_before = engine.stats.gradient_stats_given.load();
          given.ReturnGradients(step);
          auto a = given.Pending();
          ASSERT_TRUE(a.ok());
          EXPECT_EQ(measurings.load(), measurings_before) << where;
          EXPECT_EQ(engine.stats.gradient_stats_given.load() - given_before,
                    static_cast<int64_t>(kSizes.size()))
              << where;
          EXPECT_EQ(a->partitions, kSizes.size());
          EXPECT_DOUBLE_EQ(a->stats.sq_norm, gave[0].sq_norm + gave[1].sq_norm + gave[2].sq_norm)
              << where;
          // The same gradients, summed in another order.
          EXPECT_NEAR(a->stats.sq_norm, b->stats.sq_norm, 1e-6 * b->stats.sq_norm) << where;
          EXPECT_EQ(a->stats.nonfinite, 0u);
          ASSERT_TRUE(given.Step().ok()) << where;
          ASSERT_TRUE(measured.Step().ok()) << where;
          EXPECT_TRUE(given.Params() == measured.Params()) << where << " step " << step;
        }
        engine.steps->SetSyncPointForTesting(nullptr);
      });
}

// What the trainer's statistics decide, and where they are not taken: a
// non-finite count skips the step (the buffers, all finite, are not read);
// statistics out of range, or without hand_over, are refused with
// INVALID_ARGUMENT and lose nothing; on a later micro-batch they are
// ignored and the daemon measures the sum it accumulates.
TEST(OutOfCore, GradientStatsFromTheTrainerAreCheckedAndDecideTheSkip) {
  TestEngine engine(TmpDir("given_checks"), 64 << 20);
  Trainer t(&engine, All(100));
  t.HandOver(true);
  const std::string before = t.Params();
  t.GiveStats([](size_t i, absl::Span<const float> g) {
    GradStats s = SerialStats(g);
    if (i == 1) s.nonfinite = 1;  // the trainer saw an overflow
    return s;
  });
  const int64_t given_before = engine.stats.gradient_stats_given.load();
  t.ReturnGradients(1);
  EXPECT_EQ(engine.stats.gradient_stats_given.load() - given_before,
            static_cast<int64_t>(kSizes.size()));
  ExpectPendingNonFiniteSkipTheStep(t, 1, before);

  const PartitionInfo& p = t.parts()[0];
  ASSERT_TRUE(engine.sessions->Fetch(t.key(), {p.id}, WithGrads()).ok());
  struct Bad {
    bool hand_over;
    GradStats stats;
  };
  for (const Bad& bad : {Bad{false, {1.0, 0}}, Bad{true, {-1.0, 0}}, Bad{true, {std::nan(""), 0}},
                         Bad{true, {1.0, p.numel + 1}}}) {
    const absl::Status s = engine.sessions->ReturnGradients(t.key(), p.id, p.numel, DType::kFp32,
                                                            bad.hand_over, bad.stats);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("partition " + std::to_string(p.id)), std::string::npos) << s;
  }
  EXPECT_EQ(t.Pending()->partitions, 0u);
  // Still held: returned again, with statistics in range (a NaN norm with
  // the non-finite values counted, as a sum over them gives), it is taken.
  ASSERT_TRUE(
      engine.sessions
          ->ReturnGradients(t.key(), p.id, p.numel, DType::kFp32, true, GradStats{std::nan(""), 2})
          .ok());
  ASSERT_TRUE(engine.sessions->Release(t.key(), {p.id}).ok());
  ExpectPendingNonFiniteSkipTheStep(t, 2, before);

  // Two micro-batches, both handed over with made-up statistics: the first
  // one's are taken, then the second's are ignored and the sum is measured,
  // bit for bit as for a trainer that returned both into the accumulator.
  Trainer two(&engine, All(100), {700}), ref(&engine, All(100), {700});
  two.HandOver(true);
  two.GiveStats([](size_t, absl::Span<const float>) { return GradStats{123.0, 0}; });
  auto micro = [](size_t, uint64_t j) { return 0.01f * static_cast<float>(j % 13) - 0.05f; };
  two.ReturnGradientsOf(micro);
  EXPECT_EQ(two.Pending()->stats.sq_norm, 123.0);
  // Taken back into the accumulator (a fetch with grads), they stay.
  const uint64_t only = two.parts()[0].id;
  ASSERT_TRUE(engine.sessions->Fetch(two.key(), {only}, WithGrads()).ok());
  ASSERT_TRUE(engine.sessions->Release(two.key(), {only}).ok());
  EXPECT_EQ(two.Pending()->stats.sq_norm, 123.0);
  two.ReturnGradientsOf(micro);
  ref.ReturnGradientsOf(micro);
  ref.ReturnGradientsOf(micro);
  auto a = two.Pending(), b = ref.Pending();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->micro_batches, 2u);
  EXPECT_EQ(std::memcmp(&a->stats.sq_norm, &b->stats.sq_norm, sizeof(double)), 0)
      << a->stats.sq_norm << " vs " << b->stats.sq_norm;
  ASSERT_TRUE(two.Step().ok());
  ASSERT_TRUE(ref.Step().ok());
  EXPECT_TRUE(two.Params() == ref.Params());
}

// A skipped step consumes handed-over gradients as it does accumulated
// ones: the parameters stay, and the next step sees only the next
// gradients.
TEST(OutOfCore, ASkippedStepConsumesHandedOverGradients) {
  TestEngine engine(TmpDir("handskip"), 64 << 20);
  Trainer t(&engine, All(100)), ref(&engine, All(100));
  t.HandOver(true);
  const std::string before = t.Params();
  t.ReturnGradients(1);
  ref.ReturnGradients(1);
  ASSERT_TRUE(engine.sessions->Step(t.key(), AdamHyperparams{}, SkipControl()).ok());
  ASSERT_TRUE(engine.sessions->Step(ref.key(), AdamHyperparams{}, SkipControl()).ok());
  EXPECT_TRUE(t.Params() == before);
  auto none = t.Pending();
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->micro_batches, 0u);
  EXPECT_EQ(none->partitions, 0u);
  t.ReturnGradients(2);
  ref.ReturnGradients(2);
  auto a = t.Pending(), b = ref.Pending();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(std::memcmp(&a->stats.sq_norm, &b->stats.sq_norm, sizeof(double)), 0)
      << a->stats.sq_norm << " vs " << b->stats.sq_norm;
  ASSERT_TRUE(t.Step().ok());
  ASSERT_TRUE(ref.Step().ok());
  EXPECT_TRUE(t.Params() != before);
  EXPECT_TRUE(t.Params() == ref.Params());
}

// With the delayed update, the next iteration's fetches of parameters do
// not wait for the update; but a handed-over gradient buffer is the
// update's until it has read it, so fetching it with grads waits for that
// partition's update.
TEST(OutOfCore, WithDelayedUpdateAFetchOfAHandedOverBufferWaitsForItsUpdate) {
  // Groups of two chunks: partition 0 (five chunks, returned first) is
  // midway after the first group.
  TestEngine engine(TmpDir("handdpu"), 1 << 20), ref_engine(TmpDir("handdpu_ref"), 64 << 20);
  Trainer t(&engine, All(100)), ref(&ref_engine, All(100));
  for (Trainer* tr : {&t, &ref}) {
    TestEngine& e = tr == &t ? engine : ref_engine;
    ASSERT_TRUE(e.sessions->SetDelayedUpdate(tr->key(), true).ok());
  }
  t.HandOver(true);
  t.ReturnGradients(1);
  ref.ReturnGradients(1);
  StepGate gate(engine);
  StartHeldStep(engine, t.key(), gate, Decaying());
  const PartitionInfo& p0 = t.parts()[0];
  const int64_t waits = engine.stats.waits_for_step.load();
  ASSERT_TRUE(engine.sessions->Fetch(t.key(), {p0.id}).ok());  // parameters: at once
  EXPECT_EQ(engine.stats.waits_for_step.load(), waits);
  ASSERT_TRUE(engine.sessions->Release(t.key(), {p0.id}).ok());
  // Asked only if ready (a GPU tier holding every buffer at once when the
  // step has read them all): refused at once, holding none of those asked.
  FetchMode if_ready = WithGrads();
  if_ready.if_ready = true;
  const uint64_t other = t.parts().back().id;
  auto refused = engine.sessions->Fetch(t.key(), {other, p0.id}, if_ready);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAborted) << refused.status();
  EXPECT_EQ(engine.stats.waits_for_step.load(), waits);
  EXPECT_EQ(engine.stats.grad_holds_not_ready.load(), 1);
  EXPECT_EQ(engine.sessions->Sessions()[0].held, 0u);
  absl::StatusOr<std::vector<PartitionInfo>> waited;
  std::thread fetcher([&] { waited = engine.sessions->Fetch(t.key(), {p0.id}, WithGrads()); });
  ASSERT_TRUE(AwaitAWaitForStep(engine, waits));
  gate.Open();
  fetcher.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  ASSERT_TRUE(engine.sessions->Release(t.key(), {p0.id}).ok());
  ASSERT_TRUE(engine.sessions->WaitStep(t.key()).ok());
  // Once the step has read them: held as without if_ready.
  auto ready = engine.sessions->Fetch(t.key(), {other, p0.id}, if_ready);
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_EQ(engine.stats.grad_holds_not_ready.load(), 1);
  ASSERT_TRUE(engine.sessions->Release(t.key(), {other, p0.id}).ok());
  ASSERT_TRUE(ref.Step().ok());
  // One more step makes step 1's version current on both.
  t.ReturnGradients(2);
  ref.ReturnGradients(2);
  ASSERT_TRUE(t.Step().ok());
  ASSERT_TRUE(ref.Step().ok());
  EXPECT_TRUE(t.Params() == ref.Params());
}

// Taking a handed-over buffer back (a fetch with grads before the step)
// that fails midway, on a swap-in of its gradients: the fetch fails with
// the read's error and holds nothing, the buffer stays handed over (the
// chunks already copied are overwritten by the next try), and the retry
// takes it back whole: the step equals one over the same gradients kept.
TEST(OutOfCore, AFailedReclaimKeepsTheBufferHandedOverAndTheRetryTakesItBack) {
  TestEngine in_memory(TmpDir("reclaim_ref"), 64 << 20);
  TestEngine small(TmpDir("reclaim"), RoundUpToPage(TotalBytes() / 4), /*prefetch_depth=*/0);
  Trainer ref(&in_memory, All(100)), t(&small, All(0));
  t.HandOver(true);
  t.ReturnGradients(1);
  ref.ReturnGradients(1);
  ASSERT_TRUE(t.Pending().ok());  // measured
  // Everything out of the pool's cache: to NVMe.
  const uint64_t limit = small.pool->limit();
  small.pool->SetLimit(4096);
  small.swapper->Trim();
  small.swapper->WaitIdle();
  small.pool->SetLimit(limit);
  const PartitionInfo& p0 = t.parts()[0];
  for (uint64_t c : {0, 1}) {
    ASSERT_EQ(small.swapper->State(PartitionStore::BlockOf(p0.id, c, PartitionStore::kGradsBlock))
                  .value(),
              BlockState::kOnNvme);
  }
  // The second chunk's gradients fail to come in (the first is copied).
  FaultRule eio;
  eio.any_op = false;
  eio.op = IoOp::kRead;
  eio.skip = 1;
  eio.error = EIO;
  small.faults->AddRule(eio);
  auto failed = small.sessions->Fetch(t.key(), {p0.id}, WithGrads());
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
  EXPECT_NE(failed.status().message().find("still handed over"), std::string::npos)
      << failed.status();
  small.faults->ClearRules();
  EXPECT_EQ(small.sessions->Sessions()[0].held, 0u);
  EXPECT_EQ(small.swapper->Stats().pinned_bytes, 0u);
  auto a = t.Pending(), b = ref.Pending();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(std::memcmp(&a->stats.sq_norm, &b->stats.sq_norm, sizeof(double)), 0);
  auto again = small.sessions->Fetch(t.key(), {p0.id}, WithGrads());
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(small.sessions->Release(t.key(), {p0.id}).ok());
  ASSERT_TRUE(t.Step().ok());
  ASSERT_TRUE(ref.Step().ok());
  EXPECT_TRUE(t.Params() == ref.Params());
}

// Handed-over gradients are measured in the background, beside the
// trainer's next fetches, at a different point every iteration: the
// learned order must not take that for a change (it would stop prefetch
// for every iteration: state on NVMe would be read on demand).
TEST(OutOfCore, MeasuringInTheBackgroundKeepsTheLearnedOrder) {
  TestEngine engine(TmpDir("handtrace"), RoundUpToPage(TotalBytes() / 2));
  Trainer t(&engine, All(0));
  SwapperStats before;
  for (int step = 1; step <= 6; ++step) {
    if (step == 3) before = engine.swapper->Stats();  // learned by now
    // This iteration's measurements start after partition step % 3 is
    // returned.
    absl::Notification go;
    engine.steps->SetSyncPointForTesting([&go](StepPoint point) {
      if (point == StepPoint::kMeasuring) go.WaitForNotification();
    });
    for (size_t i = 0; i < t.parts().size(); ++i) {
      const PartitionInfo& p = t.parts()[i];
      ASSERT_TRUE(engine.sessions->Fetch(t.key(), {p.id}, WithGrads()).ok());
      auto* g = reinterpret_cast<float*>(t.arena().data() + p.grads.offset);
      for (uint64_t j = 0; j < p.numel; ++j) g[j] = 0.001f * static_cast<float>((j + step) % 7);
      ASSERT_TRUE(
          engine.sessions->ReturnGradients(t.key(), p.id, p.numel, DType::kFp32, /*hand_over=*/true)
              .ok());
      ASSERT_TRUE(engine.sessions->Release(t.key(), {p.id}).ok());
      if (i == static_cast<size_t>(step % 3)) go.Notify();
    }
    ASSERT_TRUE(t.Pending().ok());  // every measurement done
    engine.steps->SetSyncPointForTesting(nullptr);
    ASSERT_TRUE(t.Step().ok());
    engine.swapper->WaitIdle();
  }
  const SwapperStats after = engine.swapper->Stats();
  EXPECT_EQ(after.relearned, before.relearned);
  EXPECT_GT(after.prefetches, before.prefetches);
}

// Stress: with DPU and overlapped steps, a reader fetching every partition
// over and over while each update runs always sees the one version made
// current at that step's commit, whole (data on NVMe, a small pool).
TEST(OutOfCore, DelayedUpdateFetchesRacingUpdatesNeverSeeAMix) {
  TestEngine engine(TmpDir("dpus"), RoundUpToPage(TotalBytes() / 2));
  Trainer t(&engine, All(0));
  ASSERT_TRUE(engine.sessions->SetDelayedUpdate(t.key(), true).ok());
  StepControl overlap;
  overlap.overlap = true;
  std::atomic<int> reads{0};
  for (int step = 1; step <= 8; ++step) {
    t.ReturnGradients(step);
    ASSERT_TRUE(engine.sessions->Step(t.key(), AdamHyperparams{}, overlap).ok());
    // The version current from this commit on, while the update runs.
    const std::string current = t.Params();
    std::atomic<bool> done{false};
    std::thread reader([&] {
      while (!done.load()) {
        ASSERT_TRUE(t.Params() == current) << "a mixed or newer version during step " << step;
        ++reads;
      }
    });
    ASSERT_TRUE(engine.sessions->WaitStep(t.key()).ok());
    done = true;
    reader.join();
    EXPECT_TRUE(t.Params() == current);  // the update's version waits for the next commit
  }
  EXPECT_GT(reads, 0);
}

}  // namespace
}  // namespace offload
