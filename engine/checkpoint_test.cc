// Checkpoints: a session restored from one (into a fresh engine, also with
// another number of ranks) trains on bit for bit as the checkpointed one
// did; a step running while a checkpoint is written changes nothing in it.
#include "engine/checkpoint.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/host_memory.h"
#include "checkpoint/format.h"
#include "cpu_adam/dtype.h"
#include "engine/test_engine.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

constexpr uint64_t kChunk = 4096;

struct TensorDef {
  const char* name;
  uint64_t numel;
};
// Several chunks, an odd size (padded when sliced), a tiny one.
const TensorDef kTensors[] = {{"a", 3 * kChunk + 5}, {"b", 7001}, {"c", 3}};

// Exact, platform-independent values: small integers times a power of two.
float Value(uint64_t seed, uint64_t i) {
  uint64_t h = (seed * 0x9E3779B97F4A7C15ull) ^ (i * 0xC2B2AE3D27D4EB4Full);
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return static_cast<float>(static_cast<int64_t>(h % 2001) - 1000) * (1.0f / 1024);
}

std::string TmpDir(const std::string& name) {
  return std::string(getenv("TEST_TMPDIR")) + "/" + name;
}

struct Options {
  DType dtype = DType::kFp32;
  int state_host_percent = 100;
  bool delayed_update = false;
  std::optional<LossScalingOptions> loss_scaling;
  std::string restore_from;
  std::optional<uint64_t> restore_steps;
};

RestoreFrom Restore(const Options& o) {
  RestoreFrom r(o.restore_from);
  r.steps = o.restore_steps;
  return r;
}

// One rank of a job: a session holding slice `rank` of `world` of every
// tensor of kTensors.
class Rank {
 public:
  Rank(TestEngine* engine, int rank, int world, const Options& o) : engine_(engine), o_(o) {
    PlacementChange placement;
    if (o.restore_from.empty()) placement[DataKind::kOptimizerState] = o.state_host_percent;
    auto opened = engine->sessions->Open(
        "job/rank" + std::to_string(rank), placement, o.loss_scaling,
        o.delayed_update ? std::optional<uint64_t>(1) : std::nullopt, Restore(o));
    EXPECT_TRUE(opened.ok()) << opened.status();
    if (!opened.ok()) return;
    key_ = opened->key;
    auto fd = engine->sessions->DupArenaFd(key_);
    arena_ = *HostMemory::MapShared(fd->get(), 0, 64 << 20);
    RegisterAll(rank, world);
  }

  void RegisterAll(int rank, int world) {
    const Options& o = o_;
    TestEngine* engine = engine_;
    for (size_t t = 0; t < std::size(kTensors); ++t) {
      const uint64_t slice = (kTensors[t].numel + world - 1) / world;
      PartitionSpec spec;
      spec.name = kTensors[t].name;
      spec.numel = slice;
      spec.param_dtype = o.dtype;
      spec.grad_dtype = DType::kFp32;
      spec.fp32_master = o.dtype != DType::kFp32;
      spec.tensor = kTensors[t].name;
      spec.shape = {kTensors[t].numel};
      spec.tensor_offset = rank * slice;
      auto p = engine->sessions->Register(key_, spec);
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_EQ(p->restored, !o.restore_from.empty());
      parts_.push_back({*p, t, spec.tensor_offset});
      if (!p->restored) {
        std::vector<float> init(slice, 0.0f);
        for (uint64_t j = 0; j < slice; ++j) {
          if (spec.tensor_offset + j < kTensors[t].numel)
            init[j] = Value(t, spec.tensor_offset + j);
        }
        if (spec.fp32_master) {
          std::memcpy(arena_.data() + p->master_init.offset, init.data(), slice * 4);
        } else {
          std::memcpy(arena_.data() + p->params.offset, init.data(), slice * 4);
        }
      }
      ASSERT_TRUE(engine->sessions->Release(key_, {p->id}).ok());
    }
  }

  // Micro-batch `micro` of step `step`: the same gradient for an element of
  // a tensor however it is sliced; zeros in the padding.
  void ReturnGradients(int step, int micro = 0, bool overflow = false) {
    for (const Part& part : parts_) {
      const PartitionInfo& p = part.info;
      ASSERT_TRUE(engine_->sessions->Fetch(key_, {p.id}, FetchMode{true, false}).ok());
      auto* g = reinterpret_cast<float*>(arena_.data() + p.grads.offset);
      for (uint64_t j = 0; j < p.numel; ++j) {
        const uint64_t e = part.offset + j;
        g[j] = e < kTensors[part.tensor].numel ? Value(1000 + 10 * step + micro, e) : 0.0f;
        if (overflow && e == 0) g[j] = INFINITY;
      }
      ASSERT_TRUE(engine_->sessions->ReturnGradients(key_, p.id, p.numel, DType::kFp32).ok());
      ASSERT_TRUE(engine_->sessions->Release(key_, {p.id}).ok());
    }
  }

  StepSummary Step() {
    AdamHyperparams h;
    h.lr = 1e-2;
    h.weight_decay = 0.01;
    auto s = engine_->sessions->Step(key_, h);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : StepSummary{};
  }

  // This rank's elements of every tensor (widened), into `full`.
  void Gather(std::map<std::string, std::vector<float>>* full) const {
    for (const Part& part : parts_) {
      const TensorDef& t = kTensors[part.tensor];
      std::vector<float>& out = (*full)[t.name];
      out.resize(t.numel);
      auto held = engine_->sessions->Fetch(key_, {part.info.id});
      ASSERT_TRUE(held.ok()) << held.status();
      std::vector<float> wide(part.info.numel);
      WidenToFloat(arena_.data() + (*held)[0].params.offset, o_.dtype, wide.data(), wide.size());
      for (uint64_t j = 0; j < part.info.numel && part.offset + j < t.numel; ++j) {
        out[part.offset + j] = wide[j];
      }
      EXPECT_EQ((*held)[0].step, part_step_ = (*held)[0].step);
      ASSERT_TRUE(engine_->sessions->Release(key_, {part.info.id}).ok());
    }
  }

  double LossScale() { return engine_->sessions->Pending(key_)->loss_scale; }
  const SessionKey& key() const { return key_; }
  uint64_t step() const { return part_step_; }

 private:
  struct Part {
    PartitionInfo info;
    size_t tensor;
    uint64_t offset;
  };
  TestEngine* engine_;
  Options o_;
  SessionKey key_;
  HostMemory arena_;
  std::vector<Part> parts_;
  mutable uint64_t part_step_ = 0;
};

using Snapshot = std::map<std::string, std::vector<float>>;

bool BitEqual(const Snapshot& a, const Snapshot& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, v] : a) {
    const auto& w = b.at(name);
    if (v.size() != w.size() || std::memcmp(v.data(), w.data(), v.size() * 4) != 0) return false;
  }
  return true;
}

struct Case {
  const char* name;
  Options options;
  bool pending_gradients;  // a micro-batch accumulated when checkpointing
  int world_before, world_after;
};

class RestoreTest : public ::testing::TestWithParam<Case> {};

// A job trains 3 steps, checkpoints, trains 3 more; the same job restored
// from the checkpoint into a fresh engine (its own pool and NVMe tier)
// trains the same 3 steps to the same bits.
TEST_P(RestoreTest, ContinuesBitForBit) {
  const Case& c = GetParam();
  const std::string dir = TmpDir(std::string("ckpt-") + c.name);
  TestEngine first(TmpDir(std::string("nvme-a-") + c.name), 64 << 20, 8, kChunk);
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int r = 0; r < c.world_before; ++r) {
    ranks.push_back(std::make_unique<Rank>(&first, r, c.world_before, c.options));
  }
  for (int step = 1; step <= 3; ++step) {
    // With loss scaling, step 2 overflows: skipped, the scale drops.
    const bool overflow = c.options.loss_scaling.has_value() && step == 2;
    for (auto& r : ranks) r->ReturnGradients(step, 0, overflow);
    for (auto& r : ranks) r->Step();
  }
  if (c.pending_gradients) {
    for (auto& r : ranks) r->ReturnGradients(4, 0);
  }
  for (auto& r : ranks) {
    auto written = first.sessions->Checkpoint(r->key(), dir, /*background=*/false);
    ASSERT_TRUE(written.ok()) << written.status();
    EXPECT_FALSE(written->running);
    EXPECT_EQ(written->summary.partitions, std::size(kTensors));
  }
  const double scale = ranks[0]->LossScale();
  std::vector<Snapshot> expected;
  for (int step = 4; step <= 6; ++step) {
    for (auto& r : ranks) r->ReturnGradients(step, c.pending_gradients && step == 4 ? 1 : 0);
    for (auto& r : ranks) r->Step();
    Snapshot s;
    for (auto& r : ranks) r->Gather(&s);
    expected.push_back(s);
  }

  TestEngine second(TmpDir(std::string("nvme-b-") + c.name), 64 << 20, 8, kChunk);
  Options o = c.options;
  o.restore_from = dir;
  std::vector<std::unique_ptr<Rank>> restored;
  for (int r = 0; r < c.world_after; ++r) {
    restored.push_back(std::make_unique<Rank>(&second, r, c.world_after, o));
  }
  EXPECT_EQ(restored[0]->LossScale(), scale);
  for (int step = 4; step <= 6; ++step) {
    for (auto& r : restored) r->ReturnGradients(step, c.pending_gradients && step == 4 ? 1 : 0);
    for (auto& r : restored) r->Step();
    Snapshot s;
    for (auto& r : restored) r->Gather(&s);
    EXPECT_TRUE(BitEqual(s, expected[step - 4])) << "step " << step;
  }
  EXPECT_EQ(restored[0]->step(), ranks[0]->step());
}

Options Bf16StateOnNvme() {
  Options o;
  o.dtype = DType::kBf16;
  o.state_host_percent = 0;
  return o;
}

Options Fp16LossScaled() {
  Options o;
  o.dtype = DType::kFp16;
  LossScalingOptions l;
  l.initial_scale = 1024;
  l.hysteresis = 1;
  o.loss_scaling = l;
  return o;
}

Options Delayed() {
  Options o = Bf16StateOnNvme();
  o.delayed_update = true;
  return o;
}

INSTANTIATE_TEST_SUITE_P(
    Checkpoint, RestoreTest,
    ::testing::Values(Case{"fp32", Options{}, false, 1, 1},
                      Case{"bf16_state_on_nvme", Bf16StateOnNvme(), false, 1, 1},
                      Case{"pending_gradients", Bf16StateOnNvme(), true, 2, 2},
                      Case{"fp16_loss_scaled", Fp16LossScaled(), false, 1, 1},
                      Case{"delayed_update", Delayed(), false, 1, 1},
                      Case{"two_ranks_to_one", Bf16StateOnNvme(), false, 2, 1},
                      Case{"two_ranks_to_three", Options{}, false, 2, 3}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// A job's checkpoint into one directory that only some ranks committed
// (offloadd died, or a rank's disk filled, between their commits) leaves
// every rank's checkpoint before it there: a restore refuses the mix and
// names the step all hold, and restores it when asked.
TEST(Checkpoint, ARanksUnfinishedCheckpointLeavesThePreviousOneRestorable) {
  const std::string dir = TmpDir("ckpt-partial");
  TestEngine first(TmpDir("nvme-partial-a"), 64 << 20, 8, kChunk);
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int r = 0; r < 2; ++r) ranks.push_back(std::make_unique<Rank>(&first, r, 2, Options{}));
  std::vector<Snapshot> expected;
  for (int step = 1; step <= 5; ++step) {
    for (auto& r : ranks) r->ReturnGradients(step);
    for (auto& r : ranks) r->Step();
    if (step == 2) {
      for (auto& r : ranks) ASSERT_TRUE(first.sessions->Checkpoint(r->key(), dir, false).ok());
    }
    if (step == 3) {  // rank 1's never commits
      ASSERT_TRUE(first.sessions->Checkpoint(ranks[0]->key(), dir, false).ok());
    }
    if (step >= 3) {
      Snapshot s;
      for (auto& r : ranks) r->Gather(&s);
      expected.push_back(s);
    }
  }
  TestEngine second(TmpDir("nvme-partial-b"), 64 << 20, 8, kChunk);
  auto mixed = second.sessions->Open("job/rank0", {}, std::nullopt, std::nullopt, dir);
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kFailedPrecondition) << mixed.status();
  EXPECT_NE(mixed.status().message().find("All of them hold step 2"), absl::string_view::npos)
      << mixed.status();
  Options o;
  o.restore_from = dir;
  o.restore_steps = 2;
  std::vector<std::unique_ptr<Rank>> restored;
  for (int r = 0; r < 2; ++r) restored.push_back(std::make_unique<Rank>(&second, r, 2, o));
  for (int step = 3; step <= 5; ++step) {
    for (auto& r : restored) r->ReturnGradients(step);
    for (auto& r : restored) r->Step();
    Snapshot s;
    for (auto& r : restored) r->Gather(&s);
    EXPECT_TRUE(BitEqual(s, expected[step - 3])) << "step " << step;
  }
}

TEST(RestoreErrors, SayWhatIsWrong) {
  TestEngine engine(TmpDir("nvme-errors"), 64 << 20, 8, kChunk);
  EXPECT_EQ(
      engine.sessions->Open("x", {}, std::nullopt, std::nullopt, TmpDir("none")).status().code(),
      absl::StatusCode::kNotFound);
  EXPECT_EQ(engine.sessions->Open("x", {}, std::nullopt, std::nullopt, "relative").status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string dir = TmpDir("ckpt-errors");
  {
    Rank r(&engine, 0, 1, Options{});
    r.ReturnGradients(1);
    r.Step();
    EXPECT_EQ(engine.sessions->Checkpoint(r.key(), "rel/dir", false).status().code(),
              absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(engine.sessions->Checkpoint(r.key(), dir, false).ok());
    EXPECT_EQ(engine.sessions->WaitCheckpoint(r.key()).status().code(),
              absl::StatusCode::kFailedPrecondition);  // none in the background
  }
  auto opened = engine.sessions->Open("y", {}, std::nullopt, std::nullopt, dir);
  ASSERT_TRUE(opened.ok()) << opened.status();
  PartitionSpec unknown{"zzz", 10, DType::kFp32, DType::kFp32};
  EXPECT_EQ(engine.sessions->Register(opened->key, unknown).status().code(),
            absl::StatusCode::kNotFound);
  PartitionSpec other_dtype{"a", kTensors[0].numel, DType::kBf16, DType::kFp32};
  EXPECT_EQ(engine.sessions->Register(opened->key, other_dtype).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A slice reaching past what the checkpoint holds.
  PartitionSpec beyond{"b", 10, DType::kFp32, DType::kFp32};
  beyond.tensor_offset = 7000;
  beyond.shape = {8000};
  EXPECT_EQ(engine.sessions->Register(opened->key, beyond).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // What was refused holds nothing: the right registration still works.
  PartitionSpec right{"c", 3, DType::kFp32, DType::kFp32};
  auto ok = engine.sessions->Register(opened->key, right);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(ok->restored);
  EXPECT_EQ(ok->step, 1u);
}

// A partition registered without a tensor or shape (its own tensor)
// restores only at the size it was checkpointed with: neither filled with
// zeros past it nor cut.
TEST(RestoreErrors, APartitionWithoutAShapeRestoresOnlyAtItsSize) {
  TestEngine engine(TmpDir("nvme-noshape"), 64 << 20, 8, kChunk);
  const std::string dir = TmpDir("ckpt-noshape");
  {
    auto opened = engine.sessions->Open("solo");
    ASSERT_TRUE(opened.ok()) << opened.status();
    auto p = engine.sessions->Register(opened->key,
                                       PartitionSpec{"w", 1000, DType::kFp32, DType::kFp32});
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(engine.sessions->Release(opened->key, {p->id}).ok());
    ASSERT_TRUE(engine.sessions->Checkpoint(opened->key, dir, false).ok());
    ASSERT_TRUE(engine.sessions->Close(opened->key).ok());
  }
  auto opened = engine.sessions->Open("solo", {}, std::nullopt, std::nullopt, dir);
  ASSERT_TRUE(opened.ok()) << opened.status();
  for (uint64_t numel : {1200, 800}) {
    auto other = engine.sessions->Register(opened->key,
                                           PartitionSpec{"w", numel, DType::kFp32, DType::kFp32});
    EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition) << other.status();
    EXPECT_NE(other.status().message().find("holds 1000 elements of it, not"),
              absl::string_view::npos)
        << other.status();
  }
  // A slice of it past what was checkpointed: padding, as more ranks have
  // (without a shape it cannot be told from a rank's missing elements).
  PartitionSpec past{"w1", 500, DType::kFp32, DType::kFp32};
  past.tensor = "w";
  past.tensor_offset = 1000;
  auto padding = engine.sessions->Register(opened->key, past);
  EXPECT_TRUE(padding.ok()) << padding.status();
  auto right =
      engine.sessions->Register(opened->key, PartitionSpec{"w", 1000, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(right.ok()) << right.status();
  EXPECT_TRUE(right->restored);
}

// Records every chunk a checkpoint captures.
class RecordingSink : public ChunkSink {
 public:
  absl::Status Write(uint64_t id, uint64_t chunk, int kind,
                     absl::Span<const std::byte> bytes) override {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] =
        chunks_.emplace(std::make_tuple(id, chunk, kind),
                        std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
    EXPECT_TRUE(inserted) << "chunk " << chunk << " kind " << kind << " captured twice";
    return absl::OkStatus();
  }
  std::map<std::tuple<uint64_t, uint64_t, int>, std::string> chunks() {
    absl::MutexLock lock(&mu_);
    return chunks_;
  }

 private:
  absl::Mutex mu_;
  std::map<std::tuple<uint64_t, uint64_t, int>, std::string> chunks_ ABSL_GUARDED_BY(mu_);
};

// Two sets with the same history. One is captured whole at once; in the
// other a step and an accumulation run while its checkpoint is open, and
// capture first what they change: both checkpoints hold the same bytes.
TEST(CopyOnWrite, AStepDuringACheckpointChangesNothingInIt) {
  TestEngine engine(TmpDir("nvme-cow"), 64 << 20, 8, kChunk);
  const uint64_t numel = 3 * kChunk + 10;
  auto make = [&](uint64_t session) {
    auto set = engine.store->CreateStore(session, All(0));  // everything on NVMe
    EXPECT_TRUE(set.ok());
    auto p = (*set)->Register(7 + session, PartitionSpec{"w", numel, DType::kFp32, DType::kFp32});
    EXPECT_TRUE(p.ok()) << p.status();
    auto region = HostMemory::MapShared((*set)->arena_fd(), 0, p->span.offset + p->span.bytes);
    for (uint64_t j = 0; j < numel; ++j) {
      reinterpret_cast<float*>(region->data() + p->params.offset)[j] = Value(1, j);
    }
    EXPECT_TRUE((*set)->Release({p->id}).ok());
    for (int step = 1; step <= 2; ++step) {
      EXPECT_TRUE((*set)->Fetch({p->id}, FetchMode{true, false}).ok());
      for (uint64_t j = 0; j < numel; ++j) {
        reinterpret_cast<float*>(region->data() + p->grads.offset)[j] = Value(step + 5, j);
      }
      EXPECT_TRUE(engine.steps->Accumulate(**set, p->id, numel, DType::kFp32).ok());
      EXPECT_TRUE((*set)->Release({p->id}).ok());
      if (step == 1) {
        AdamHyperparams h;
        h.lr = 0.1;
        EXPECT_TRUE(engine.steps->Run(**set, h, false, {}).ok());
      }
    }
    // Gradients of step 2 are pending: the checkpoint holds them too.
    return std::make_pair(*std::move(set), *p);
  };
  auto [quiet, qp] = make(1);
  auto [busy, bp] = make(2);

  RecordingSink whole, cow;
  auto quiet_image = quiet->BeginCheckpoint(&whole);
  ASSERT_TRUE(quiet_image.ok()) << quiet_image.status();
  for (uint64_t c = 0; c < 4; ++c) quiet->CaptureChunk(qp.id, c);
  ASSERT_TRUE(quiet->EndCheckpoint().ok());

  auto busy_image = busy->BeginCheckpoint(&cow);
  ASSERT_TRUE(busy_image.ok());
  ASSERT_EQ(busy_image->partitions.size(), 1u);
  EXPECT_TRUE(busy_image->partitions[0].grads_ready);
  // The step consumes the pending gradients and updates every chunk.
  AdamHyperparams h;
  h.lr = 0.1;
  auto stepped = engine.steps->Run(*busy, h, false, {});
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(cow.chunks().size(), 4u * 5);  // every chunk's 5 kinds, before the update
  for (uint64_t c = 0; c < 4; ++c) busy->CaptureChunk(bp.id, c);  // nothing left to do
  ASSERT_TRUE(busy->EndCheckpoint().ok());

  auto a = whole.chunks(), b = cow.chunks();
  ASSERT_EQ(a.size(), b.size());
  for (auto ia = a.begin(), ib = b.begin(); ia != a.end(); ++ia, ++ib) {
    EXPECT_EQ(std::get<1>(ia->first), std::get<1>(ib->first));
    EXPECT_EQ(std::get<2>(ia->first), std::get<2>(ib->first));
    EXPECT_TRUE(ia->second == ib->second)
        << "chunk " << std::get<1>(ia->first) << " kind " << std::get<2>(ia->first);
  }
  EXPECT_EQ(busy->steps(), 2u);  // the step did happen
}

// A set whose step fills a small pool: partition "a" (2 chunks) with
// gradients pending, and "b" (43 chunks, no gradients), everything on NVMe,
// with the same history in every engine. A pool of 48 blocks of one chunk's
// kind makes the step's groups 2 chunks (a group stops once it pins an
// eighth of the pool): while the trainer holds b's 43 parameter blocks,
// a's first chunk (master, moments, accumulator, working copy: 5 blocks)
// fills the pool.
struct FullPoolSet {
  static constexpr uint64_t kHeld = 43;
  static uint64_t Block() { return HostPool::Charge(kChunk * sizeof(float)); }

  // Partitions `first_id` (a) and `first_id` + 1 (b): ids are the node's,
  // so two sets in one engine need different ones.
  FullPoolSet(TestEngine& engine, uint64_t session, uint64_t first_id = 1) {
    auto made = engine.store->CreateStore(session, All(0));
    EXPECT_TRUE(made.ok()) << made.status();
    set = *std::move(made);
    auto pa = set->Register(first_id, PartitionSpec{"a", 2 * kChunk, DType::kFp32, DType::kFp32});
    auto pb =
        set->Register(first_id + 1, PartitionSpec{"b", kHeld * kChunk, DType::kFp32, DType::kFp32});
    EXPECT_TRUE(pa.ok() && pb.ok()) << pa.status() << pb.status();
    a = *pa;
    b = *pb;
    region = *HostMemory::MapShared(set->arena_fd(), 0, b.span.offset + b.span.bytes);
    for (const PartitionInfo* p : {&a, &b}) {
      auto* w = reinterpret_cast<float*>(region.data() + p->params.offset);
      for (uint64_t j = 0; j < p->numel; ++j) w[j] = Value(p->id, j);
    }
    EXPECT_TRUE(set->Release({a.id, b.id}).ok());
    EXPECT_TRUE(set->Fetch({a.id}, FetchMode{true, false}).ok());
    auto* g = reinterpret_cast<float*>(region.data() + a.grads.offset);
    for (uint64_t j = 0; j < a.numel; ++j) g[j] = Value(9, j);
    EXPECT_TRUE(engine.steps->Accumulate(*set, a.id, a.numel, DType::kFp32).ok());
    EXPECT_TRUE(set->Release({a.id}).ok());
  }

  // Captures every chunk not captured yet and ends the checkpoint.
  absl::Status FinishCheckpoint() {
    for (const PartitionInfo* p : {&a, &b}) {
      for (uint64_t c = 0; c < p->numel / kChunk; ++c) set->CaptureChunk(p->id, c);
    }
    return set->EndCheckpoint();
  }

  std::unique_ptr<PartitionStore> set;
  PartitionInfo a, b;
  HostMemory region;
};

// A synchronous step of `set` (lr 0.1).
absl::StatusOr<StepSummary> RunStep(TestEngine& engine, PartitionStore& set) {
  AdamHyperparams h;
  h.lr = 0.1;
  return engine.steps->Run(set, h, false, {});
}

// A step of `set` on its own thread, held at the first `point` it reaches
// until Go(); the destructor lets it go and joins it.
class HeldStep {
 public:
  HeldStep(TestEngine& engine, PartitionStore& set, StepPoint point) : engine_(engine) {
    engine.steps->SetSyncPointForTesting([this, point](StepPoint at) {
      if (at != point || reached_.HasBeenNotified()) return;
      reached_.Notify();
      go_.WaitForNotification();
    });
    thread_ = std::thread([this, &set] { result_ = RunStep(engine_, set); });
    reached_.WaitForNotification();
  }
  ~HeldStep() { Join(); }
  void Go() {
    if (!go_.HasBeenNotified()) go_.Notify();
  }
  // Lets it go and waits for its end.
  const absl::StatusOr<StepSummary>& Join() {
    Go();
    if (thread_.joinable()) thread_.join();
    engine_.steps->SetSyncPointForTesting(nullptr);
    return result_;
  }

 private:
  TestEngine& engine_;
  absl::Notification reached_, go_;
  absl::StatusOr<StepSummary> result_;
  std::thread thread_;
};

// The checkpoint of a FullPoolSet with nothing running, chunk by chunk.
std::map<std::tuple<uint64_t, uint64_t, int>, std::string> QuietCheckpoint() {
  TestEngine engine(TmpDir("nvme-quiet"), 64 << 20, 8, kChunk);
  FullPoolSet quiet(engine, 1);
  RecordingSink sink;
  EXPECT_TRUE(quiet.set->BeginCheckpoint(&sink).ok());
  EXPECT_TRUE(quiet.FinishCheckpoint().ok());
  return sink.chunks();
}

// `work` on a thread of its own, for a call that must not wait for room in
// the pool: Ended() says whether it ended within 20 s (a call that waits
// fails the test instead of hanging it); Join() waits for it, which the test
// does once it has given the room back.
class Background {
 public:
  explicit Background(std::function<void()> work)
      : thread_([this, work = std::move(work)] {
          work();
          done_.Notify();
        }) {}
  ~Background() { Join(); }
  bool Ended() { return done_.WaitForNotificationWithTimeout(absl::Seconds(20)); }
  void Join() {
    if (thread_.joinable()) thread_.join();
  }

 private:
  absl::Notification done_;
  std::thread thread_;
};

// A step whose group fills the pool while the trainer holds most of it:
// the capture the step makes before changing a chunk reads the blocks it
// pinned, needing no room of its own.
TEST(CopyOnWrite, AStepsCaptureNeedsNoRoomInThePoolItsOwnPinsFill) {
  TestEngine engine(TmpDir("nvme-full-step"), 48 * FullPoolSet::Block(), 8, kChunk);
  FullPoolSet busy(engine, 2);
  ASSERT_TRUE(busy.set->Fetch({busy.b.id}).ok());  // the forward pass holds b
  RecordingSink sink;
  ASSERT_TRUE(busy.set->BeginCheckpoint(&sink).ok());
  auto stepped = RunStep(engine, *busy.set);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(stepped->partitions_updated, 1u);
  EXPECT_EQ(engine.swapper->Stats().copy_outs, 0u);
  ASSERT_TRUE(busy.set->Release({busy.b.id}).ok());
  absl::Status ended = busy.FinishCheckpoint();
  ASSERT_TRUE(ended.ok()) << ended;
  EXPECT_EQ(sink.chunks(), QuietCheckpoint());
}

// The checkpoint's writer finds the pool full of a running step's pins and
// the trainer's holds: it captures without waiting for the step.
TEST(CopyOnWrite, TheWritersCaptureNeedsNoRoomWhileAStepFillsThePool) {
  TestEngine engine(TmpDir("nvme-full-writer"), 48 * FullPoolSet::Block(), 8, kChunk);
  FullPoolSet busy(engine, 2);
  ASSERT_TRUE(busy.set->Fetch({busy.b.id}).ok());
  RecordingSink sink;
  ASSERT_TRUE(busy.set->BeginCheckpoint(&sink).ok());
  // The step stops with its first group pinned: the pool is full.
  HeldStep step(engine, *busy.set, StepPoint::kGroupPinned);
  ASSERT_EQ(engine.pool->used(), engine.pool->limit());
  const uint64_t copied = engine.swapper->Stats().copy_outs;
  // a's second chunk, on NVMe (the step could not pin it), while the step
  // is still held.
  Background writer([&] { busy.set->CaptureChunk(busy.a.id, 1); });
  EXPECT_TRUE(writer.Ended());
  EXPECT_GT(engine.swapper->Stats().copy_outs, copied);
  EXPECT_EQ(engine.pool->used(), engine.pool->limit());  // and never more
  const absl::StatusOr<StepSummary>& stepped = step.Join();
  writer.Join();
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  ASSERT_TRUE(busy.set->Release({busy.b.id}).ok());
  absl::Status ended = busy.FinishCheckpoint();
  ASSERT_TRUE(ended.ok()) << ended;
  EXPECT_EQ(sink.chunks(), QuietCheckpoint());
}

// Nothing runs and nothing can leave the pool: every byte of it is held,
// by the checkpointed session's trainer or by another session's. The
// checkpoint still completes, equal to one taken with room to spare, and
// the pool's limit holds throughout.
TEST(CopyOnWrite, APoolFullOfHeldPartitionsDoesNotFailTheCheckpoint) {
  for (bool held_by_other_session : {false, true}) {
    SCOPED_TRACE(held_by_other_session ? "held by another session" : "held by its trainer");
    TestEngine engine(TmpDir("nvme-full-held"), 64 << 20, 8, kChunk);
    FullPoolSet mine(engine, 1);
    std::optional<FullPoolSet> other;
    if (held_by_other_session) other.emplace(engine, 2, /*first_id=*/11);
    FullPoolSet& holder = held_by_other_session ? *other : mine;
    ASSERT_TRUE(holder.set->Fetch({holder.a.id, holder.b.id}).ok());
    // Everything not held goes to NVMe, and the pool shrinks to the holds.
    const uint64_t limit = engine.pool->limit();
    engine.pool->SetLimit(0);
    engine.swapper->Trim();
    engine.swapper->WaitIdle();
    ASSERT_GT(engine.pool->used(), 0u);
    engine.pool->SetLimit(engine.pool->used());
    RecordingSink sink;
    ASSERT_TRUE(mine.set->BeginCheckpoint(&sink).ok());
    absl::Status ended;
    Background writer([&] { ended = mine.FinishCheckpoint(); });
    EXPECT_TRUE(writer.Ended());
    EXPECT_LE(engine.pool->used(), engine.pool->limit());
    EXPECT_GT(engine.swapper->Stats().copy_outs, 0u);
    ASSERT_TRUE(holder.set->Release({holder.a.id, holder.b.id}).ok());
    engine.pool->SetLimit(limit);
    writer.Join();
    ASSERT_TRUE(ended.ok()) << ended;
    EXPECT_EQ(sink.chunks(), QuietCheckpoint());
  }
}

// A checkpoint whose disk fills up (its sink says RESOURCE_EXHAUSTED) fails;
// the step that captures chunks meanwhile does not.
TEST(CopyOnWrite, AFullCheckpointDiskFailsTheCheckpointNotTheStep) {
  class FullDisk : public ChunkSink {
   public:
    absl::Status Write(uint64_t, uint64_t, int, absl::Span<const std::byte>) override {
      ++writes;
      return absl::ResourceExhaustedError("writing the checkpoint: No space left (ENOSPC)");
    }
    std::atomic<int> writes{0};
  } sink;
  TestEngine engine(TmpDir("nvme-full-disk"), 64 << 20, 8, kChunk);
  FullPoolSet busy(engine, 2);
  ASSERT_TRUE(busy.set->BeginCheckpoint(&sink).ok());
  auto stepped = RunStep(engine, *busy.set);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(stepped->partitions_updated, 1u);
  absl::Status ended = busy.FinishCheckpoint();
  EXPECT_EQ(ended.code(), absl::StatusCode::kResourceExhausted) << ended;
  EXPECT_EQ(sink.writes.load(), 1);  // once failed, no more I/O for it
  EXPECT_EQ(busy.set->steps(), 1u);
}

// With no room in the pool at all, every block of a checkpoint is copied out
// of the NVMe tier: a bf16 working copy and a last chunk shorter than the
// others (blocks smaller than the staging buffer) reach the sink with their
// own sizes and bytes, as a checkpoint taken with room to spare has them.
TEST(CopyOnWrite, ACheckpointWithNoRoomInThePoolEqualsOneWithRoom) {
  auto checkpoint = [](bool room) {
    TestEngine engine(TmpDir(room ? "nvme-room" : "nvme-no-room"), 64 << 20, 8, kChunk);
    auto set = engine.store->CreateStore(1, All(0));
    EXPECT_TRUE(set.ok()) << set.status();
    const uint64_t numel = 2 * kChunk + kChunk / 2;
    auto p = (*set)->Register(7, PartitionSpec{"h", numel, DType::kBf16, DType::kBf16});
    EXPECT_TRUE(p.ok()) << p.status();
    auto region = HostMemory::MapShared((*set)->arena_fd(), 0, p->span.offset + p->span.bytes);
    auto* w = reinterpret_cast<uint16_t*>(region->data() + p->params.offset);
    for (uint64_t j = 0; j < numel; ++j) w[j] = static_cast<uint16_t>(0x3f80 + j % 97);
    EXPECT_TRUE((*set)->Release({p->id}).ok());
    EXPECT_TRUE((*set)->Fetch({p->id}, FetchMode{true, false}).ok());
    auto* g = reinterpret_cast<uint16_t*>(region->data() + p->grads.offset);
    for (uint64_t j = 0; j < numel; ++j) g[j] = static_cast<uint16_t>(0x3c00 + j % 89);
    EXPECT_TRUE(engine.steps->Accumulate(**set, p->id, numel, DType::kBf16).ok());
    EXPECT_TRUE((*set)->Release({p->id}).ok());
    EXPECT_TRUE(RunStep(engine, **set).ok());
    // Everything to NVMe; without room, nothing comes back into the pool.
    engine.pool->SetLimit(0);
    engine.swapper->Trim();
    engine.swapper->WaitIdle();
    if (room) engine.pool->SetLimit(64 << 20);
    RecordingSink sink;
    EXPECT_TRUE((*set)->BeginCheckpoint(&sink).ok());
    for (uint64_t c = 0; c < 3; ++c) (*set)->CaptureChunk(p->id, c);
    EXPECT_TRUE((*set)->EndCheckpoint().ok());
    EXPECT_EQ(engine.swapper->Stats().copy_outs > 0, !room);
    if (!room) {
      EXPECT_EQ(engine.pool->used(), 0u);
    }
    return sink.chunks();
  };
  const auto with_room = checkpoint(true);
  ASSERT_FALSE(with_room.empty());
  EXPECT_EQ(checkpoint(false), with_room);
}

// A capture whose first block takes the pool's last room finds none for
// the next ones: it copies them out, and each kind reaches the sink once
// (RecordingSink fails the test on a second write), with the bytes as they
// were when the checkpoint began.
TEST(CopyOnWrite, ACaptureThatLosesItsRoomMidwayCopiesTheRestOut) {
  TestEngine engine(TmpDir("nvme-resume"), 64 << 20, 8, kChunk);
  FullPoolSet busy(engine, 2);
  // Everything to NVMe, so that the captures read it back.
  const uint64_t limit = engine.pool->limit();
  engine.pool->SetLimit(0);
  engine.swapper->Trim();
  engine.swapper->WaitIdle();
  engine.pool->SetLimit(limit);
  ASSERT_EQ(engine.pool->used(), 0u);
  RecordingSink sink;
  ASSERT_TRUE(busy.set->BeginCheckpoint(&sink).ok());
  // The capture's first swap-in (a's first kind of chunk 0) takes the
  // pool's room away.
  absl::Notification limited;
  engine.swapper->SetIoHookForTesting([&](uint64_t, bool is_write) {
    if (is_write || limited.HasBeenNotified()) return;
    engine.pool->SetLimit(0);
    limited.Notify();
  });
  busy.set->CaptureChunk(busy.a.id, 0);
  EXPECT_TRUE(limited.HasBeenNotified());
  EXPECT_GT(engine.swapper->Stats().copy_outs, 0u);
  engine.swapper->SetIoHookForTesting(nullptr);
  engine.pool->SetLimit(limit);
  absl::Status ended = busy.FinishCheckpoint();
  ASSERT_TRUE(ended.ok()) << ended;
  EXPECT_EQ(sink.chunks(), QuietCheckpoint());
}

// A partition held for writing is being changed by its trainer: a
// checkpoint waits for the release (refuses); a writable hold taken while a
// checkpoint runs gets its chunks captured before the fetch returns.
TEST(CopyOnWrite, WritableHoldsAreNeverCapturedMidWrite) {
  TestEngine engine(TmpDir("nvme-writable"), 64 << 20, 8, kChunk);
  auto set = engine.store->CreateStore(1);
  ASSERT_TRUE(set.ok());
  const uint64_t numel = 2 * kChunk;
  auto p = (*set)->Register(5, PartitionSpec{"w", numel, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok());
  RecordingSink sink;
  // Registered: held for its initial values.
  auto refused = (*set)->BeginCheckpoint(&sink);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("held for writing"), std::string::npos)
      << refused.status();
  auto region = HostMemory::MapShared((*set)->arena_fd(), 0, p->span.offset + p->span.bytes);
  auto* w = reinterpret_cast<float*>(region->data() + p->params.offset);
  for (uint64_t j = 0; j < numel; ++j) w[j] = Value(3, j);
  ASSERT_TRUE((*set)->Release({p->id}).ok());
  // A read-only hold is fine; a second checkpoint while one runs is not.
  ASSERT_TRUE((*set)->Fetch({p->id}).ok());
  ASSERT_TRUE((*set)->BeginCheckpoint(&sink).ok());
  EXPECT_EQ((*set)->BeginCheckpoint(&sink).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*set)->Release({p->id}).ok());
  // Writable now: its chunks are in the checkpoint before the trainer
  // has the pointers, so what it writes next is not.
  ASSERT_TRUE((*set)->Fetch({p->id}, FetchMode{false, true}).ok());
  EXPECT_EQ(sink.chunks().size(), 2u);
  for (uint64_t j = 0; j < numel; ++j) w[j] = -1.0f;
  for (uint64_t c = 0; c < 2; ++c) (*set)->CaptureChunk(p->id, c);
  ASSERT_TRUE((*set)->EndCheckpoint().ok());
  for (const auto& [key, bytes] : sink.chunks()) {
    const auto* v = reinterpret_cast<const float*>(bytes.data());
    const uint64_t begin = std::get<1>(key) * kChunk;
    for (uint64_t j = 0; j < bytes.size() / 4; ++j) ASSERT_EQ(v[j], Value(3, begin + j));
  }
}

TEST(CopyOnWrite, BackgroundCheckpointWhileTrainingRestoresTheStateAtItsStart) {
  const std::string dir = TmpDir("ckpt-background");
  TestEngine first(TmpDir("nvme-bg-a"), 64 << 20, 8, kChunk);
  Rank r(&first, 0, 1, Bf16StateOnNvme());
  for (int step = 1; step <= 2; ++step) {
    r.ReturnGradients(step);
    r.Step();
  }
  auto started = first.sessions->Checkpoint(r.key(), dir, /*background=*/true);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_TRUE(started->running);
  EXPECT_EQ(started->summary.steps, 2u);
  std::vector<Snapshot> expected;
  for (int step = 3; step <= 5; ++step) {  // while it is written
    r.ReturnGradients(step);
    r.Step();
    Snapshot s;
    r.Gather(&s);
    expected.push_back(s);
  }
  auto done = first.sessions->WaitCheckpoint(r.key());
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->summary.steps, 2u);
  EXPECT_FALSE(done->summary.manifest.empty());

  TestEngine second(TmpDir("nvme-bg-b"), 64 << 20, 8, kChunk);
  Options o = Bf16StateOnNvme();
  o.restore_from = dir;
  Rank q(&second, 0, 1, o);
  for (int step = 3; step <= 5; ++step) {
    q.ReturnGradients(step);
    q.Step();
    Snapshot s;
    q.Gather(&s);
    EXPECT_TRUE(BitEqual(s, expected[step - 3])) << "step " << step;
  }
}

}  // namespace
}  // namespace offload
