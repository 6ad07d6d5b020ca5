// ZeRO-3 for C++ GPU trainers (client/zero3.h) against a real offloadd:
// ranks as threads, each with its own session, emulated device and
// communicator; and the GPU demo (client/demo/gpu_mlp.h) that trains
// through it, on the emulated device here and on CUDA with NCCL where the
// machine has a GPU.
#include "client/zero3.h"

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/demo/gpu_mlp.h"
#include "client/demo/mlp.h"
#include "client/gpu_tier.h"
#include "gpu/emulated_communicator.h"
#include "gpu/emulated_device.h"
#include "gtest/gtest.h"
#include "tests/daemon_process.h"

namespace offload {
namespace {

using ::offload::testing::DaemonProcess;

class Zero3Test : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = DaemonProcess::Start({});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d);
  }

  // `n` ranks: a device, a communicator and a session each.
  struct Ranks {
    std::vector<std::unique_ptr<gpu::EmulatedDevice>> devices;
    std::vector<std::unique_ptr<gpu::EmulatedCommunicator>> comms;
    std::vector<std::unique_ptr<Client>> clients;
    std::vector<std::unique_ptr<Session>> sessions;
  };
  Ranks MakeRanks(int n) {
    Ranks r;
    std::vector<gpu::EmulatedDevice*> raw;
    for (int i = 0; i < n; ++i) {
      r.devices.push_back(std::make_unique<gpu::EmulatedDevice>(gpu::EmulatedDeviceOptions{
          .memory_bytes = 64 << 20, .seed = static_cast<uint64_t>(i + 7)}));
      raw.push_back(r.devices.back().get());
      auto c = Client::Connect({daemon_->address()});
      EXPECT_TRUE(c.ok()) << c.status();
      auto s = (*c)->OpenSession(absl::StrCat("rank ", i));
      EXPECT_TRUE(s.ok()) << s.status();
      r.clients.push_back(std::move(*c));
      r.sessions.push_back(std::move(*s));
    }
    r.comms = gpu::EmulatedCommunicator::CreateGroup(raw);
    return r;
  }
  // Rank 0 of two whose group gives up after `group_timeout` (rank 1 issues
  // nothing): a partition "w" of `slice` fp32 values, a tier over its
  // session (a 1 MiB budget and `tier_options`), a compute stream, and a
  // full gradient of both ranks' slices on the device, all ones.
  struct LoneRank {
    Ranks ranks;
    Session* session = nullptr;
    gpu::EmulatedDevice* dev = nullptr;
    uint64_t id = 0;
    std::unique_ptr<GpuTier> tier;
    std::optional<gpu::Stream> compute;
    gpu::DeviceMemory grads;
    float* grad = nullptr;
  };
  void MakeLoneRank(absl::Duration group_timeout, uint64_t slice, GpuTierOptions tier_options,
                    LoneRank* r) {
    r->ranks = MakeRanks(2);
    std::vector<gpu::EmulatedDevice*> raw = {r->ranks.devices[0].get(), r->ranks.devices[1].get()};
    r->ranks.comms = gpu::EmulatedCommunicator::CreateGroup(raw, group_timeout);
    r->session = r->ranks.sessions[0].get();
    r->dev = r->ranks.devices[0].get();
    auto p = r->session->Register("w", slice, DType::kFp32, DType::kFp32);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(r->session->Release(*p).ok());
    r->id = p->id;
    tier_options.params.budget_bytes = 1 << 20;
    auto tier = GpuTier::Create(r->session, r->dev, tier_options);
    ASSERT_TRUE(tier.ok()) << tier.status();
    r->tier = std::move(*tier);
    auto compute = r->dev->CreateStream();
    ASSERT_TRUE(compute.ok());
    r->compute = std::move(*compute);
    auto grads = r->dev->Allocate(2 * slice * sizeof(float));
    ASSERT_TRUE(grads.ok());
    r->grads = std::move(*grads);
    r->grad = static_cast<float*>(r->grads.get());
    for (uint64_t i = 0; i < 2 * slice; ++i) r->grad[i] = 1.0f;
  }

  static void Each(int n, const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
    for (auto& t : threads) t.join();
  }

  std::unique_ptr<DaemonProcess> daemon_;
};

// Tensor t's element i, as a full tensor holds it.
float Value(int t, uint64_t i) { return 1000.0f * t + static_cast<float>(i) * 0.5f; }

TEST_F(Zero3Test, AUnitIsGatheredPerBucketAndGradientsAveragedIntoTheDaemon) {
  constexpr int kRanks = 2;
  // Three tensors, the first two padded (odd sizes), 5, 1001 and 3000.
  const uint64_t numel[] = {5, 1001, 3000};
  Ranks ranks = MakeRanks(kRanks);
  std::vector<Zero3Stats> stats(kRanks);
  std::vector<std::vector<std::vector<float>>> gathered(kRanks), after(kRanks);
  Each(kRanks, [&](int me) {
    Session* s = ranks.sessions[me].get();
    gpu::EmulatedDevice& dev = *ranks.devices[me];
    std::vector<uint64_t> ids, slices;
    std::vector<std::pair<uint64_t, uint64_t>> unit;
    for (int t = 0; t < 3; ++t) {
      const uint64_t slice = Zero3::SliceNumel(numel[t], kRanks);
      auto p = s->Register(absl::StrCat("t", t), slice, DType::kFp32, DType::kFp32);
      ASSERT_TRUE(p.ok()) << p.status();
      for (uint64_t i = 0; i < slice; ++i) {
        const uint64_t at = me * slice + i;
        static_cast<float*>(p->params)[i] = at < numel[t] ? Value(t, at) : 0.0f;
      }
      ASSERT_TRUE(s->Release(*p).ok());
      ids.push_back(p->id);
      slices.push_back(slice);
      unit.push_back({p->id, slice * sizeof(float)});
    }
    GpuTierOptions tier_options;
    tier_options.params.budget_bytes = 1 << 20;
    auto tier = GpuTier::Create(s, &dev, tier_options);
    ASSERT_TRUE(tier.ok()) << tier.status();
    // The first two tensors' gathered output (24 + 4008 bytes) fits one
    // bucket of 8 KiB, the third's (12000) goes alone; gradients likewise.
    auto zero3 = Zero3::Create(tier->get(), &dev, ranks.comms[me].get(),
                               {.bucket_bytes = 8 << 10, .hand_over = false});
    ASSERT_TRUE(zero3.ok()) << zero3.status();
    auto u = (*zero3)->AddUnit(unit);
    ASSERT_TRUE(u.ok()) << u.status();
    std::vector<gpu::DeviceMemory> full, grads;
    std::vector<void*> full_ptrs;
    for (int t = 0; t < 3; ++t) {
      full.push_back(*dev.Allocate(slices[t] * kRanks * sizeof(float)));
      grads.push_back(*dev.Allocate(slices[t] * kRanks * sizeof(float)));
      full_ptrs.push_back(full.back().get());
    }
    auto compute = dev.CreateStream();
    auto done = dev.CreateEvent();
    ASSERT_TRUE(compute.ok() && done.ok());
    ASSERT_TRUE((*tier)->BeginIteration().ok());
    ASSERT_TRUE((*zero3)->Gather(*u, full_ptrs, *compute).ok());
    ASSERT_TRUE(dev.Record(*done, *compute).ok());
    ASSERT_TRUE(dev.Synchronize(*done).ok());
    for (int t = 0; t < 3; ++t) {
      const float* f = static_cast<const float*>(full[t].get());
      gathered[me].emplace_back(f, f + slices[t] * kRanks);
      // Rank r's gradient of element i: (r + 1) * (i + 1); their average
      // is 1.5 (i + 1).
      float* g = static_cast<float*>(grads[t].get());
      for (uint64_t i = 0; i < slices[t] * kRanks; ++i) g[i] = (me + 1.0f) * (i + 1.0f);
    }
    for (int t = 2; t >= 0; --t) {
      ASSERT_TRUE((*zero3)
                      ->ReduceScatter(ids[t], static_cast<const float*>(grads[t].get()),
                                      slices[t] * kRanks, *compute)
                      .ok());
    }
    auto returned = (*zero3)->FinishBackward(*compute);
    ASSERT_TRUE(returned.ok()) << returned.status();
    EXPECT_EQ(returned->size(), 3u);
    ASSERT_TRUE((*tier)->EndIteration().ok());
    // beta1 = beta2 = 0, eps = lr = 1e6: the update is 1e6 g / (|g| +
    // 1e6), a function of the averaged gradient alone.
    AdamHyperparams sgd{/*lr=*/1e6,
                        /*beta1=*/0,
                        /*beta2=*/0,
                        /*eps=*/1e6,
                        /*weight_decay=*/0,
                        /*decoupled_weight_decay=*/true,
                        /*bias_correction=*/false};
    auto step = s->Step(sgd);
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_EQ(step->partitions_updated, 3u);
    for (int t = 0; t < 3; ++t) {
      auto p = s->Fetch(ids[t]);
      ASSERT_TRUE(p.ok()) << p.status();
      const float* v = static_cast<const float*>(p->params);
      after[me].emplace_back(v, v + slices[t]);
      ASSERT_TRUE(s->Release(*p).ok());
    }
    stats[me] = (*zero3)->stats();
  });
  for (int me = 0; me < kRanks; ++me) {
    for (int t = 0; t < 3; ++t) {
      const uint64_t slice = Zero3::SliceNumel(numel[t], kRanks);
      ASSERT_EQ(gathered[me][t].size(), slice * kRanks);
      for (uint64_t i = 0; i < slice * kRanks; ++i) {
        ASSERT_EQ(gathered[me][t][i], i < numel[t] ? Value(t, i) : 0.0f)
            << "rank " << me << " tensor " << t << " element " << i;
      }
      for (uint64_t i = 0; i < slice; ++i) {
        const uint64_t at = me * slice + i;
        const float before = at < numel[t] ? Value(t, at) : 0.0f;
        const double avg = 1.5 * (at + 1.0);
        const double update = avg * 1e6 / (avg + 1e6);  // lr m / (sqrt(v) + eps)
        EXPECT_NEAR(before - after[me][t][i], update, 1e-5 * update + 1e-3)
            << "rank " << me << " tensor " << t << " element " << i;
      }
    }
    EXPECT_EQ(stats[me].all_gathers, 2u);
    EXPECT_EQ(stats[me].gathered_tensors, 3u);
    EXPECT_EQ(stats[me].reduce_scatters, 2u);  // t2 alone, then t1 and t0
    EXPECT_EQ(stats[me].scattered_tensors, 3u);
    EXPECT_EQ(stats[me].gradients_returned, 3u);
    EXPECT_EQ(ranks.comms[me]->collectives(), 4u);
  }
}

TEST_F(Zero3Test, BadShapesAreRefusedAndNothingIsIssued) {
  Ranks ranks = MakeRanks(2);
  gpu::EmulatedDevice& dev = *ranks.devices[0];
  GpuTierOptions small;
  small.params.budget_bytes = 1 << 20;
  auto tier = GpuTier::Create(ranks.sessions[0].get(), &dev, small);
  ASSERT_TRUE(tier.ok()) << tier.status();
  auto zero3 = Zero3::Create(tier->get(), &dev, ranks.comms[0].get());
  ASSERT_TRUE(zero3.ok());
  auto compute = dev.CreateStream();
  ASSERT_TRUE(compute.ok());
  float g[3] = {};
  absl::Status odd = (*zero3)->ReduceScatter(1, g, 3, *compute);
  EXPECT_EQ(odd.code(), absl::StatusCode::kInvalidArgument) << odd;
  EXPECT_TRUE(absl::StrContains(odd.message(), "multiple of the 2 ranks")) << odd;
  auto p = ranks.sessions[0]->Register("w", 4, DType::kFp32, DType::kFp32);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(ranks.sessions[0]->Release(*p).ok());
  auto unit = (*zero3)->AddUnit({{p->id, 4 * sizeof(float)}});
  ASSERT_TRUE(unit.ok()) << unit.status();
  void* none[1] = {nullptr};
  absl::Status null = (*zero3)->Gather(*unit, none, *compute);
  EXPECT_EQ(null.code(), absl::StatusCode::kInvalidArgument) << null;
  EXPECT_TRUE(absl::StrContains(null.message(), "null")) << null;
  EXPECT_EQ(ranks.comms[0]->collectives(), 0u);
  EXPECT_EQ(
      Zero3::Create(tier->get(), &dev, ranks.comms[0].get(), {.bucket_bytes = 0}).status().code(),
      absl::StatusCode::kInvalidArgument);
}

// A reduce-scatter that fails while it runs (the other rank never issues
// it) breaks the communicator: the slices it was to write are released
// unreturned, nothing of them reaches the daemon, and FinishBackward says
// why (before: the copies of whatever the scratch buffer held were handed
// over and FinishBackward returned OK).
TEST_F(Zero3Test, AReduceScatterThatFailsHandsNothingToTheDaemon) {
  constexpr uint64_t kSlice = 64;
  LoneRank r;
  ASSERT_NO_FATAL_FAILURE(MakeLoneRank(absl::Milliseconds(200), kSlice, {}, &r));
  auto zero3 = Zero3::Create(r.tier.get(), r.dev, r.ranks.comms[0].get(), {.hand_over = false});
  ASSERT_TRUE(zero3.ok()) << zero3.status();
  ASSERT_TRUE((*zero3)->ReduceScatter(r.id, r.grad, 2 * kSlice, *r.compute).ok());
  auto finished = (*zero3)->FinishBackward(*r.compute);  // rank 1 issues nothing
  EXPECT_EQ(finished.status().code(), absl::StatusCode::kDeadlineExceeded) << finished.status();
  EXPECT_TRUE(absl::StrContains(finished.status().message(), "did not issue it"))
      << finished.status();
  auto pending = r.session->GetPendingGradients();
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_EQ(pending->partitions, 0u) << "a failed collective's output reached the daemon";
  EXPECT_EQ((*zero3)->stats().gradients_returned, 0u);
  EXPECT_EQ(r.tier->gradients_pending(), 0u);
  // The iteration given up: nothing of it is queued for the next.
  EXPECT_TRUE((*zero3)->Abandon().ok());
  auto next = (*zero3)->FinishBackward(*r.compute);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE(next->empty());
  EXPECT_EQ(r.ranks.comms[0]->collectives(), 1u) << "a stale bucket was issued again";
}

// A peer that never joins a reduce-scatter (died, hangs) holds it for good
// on NCCL, which sees no error: Zero3's wait for it gives up after
// collective_timeout and aborts the communicator, which ends the
// collective; nothing of it reaches the daemon. (The emulated group's own
// timeout is set far longer here, as NCCL has none.)
TEST_F(Zero3Test, AWaitForACollectiveAPeerNeverJoinsGivesUpAndAborts) {
  constexpr uint64_t kSlice = 64;
  LoneRank r;
  ASSERT_NO_FATAL_FAILURE(MakeLoneRank(absl::Minutes(10), kSlice, {}, &r));
  auto zero3 = Zero3::Create(r.tier.get(), r.dev, r.ranks.comms[0].get(),
                             {.hand_over = false, .collective_timeout = absl::Milliseconds(300)});
  ASSERT_TRUE(zero3.ok()) << zero3.status();
  ASSERT_TRUE((*zero3)->ReduceScatter(r.id, r.grad, 2 * kSlice, *r.compute).ok());
  const absl::Time began = absl::Now();
  auto finished = (*zero3)->FinishBackward(*r.compute);  // rank 1 issues nothing
  EXPECT_LT(absl::Now() - began, absl::Seconds(30));
  EXPECT_EQ(finished.status().code(), absl::StatusCode::kDeadlineExceeded) << finished.status();
  EXPECT_TRUE(absl::StrContains(finished.status().message(), "collective_timeout"))
      << finished.status();
  EXPECT_EQ(r.ranks.comms[0]->Check().code(), absl::StatusCode::kDeadlineExceeded);
  auto pending = r.session->GetPendingGradients();
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_EQ(pending->partitions, 0u) << "a collective that never ran reached the daemon";
  EXPECT_EQ(r.tier->gradients_pending(), 0u);
}

// The same through staged copies (the session's memory not registered for
// DMA: state on NVMe): the tier's own host waits for a staging buffer
// smaller than a slice sit behind the reduce-scatter too, and time out as
// Zero3's do.
TEST_F(Zero3Test, StagedCopiesBehindACollectiveAPeerNeverJoinsTimeOutToo) {
  constexpr uint64_t kSlice = 1 << 19;  // 2 MiB, twice the staging buffer (its least: 1 MiB)
  GpuTierOptions tier_options;
  tier_options.register_arena = false;
  tier_options.gradient_staging_bytes = 1 << 20;
  LoneRank r;
  ASSERT_NO_FATAL_FAILURE(MakeLoneRank(absl::Seconds(20), kSlice, tier_options, &r));
  // (A Zero3 made before on the same tier and gone after the next one was
  // made leaves that one's host waits in place: it gives back only its own.)
  auto earlier = Zero3::Create(r.tier.get(), r.dev, r.ranks.comms[0].get(), {});
  ASSERT_TRUE(earlier.ok()) << earlier.status();
  auto zero3 = Zero3::Create(
      r.tier.get(), r.dev, r.ranks.comms[0].get(),
      {.bucket_bytes = 1024, .hand_over = false, .collective_timeout = absl::Milliseconds(300)});
  ASSERT_TRUE(zero3.ok()) << zero3.status();
  earlier->reset();
  const absl::Time began = absl::Now();
  absl::Status scattered = (*zero3)->ReduceScatter(r.id, r.grad, 2 * kSlice, *r.compute);
  absl::Status finished =
      scattered.ok() ? (*zero3)->FinishBackward(*r.compute).status() : scattered;
  EXPECT_LT(absl::Now() - began, absl::Seconds(30));
  EXPECT_EQ(finished.code(), absl::StatusCode::kDeadlineExceeded) << finished;
  EXPECT_TRUE(absl::StrContains(finished.message(), "collective_timeout")) << finished;
  auto pending = r.session->GetPendingGradients();
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_EQ(pending->partitions, 0u);
}

// A ReduceScatter whose bucket cannot be issued (no device memory for its
// scratch buffer) leaves the gradient queued; the call made again, as the
// header says, issues the bucket once (it was queued twice and issued
// twice: the second collective this rank's alone, the daemon refusing the
// gradient as already on its way).
TEST_F(Zero3Test, AReduceScatterCalledAgainAfterItsBucketFailedIssuesItOnce) {
  Ranks ranks = MakeRanks(1);
  Session* s = ranks.sessions[0].get();
  gpu::EmulatedDevice& dev = *ranks.devices[0];
  constexpr uint64_t kSlice = 64;
  auto p = s->Register("w", kSlice, DType::kFp32, DType::kFp32);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(s->Release(*p).ok());
  GpuTierOptions tier_options;
  tier_options.params.budget_bytes = 1 << 20;
  auto tier = GpuTier::Create(s, &dev, tier_options);
  ASSERT_TRUE(tier.ok()) << tier.status();
  auto zero3 = Zero3::Create(tier->get(), &dev, ranks.comms[0].get(),
                             {.bucket_bytes = 64, .hand_over = false});
  ASSERT_TRUE(zero3.ok()) << zero3.status();
  auto compute = dev.CreateStream();
  ASSERT_TRUE(compute.ok());
  auto grads = dev.Allocate(kSlice * sizeof(float));
  ASSERT_TRUE(grads.ok());
  float* g = static_cast<float*>(grads->get());
  for (uint64_t i = 0; i < kSlice; ++i) g[i] = 0.5f;
  auto free_bytes = dev.FreeBytes();
  ASSERT_TRUE(free_bytes.ok());
  auto hog = dev.Allocate(*free_bytes);  // no room left for the scratch buffer
  ASSERT_TRUE(hog.ok()) << hog.status();
  absl::Status first = (*zero3)->ReduceScatter(p->id, g, kSlice, *compute);
  EXPECT_EQ(first.code(), absl::StatusCode::kResourceExhausted) << first;
  EXPECT_EQ(ranks.comms[0]->collectives(), 0u);
  hog->Reset();
  ASSERT_TRUE((*zero3)->ReduceScatter(p->id, g, kSlice, *compute).ok());
  auto returned = (*zero3)->FinishBackward(*compute);
  ASSERT_TRUE(returned.ok()) << returned.status();
  EXPECT_EQ(*returned, std::vector<uint64_t>{p->id});
  EXPECT_EQ(ranks.comms[0]->collectives(), 1u);
  EXPECT_EQ((*zero3)->stats().reduce_scatters, 1u);
}

// The C++ GPU demo: two ranks train the MLP with ZeRO-3 through offloadd
// and lose as a single process training on the host does.
TEST_F(Zero3Test, TheGpuDemoTrainsLikeTheHostInProcess) {
  for (uint64_t bucket : {uint64_t{64} << 20, uint64_t{1} << 10}) {
    SCOPED_TRACE(absl::StrCat("bucket_bytes ", bucket));
    demo::MlpConfig config;
    config.steps = 40;
    constexpr int kRanks = 2;
    Ranks ranks = MakeRanks(kRanks);
    std::vector<absl::StatusOr<demo::GpuTrainResult>> results(kRanks,
                                                              absl::UnknownError("not run"));
    Each(kRanks, [&](int me) {
      auto kernels = demo::MakeEmulatedMlpKernels(ranks.devices[me].get());
      demo::GpuRank rank;
      rank.session = ranks.sessions[me].get();
      rank.device = ranks.devices[me].get();
      rank.comm = ranks.comms[me].get();
      rank.kernels = kernels.get();
      rank.tier.params.budget_bytes = 1 << 20;
      rank.zero3.bucket_bytes = bucket;
      results[me] = demo::TrainZero3(config, rank);
    });
    auto store = demo::MakeInProcessStore(config);
    auto host = demo::Train(config, store.get());
    ASSERT_TRUE(host.ok()) << host.status();
    for (int me = 0; me < kRanks; ++me) {
      ASSERT_TRUE(results[me].ok()) << "rank " << me << ": " << results[me].status();
      ASSERT_EQ(results[me]->losses.size(), 40u);
      for (size_t i = 0; i < 40; ++i) {
        EXPECT_NEAR(results[me]->losses[i], (*host)[i], 1e-5 * (*host)[i]) << "step " << i;
      }
      // Two units a step, one bucket each; with 1 KiB buckets, two each
      // (w1 and b1 apart, w2's 1 KiB and b2 apart).
      EXPECT_EQ(results[me]->zero3.all_gathers, (bucket > 1024 ? 2u : 4u) * 40);
      EXPECT_EQ(results[me]->zero3.gradients_returned, 4u * 40);
    }
    EXPECT_LT(results[0]->losses.back(), 0.5 * results[0]->losses.front());
  }
}

// The same demo binary on CUDA with NCCL (one rank): skips where the
// machine has no CUDA device or the build no toolkit.
TEST_F(Zero3Test, TheGpuDemoOnCudaWithNccl) {
  const std::string cmd = absl::StrCat(
      "client/demo/offload_gpu_demo --device=cuda --steps=60 "
      "--address=",
      daemon_->address(), " 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  const int status = pclose(p);
  if (absl::StrContains(out, "FAILED_PRECONDITION")) {
    GTEST_SKIP() << "no CUDA device or toolkit here: " << out;
  }
  EXPECT_EQ(status, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "losses agree with in-process training")) << out;
}

}  // namespace
}  // namespace offload
