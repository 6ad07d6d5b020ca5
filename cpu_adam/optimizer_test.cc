#include "cpu_adam/optimizer.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cpu_adam/dtype.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

struct Buffers {
  std::vector<float> p, m, v, g, w;
  explicit Buffers(size_t n, uint32_t seed) : p(n), m(n, 0.f), v(n, 0.f), g(n), w(n) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    for (size_t i = 0; i < n; ++i) {
      p[i] = d(rng);
      g[i] = d(rng);
    }
  }
  AdamTask Task(uint64_t step) {
    return {
        {p.data(), m.data(), v.data(), g.data(), DType::kFp32, w.data(), DType::kFp32, p.size()},
        step};
  }
};

TEST(Optimizer, ParallelTilesEqualOneScalarPass) {
  OptimizerOptions options;
  options.threads = 2;
  options.tile_elems = 1024;
  Optimizer opt(options);
  AdamHyperparams h;
  // Sizes that are not a multiple of the tile size, and several partitions.
  Buffers a(10'000, 1), b(3'333, 2), ra(10'000, 1), rb(3'333, 2);
  std::vector<AdamTask> tasks = {a.Task(3), b.Task(1)};
  ASSERT_TRUE(opt.Step(tasks, h).ok());
  AdamScalar(ComputeStepConstants(h, 3), ra.Task(3).span);
  AdamScalar(ComputeStepConstants(h, 1), rb.Task(1).span);
  EXPECT_EQ(a.p, ra.p);
  EXPECT_EQ(a.w, ra.w);
  EXPECT_EQ(b.p, rb.p);
  EXPECT_EQ(b.v, rb.v);
}

TEST(Optimizer, ScanThenUpdateInGroupsEqualsOneStep) {
  Optimizer opt(OptimizerOptions{});
  AdamHyperparams h;
  Buffers a(10'000, 1), b(3'333, 2), ra(10'000, 1), rb(3'333, 2);
  std::vector<AdamTask> whole = {ra.Task(2), rb.Task(5)};
  ASSERT_TRUE(opt.Step(whole, h).ok());
  std::vector<AdamTask> both = {a.Task(2), b.Task(5)};
  EXPECT_EQ(opt.CountNonFinite(both), 0u);
  ASSERT_TRUE(opt.Update({a.Task(2)}, h).ok());
  ASSERT_TRUE(opt.Update({b.Task(5)}, h).ok());
  EXPECT_EQ(a.p, ra.p);
  EXPECT_EQ(a.m, ra.m);
  EXPECT_EQ(b.v, rb.v);
  EXPECT_EQ(b.w, rb.w);
  b.g[7] = std::numeric_limits<float>::infinity();
  b.g[8] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(opt.CountNonFinite(both), 2u);
  opt.SetCheckFinite(false);
  EXPECT_EQ(opt.CountNonFinite(both), 0u);
  AdamHyperparams bad;
  bad.beta1 = 2;
  EXPECT_EQ(opt.Update({a.Task(3)}, bad).code(), absl::StatusCode::kInvalidArgument);
}

TEST(Optimizer, ResizesWhileOtherThreadsStep) {
  Optimizer opt(OptimizerOptions{});
  AdamHyperparams h;
  std::thread stepper([&] {
    Buffers a(50'000, 3);
    for (int i = 1; i <= 20; ++i) {
      std::vector<AdamTask> tasks = {a.Task(i)};
      ASSERT_TRUE(opt.Step(tasks, h).ok());
    }
  });
  for (int t : {1, 2, 3, 1}) ASSERT_TRUE(opt.SetThreads(t).ok());
  stepper.join();
  EXPECT_EQ(opt.threads(), 1);
}

TEST(Optimizer, RejectsBadSettingsAndHyperparams) {
  Optimizer opt(OptimizerOptions{});
  EXPECT_EQ(opt.SetThreads(-1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(opt.SetTileElems(5).code(), absl::StatusCode::kInvalidArgument);
  Buffers a(100, 4);
  std::vector<float> before = a.p;
  AdamHyperparams h;
  h.lr = -1.f;
  std::vector<AdamTask> tasks = {a.Task(1)};
  EXPECT_EQ(opt.Step(tasks, h).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a.p, before);
}

TEST(Optimizer, NonFiniteGradientsSkipTheStepWithoutChangingState) {
  OptimizerOptions options;
  options.tile_elems = 1024;
  Optimizer opt(options);
  Buffers a(5000, 6), b(3000, 7);
  b.g[2999] = std::numeric_limits<float>::infinity();
  b.g[10] = std::numeric_limits<float>::quiet_NaN();
  Buffers a0 = a, b0 = b;
  std::vector<AdamTask> tasks = {a.Task(1), b.Task(1)};
  auto report = opt.Step(tasks, AdamHyperparams{});
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->skipped);
  EXPECT_EQ(report->nonfinite, 2u);
  EXPECT_EQ(a.p, a0.p);
  EXPECT_EQ(a.m, a0.m);
  EXPECT_EQ(b.v, b0.v);
  // With the check off, the step goes ahead (and NaN spreads, as asked).
  opt.SetCheckFinite(false);
  report = opt.Step(tasks, AdamHyperparams{});
  ASSERT_TRUE(report.ok());
  EXPECT_FALSE(report->skipped);
  EXPECT_NE(a.p, a0.p);
}

TEST(Optimizer, EveryKernelGivesTheSameStep) {
  Buffers ref(20'000, 8);
  {
    OptimizerOptions o;
    o.kernel = "scalar";
    Optimizer opt(o);
    std::vector<AdamTask> tasks = {ref.Task(4)};
    ASSERT_TRUE(opt.Step(tasks, AdamHyperparams{}).ok());
  }
  Optimizer opt(OptimizerOptions{});
  for (const char* name : {"avx2", "avx512"}) {
    if (!opt.SetKernel(name).ok()) continue;  // this CPU lacks it
    EXPECT_EQ(opt.kernel_name(), name);
    Buffers got(20'000, 8);
    std::vector<AdamTask> tasks = {got.Task(4)};
    ASSERT_TRUE(opt.Step(tasks, AdamHyperparams{}).ok());
    EXPECT_EQ(got.p, ref.p) << name;
    EXPECT_EQ(got.w, ref.w) << name;
  }
  EXPECT_EQ(opt.SetKernel("mmx").code(), absl::StatusCode::kInvalidArgument);
}

// Measuring only (no accumulator) gives the statistics of a first
// accumulation bit for bit, with every kernel, over lengths around the
// statistics' blocks and the tiles, with and without non-finite values;
// it writes nothing.
TEST(Optimizer, MeasuringGivesTheStatisticsOfAFirstAccumulation) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  OptimizerOptions o;
  o.tile_elems = 4096;
  Optimizer opt(o);
  for (const char* kernel : {"scalar", "avx2", "avx512"}) {
    if (!opt.SetKernel(kernel).ok()) continue;
    for (DType dtype : {DType::kFp32, DType::kBf16, DType::kFp16}) {
      // (Tiles of 4096: 4096 + 3000 ends a tile on 2 blocks and a 952-value
      // tail, which a first accumulation adds into its running total.)
      for (size_t n : {1, 1000, 1024, 1025, 4096, 4096 + 3000, 4097 + 1024 * 3, 50'000}) {
        for (bool poison : {false, true}) {
          std::vector<float> values(n);
          for (float& v : values) v = normal(rng);
          if (poison) values[n / 2] = std::numeric_limits<float>::infinity();
          std::vector<std::byte> grads(n * DTypeSize(dtype));
          NarrowFromFloat(values.data(), dtype, grads.data(), n);
          std::vector<float> acc(n, 5.0f);
          AccumulateTask accumulate{grads.data(), dtype, acc.data(), n, /*first=*/true};
          const GradStats want = opt.Accumulate(absl::MakeConstSpan(&accumulate, 1));
          const std::vector<std::byte> before = grads;
          AccumulateTask measure{grads.data(), dtype, nullptr, n, /*first=*/false};
          const GradStats got = opt.Accumulate(absl::MakeConstSpan(&measure, 1));
          const std::string where = absl::StrCat(kernel, " ", DTypeName(dtype), " n=", n);
          EXPECT_EQ(std::memcmp(&got.sq_norm, &want.sq_norm, sizeof(double)), 0)
              << where << ": " << got.sq_norm << " vs " << want.sq_norm;
          EXPECT_EQ(got.nonfinite, want.nonfinite) << where;
          EXPECT_EQ(got.nonfinite, poison ? 1u : 0u) << where;
          EXPECT_TRUE(grads == before) << where;
        }
      }
    }
  }
}

// Started at any point of an update, an accumulation and a measuring call
// give the bits they give alone. Measuring (no accumulator) runs in the
// update's arena: beside the update when the arena has a free slot (one
// thread: the arena's second slot), queued for the arena's threads when
// the update fills it (two threads, while the pool's thread holds the
// second slot), including when the update's caller leaves the arena before
// any thread took the queued call. An accumulation started while the
// update runs offers its tiles to the update's threads, which take some at
// their next tile boundary. When each case happens depends on timing: the
// rounds spread the calls from the update's start to past its end. A tile
// lost or run twice changes the bits; a lost call or a missed wake-up hangs
// this test (the test's timeout fails it).
TEST(Optimizer, AccumulatingAndMeasuringBesideAnUpdateGiveTheSameBits) {
  constexpr size_t kUpdate = 1 << 20, kGrads = 100'000;
  std::vector<float> values(kGrads);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : values) v = normal(rng);
  values[17] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::byte> grads(kGrads * DTypeSize(DType::kBf16));
  NarrowFromFloat(values.data(), DType::kBf16, grads.data(), kGrads);
  const std::vector<float> acc0(kGrads, 0.25f);
  AccumulateTask measure{grads.data(), DType::kBf16, nullptr, kGrads, /*first=*/false};
  int beside[3] = {};       // per thread count: rounds whose calls began before the update ended
  uint64_t helped[3] = {};  // per thread count: accumulation tiles the update's threads ran
  for (int threads : {1, 2}) {
    OptimizerOptions o;
    o.threads = threads;
    o.tile_elems = 4096;  // 25 tiles for each call
    o.kernel = "scalar";  // the slowest: an update of a few milliseconds
    Optimizer opt(o);
    const GradStats want_measure = opt.Accumulate(absl::MakeConstSpan(&measure, 1));
    ASSERT_EQ(want_measure.nonfinite, 1u);
    std::vector<float> want_acc = acc0;
    AccumulateTask reference{grads.data(), DType::kBf16, want_acc.data(), kGrads, false};
    const GradStats want_sum = opt.Accumulate(absl::MakeConstSpan(&reference, 1));
    Buffers b(kUpdate, 5);
    const AdamTask task = b.Task(1);
    AdamHyperparams h;
    for (int round = 0; round < 40; ++round) {
      std::atomic<bool> started{false}, ended{false};
      std::thread updater([&] {
        started.store(true);
        EXPECT_TRUE(opt.Update(absl::MakeConstSpan(&task, 1), h).ok());
        ended.store(true);
      });
      while (!started.load()) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::microseconds(250 * round));
      beside[threads] += ended.load() ? 0 : 1;
      std::vector<float> acc = acc0;
      AccumulateTask accumulate{grads.data(), DType::kBf16, acc.data(), kGrads, false};
      GradStats measured, summed;
      // Either call first: each gets the update's middle in some rounds.
      if (round % 2 == 0) {
        summed = opt.Accumulate(absl::MakeConstSpan(&accumulate, 1));
        measured = opt.Accumulate(absl::MakeConstSpan(&measure, 1));
      } else {
        measured = opt.Accumulate(absl::MakeConstSpan(&measure, 1));
        summed = opt.Accumulate(absl::MakeConstSpan(&accumulate, 1));
      }
      updater.join();
      const std::string where = absl::StrCat(threads, " threads, round ", round);
      EXPECT_EQ(std::memcmp(&measured.sq_norm, &want_measure.sq_norm, sizeof(double)), 0) << where;
      EXPECT_EQ(measured.nonfinite, 1u) << where;
      EXPECT_EQ(std::memcmp(&summed.sq_norm, &want_sum.sq_norm, sizeof(double)), 0) << where;
      EXPECT_EQ(summed.nonfinite, want_sum.nonfinite) << where;
      EXPECT_EQ(std::memcmp(acc.data(), want_acc.data(), kGrads * sizeof(float)), 0) << where;
    }
    helped[threads] = opt.tiles_helped();
  }
  std::printf(
      "rounds whose calls began before the update ended: %d of 40 on one thread, %d of "
      "40 on two; accumulation tiles the update's threads ran: %llu and %llu\n",
      beside[1], beside[2], static_cast<unsigned long long>(helped[1]),
      static_cast<unsigned long long>(helped[2]));
  if (beside[1] + beside[2] < 10) {
    GTEST_SKIP() << "fewer than 10 rounds began a call before the update ended (a loaded host): "
                    "the cases beside an update were not reached";
  }
  // With that many calls inside an update of 256 tiles, its threads took
  // some of the accumulations' tiles: helping is not silently off.
  EXPECT_GT(helped[1] + helped[2], 0u);
}

}  // namespace
}  // namespace offload
