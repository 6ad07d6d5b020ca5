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
  absl::StatusOr<Span> Hold(uint64_t key) override {
    auto& v = buffers[key];
    v.assign(bytes, 0);
    return Span{v.data(), v.size(), dma};
  }
  std::map<uint64_t, std::vector<char>> buffers;
  uint64_t bytes = 1 << 20;
  bool dma = true;
};

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
    grads.push_back(*dev.Allocate(bytes));
    char* g = static_cast<char*>(grads.back().get());
    // "backward" writes the gradient late on its stream; the copy must see it.
    ASSERT_TRUE(dev.Launch(*producer,
                           [g, k, bytes] {
                             absl::SleepFor(absl::Milliseconds(2));
                             std::memset(g, 'a' + k, bytes);
                           })
                    .ok());
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

INSTANTIATE_TEST_SUITE_P(DmaAndStaged, GradientDrainTest, ::testing::Bool());

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

}  // namespace
}  // namespace offload::gpu
