#include "gpu/param_cache.h"

#include <atomic>
#include <cstring>
#include <map>
#include <numeric>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gpu/emulated_device.h"
#include "gtest/gtest.h"

namespace offload::gpu {
namespace {

// Host tensors by key, with a record of every Hold.
class FakeSource : public HostSource {
 public:
  void Add(uint64_t key, uint64_t bytes, uint8_t seed) {
    auto& v = data_[key];
    v.resize(bytes);
    Fill(key, seed);
  }
  void Fill(uint64_t key, uint8_t seed) {
    auto& v = data_[key];
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(seed + i * 31 + key);
  }
  const std::vector<uint8_t>& data(uint64_t key) { return data_[key]; }

  absl::StatusOr<std::vector<Span>> Hold(absl::Span<const uint64_t> keys) override {
    absl::MutexLock l(&mu_);
    ++hold_calls_;
    std::vector<Span> out;
    for (uint64_t k : keys) {
      holds_.push_back(k);
      ++held_[k];
      out.push_back({data_[k].data(), dma_, data_[k].size()});
    }
    return out;
  }
  absl::Status Release(absl::Span<const uint64_t> keys) override {
    absl::MutexLock l(&mu_);
    for (uint64_t k : keys) {
      if (held_[k]-- <= 0) return absl::FailedPreconditionError("released twice");
    }
    return absl::OkStatus();
  }
  std::vector<uint64_t> TakeHolds() {
    absl::MutexLock l(&mu_);
    return std::exchange(holds_, {});
  }
  int hold_calls() {
    absl::MutexLock l(&mu_);
    return hold_calls_;
  }
  int outstanding() {
    absl::MutexLock l(&mu_);
    int n = 0;
    for (auto& [k, c] : held_) n += c;
    return n;
  }
  bool dma_ = true;

 private:
  std::map<uint64_t, std::vector<uint8_t>> data_;
  absl::Mutex mu_;
  std::vector<uint64_t> holds_;
  std::map<uint64_t, int> held_;
  int hold_calls_ = 0;
};

class ParamCacheTest : public ::testing::Test {
 protected:
  // `units` units of `per` tensors of `bytes` each; tensor keys 100*u + t.
  void Declare(ParamCache& cache, int units, int per, uint64_t bytes) {
    for (int u = 0; u < units; ++u) {
      std::vector<std::pair<uint64_t, uint64_t>> t;
      for (int k = 0; k < per; ++k) {
        const uint64_t key = 100 * u + k;
        source_.Add(key, bytes, static_cast<uint8_t>(u));
        t.push_back({key, bytes});
      }
      auto index = cache.AddUnit(t);
      ASSERT_TRUE(index.ok()) << index.status();
      ASSERT_EQ(*index, u);
    }
  }
  // Uses the unit on the host stream and checks what the device holds.
  void UseAndCheck(ParamCache& cache, int unit, int per) {
    auto offsets = cache.Use(unit, host_);
    ASSERT_TRUE(offsets.ok()) << offsets.status();
    for (int k = 0; k < per; ++k) {
      const auto& want = source_.data(100 * unit + k);
      ASSERT_EQ(
          std::memcmp(static_cast<char*>(cache.slab()) + (*offsets)[k], want.data(), want.size()),
          0)
          << "unit " << unit << " tensor " << k << " seen before its copy completed";
    }
    ASSERT_TRUE(cache.Done(unit, host_).ok());
  }

  // A "kernel" on `compute` that reads the tensor at `offset` of the slab
  // 20 ms later, and counts in `good` whether it still held `key`'s values
  // (a copy that did not wait for it overwrote them).
  absl::Status LaunchSlowReader(ParamCache& cache, const Stream& compute, uint64_t offset,
                                uint64_t key, std::atomic<int>* good) {
    const char* at = static_cast<char*>(cache.slab()) + offset;
    const std::vector<uint8_t>* want = &source_.data(key);
    return device_.Launch(compute, [at, want, good] {
      absl::SleepFor(absl::Milliseconds(20));
      *good += std::memcmp(at, want->data(), want->size()) == 0;
    });
  }

  EmulatedDevice device_{{.memory_bytes = 64 << 20,
                          .max_copy_delay = absl::Microseconds(300),
                          .copy_chunk_bytes = 4096}};
  Stream host_ = device_.BorrowStream(nullptr);
  FakeSource source_;
};

TEST_F(ParamCacheTest, UseNeverSeesACopyInFlightAndBudgetHolds) {
  const uint64_t budget = 3 * 2 * (64 << 10);  // three units of the eight
  auto cache =
      ParamCache::Create(&device_, &source_, {.budget_bytes = budget, .prefetch_depth = 2});
  ASSERT_TRUE(cache.ok()) << cache.status();
  Declare(**cache, 8, 2, 64 << 10);
  for (int it = 0; it < 4; ++it) {
    (*cache)->BeginIteration();
    for (int u = 0; u < 8; ++u) UseAndCheck(**cache, u, 2);
    for (int u = 7; u >= 0; --u) UseAndCheck(**cache, u, 2);  // backward
    ASSERT_TRUE((*cache)->Synchronize().ok());
  }
  ParamCacheStats s = (*cache)->stats();
  EXPECT_LE(s.peak_resident_bytes, budget);
  // The device never held more than the slab and the staging buffer's
  // pinned memory is host memory: device use is the budget, measured.
  EXPECT_EQ(device_.peak_bytes(), budget);
  EXPECT_GT(s.prefetch_hits, 0u);
  EXPECT_GT(s.resident_hits, 0u);  // backward finds forward's last units
  // As the daemon checks them (ReportGpuTier): disjoint parts of the uses.
  EXPECT_LE(s.resident_hits + s.prefetch_hits, s.tensor_uses);
  EXPECT_EQ(source_.outstanding(), 0);
  cache->reset();
  EXPECT_EQ(device_.used_bytes(), 0u);
}

// Invalidate keeps each tensor where it is: the next use copies the new
// values into the same place (views of it, such as autograd's saved
// tensors, stay valid), and where room is short a stale tensor is the
// first to give its place up.
TEST_F(ParamCacheTest, InvalidateKeepsEachTensorsPlace) {
  auto cache =
      ParamCache::Create(&device_, &source_, {.budget_bytes = 1 << 20, .prefetch_depth = 2});
  ASSERT_TRUE(cache.ok());
  Declare(**cache, 4, 2, 4096);
  std::map<int, std::vector<uint64_t>> placed;
  (*cache)->BeginIteration();
  for (int u = 0; u < 4; ++u) {
    auto offsets = (*cache)->Use(u, host_);
    ASSERT_TRUE(offsets.ok());
    placed[u] = *offsets;
    ASSERT_TRUE((*cache)->Done(u, host_).ok());
  }
  for (int it = 1; it < 3; ++it) {
    ASSERT_TRUE((*cache)->Invalidate(host_).ok());
    for (int u = 0; u < 4; ++u) {
      for (int k = 0; k < 2; ++k) source_.Fill(100 * u + k, static_cast<uint8_t>(50 * it + u));
    }
    (*cache)->BeginIteration();
    for (int u = 3; u >= 0; --u) {  // another order: the places stay
      auto offsets = (*cache)->Use(u, host_);
      ASSERT_TRUE(offsets.ok());
      EXPECT_EQ(*offsets, placed[u]) << "unit " << u << " moved in iteration " << it;
      ASSERT_TRUE((*cache)->Done(u, host_).ok());
      ASSERT_TRUE((*cache)->Synchronize().ok());
      for (int k = 0; k < 2; ++k) {  // the new values, in place
        const auto& want = source_.data(100 * u + k);
        EXPECT_EQ(std::memcmp(static_cast<char*>((*cache)->slab()) + placed[u][k], want.data(),
                              want.size()),
                  0);
      }
    }
  }
  EXPECT_EQ((*cache)->stats().h2d_bytes, 3u * 4 * 2 * 4096);  // each tensor once an iteration
  EXPECT_EQ((*cache)->stats().evictions, 0u);
}

TEST_F(ParamCacheTest, StaleTensorsGiveTheirPlaceFirst) {
  // Room for two units of four: after Invalidate every tensor is stale and
  // placed; using the other two units evicts stale ones, not a fresh one.
  auto cache =
      ParamCache::Create(&device_, &source_, {.budget_bytes = 4 * 4096, .prefetch_depth = 0});
  ASSERT_TRUE(cache.ok());
  Declare(**cache, 4, 2, 4096);
  (*cache)->BeginIteration();
  UseAndCheck(**cache, 0, 2);
  UseAndCheck(**cache, 1, 2);
  ASSERT_TRUE((*cache)->Invalidate(host_).ok());
  (*cache)->BeginIteration();
  UseAndCheck(**cache, 1, 2);  // fresh again, in place
  const uint64_t evicted = (*cache)->stats().evictions;
  UseAndCheck(**cache, 2, 2);  // takes unit 0's stale place, not unit 1's
  EXPECT_EQ((*cache)->stats().evictions, evicted + 2);
  UseAndCheck(**cache, 1, 2);  // still there: no copy
  // Units 0 and 1, then unit 1 again (in place) and unit 2: 8 tensors.
  EXPECT_EQ((*cache)->stats().h2d_bytes, 8u * 4096);
  EXPECT_LE((*cache)->stats().peak_resident_bytes, 4u * 4096);
}

TEST_F(ParamCacheTest, PrefetchFollowsTheRecordedOrderToItsDepth) {
  auto cache =
      ParamCache::Create(&device_, &source_, {.budget_bytes = 16 << 20, .prefetch_depth = 2});
  ASSERT_TRUE(cache.ok());
  Declare(**cache, 6, 1, 4096);
  const std::vector<int> order = {3, 1, 4, 0, 5, 2};
  (*cache)->BeginIteration();
  for (int u : order) UseAndCheck(**cache, u, 1);
  ASSERT_TRUE((*cache)->Invalidate(host_).ok());
  source_.TakeHolds();
  // Second iteration: Begin prefetches the first two along the order; each
  // Use then brings the one two ahead, and nothing further.
  (*cache)->BeginIteration();
  EXPECT_EQ(source_.TakeHolds(), (std::vector<uint64_t>{300, 100}));
  for (size_t i = 0; i < order.size(); ++i) {
    UseAndCheck(**cache, order[i], 1);
    std::vector<uint64_t> want;
    if (i + 2 < order.size()) want.push_back(100 * order[i + 2]);
    EXPECT_EQ(source_.TakeHolds(), want) << "after use " << i;
  }
  EXPECT_EQ((*cache)->stats().prefetch_hits, 6u);
  // Depth 0: copies start at use.
  ASSERT_TRUE((*cache)->Invalidate(host_).ok());
  (*cache)->SetPrefetch(0, 0);
  (*cache)->BeginIteration();
  EXPECT_TRUE(source_.TakeHolds().empty());
  UseAndCheck(**cache, 3, 1);
  EXPECT_EQ(source_.TakeHolds(), (std::vector<uint64_t>{300}));
}

TEST_F(ParamCacheTest, EvictsByNextUse) {
  // Room for three of four units; the order 0 1 2 3 0: at 3, unit 0 is
  // used again and 1, 2 are not, so 1 or 2 goes (LRU would drop 0).
  auto cache =
      ParamCache::Create(&device_, &source_, {.budget_bytes = 3 * 8192, .prefetch_depth = 0});
  ASSERT_TRUE(cache.ok());
  Declare(**cache, 4, 1, 8192);
  const std::vector<int> order = {0, 1, 2, 3, 0};
  (*cache)->BeginIteration();
  for (int u : order) UseAndCheck(**cache, u, 1);
  ASSERT_TRUE((*cache)->Invalidate(host_).ok());
  (*cache)->BeginIteration();
  source_.TakeHolds();
  for (int u : order) UseAndCheck(**cache, u, 1);
  EXPECT_EQ(source_.TakeHolds(), (std::vector<uint64_t>{0, 100, 200, 300}))
      << "unit 0 was evicted though its next use was nearest";
}

TEST_F(ParamCacheTest, AFailedPrefetchIsReportedAtTheNextUseAndThenRetried) {
  auto cache = ParamCache::Create(&device_, &source_, {.budget_bytes = 1 << 20});
  ASSERT_TRUE(cache.ok());
  Declare(**cache, 4, 1, 8192);  // (unit 3 is used only at the end)
  (*cache)->BeginIteration();
  for (int u = 0; u < 3; ++u) UseAndCheck(**cache, u, 1);
  auto first = (*cache)->Use(2, host_);  // where tensor 200 is (kept across Invalidate)
  ASSERT_TRUE(first.ok() && (*cache)->Done(2, host_).ok());
  ASSERT_TRUE((*cache)->Invalidate(host_).ok());
  const void* bad = source_.data(200).data();
  std::atomic<int> failures{0};
  device_.SetCopyFault([&](void*, const void* src, uint64_t, Direction) {
    if (src != bad || failures.fetch_add(1) > 0) return absl::OkStatus();
    return absl::DataLossError("injected PCIe error");
  });
  (*cache)->BeginIteration();  // prefetches 0 and 1
  UseAndCheck(**cache, 0, 1);  // prefetches 2, which fails
  ASSERT_TRUE((*cache)->Synchronize().ok()) << "no use of 2 was issued";
  UseAndCheck(**cache, 1, 1);
  auto failed = (*cache)->Use(2, host_);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(failed.status().message(), "tensor 200")) << failed.status();
  EXPECT_TRUE(absl::StrContains(failed.status().message(), "host copy is intact"));
  UseAndCheck(**cache, 3, 1);            // placed first: not where 200 is
  auto again = (*cache)->Use(2, host_);  // copied again, in the same place
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *first) << "the failed copy in place gave its place up";
  ASSERT_TRUE((*cache)->Done(2, host_).ok());
  UseAndCheck(**cache, 2, 1);  // correct
  EXPECT_EQ((*cache)->stats().copy_failures, 1u);
  ASSERT_TRUE((*cache)->Synchronize().ok());
  EXPECT_EQ(source_.outstanding(), 0);
}

TEST_F(ParamCacheTest, AFailureAfterItsUseWasIssuedAbortsTheIteration) {
  auto cache =
      ParamCache::Create(&device_, &source_, {.budget_bytes = 1 << 20, .prefetch_depth = 0});
  ASSERT_TRUE(cache.ok());
  Declare(**cache, 1, 1, 8192);
  device_.SetCopyFault([](void*, const void*, uint64_t, Direction) {
    absl::SleepFor(absl::Milliseconds(5));
    return absl::UnavailableError("injected");
  });
  auto stream = device_.CreateStream();  // asynchronous compute: Use does not block
  ASSERT_TRUE(stream.ok());
  (*cache)->BeginIteration();
  ASSERT_TRUE((*cache)->Use(0, *stream).ok());
  ASSERT_TRUE((*cache)->Done(0, *stream).ok());
  (*cache)->AwaitCopies();  // (waits, the report kept for Synchronize)
  absl::Status s = (*cache)->Synchronize();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "run it again")) << s;
  device_.SetCopyFault(nullptr);
  EXPECT_TRUE((*cache)->Synchronize().ok());  // once
  UseAndCheck(**cache, 0, 1);
}

TEST_F(ParamCacheTest, ACopyNeverOverwritesWhatComputeStillReads) {
  // Room for one unit: B goes where A was, and its copy must wait for the
  // "kernel" reading A on an asynchronous compute stream.
  auto cache =
      ParamCache::Create(&device_, &source_, {.budget_bytes = 64 << 10, .prefetch_depth = 0});
  ASSERT_TRUE(cache.ok());
  Declare(**cache, 2, 1, 64 << 10);
  auto compute = device_.CreateStream();
  auto end = device_.CreateEvent();
  ASSERT_TRUE(compute.ok() && end.ok());
  std::atomic<int> good{0};
  (*cache)->BeginIteration();
  for (int u = 0; u < 2; ++u) {
    auto offsets = (*cache)->Use(u, *compute);
    ASSERT_TRUE(offsets.ok()) << offsets.status();
    ASSERT_TRUE(LaunchSlowReader(**cache, *compute, (*offsets)[0], 100 * u, &good).ok());
    ASSERT_TRUE((*cache)->Done(u, *compute).ok());
  }
  ASSERT_TRUE(device_.Record(*end, *compute).ok());
  ASSERT_TRUE(device_.Synchronize(*end).ok());
  EXPECT_EQ(good.load(), 2);
  EXPECT_EQ((*cache)->stats().evictions, 1u);
}

// Where the copy stream cannot be made to wait for that compute (its wait
// fails), the host waits for it instead; where that fails too, the memory
// is not given to another tensor and the use that wanted it fails.
TEST_F(ParamCacheTest, AnEvictionWhoseStreamWaitFailsWaitsOnTheHost) {
  auto compute = device_.CreateStream();
  auto end = device_.CreateEvent();
  ASSERT_TRUE(compute.ok() && end.ok());
  void* const compute_handle = compute->get();
  for (const bool host_wait_fails : {false, true}) {
    SCOPED_TRACE(host_wait_fails ? "the host's wait fails too" : "the stream's wait fails");
    auto cache =
        ParamCache::Create(&device_, &source_, {.budget_bytes = 64 << 10, .prefetch_depth = 0});
    ASSERT_TRUE(cache.ok());
    Declare(**cache, 2, 1, 64 << 10);
    // Only the copy stream's waits fail (the compute stream's wait for its
    // copy is the one a Use needs).
    device_.SetWaitFault([compute_handle](void* stream, void*) {
      return stream == compute_handle ? absl::OkStatus()
                                      : absl::UnavailableError("injected stream-wait failure");
    });
    std::atomic<int> good{0};
    (*cache)->BeginIteration();
    auto first = (*cache)->Use(0, *compute);
    ASSERT_TRUE(first.ok()) << first.status();
    ASSERT_TRUE(LaunchSlowReader(**cache, *compute, (*first)[0], 0, &good).ok());
    ASSERT_TRUE((*cache)->Done(0, *compute).ok());
    (*cache)->AwaitCopies();  // (the host's wait that fails is the eviction's)
    if (host_wait_fails) {
      (*cache)->SetHostWait(
          [](const Event&) { return absl::InternalError("injected host-wait failure"); });
    }
    auto second = (*cache)->Use(1, *compute);
    if (host_wait_fails) {
      EXPECT_EQ(second.status().code(), absl::StatusCode::kInternal) << second.status();
      EXPECT_TRUE(absl::StrContains(second.status().message(), "cannot reuse")) << second.status();
      EXPECT_EQ((*cache)->stats().evictions, 0u);
    } else {
      ASSERT_TRUE(second.ok()) << second.status();
      ASSERT_TRUE((*cache)->Done(1, *compute).ok());
      EXPECT_EQ((*cache)->stats().evictions, 1u);
    }
    ASSERT_TRUE(device_.Record(*end, *compute).ok());
    ASSERT_TRUE(device_.Synchronize(*end).ok());
    EXPECT_EQ(good.load(), 1) << "the compute read a tensor overwritten under it";
    device_.SetWaitFault(nullptr);
    (*cache)->SetHostWait(nullptr);
    EXPECT_TRUE((*cache)->Synchronize().ok());
  }
}

// A use whose tensors fit the budget only in one piece, split by one of its
// own tensors resident between two others (a tied weight brought in by
// another unit): that tensor moves, copied again with the rest (the use
// was refused, with room enough in all). The largest tensor is placed first.
TEST_F(ParamCacheTest, AUsesOwnResidentTensorMovesWhereItSplitsTheRoom) {
  // Once as they are, once after a step made them stale (each copied into
  // its place, unless it must move).
  for (const bool stale : {false, true}) {
    SCOPED_TRACE(stale ? "stale" : "ready");
    auto cache =
        ParamCache::Create(&device_, &source_, {.budget_bytes = 3072, .prefetch_depth = 0});
    ASSERT_TRUE(cache.ok()) << cache.status();
    // Units: A {a 1024}, T {s 512}, B {b 1536}, U {s 512, big 2048}.
    const std::vector<std::vector<std::pair<uint64_t, uint64_t>>> units = {
        {{1, 1024}}, {{2, 512}}, {{3, 1536}}, {{2, 512}, {4, 2048}}};
    for (const auto& unit : units) {
      for (const auto& [key, bytes] : unit) source_.Add(key, bytes, static_cast<uint8_t>(key));
      ASSERT_TRUE((*cache)->AddUnit(unit).ok());
    }
    (*cache)->BeginIteration();
    for (int u : {0, 1, 2}) {  // the slab: [a][s][b], full
      auto offsets = (*cache)->Use(u, host_);
      ASSERT_TRUE(offsets.ok()) << offsets.status();
      ASSERT_TRUE((*cache)->Done(u, host_).ok());
    }
    if (stale) {
      for (uint64_t key : {1, 2, 3, 4}) source_.Fill(key, 99);
      ASSERT_TRUE((*cache)->Invalidate(host_).ok());
      (*cache)->BeginIteration();
    }
    auto offsets = (*cache)->Use(3, host_);
    ASSERT_TRUE(offsets.ok()) << offsets.status();
    for (size_t k = 0; k < units[3].size(); ++k) {
      const auto& want = source_.data(units[3][k].first);
      EXPECT_EQ(std::memcmp(static_cast<char*>((*cache)->slab()) + (*offsets)[k], want.data(),
                            want.size()),
                0)
          << "tensor " << units[3][k].first;
    }
    ASSERT_TRUE((*cache)->Done(3, host_).ok());
    EXPECT_TRUE((*cache)->Synchronize().ok());
  }
}

// A parent's tensors in use while its children's are used: placed where
// first-fit found room (above a leaf used before), they split what is left,
// and a child's tensor, which needs its room in one piece, found none with a
// budget of exactly what nesting holds at once. A holder's tensors stack
// from the slab's top instead: declared so, from the first use; learnt from
// the uses (a unit in use when another's use comes), from then on.
TEST_F(ParamCacheTest, ParentsStackFromTheTopSoChildrenFindRoomInOnePiece) {
  constexpr uint64_t kKiB = 1024;
  for (bool declared : {true, false}) {
    SCOPED_TRACE(declared ? "holder declared" : "holder learnt");
    const uint64_t k = declared ? 0 : 10;  // (keys of their own)
    auto cache =
        ParamCache::Create(&device_, &source_, {.budget_bytes = 12 * kKiB, .prefetch_depth = 0});
    ASSERT_TRUE(cache.ok()) << cache.status();
    source_.Add(k + 1, 4 * kKiB, 1);  // unit 0: a leaf run before the parent
    source_.Add(k + 2, 4 * kKiB, 2);  // unit 1: the parent
    source_.Add(k + 3, 8 * kKiB, 3);  // unit 2: its child
    ASSERT_TRUE((*cache)->AddUnit({{k + 1, 4 * kKiB}}).ok());
    ASSERT_TRUE((*cache)->AddUnit({{k + 2, 4 * kKiB}}, declared).ok());
    ASSERT_TRUE((*cache)->AddUnit({{k + 3, 8 * kKiB}}).ok());
    for (int it = 0; it < 3; ++it) {
      SCOPED_TRACE(it);
      (*cache)->BeginIteration();
      UseAndCheck(**cache, 0, 0);
      auto parent = (*cache)->Use(1, host_);
      ASSERT_TRUE(parent.ok()) << parent.status();
      if (it > 0 || declared) {
        EXPECT_EQ((*parent)[0], 8 * kKiB);  // on top
      }
      auto child = (*cache)->Use(2, host_);
      if (it == 0 && !declared) {
        // First-fit put the parent at 4 KiB: 8 KiB free in two pieces.
        EXPECT_EQ((*parent)[0], 4 * kKiB);
        EXPECT_EQ(child.status().code(), absl::StatusCode::kResourceExhausted) << child.status();
      } else {
        ASSERT_TRUE(child.ok()) << child.status();
        ASSERT_EQ(std::memcmp(static_cast<char*>((*cache)->slab()) + (*child)[0],
                              source_.data(k + 3).data(), 8 * kKiB),
                  0);
        ASSERT_TRUE((*cache)->Done(2, host_).ok());
      }
      ASSERT_TRUE((*cache)->Done(1, host_).ok());
      ASSERT_TRUE((*cache)->Invalidate(host_).ok());
    }
    EXPECT_LE((*cache)->stats().peak_resident_bytes, 12 * kKiB);
  }
}

// A unit's first tensor placed where the room was free (above a module
// used before, still cached), the next one found the rest of the room in
// two pieces once that module was given back: the use was refused with
// the budget holding the unit exactly. Refused once, everything not in use
// goes and the unit is placed again, the largest tensor first.
TEST_F(ParamCacheTest, AUseRefusedForRoomInPiecesPlacesItsTensorsAgain) {
  constexpr uint64_t kKiB = 1024;
  auto cache =
      ParamCache::Create(&device_, &source_, {.budget_bytes = 8 * kKiB, .prefetch_depth = 0});
  ASSERT_TRUE(cache.ok()) << cache.status();
  source_.Add(0, 2 * kKiB, 1);  // unit 0: a small module used first
  source_.Add(1, 256, 2);
  source_.Add(100, 4 * kKiB, 3);  // unit 1: two tensors, the whole budget
  source_.Add(101, 4 * kKiB, 4);
  ASSERT_TRUE((*cache)->AddUnit({{0, 2 * kKiB}, {1, 256}}).ok());
  ASSERT_TRUE((*cache)->AddUnit({{100, 4 * kKiB}, {101, 4 * kKiB}}).ok());
  for (int it = 0; it < 3; ++it) {
    (*cache)->BeginIteration();
    UseAndCheck(**cache, 0, 2);
    UseAndCheck(**cache, 1, 2);
  }
}

// Where there is room, a holder keeps its place: one not on top of what is
// in use (two siblings under one parent, say, each in use in turn) is not
// placed again, so nothing is copied again while the values hold.
TEST_F(ParamCacheTest, AHolderWithRoomAroundItKeepsItsPlace) {
  constexpr uint64_t kKiB = 4096;
  auto cache =
      ParamCache::Create(&device_, &source_, {.budget_bytes = 8 * kKiB, .prefetch_depth = 2});
  ASSERT_TRUE(cache.ok()) << cache.status();
  // Units 0-4: a parent, two siblings each with a child (holders declared);
  // 5-8: never used, so that the budget does not hold every unit.
  for (uint64_t u = 0; u < 9; ++u) {
    source_.Add(100 * u, kKiB, static_cast<uint8_t>(u));
    const bool holder = u == 0 || u == 1 || u == 3;
    ASSERT_TRUE((*cache)->AddUnit({{100 * u, kKiB}}, holder).ok());
  }
  auto use = [&](int unit) {
    auto offsets = (*cache)->Use(unit, host_);
    ASSERT_TRUE(offsets.ok()) << offsets.status();
    ASSERT_EQ(std::memcmp(static_cast<char*>((*cache)->slab()) + (*offsets)[0],
                          source_.data(100 * unit).data(), kKiB),
              0);
  };
  uint64_t copies_after_first = 0;
  for (int it = 0; it < 4; ++it) {
    (*cache)->BeginIteration();
    use(0);
    for (int sibling : {1, 3}) {
      use(sibling);
      use(sibling + 1);
      ASSERT_TRUE((*cache)->Done(sibling + 1, host_).ok());
      ASSERT_TRUE((*cache)->Done(sibling, host_).ok());
    }
    ASSERT_TRUE((*cache)->Done(0, host_).ok());
    ASSERT_TRUE((*cache)->Synchronize().ok());
    if (it == 0) copies_after_first = (*cache)->stats().copies;
  }
  EXPECT_EQ(copies_after_first, 5u);
  EXPECT_EQ((*cache)->stats().copies, 5u);  // none again: each kept its place
}

// A unit refused declares none of its tensors: they may be declared again
// otherwise, and the cache names only tensors of units it has.
TEST_F(ParamCacheTest, ARefusedUnitDeclaresNothing) {
  auto cache = ParamCache::Create(&device_, &source_, {.budget_bytes = 1 << 20});
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ((*cache)->AddUnit({{1, 100}, {2, 0}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*cache)->AddUnit({{3, 100}, {4, 2 << 20}}).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE((*cache)->Keys().empty());
  auto unit = (*cache)->AddUnit({{1, 200}});
  ASSERT_TRUE(unit.ok()) << unit.status();
  EXPECT_EQ((*cache)->Keys(), std::vector<uint64_t>{1});
}

// Staged copies: a copy that fails before the staging buffer wraps is
// told at the wrap's fence, which cannot say whose it was. The batch being
// copied fails with the ones in flight (the failed copy may be its own):
// no tensor of it becomes ready with bytes never copied.
TEST_F(ParamCacheTest, AStagedCopyFailureAtTheWrapFailsTheBatchBeingCopied) {
  source_.dma_ = false;
  auto cache = ParamCache::Create(
      &device_, &source_, {.budget_bytes = 8 << 20, .prefetch_depth = 0, .staging_bytes = 1 << 20});
  ASSERT_TRUE(cache.ok()) << cache.status();
  source_.Add(1, 768 << 10, 1);  // unit 0
  source_.Add(2, 256 << 10, 2);  // unit 1: fills the buffer to its end,
  source_.Add(3, 900 << 10, 3);  // then wraps it
  ASSERT_TRUE((*cache)->AddUnit({{1, 768 << 10}}).ok());
  ASSERT_TRUE((*cache)->AddUnit({{2, 256 << 10}, {3, 900 << 10}}).ok());
  UseAndCheck(**cache, 0, 0);
  std::atomic<int> copies{0};
  device_.SetCopyFault([&copies](void*, const void*, uint64_t, Direction) {
    return ++copies == 1 ? absl::DataLossError("injected") : absl::OkStatus();  // tensor 2's
  });
  auto failed = (*cache)->Use(1, host_);
  EXPECT_FALSE(failed.ok());
  device_.SetCopyFault(nullptr);
  (void)(*cache)->Synchronize();
  // Copied again at the next use, whole.
  auto offsets = (*cache)->Use(1, host_);
  ASSERT_TRUE(offsets.ok()) << offsets.status();
  for (int k = 0; k < 2; ++k) {
    const auto& want = source_.data(2 + k);
    EXPECT_EQ(
        std::memcmp(static_cast<char*>((*cache)->slab()) + (*offsets)[k], want.data(), want.size()),
        0)
        << "tensor " << 2 + k;
  }
  ASSERT_TRUE((*cache)->Done(1, host_).ok());
}

TEST_F(ParamCacheTest, InvalidateCopiesTheNewValues) {
  auto cache = ParamCache::Create(&device_, &source_, {.budget_bytes = 1 << 20});
  ASSERT_TRUE(cache.ok());
  Declare(**cache, 2, 2, 4096);
  for (int step = 0; step < 3; ++step) {
    (*cache)->BeginIteration();
    UseAndCheck(**cache, 0, 2);
    UseAndCheck(**cache, 1, 2);
    UseAndCheck(**cache, 1, 2);  // resident: no copy
    UseAndCheck(**cache, 0, 2);
    ASSERT_TRUE((*cache)->Invalidate(host_).ok());
    for (uint64_t key : {0, 1, 100, 101}) source_.Fill(key, static_cast<uint8_t>(step + 10));
  }
  EXPECT_EQ((*cache)->stats().copies, 3u * 4u);
}

// A trainer that knows its next iteration (every unit, after a step)
// issues the copies before the iteration begins; its uses then copy
// nothing and wait for those copies on the compute stream.
TEST_F(ParamCacheTest, UnitsPrefetchedBeforeTheIterationAreCopiedOnce) {
  auto cache =
      ParamCache::Create(&device_, &source_, {.budget_bytes = 1 << 20, .prefetch_depth = 0});
  ASSERT_TRUE(cache.ok());
  Declare(**cache, 3, 2, 4096);
  const std::vector<int> all = {0, 1, 2};
  (*cache)->BeginIteration();
  for (int u : all) UseAndCheck(**cache, u, 2);
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE((*cache)->Invalidate(host_).ok());
    for (int u : all) {
      for (uint64_t k : {0, 1}) source_.Fill(100 * u + k, static_cast<uint8_t>(step + 50));
    }
    const ParamCacheStats before = (*cache)->stats();
    const int calls = source_.hold_calls();
    ASSERT_TRUE((*cache)->PrefetchUnits(all).ok());
    ParamCacheStats s = (*cache)->stats();
    EXPECT_EQ(s.copies, before.copies + 6) << "issued by the prefetch, before any use";
    EXPECT_EQ(s.prefetched_units, before.prefetched_units + 3);
    EXPECT_EQ(source_.hold_calls(), calls + 1) << "one batch";
    ASSERT_TRUE((*cache)->PrefetchUnits(all).ok()) << "again: nothing more to copy";
    (*cache)->BeginIteration();
    for (int u : all) UseAndCheck(**cache, u, 2);  // the new values
    s = (*cache)->stats();
    EXPECT_EQ(s.copies, before.copies + 6) << "the uses copied nothing";
    EXPECT_EQ(s.prefetch_hits, before.prefetch_hits + 6);
  }
  // Values that change after the prefetch (Invalidate) are copied again at
  // the use.
  ASSERT_TRUE((*cache)->Invalidate(host_).ok());
  ASSERT_TRUE((*cache)->PrefetchUnits(all).ok());
  ASSERT_TRUE((*cache)->Invalidate(host_).ok());
  for (int u : all) source_.Fill(100 * u, 99);
  const uint64_t copies = (*cache)->stats().copies;
  (*cache)->BeginIteration();
  for (int u : all) UseAndCheck(**cache, u, 2);
  EXPECT_EQ((*cache)->stats().copies, copies + 6);
  EXPECT_EQ((*cache)->PrefetchUnits({3}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*cache)->PrefetchUnits({1, 1}).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*cache)->Synchronize().ok());
  EXPECT_EQ(source_.outstanding(), 0);
}

// A prefetch makes room only from what is not used again and waits for
// nothing: where units in use fill the budget it issues nothing.
TEST_F(ParamCacheTest, APrefetchWithoutRoomIssuesNothing) {
  auto cache =
      ParamCache::Create(&device_, &source_, {.budget_bytes = 2 * 2 * 4096, .prefetch_depth = 0});
  ASSERT_TRUE(cache.ok());
  Declare(**cache, 3, 2, 4096);
  (*cache)->BeginIteration();
  ASSERT_TRUE((*cache)->Use(0, host_).ok());
  ASSERT_TRUE((*cache)->Use(1, host_).ok());
  const uint64_t copies = (*cache)->stats().copies;
  EXPECT_EQ((*cache)->PrefetchUnits({2}).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*cache)->stats().copies, copies);
  ASSERT_TRUE((*cache)->Done(0, host_).ok());  // 0 is free to go (not used again)
  ASSERT_TRUE((*cache)->PrefetchUnits({2}).ok());
  EXPECT_EQ((*cache)->stats().copies, copies + 2);
  UseAndCheck(**cache, 2, 2);
  ASSERT_TRUE((*cache)->Done(1, host_).ok());
  ASSERT_TRUE((*cache)->Synchronize().ok());
  EXPECT_EQ(source_.outstanding(), 0);
}

// A use refused for room changes neither the order being recorded nor the
// counts: asked again until it fits (a trainer waiting for room), the
// next iteration's order has it once.
TEST_F(ParamCacheTest, AUseRefusedForRoomCanBeAskedAgain) {
  auto cache =
      ParamCache::Create(&device_, &source_, {.budget_bytes = 2 * 2 * 4096, .prefetch_depth = 1});
  ASSERT_TRUE(cache.ok());
  Declare(**cache, 3, 2, 4096);
  (*cache)->BeginIteration();
  ASSERT_TRUE((*cache)->Use(0, host_).ok());
  ASSERT_TRUE((*cache)->Use(1, host_).ok());
  for (int attempt = 0; attempt < 3; ++attempt) {
    EXPECT_EQ((*cache)->Use(2, host_).status().code(), absl::StatusCode::kResourceExhausted);
  }
  EXPECT_EQ((*cache)->stats().uses, 2u);
  ASSERT_TRUE((*cache)->Done(0, host_).ok());
  ASSERT_TRUE((*cache)->Done(1, host_).ok());
  UseAndCheck(**cache, 2, 2);
  EXPECT_EQ((*cache)->stats().uses, 3u);
  // The order recorded is 0, 1, 2: the next iteration follows it, each use
  // prefetching the next.
  (*cache)->BeginIteration();
  for (int u = 0; u < 3; ++u) UseAndCheck(**cache, u, 2);
  EXPECT_EQ((*cache)->stats().off_trace_uses, 0u);
  EXPECT_EQ((*cache)->stats().uses, 6u);
  ASSERT_TRUE((*cache)->Synchronize().ok());
  EXPECT_EQ(source_.outstanding(), 0);
}

TEST_F(ParamCacheTest, UnregisteredHostMemoryGoesThroughStaging) {
  source_.dma_ = false;
  auto cache =
      ParamCache::Create(&device_, &source_, {.budget_bytes = 8 << 20, .staging_bytes = 1 << 20});
  ASSERT_TRUE(cache.ok());
  Declare(**cache, 4, 1, 1536 << 10);  // larger than the staging buffer
  for (int it = 0; it < 2; ++it) {
    (*cache)->BeginIteration();
    for (int u = 0; u < 4; ++u) UseAndCheck(**cache, u, 1);
    ASSERT_TRUE((*cache)->Invalidate(host_).ok());
  }
  EXPECT_EQ((*cache)->stats().staged_bytes, 8u * (1536 << 10));
}

TEST_F(ParamCacheTest, PersistentTensorsStayAndLiveBytesAreCapped) {
  auto cache = ParamCache::Create(&device_, &source_,
                                  {.budget_bytes = 64 << 10,
                                   .prefetch_depth = 0,
                                   .persistence_threshold_bytes = 1024,
                                   .max_live_bytes = 16 << 10});
  ASSERT_TRUE(cache.ok());
  // Each unit: one small (persistent) and one large tensor.
  for (int u = 0; u < 4; ++u) {
    source_.Add(100 * u, 512, u);
    source_.Add(100 * u + 1, 16 << 10, u);
    ASSERT_TRUE((*cache)->AddUnit({{100u * u, 512}, {100u * u + 1, 16 << 10}}).ok());
  }
  for (int it = 0; it < 2; ++it) {
    (*cache)->BeginIteration();
    source_.TakeHolds();
    for (int u = 0; u < 4; ++u) UseAndCheck(**cache, u, 2);
    std::vector<uint64_t> holds = source_.TakeHolds();
    for (uint64_t k : holds) {
      if (it == 1) {
        EXPECT_EQ(k % 100, 1u) << "persistent tensor " << k << " copied again";
      }
    }
  }
  ParamCacheStats s = (*cache)->stats();
  EXPECT_LE(s.peak_resident_bytes, 4 * 512 + (16 << 10));
}

// A cap on live bytes smaller than what is in use at once (a parent's own
// tensors while a child's are gathered) gives way rather than refuse the
// use; once they are released it holds again (evictions, not growth).
TEST_F(ParamCacheTest, TheLiveCapGivesWayToWhatIsInUseAtOnce) {
  auto cache = ParamCache::Create(
      &device_, &source_,
      {.budget_bytes = 64 << 10, .prefetch_depth = 0, .max_live_bytes = 16 << 10});
  ASSERT_TRUE(cache.ok());
  Declare(**cache, 3, 1, 16 << 10);
  (*cache)->BeginIteration();
  auto parent = (*cache)->Use(0, host_);
  ASSERT_TRUE(parent.ok()) << parent.status();
  auto child = (*cache)->Use(1, host_);  // the parent still in use
  ASSERT_TRUE(child.ok()) << child.status();
  ASSERT_TRUE((*cache)->Done(1, host_).ok());
  ASSERT_TRUE((*cache)->Done(0, host_).ok());
  EXPECT_EQ((*cache)->stats().over_live_cap, 1u);
  UseAndCheck(**cache, 2, 1);  // nothing in use: the cap holds again
  EXPECT_EQ((*cache)->stats().over_live_cap, 1u);
  EXPECT_GE((*cache)->stats().evictions, 1u);
}

// ... for a use only: a prefetch stops at the cap (it gave way for
// prefetches too, each one unit past it, the cap plus the depth resident).
TEST_F(ParamCacheTest, APrefetchStopsAtTheLiveCap) {
  auto cache = ParamCache::Create(
      &device_, &source_,
      {.budget_bytes = 64 << 10, .prefetch_depth = 2, .max_live_bytes = 16 << 10});
  ASSERT_TRUE(cache.ok());
  Declare(**cache, 4, 1, 16 << 10);
  for (int it = 0; it < 3; ++it) {  // the first records the order, the others prefetch along it
    (*cache)->BeginIteration();
    for (int u = 0; u < 4; ++u) UseAndCheck(**cache, u, 1);
  }
  EXPECT_EQ((*cache)->stats().over_live_cap, 0u);
  EXPECT_LE((*cache)->stats().peak_resident_bytes, uint64_t{16} << 10);
}

// Units used in one call (a trainer whose budget holds them all, at its
// iteration's start): their copies are one batch (one hold of the host's
// bytes), a tensor two of them share is copied once, and each unit sees its
// own values, new ones after Invalidate.
TEST_F(ParamCacheTest, UnitsUsedTogetherAreCopiedAsOneBatch) {
  auto cache =
      ParamCache::Create(&device_, &source_, {.budget_bytes = 4 << 20, .prefetch_depth = 0});
  ASSERT_TRUE(cache.ok()) << cache.status();
  Declare(**cache, 6, 2, 64 << 10);
  source_.Add(600, 64 << 10, 6);
  ASSERT_TRUE((*cache)->AddUnit({{600, 64 << 10}, {0, 64 << 10}}).ok());  // ties unit 0's first
  const std::vector<int> all = {0, 1, 2, 3, 4, 5, 6};
  for (int it = 0; it < 3; ++it) {
    (*cache)->BeginIteration();
    source_.TakeHolds();
    const int calls = source_.hold_calls();
    auto offsets = (*cache)->Use(all, host_);
    ASSERT_TRUE(offsets.ok()) << offsets.status();
    EXPECT_EQ(source_.hold_calls(), calls + 1) << "iteration " << it;
    EXPECT_EQ(source_.TakeHolds().size(), 13u) << "the shared tensor held once";
    ASSERT_EQ(offsets->size(), all.size());
    for (int u : all) {
      const std::vector<uint64_t> keys =
          u < 6 ? std::vector<uint64_t>{100u * u, 100u * u + 1} : std::vector<uint64_t>{600, 0};
      ASSERT_EQ((*offsets)[u].size(), keys.size());
      for (size_t k = 0; k < keys.size(); ++k) {
        const auto& want = source_.data(keys[k]);
        EXPECT_EQ(std::memcmp(static_cast<char*>((*cache)->slab()) + (*offsets)[u][k], want.data(),
                              want.size()),
                  0)
            << "iteration " << it << " unit " << u << " tensor " << k;
      }
    }
    EXPECT_EQ((*offsets)[6][1], (*offsets)[0][0]);
    ASSERT_TRUE((*cache)->Done(all, host_).ok());
    ASSERT_TRUE((*cache)->Invalidate(host_).ok());
    for (int u = 0; u < 6; ++u) {
      source_.Fill(100 * u, static_cast<uint8_t>(it + 20));
      source_.Fill(100 * u + 1, static_cast<uint8_t>(it + 30));
    }
    source_.Fill(600, static_cast<uint8_t>(it + 40));
  }
  ParamCacheStats s = (*cache)->stats();
  EXPECT_EQ(s.copies, 3u * 13u);
  EXPECT_EQ(s.uses, 3u * 7u);
  ASSERT_TRUE((*cache)->Synchronize().ok());
  EXPECT_EQ(source_.outstanding(), 0);
}

// What one call cannot do it refuses whole: nothing stays in use.
TEST_F(ParamCacheTest, UnitsUsedTogetherAreRefusedAsOne) {
  auto cache = ParamCache::Create(&device_, &source_, {.budget_bytes = 2 * (64 << 10)});
  ASSERT_TRUE(cache.ok()) << cache.status();
  Declare(**cache, 3, 1, 64 << 10);  // the budget holds two of the three at once
  (*cache)->BeginIteration();
  const std::vector<int> twice = {0, 1, 0}, unknown = {0, 7}, three = {0, 1, 2};
  EXPECT_EQ((*cache)->Use(twice, host_).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*cache)->Use(unknown, host_).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*cache)->Use(three, host_).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*cache)->stats().resident_bytes, 0u) << "nothing placed";
  // So each unit alone still fits, and two at once.
  UseAndCheck(**cache, 2, 1);
  const std::vector<int> two = {0, 1};
  ASSERT_TRUE((*cache)->Use(two, host_).ok());
  // Done of units of which one is not in use: none done.
  EXPECT_EQ((*cache)->Done(three, host_).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*cache)->Use(std::vector<int>{2}, host_).status().code(),
            absl::StatusCode::kResourceExhausted)
      << "units 0 and 1 are still in use";
  ASSERT_TRUE((*cache)->Done(two, host_).ok());
  UseAndCheck(**cache, 2, 1);
  ASSERT_TRUE((*cache)->Synchronize().ok());
  EXPECT_EQ(source_.outstanding(), 0);
}

// A tensor declared larger than what its host memory holds is refused at
// its use (INVALID_ARGUMENT, nothing copied past the host's bytes, its
// hold given back), and one whose size would wrap the cache's rounding at
// its declaration.
TEST_F(ParamCacheTest, ATensorLargerThanItsHostMemoryIsRefused) {
  auto cache =
      ParamCache::Create(&device_, &source_, {.budget_bytes = 1 << 20, .prefetch_depth = 0});
  ASSERT_TRUE(cache.ok());
  source_.Add(7, 4096, 1);
  auto unit = (*cache)->AddUnit({{7, 8192}});
  ASSERT_TRUE(unit.ok()) << unit.status();
  (*cache)->BeginIteration();
  auto used = (*cache)->Use(*unit, host_);
  EXPECT_EQ(used.status().code(), absl::StatusCode::kInvalidArgument) << used.status();
  EXPECT_EQ(source_.outstanding(), 0);
  EXPECT_EQ((*cache)->stats().h2d_bytes, 0u);
  EXPECT_EQ((*cache)->AddUnit({{8, ~uint64_t{0} - 100}}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ParamCacheTest, RefusesWhatCannotFit) {
  auto cache = ParamCache::Create(&device_, &source_, {.budget_bytes = 8192});
  ASSERT_TRUE(cache.ok());
  source_.Add(1, 16384, 0);
  auto unit = (*cache)->AddUnit({{1, 16384}});
  EXPECT_EQ(unit.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(unit.status().message(), "budget is 8192")) << unit.status();
  auto too_big = ParamCache::Create(&device_, &source_, {.budget_bytes = 1ull << 40});
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  // Two units that each fit, both in use at once, do not.
  source_.Add(2, 8192, 0);
  source_.Add(3, 8192, 0);
  ASSERT_TRUE((*cache)->AddUnit({{2, 8192}}).ok());
  ASSERT_TRUE((*cache)->AddUnit({{3, 8192}}).ok());
  (*cache)->BeginIteration();
  ASSERT_TRUE((*cache)->Use(0, host_).ok());
  EXPECT_EQ((*cache)->Use(1, host_).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE((*cache)->Done(0, host_).ok());
  UseAndCheck(**cache, 1, 0);
}

}  // namespace
}  // namespace offload::gpu
