#include "gpu/gradient_drain.h"

#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gpu/emulated_device.h"
#include "gtest/gtest.h"

namespace offload::gpu {
namespace {

class FakeSink : public GradientSink {
 public:
  absl::StatusOr<std::vector<Span>> HoldBuffers(absl::Span<const uint64_t> keys) override {
    ++holds;
    for (uint64_t key : keys) {
      if (key == refuse) return absl::ResourceExhaustedError("no room for this buffer");
    }
    std::vector<Span> out;
    for (uint64_t key : keys) {
      auto& v = buffers[key];
      v.assign(bytes, 0);
      out.push_back(Span{v.data(), v.size(), dma});
    }
    return out;
  }
  int holds = 0;  // calls
  std::map<uint64_t, std::vector<char>> buffers;
  uint64_t bytes = 1 << 20;
  bool dma = true;
  uint64_t refuse = ~0ull;  // Hold of this key fails
};

// Gradient `k` of `bytes` in memory added to `grads` (which `dev` must
// outlive), written late by "backward" on `producer` (after `delay`),
// filled with 'a' + k.
char* LateGradient(EmulatedDevice& dev, const Stream& producer, int k, uint64_t bytes,
                   absl::Duration delay, std::vector<DeviceMemory>* grads) {
  grads->push_back(*dev.Allocate(bytes));
  char* g = static_cast<char*>(grads->back().get());
  EXPECT_TRUE(dev.Launch(producer,
                         [g, k, bytes, delay] {
                           absl::SleepFor(delay);
                           std::memset(g, 'a' + k, bytes);
                         })
                  .ok());
  return g;
}

class GradientDrainTest : public ::testing::TestWithParam<bool> {};

TEST_P(GradientDrainTest, CopiesWaitForTheProducerAndArriveWhole) {
  EmulatedDevice dev({.memory_bytes = 64 << 20, .copy_chunk_bytes = 4096});
  FakeSink sink;
  sink.dma = GetParam();
  auto drain = GradientDrain::Create(&dev, &sink, 1 << 20);
  auto producer = dev.CreateStream();
  ASSERT_TRUE(drain.ok() && producer.ok());
  std::vector<DeviceMemory> grads;
  const uint64_t bytes = 384 << 10;  // two fit the staging buffer, the third wraps it
  for (int k = 0; k < 6; ++k) {
    // The copy must see what backward writes late on its stream.
    char* g = LateGradient(dev, *producer, k, bytes, absl::Milliseconds(2), &grads);
    ASSERT_TRUE((*drain)->Add(k, g, bytes, *producer).ok());
  }
  std::vector<GradientDrain::Done> done = (*drain)->Completed(/*wait=*/true);
  ASSERT_EQ(done.size(), 6u);
  for (int k = 0; k < 6; ++k) {
    EXPECT_EQ(done[k].key, static_cast<uint64_t>(k));
    EXPECT_TRUE(done[k].status.ok()) << done[k].status;
    EXPECT_EQ(sink.buffers[k][0], 'a' + k);
    EXPECT_EQ(sink.buffers[k][bytes - 1], 'a' + k);
    EXPECT_EQ(sink.buffers[k][bytes], 0);
  }
  EXPECT_EQ((*drain)->stats().staged_bytes, GetParam() ? 0 : 6 * bytes);
  EXPECT_EQ((*drain)->pending(), 0u);
}

// Gradients added several at once (one wait on the producer, one event for
// the batch): each still arrives whole, reported in order and never before
// its bytes are there; in the staged case the staging buffer wraps inside
// the first batch.
TEST_P(GradientDrainTest, BatchesArriveWholeAndInOrder) {
  EmulatedDevice dev({.memory_bytes = 64 << 20,
                      .max_copy_delay = absl::Microseconds(500),
                      .copy_chunk_bytes = 4096});
  FakeSink sink;
  sink.dma = GetParam();
  auto drain = GradientDrain::Create(&dev, &sink, 1 << 20);
  auto producer = dev.CreateStream();
  ASSERT_TRUE(drain.ok() && producer.ok());
  const uint64_t bytes = 384 << 10;
  std::vector<DeviceMemory> grads;
  std::vector<GradientDrain::Item> items;
  for (int k = 0; k < 6; ++k) {
    items.push_back({static_cast<uint64_t>(k),
                     LateGradient(dev, *producer, k, bytes, absl::Milliseconds(1), &grads), bytes});
  }
  ASSERT_TRUE((*drain)->Add(absl::MakeConstSpan(items).subspan(0, 3), *producer).ok());
  ASSERT_TRUE((*drain)->Add(absl::MakeConstSpan(items).subspan(3), *producer).ok());
  std::vector<GradientDrain::Done> done;
  while (done.size() < 6) {
    for (GradientDrain::Done& d : (*drain)->Completed(/*wait=*/false)) {
      ASSERT_TRUE(d.status.ok()) << d.status;
      EXPECT_EQ(d.key, done.size());                                      // in order
      EXPECT_EQ(sink.buffers[d.key][0], static_cast<char>('a' + d.key));  // whole when reported
      EXPECT_EQ(sink.buffers[d.key][bytes - 1], static_cast<char>('a' + d.key));
      done.push_back(d);
    }
  }
  EXPECT_EQ((*drain)->stats().copies, 6u);
  EXPECT_EQ((*drain)->pending(), 0u);
}

INSTANTIATE_TEST_SUITE_P(DmaAndStaged, GradientDrainTest, ::testing::Bool());

// One hold for a batch's buffers; one the sink cannot hold adds none of
// them, and the batch after it goes on.
TEST(GradientDrainFailureTest, ABatchWhoseBuffersCannotBeHeldAddsNone) {
  EmulatedDevice dev;
  FakeSink sink;
  sink.refuse = 2;
  auto drain = GradientDrain::Create(&dev, &sink);
  ASSERT_TRUE(drain.ok());
  auto g = dev.Allocate(4096);
  ASSERT_TRUE(g.ok());
  std::memset(g->get(), 'x', 4096);
  std::vector<GradientDrain::Item> items;
  for (uint64_t k = 0; k < 4; ++k) items.push_back({k, g->get(), 4096});
  Stream host = dev.BorrowStream(nullptr);
  absl::Status s = (*drain)->Add(items, host);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(sink.holds, 1);
  EXPECT_TRUE(sink.buffers.empty());
  EXPECT_TRUE((*drain)->Completed(true).empty());
  EXPECT_EQ((*drain)->pending(), 0u);
  items.erase(items.begin() + 2);
  ASSERT_TRUE((*drain)->Add(items, host).ok());
  EXPECT_EQ(sink.holds, 2);
  auto done = (*drain)->Completed(true);
  ASSERT_EQ(done.size(), 3u);
  for (size_t i = 0; i < done.size(); ++i) {
    EXPECT_EQ(done[i].key, items[i].key);
    EXPECT_TRUE(done[i].status.ok());
    EXPECT_EQ(sink.buffers[items[i].key][4095], 'x');
  }
}

TEST(GradientDrainFailureTest, AFailedCopyIsReportedWithItsKey) {
  EmulatedDevice dev;
  FakeSink sink;
  auto drain = GradientDrain::Create(&dev, &sink);
  ASSERT_TRUE(drain.ok());
  auto g = dev.Allocate(4096);
  ASSERT_TRUE(g.ok());
  dev.SetCopyFault(
      [](void*, const void*, uint64_t, Direction) { return absl::DataLossError("injected"); });
  Stream host = dev.BorrowStream(nullptr);
  ASSERT_TRUE((*drain)->Add(7, g->get(), 4096, host).ok());
  // Too large for its buffer: reported too, not written.
  ASSERT_TRUE((*drain)->Add(8, g->get(), sink.bytes + 1, host).ok());
  auto done = (*drain)->Completed(true);
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].status.code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(done[0].status.message(), "gradient 7")) << done[0].status;
  EXPECT_EQ(done[1].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*drain)->stats().copy_failures, 2u);
}

// A copy that fails among others of one Add: the device tells of it once,
// at the Add's event; every copy of the Add is reported failed (which of
// them cannot be told), none passes as good with bytes never written.
TEST(GradientDrainFailureTest, AFailedCopyInABatchFailsItsWholeBatch) {
  for (bool dma : {true, false}) {
    SCOPED_TRACE(dma ? "DMA" : "staged");
    EmulatedDevice dev;
    FakeSink sink;
    sink.dma = dma;
    auto drain = GradientDrain::Create(&dev, &sink, 1 << 20);
    ASSERT_TRUE(drain.ok());
    std::vector<DeviceMemory> grads;
    std::vector<GradientDrain::Item> items;
    for (uint64_t k = 0; k < 3; ++k) {
      grads.push_back(*dev.Allocate(4096));
      std::memset(grads.back().get(), 'a' + static_cast<int>(k), 4096);
      items.push_back({k, grads.back().get(), 4096});
    }
    const void* bad = grads[1].get();
    dev.SetCopyFault([bad](void*, const void* src, uint64_t, Direction) {
      return src == bad ? absl::DataLossError("injected") : absl::OkStatus();
    });
    Stream host = dev.BorrowStream(nullptr);
    ASSERT_TRUE((*drain)->Add(items, host).ok());
    auto done = (*drain)->Completed(true);
    ASSERT_EQ(done.size(), 3u);
    for (const GradientDrain::Done& d : done) {
      EXPECT_EQ(d.status.code(), absl::StatusCode::kDataLoss) << "gradient " << d.key;
    }
  }
}

}  // namespace
}  // namespace offload::gpu
