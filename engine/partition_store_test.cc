// The partition store: arenas laid out for huge pages, holds and their
// release, placement (shares, live changes racing registrations, no NVMe
// tier), two sessions in one pool, fp32 initial values.
#include "engine/partition_store.h"

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

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/env.h"
#include "checkpoint/format.h"
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

TEST(ArenaLayout, HugePagesOnlyWhereBlocksFillThemAndLittleIsWasted) {
  constexpr uint64_t kHuge = 2 << 20, kChunk = 1 << 20, kSmall = 4096;
  const DType bf16 = DType::kBf16, fp32 = DType::kFp32;
  EXPECT_EQ(ArenaLayoutPageBytes(2 * kChunk, bf16, bf16, false, kChunk, 0), kSmall);
  EXPECT_EQ(ArenaLayoutPageBytes(2 * kChunk, bf16, bf16, false, kChunk, kHuge), kHuge);
  EXPECT_EQ(ArenaLayoutPageBytes(2 * kChunk, bf16, fp32, true, kChunk, kHuge), kHuge);
  // 1 MiB blocks of bf16 would share huge pages.
  EXPECT_EQ(ArenaLayoutPageBytes(2 * kChunk, bf16, bf16, false, kChunk / 2, kHuge), kSmall);
  // 3 MiB regions rounded to 4 MiB waste a third; 17 MiB ones to 18, a 17th.
  EXPECT_EQ(ArenaLayoutPageBytes(3 * kChunk / 2, bf16, bf16, false, kChunk, kHuge), kSmall);
  EXPECT_EQ(ArenaLayoutPageBytes(8 * kChunk + kChunk / 2, bf16, bf16, false, kChunk, kHuge), kHuge);
  EXPECT_EQ(ArenaLayoutPageBytes(700, bf16, bf16, false, kChunk, kHuge), kSmall);
}

// A registration that finds no room in the pool to hold its parameters is
// undone whole, its arena span given back: retried while the trainer waits
// for room, it does not take new arena each time.
TEST(OutOfCore, ARegistrationWithoutRoomGivesItsArenaSpanBack) {
  TestEngine engine(TmpDir("register_room"), 1 << 20);
  auto opened = engine.sessions->Open("room", All(0));
  ASSERT_TRUE(opened.ok()) << opened.status();
  const SessionKey key = opened->key;
  constexpr uint64_t kN = 96 << 10;  // 384 KiB of fp32 parameters each
  std::vector<uint64_t> held;
  for (int i = 0; i < 2; ++i) {
    auto p =
        engine.sessions->Register(key, {"p" + std::to_string(i), kN, DType::kFp32, DType::kFp32});
    ASSERT_TRUE(p.ok()) << p.status();
    held.push_back(p->id);
  }
  const uint64_t arena = engine.sessions->Sessions()[0].arena_bytes;
  for (int attempt = 0; attempt < 3; ++attempt) {
    auto third = engine.sessions->Register(key, {"p2", kN, DType::kFp32, DType::kFp32});
    ASSERT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
    EXPECT_EQ(engine.sessions->Sessions()[0].arena_bytes, arena) << "attempt " << attempt;
  }
  ASSERT_TRUE(engine.sessions->Release(key, held).ok());
  auto third = engine.sessions->Register(key, {"p2", kN, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->span.offset, arena) << "where the failed ones would have gone";
  ASSERT_TRUE(engine.sessions->Release(key, {third->id}).ok());
}

// What the trainer holds stays in memory however hard the pool is pressed;
// what it releases leaves the arena; holding more than the pool can ever
// hold is RESOURCE_EXHAUSTED with the numbers, and holds nothing.
TEST(OutOfCore, HeldPartitionsStayAndReleasedOnesLeave) {
  TestEngine in_memory(TmpDir("j"), 64 << 20);
  Trainer reference(&in_memory, All(100));
  TestEngine small(TmpDir("k"), RoundUpToPage(TotalBytes() / 4));
  Trainer t(&small, All(0));
  const std::string before = reference.Params();
  ASSERT_EQ(t.Params(), before);
  const PartitionInfo& held = t.parts()[2];
  ASSERT_TRUE(small.sessions->Fetch(t.key(), {held.id}).ok());
  const std::string held_bytes(reinterpret_cast<const char*>(t.arena().data() + held.params.offset),
                               held.params.bytes);
  // Press the pool: a full step's worth of every other block.
  for (int step = 1; step <= 2; ++step) {
    reference.ReturnGradients(step);
    t.ReturnGradients(step, /*keep=*/held.id);
    ASSERT_TRUE(reference.Step().ok());
    ASSERT_TRUE(t.Step().ok());
    // The held parameters changed only in the step, in place, like the
    // reference's; they never left (read through the trainer's mapping).
    EXPECT_EQ(
        small.swapper->State(PartitionStore::BlockOf(held.id, 0, PartitionStore::kParamsBlock))
            .value(),
        BlockState::kResident);
  }
  EXPECT_NE(std::string(reinterpret_cast<const char*>(t.arena().data() + held.params.offset),
                        held.params.bytes),
            held_bytes);
  ASSERT_EQ(t.Params(/*keep=*/held.id), reference.Params());
  ASSERT_TRUE(small.sessions->Release(t.key(), {held.id}).ok());
  // Everything released: at most the pool's worth of the arena has pages.
  small.swapper->WaitIdle();
  struct stat st;
  auto fd = small.sessions->DupArenaFd(t.key());
  ASSERT_EQ(fstat(fd->get(), &st), 0);
  EXPECT_LE(static_cast<uint64_t>(st.st_blocks) * 512, small.pool->limit());
  // All three partitions at once need more than the pool.
  auto all = small.sessions->Fetch(t.key(), {}, WithGrads());
  EXPECT_EQ(all.status().code(), absl::StatusCode::kResourceExhausted) << all.status();
  EXPECT_NE(all.status().message().find("held by callers"), std::string::npos) << all.status();
  EXPECT_EQ(small.sessions->Sessions()[0].held, 0u);
  EXPECT_EQ(small.swapper->Stats().pinned_bytes, 0u);
}

// A trainer that dies (its session abandoned) releases what it held: the
// pool it filled serves the next trainer.
TEST(OutOfCore, ATrainerThatDiesReleasesWhatItHeld) {
  TestEngine small(TmpDir("l"), RoundUpToPage(TotalBytes() / 4));
  Trainer greedy(&small, All(0));
  Trainer next(&small, All(0));
  // `greedy` holds its biggest partition's parameters and gradients.
  ASSERT_TRUE(small.sessions->Fetch(greedy.key(), {greedy.parts()[0].id}, WithGrads()).ok());
  const uint64_t pinned = small.swapper->Stats().pinned_bytes;
  EXPECT_GE(pinned, kSizes[0] * (2 + 4));
  EXPECT_TRUE(small.sessions->Abandon(greedy.key().id));
  EXPECT_EQ(small.swapper->Stats().pinned_bytes, 0u);
  EXPECT_TRUE(small.sessions->Fetch(next.key(), {next.parts()[0].id}, WithGrads()).ok());
}

// Moving the session's optimizer state to NVMe is refused with "nothing
// moved", and nothing did: its figures as before, the tier holding none.
void ExpectStateStaysOnTheHost(TestEngine& engine, const SessionKey& key) {
  const auto before = engine.sessions->Sessions()[0];
  const absl::Status moved = engine.sessions->SetPlacement(key, StateAt(0));
  EXPECT_EQ(moved.code(), absl::StatusCode::kResourceExhausted) << moved;
  EXPECT_TRUE(absl::StrContains(moved.message(), "nothing moved")) << moved;
  const auto after = engine.sessions->Sessions()[0];
  const int state = static_cast<int>(DataKind::kOptimizerState);
  EXPECT_EQ(after.host_bytes[state], before.host_bytes[state]);
  EXPECT_EQ(after.nvme_bytes[state], 0u);
  EXPECT_EQ(engine.swapper->Stats().nvme_home_bytes, 0u);
}

// Placing on NVMe more than its tier holds (64 MiB here) is refused before
// anything moves; registering state there past it is refused too.
TEST(OutOfCore, PlacingMoreOnNvmeThanTheTierHoldsChangesNothing) {
  TestEngine engine(TmpDir("room"), 256 << 20);
  auto opened = engine.sessions->Open("room", All(100));
  ASSERT_TRUE(opened.ok());
  const SessionKey key = opened->key;
  for (int i = 0; i < 9; ++i) {  // 108 MiB of master, m and v in all
    auto p = engine.sessions->Register(
        key, {"p" + std::to_string(i), 1 << 20, DType::kBf16, DType::kBf16});
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
  }
  ExpectStateStaysOnTheHost(engine, key);
  // A share that fits moves.
  const absl::Status half = engine.sessions->SetPlacement(key, StateAt(50));
  EXPECT_TRUE(half.ok()) << half;
  // A new session with its state on NVMe: refused past the tier's room.
  auto nvme = engine.sessions->Open("nvme", StateAt(0));
  ASSERT_TRUE(nvme.ok());
  auto big = engine.sessions->Register(nvme->key, {"big", 2 << 20, DType::kBf16, DType::kBf16});
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
}

// A move to NVMe that fails part way (the estimate leaves out the
// gradient accumulator, here made by returned gradients: master, m and v
// fit the 64 MiB tier, the accumulator does not) puts every block back:
// the session's homes and figures are as before, the tier holds nothing of
// it, and it trains on.
TEST(OutOfCore, APlacementThatFailsPartWayMovesNothing) {
  TestEngine engine(TmpDir("part_way"), 256 << 20);
  auto opened = engine.sessions->Open("part_way", All(100));
  ASSERT_TRUE(opened.ok());
  const SessionKey key = opened->key;
  constexpr uint64_t kNumel = 5 << 20;  // 60 MiB of master, m and v; 80 with the accumulator
  auto p = engine.sessions->Register(key, {"w", kNumel, DType::kBf16, DType::kBf16});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(engine.sessions->Fetch(key, {p->id}, WithGrads()).ok());
  ASSERT_TRUE(engine.sessions->ReturnGradients(key, p->id, kNumel, DType::kBf16).ok());
  ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
  ExpectStateStaysOnTheHost(engine, key);
  EXPECT_TRUE(engine.sessions->Step(key, AdamHyperparams{}).ok());
}

TEST(OutOfCore, FractionalPlacementKeepsThatShareOnTheHost) {
  TestEngine engine(TmpDir("c"), 64 << 20);
  Trainer quarter(&engine, StateAt(25));
  auto sessions = engine.sessions->Sessions();
  ASSERT_EQ(sessions.size(), 1u);
  const int state = static_cast<int>(DataKind::kOptimizerState);
  const double host = static_cast<double>(sessions[0].host_bytes[state]);
  const double total = host + static_cast<double>(sessions[0].nvme_bytes[state]);
  EXPECT_EQ(total, static_cast<double>(StateBytes()));
  // Whole partitions go one way or the other, never above the share.
  EXPECT_LE(host / total, 0.25);
  EXPECT_GT(host, 0.0);  // the smallest partitions fit under it
}

// Two sessions whose state is on NVMe share one small pool, stepping at the
// same time from two threads: each trains bit-for-bit like its own copy with
// state in memory (their traces are separate; eviction weighs both).
TEST(OutOfCore, TwoSessionsShareASmallPool) {
  TestEngine in_memory(TmpDir("h"), 64 << 20);
  Trainer ref_a(&in_memory, All(100)), ref_b(&in_memory, All(100));
  TestEngine shared(TmpDir("i"), RoundUpToPage(2 * TotalBytes() / 4));
  Trainer a(&shared, All(0)), b(&shared, All(0));
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

// Registrations and placement changes racing from two threads: each sees
// the other whole, so that at the end every partition's blocks rest where
// the final placement puts them, and the per-kind byte counts add up.
TEST(OutOfCore, PlacementChangesRacingRegistrationsEndConsistent) {
  TestEngine engine(TmpDir("n"), 64 << 20);
  auto opened = engine.sessions->Open("race", All(100));
  ASSERT_TRUE(opened.ok());
  const SessionKey key = opened->key;
  constexpr int kParts = 40;
  std::vector<PartitionInfo> parts(kParts);
  std::thread registrar([&] {
    for (int i = 0; i < kParts; ++i) {
      auto p = engine.sessions->Register(
          key,
          {"p" + std::to_string(i), 3000 + 1000 * uint64_t(i % 5), DType::kBf16, DType::kFp32});
      ASSERT_TRUE(p.ok()) << p.status();
      parts[i] = *p;
      ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
    }
  });
  for (int round = 0; round < 60; ++round) {
    ASSERT_TRUE(engine.sessions->SetPlacement(key, All(round % 2 == 0 ? 0 : 100)).ok());
  }
  registrar.join();
  PlacementChange final_placement;
  final_placement[DataKind::kParams] = 30;
  final_placement[DataKind::kGrads] = 0;
  final_placement[DataKind::kOptimizerState] = 60;
  ASSERT_TRUE(engine.sessions->SetPlacement(key, final_placement).ok());
  engine.swapper->WaitIdle();
  // Recompute each kind's homes greedily in registration order, as the
  // store does, and compare with what the swapper says.
  const uint64_t elem_bytes[kDataKinds] = {2, 4, 16};
  const int blocks_of[kDataKinds][3] = {
      {PartitionStore::kParamsBlock, -1, -1},
      {PartitionStore::kGradsBlock, -1, -1},
      {PartitionStore::kMaster, PartitionStore::kExpAvg, PartitionStore::kExpAvgSq}};
  const auto sessions = engine.sessions->Sessions();
  ASSERT_EQ(sessions.size(), 1u);
  for (int k = 0; k < kDataKinds; ++k) {
    const int percent = *final_placement.host_percent[k];
    uint64_t host = 0, total = 0;
    for (const PartitionInfo& p : parts) {
      const uint64_t add = p.numel * elem_bytes[k];
      const bool on_host = (host + add) * 100 <= static_cast<uint64_t>(percent) * (total + add);
      total += add;
      if (on_host) host += add;
      for (int b : blocks_of[k]) {
        if (b < 0) continue;
        auto home = engine.swapper->Home(PartitionStore::BlockOf(p.id, 0, b));
        ASSERT_TRUE(home.ok());
        EXPECT_EQ(*home, on_host ? Tier::kHost : Tier::kNvme) << "kind " << k << " " << p.name;
      }
    }
    EXPECT_EQ(sessions[0].host_bytes[k], host) << "kind " << k;
    EXPECT_EQ(sessions[0].nvme_bytes[k], total - host) << "kind " << k;
  }
}

// fp32 master weights from the start: a bf16 partition registered with its
// exact fp32 initial values steps from them, not from their bf16 rounding
// (checked against the optimizer run directly on the fp32 values), with the
// master on NVMe; the release derives the working copy.
TEST(OutOfCore, Fp32InitialValuesBecomeTheMasterWeights) {
  TestEngine engine(TmpDir("fp32"), 64 << 20);
  auto opened = engine.sessions->Open("fp32", StateAt(0));
  ASSERT_TRUE(opened.ok());
  const SessionKey key = opened->key;
  constexpr uint64_t kN = 3 * kChunkElems + 17;  // several chunks, the last partial
  PartitionSpec spec{"w", kN, DType::kBf16, DType::kBf16};
  spec.fp32_master = true;
  auto p = engine.sessions->Register(key, spec);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->master_init.bytes, kN * 4);
  HostMemory arena = MapArena(engine, key);
  std::vector<float> init(kN), grads(kN);
  for (uint64_t j = 0; j < kN; ++j) {
    init[j] = 1.0f + 1e-4f * static_cast<float>(j % 97);  // not representable in bf16
    grads[j] = 0.01f * std::sin(static_cast<float>(j));
  }
  std::memcpy(arena.data() + p->master_init.offset, init.data(), kN * 4);
  ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
  ASSERT_TRUE(engine.sessions->Fetch(key, {p->id}).ok());
  std::vector<uint16_t> want(kN);
  NarrowFromFloat(init.data(), DType::kBf16, want.data(), kN);
  ASSERT_EQ(std::memcmp(arena.data() + p->params.offset, want.data(), kN * 2), 0);
  auto again = engine.sessions->Fetch(key, {p->id}, WithGrads());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)[0].master_init.bytes, 0u);  // committed
  std::vector<uint16_t> g16(kN);
  NarrowFromFloat(grads.data(), DType::kBf16, g16.data(), kN);
  std::memcpy(arena.data() + p->grads.offset, g16.data(), kN * 2);
  ASSERT_TRUE(engine.sessions->ReturnGradients(key, p->id, kN, DType::kBf16).ok());
  ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
  AdamHyperparams h;
  h.lr = 1e-3;
  ASSERT_TRUE(engine.sessions->Step(key, h).ok());
  // The reference: the optimizer over master = the fp32 values.
  std::vector<float> master = init, m(kN, 0.f), v(kN, 0.f), acc(kN);
  WidenToFloat(g16.data(), DType::kBf16, acc.data(), kN);
  std::vector<uint16_t> working(kN);
  Optimizer optimizer{OptimizerOptions{}};
  AdamTask task;
  task.span = {master.data(), m.data(),       v.data(),     acc.data(),
               DType::kFp32,  working.data(), DType::kBf16, kN};
  task.step = 1;
  ASSERT_TRUE(optimizer.Step(absl::MakeConstSpan(&task, 1), h).ok());
  ASSERT_TRUE(engine.sessions->Fetch(key, {p->id}).ok());
  EXPECT_EQ(std::memcmp(arena.data() + p->params.offset, working.data(), kN * 2), 0);
  // Starting from the rounded values instead gives other bits.
  std::vector<float> rounded(kN), m2(kN, 0.f), v2(kN, 0.f);
  WidenToFloat(want.data(), DType::kBf16, rounded.data(), kN);
  std::vector<uint16_t> working2(kN);
  task.span = {rounded.data(), m2.data(),       v2.data(),    acc.data(),
               DType::kFp32,   working2.data(), DType::kBf16, kN};
  ASSERT_TRUE(optimizer.Step(absl::MakeConstSpan(&task, 1), h).ok());
  EXPECT_NE(working, working2);
  // Stepping a partition whose fp32 values are not committed is refused.
  PartitionSpec u{"u", 100, DType::kBf16, DType::kBf16};
  u.fp32_master = true;
  auto pu = engine.sessions->Register(key, u);
  ASSERT_TRUE(pu.ok());
  ASSERT_TRUE(engine.sessions->Fetch(key, {pu->id}, WithGrads()).ok());
  ASSERT_TRUE(engine.sessions->ReturnGradients(key, pu->id, 100, DType::kBf16).ok());
  auto refused = engine.sessions->Step(key, h);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("'u'"), std::string::npos) << refused.status();
  ASSERT_TRUE(engine.sessions->Release(key, {pu->id}).ok());
  EXPECT_TRUE(engine.sessions->Step(key, h).ok());
}

// A load (torch's load_state_dict): the values written become the master
// weights, fp32 exactly where the working copy is bf16 (through the fp32
// initial values' region) and from the working copy where it is fp32; the
// moments and the step count stay; refused with the delayed update on.
// Holds partition `p`'s gradient buffer, writes `g` (fp32) into it,
// returns and releases it, and steps the session.
void StepWithGradients(TestEngine& engine, const SessionKey& key, const PartitionInfo& p,
                       HostMemory& arena, const std::vector<float>& g) {
  ASSERT_TRUE(engine.sessions->Fetch(key, {p.id}, WithGrads()).ok());
  std::memcpy(arena.data() + p.grads.offset, g.data(), g.size() * sizeof(float));
  ASSERT_TRUE(engine.sessions->ReturnGradients(key, p.id, g.size(), DType::kFp32).ok());
  ASSERT_TRUE(engine.sessions->Release(key, {p.id}).ok());
  ASSERT_TRUE(engine.sessions->Step(key, AdamHyperparams{}).ok());
}

// A session's learned access order goes with the session (one kept per
// session ever served added up on a long-running daemon).
TEST(OutOfCore, AClosedSessionsAccessOrderGoes) {
  TestEngine engine(TmpDir("traces"), 64 << 20);
  const uint64_t before = engine.swapper->Stats().traces;
  auto opened = engine.sessions->Open("traced", StateAt(0));
  ASSERT_TRUE(opened.ok()) << opened.status();
  auto p =
      engine.sessions->Register(opened->key, {"w", 3 * kChunkElems, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(engine.swapper->Stats().traces, before + 1);
  ASSERT_TRUE(engine.sessions->Close(opened->key).ok());
  EXPECT_EQ(engine.swapper->Stats().traces, before);
}

// optimizer.state_dict() and load_state_dict(): the moments and the step
// count read and written wherever they rest, and a step after a write
// continues from them.
TEST(OutOfCore, MomentsAreReadAndWrittenWhereverTheyRest) {
  for (int host_percent : {100, 0}) {
    SCOPED_TRACE(absl::StrCat("optimizer state ", host_percent, "% on the host"));
    TestEngine engine(TmpDir(absl::StrCat("moments", host_percent)), 64 << 20);
    auto opened = engine.sessions->Open("moments", StateAt(host_percent));
    ASSERT_TRUE(opened.ok()) << opened.status();
    const SessionKey key = opened->key;
    constexpr uint64_t kN = 2 * kChunkElems + 5;
    HostMemory arena = MapArena(engine, key);
    auto p = engine.sessions->Register(key, PartitionSpec{"w", kN, DType::kFp32, DType::kFp32});
    ASSERT_TRUE(p.ok()) << p.status();
    std::vector<float> init(kN), g1(kN), g2(kN);
    for (uint64_t j = 0; j < kN; ++j) {
      init[j] = 0.5f + 1e-3f * static_cast<float>(j % 101);
      g1[j] = 0.01f * std::sin(static_cast<float>(j));
      g2[j] = 0.02f * std::cos(static_cast<float>(j));
    }
    std::memcpy(arena.data() + p->params.offset, init.data(), kN * 4);
    ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
    auto step = [&](const std::vector<float>& g) { StepWithGradients(engine, key, *p, arena, g); };
    // Before any step: step 0, zeros.
    std::vector<float> m(kN, -1.f), v(kN, -1.f);
    std::vector<float> before(kN, -1.f);
    auto read = engine.sessions->ReadMoments(key, p->id, 0, kN, m.data(), v.data(), before.data());
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, 0u);
    EXPECT_EQ(m, std::vector<float>(kN, 0.f));
    EXPECT_EQ(before, init) << "never stepped: the master weights are the working copy";
    step(g1);
    // The reference optimizer's step 1.
    std::vector<float> master = init, rm(kN, 0.f), rv(kN, 0.f), out(kN);
    Optimizer optimizer{OptimizerOptions{}};
    AdamTask task;
    task.span = {master.data(), rm.data(),  rv.data(),    g1.data(),
                 DType::kFp32,  out.data(), DType::kFp32, kN};
    task.step = 1;
    ASSERT_TRUE(optimizer.Step(absl::MakeConstSpan(&task, 1), AdamHyperparams{}).ok());
    std::vector<float> masters(kN, -1.f);
    read = engine.sessions->ReadMoments(key, p->id, 0, kN, m.data(), v.data(), masters.data());
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, 1u);
    EXPECT_EQ(m, rm);
    EXPECT_EQ(v, rv);
    EXPECT_EQ(masters, master) << "the fp32 master weights, read with the moments";
    // A window across a chunk boundary, then the rest: written, read back.
    std::vector<float> wm(kN), wv(kN);
    for (uint64_t j = 0; j < kN; ++j) {
      wm[j] = 1e-3f * static_cast<float>(j % 7) - 2e-3f;
      wv[j] = 1e-6f * static_cast<float>(j % 13 + 1);
    }
    const uint64_t cut = kChunkElems - 3;
    ASSERT_TRUE(engine.sessions->WriteMoments(key, p->id, 7, 0, cut, wm.data(), wv.data()).ok());
    ASSERT_TRUE(engine.sessions
                    ->WriteMoments(key, p->id, 7, cut, kN - cut, wm.data() + cut, wv.data() + cut)
                    .ok());
    std::vector<float> tail_m(10), tail_v(10);
    read = engine.sessions->ReadMoments(key, p->id, cut - 5, 10, tail_m.data(), tail_v.data());
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, 7u);
    EXPECT_EQ(tail_m, std::vector<float>(wm.begin() + cut - 5, wm.begin() + cut + 5));
    EXPECT_EQ(tail_v, std::vector<float>(wv.begin() + cut - 5, wv.begin() + cut + 5));
    // The next step goes on from them: step 8 with the written moments.
    step(g2);
    rm = wm;
    rv = wv;
    task.span.grads = g2.data();
    task.step = 8;
    ASSERT_TRUE(optimizer.Step(absl::MakeConstSpan(&task, 1), AdamHyperparams{}).ok());
    ASSERT_TRUE(engine.sessions->Fetch(key, {p->id}).ok());
    EXPECT_EQ(std::memcmp(arena.data() + p->params.offset, out.data(), kN * 4), 0);
    ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
    // Out of range, another's partition, the delayed update: refused.
    EXPECT_EQ(
        engine.sessions->ReadMoments(key, p->id, kN - 1, 2, m.data(), v.data()).status().code(),
        absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(
        engine.sessions->ReadMoments(key, p->id + 999, 0, 1, m.data(), v.data()).status().code(),
        absl::StatusCode::kNotFound);
    // Moments no step can take (a NaN, a negative second moment, a step
    // with no next): refused, nothing written.
    std::vector<float> before_m(kN), before_v(kN);
    ASSERT_TRUE(
        engine.sessions->ReadMoments(key, p->id, 0, kN, before_m.data(), before_v.data()).ok());
    std::vector<float> nan_m(wm), negative_v(wv);
    nan_m[3] = NAN;
    negative_v[3] = -1.0f;
    EXPECT_EQ(engine.sessions->WriteMoments(key, p->id, 1, 0, kN, nan_m.data(), wv.data()).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(
        engine.sessions->WriteMoments(key, p->id, 1, 0, kN, wm.data(), negative_v.data()).code(),
        absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(
        engine.sessions->WriteMoments(key, p->id, ~uint64_t{0}, 0, 1, wm.data(), wv.data()).code(),
        absl::StatusCode::kInvalidArgument);
    std::vector<float> after_m(kN), after_v(kN);
    ASSERT_TRUE(
        engine.sessions->ReadMoments(key, p->id, 0, kN, after_m.data(), after_v.data()).ok());
    EXPECT_EQ(before_m, after_m);
    EXPECT_EQ(before_v, after_v);
    ASSERT_TRUE(engine.sessions->SetDelayedUpdate(key, true).ok());
    EXPECT_EQ(engine.sessions->WriteMoments(key, p->id, 1, 0, 1, wm.data(), wv.data()).code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

// A checkpoint begun while moments are being written (optimizer
// load_state_dict) waits for the write: its image is the moments written
// and the step count given, never half of them under the step before.
TEST(OutOfCore, ACheckpointWaitsForAMomentsWriteUnderWay) {
  TestEngine engine(TmpDir("moments_race"), 64 << 20, /*prefetch_depth=*/0);
  auto opened = engine.sessions->Open("moments_race", StateAt(0));
  ASSERT_TRUE(opened.ok()) << opened.status();
  const SessionKey key = opened->key;
  constexpr uint64_t kN = kChunkElems;
  HostMemory arena = MapArena(engine, key);
  auto p = engine.sessions->Register(key, PartitionSpec{"w", kN, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
  StepWithGradients(engine, key, *p, arena, std::vector<float>(kN, 0.01f));
  // Its optimizer state out of memory: writing the moments reads them in.
  engine.pool->SetLimit(0);
  engine.swapper->Trim();
  engine.swapper->WaitIdle();
  engine.pool->SetLimit(64 << 20);
  absl::Notification reading, go_on;
  engine.swapper->SetIoHookForTesting([&](Swapper::BlockId, bool is_write) {
    if (is_write || reading.HasBeenNotified()) return;
    reading.Notify();
    go_on.WaitForNotification();
  });
  const std::vector<float> wm(kN, 0.25f), wv(kN, 0.5f);
  std::thread writer([&] {
    EXPECT_TRUE(engine.sessions->WriteMoments(key, p->id, 7, 0, kN, wm.data(), wv.data()).ok());
  });
  reading.WaitForNotification();  // the write is under way, held in its read
  std::atomic<bool> begun{false};
  const std::string dir = TmpDir("moments_race_checkpoint");
  std::thread checkpointer([&] {
    EXPECT_TRUE(engine.sessions->Checkpoint(key, dir, /*background=*/true).ok());
    begun = true;
  });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(begun.load());  // waits for the write
  go_on.Notify();
  writer.join();
  checkpointer.join();
  ASSERT_TRUE(engine.sessions->WaitCheckpoint(key).ok());
  engine.swapper->SetIoHookForTesting(nullptr);
  auto manifests = checkpoint::ReadManifests(dir);
  ASSERT_TRUE(manifests.ok()) << manifests.status();
  ASSERT_EQ(manifests->size(), 1u);
  EXPECT_EQ(manifests->front().second.partitions(0).step(), 7u);
}

TEST(OutOfCore, ALoadMakesItsValuesTheMasterWeightsAndKeepsTheMoments) {
  TestEngine engine(TmpDir("load"), 64 << 20);
  auto opened = engine.sessions->Open("load", StateAt(100));
  ASSERT_TRUE(opened.ok());
  const SessionKey key = opened->key;
  constexpr uint64_t kN = 2 * kChunkElems + 5;
  HostMemory arena = MapArena(engine, key);
  FetchMode load;
  load.load = true;
  for (DType working : {DType::kBf16, DType::kFp32}) {
    SCOPED_TRACE(DTypeName(working));
    const size_t esize = DTypeSize(working);
    PartitionSpec spec{absl::StrCat("w", DTypeName(working)), kN, working, DType::kFp32};
    spec.fp32_master = working != DType::kFp32;
    auto p = engine.sessions->Register(key, spec);
    ASSERT_TRUE(p.ok()) << p.status();
    std::vector<float> init(kN, 0.5f), g1(kN), g2(kN), loaded(kN);
    for (uint64_t j = 0; j < kN; ++j) {
      g1[j] = 0.01f * std::sin(static_cast<float>(j));
      g2[j] = 0.02f * std::cos(static_cast<float>(j));
      loaded[j] = 1.0f + 1e-4f * static_cast<float>(j % 89);  // not representable in bf16
    }
    std::vector<std::byte> w(kN * esize);
    NarrowFromFloat(init.data(), working, w.data(), kN);
    std::memcpy(arena.data() + p->params.offset, w.data(), w.size());
    if (spec.fp32_master) std::memcpy(arena.data() + p->master_init.offset, init.data(), kN * 4);
    ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
    auto step = [&](const std::vector<float>& g) { StepWithGradients(engine, key, *p, arena, g); };
    step(g1);
    // The load.
    auto held = engine.sessions->Fetch(key, {p->id}, load);
    ASSERT_TRUE(held.ok()) << held.status();
    const PartitionInfo& at = (*held)[0];
    if (spec.fp32_master) {
      ASSERT_EQ(at.master_init.bytes, kN * 4);
      std::memcpy(arena.data() + at.master_init.offset, loaded.data(), kN * 4);
    } else {
      ASSERT_EQ(at.master_init.bytes, 0u);
      std::memcpy(arena.data() + at.params.offset, loaded.data(), kN * 4);
    }
    ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
    std::vector<std::byte> want(kN * esize);
    NarrowFromFloat(loaded.data(), working, want.data(), kN);
    ASSERT_EQ(std::memcmp(arena.data() + at.params.offset, want.data(), want.size()), 0);
    step(g2);
    // The reference: step 1 from the initial values, then the master set to
    // the loaded values with step 1's moments, then step 2.
    std::vector<float> master = init, m(kN, 0.f), v(kN, 0.f);
    std::vector<std::byte> out(kN * esize);
    Optimizer optimizer{OptimizerOptions{}};
    AdamTask task;
    task.span = {master.data(), m.data(),   v.data(), g1.data(),
                 DType::kFp32,  out.data(), working,  kN};
    task.step = 1;
    ASSERT_TRUE(optimizer.Step(absl::MakeConstSpan(&task, 1), AdamHyperparams{}).ok());
    master = loaded;
    task.span.grads = g2.data();
    task.step = 2;
    ASSERT_TRUE(optimizer.Step(absl::MakeConstSpan(&task, 1), AdamHyperparams{}).ok());
    ASSERT_TRUE(engine.sessions->Fetch(key, {p->id}).ok());
    EXPECT_EQ(std::memcmp(arena.data() + at.params.offset, out.data(), out.size()), 0);
    ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
  }
  // With the delayed update on, a load is refused and holds nothing.
  ASSERT_TRUE(engine.sessions->SetDelayedUpdate(key, true).ok());
  auto refused = engine.sessions->Fetch(key, {}, load);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_EQ(engine.sessions->Sessions()[0].held, 0u);
}

// A load after the delayed update went off with its working copy in the
// second buffer (an odd number of its commits) goes into the buffer the
// trainer reads, and the partition is released (it was refused NOT_FOUND,
// held for good).
TEST(OutOfCore, ALoadAfterTheDelayedUpdateWentOffGoesWhereTheTrainerReads) {
  TestEngine engine(TmpDir("load_dpu"), 64 << 20);
  auto opened = engine.sessions->Open("load_dpu", StateAt(100));
  ASSERT_TRUE(opened.ok());
  const SessionKey key = opened->key;
  constexpr uint64_t kN = 2 * kChunkElems + 5;
  HostMemory arena = MapArena(engine, key);
  PartitionSpec spec{"w", kN, DType::kBf16, DType::kFp32};
  spec.fp32_master = true;
  auto p = engine.sessions->Register(key, spec);
  ASSERT_TRUE(p.ok()) << p.status();
  std::vector<float> init(kN, 0.5f), g(kN, 0.01f), loaded(kN);
  for (uint64_t j = 0; j < kN; ++j) loaded[j] = 1.0f + 1e-3f * static_cast<float>(j % 89);
  std::memcpy(arena.data() + p->master_init.offset, init.data(), kN * 4);
  ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
  ASSERT_TRUE(engine.sessions->SetDelayedUpdate(key, true).ok());
  StepWithGradients(engine, key, *p, arena, g);
  ASSERT_TRUE(engine.sessions->SetDelayedUpdate(key, false).ok());  // its commit: the second buffer
  FetchMode load;
  load.load = true;
  auto held = engine.sessions->Fetch(key, {p->id}, load);
  ASSERT_TRUE(held.ok()) << held.status();
  std::memcpy(arena.data() + (*held)[0].master_init.offset, loaded.data(), kN * 4);
  absl::Status released = engine.sessions->Release(key, {p->id});
  ASSERT_TRUE(released.ok()) << released;
  EXPECT_EQ(engine.sessions->Sessions()[0].held, 0u);
  auto read = engine.sessions->Fetch(key, {p->id});
  ASSERT_TRUE(read.ok()) << read.status();
  std::vector<std::byte> want(kN * 2);
  NarrowFromFloat(loaded.data(), DType::kBf16, want.data(), kN);
  EXPECT_EQ(std::memcmp(arena.data() + (*read)[0].params.offset, want.data(), want.size()), 0);
  ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
}

// A load whose trainer goes away before releasing it commits nothing: its
// fp32 values are dropped, and a later ordinary release (the trainer back)
// does not make the half-written working copy the master weights.
TEST(OutOfCore, ALoadItsTrainerAbandonsCommitsNothing) {
  TestEngine engine(TmpDir("load_gone"), 64 << 20);
  auto opened = engine.sessions->Open("load_gone", StateAt(100));
  ASSERT_TRUE(opened.ok());
  const SessionKey key = opened->key;
  constexpr uint64_t kN = kChunkElems + 5;
  HostMemory arena = MapArena(engine, key);
  FetchMode load;
  load.load = true;
  for (DType working : {DType::kBf16, DType::kFp32}) {
    SCOPED_TRACE(DTypeName(working));
    PartitionSpec spec{absl::StrCat("w", DTypeName(working)), kN, working, DType::kFp32};
    spec.fp32_master = working != DType::kFp32;
    auto p = engine.sessions->Register(key, spec);
    ASSERT_TRUE(p.ok()) << p.status();
    std::vector<float> init(kN, 0.5f), g(kN, 0.01f);
    if (spec.fp32_master) std::memcpy(arena.data() + p->master_init.offset, init.data(), kN * 4);
    if (!spec.fp32_master) std::memcpy(arena.data() + p->params.offset, init.data(), kN * 4);
    ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
    StepWithGradients(engine, key, *p, arena, g);
    std::vector<float> m(kN), v(kN), before(kN), after(kN);
    ASSERT_TRUE(
        engine.sessions->ReadMoments(key, p->id, 0, kN, m.data(), v.data(), before.data()).ok());
    auto held = engine.sessions->Fetch(key, {p->id}, load);
    ASSERT_TRUE(held.ok()) << held.status();
    const PartitionInfo& at = (*held)[0];
    std::memset(arena.data() + (spec.fp32_master ? at.master_init.offset : at.params.offset), 0x7f,
                kN * 2);  // half written
    ASSERT_TRUE(engine.sessions->Detach(key.id));
    // Back (resumed: once the request ring's reset, which drops the dead
    // trainer's holds again, is done): an ordinary fetch and release.
    ASSERT_TRUE(engine.sessions->Resume(key).ok());
    ASSERT_TRUE(engine.sessions->Fetch(key, {p->id}).ok());
    ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
    ASSERT_TRUE(
        engine.sessions->ReadMoments(key, p->id, 0, kN, m.data(), v.data(), after.data()).ok());
    EXPECT_EQ(std::memcmp(before.data(), after.data(), kN * 4), 0);
    // The working copy is the master weights' again.
    auto read = engine.sessions->Fetch(key, {p->id});
    ASSERT_TRUE(read.ok()) << read.status();
    std::vector<std::byte> want(kN * DTypeSize(working));
    NarrowFromFloat(before.data(), working, want.data(), kN);
    EXPECT_EQ(std::memcmp(arena.data() + (*read)[0].params.offset, want.data(), want.size()), 0);
    ASSERT_TRUE(engine.sessions->Release(key, {p->id}).ok());
  }
}

TEST(OutOfCore, PlacementOnNvmeNeedsAnNvmeTier) {
  HostPool pool(Env::Default(), 1 << 20, false);
  auto swapper = *Swapper::Create(SwapperOptions{}, &pool, nullptr);
  Stats stats;
  PartitionStoreFactory store(Env::Default(), swapper.get(), &stats, 1 << 20, Placement{},
                              kChunkElems);
  EXPECT_EQ(store.CreateStore(1, StateAt(50)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  PlacementChange params;
  params[DataKind::kParams] = 0;
  EXPECT_EQ(store.CreateStore(1, params).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store.CreateStore(1, StateAt(101)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(store.CreateStore(1, StateAt(100)).ok());
}

}  // namespace
}  // namespace offload
