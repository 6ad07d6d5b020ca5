#include "base/span_maps.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "base/unique_fd.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

constexpr uint64_t kWindow = SpanMaps::kWindowBytes;

class SpanMapsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fd_ = UniqueFd(memfd_create("span_maps_test", MFD_CLOEXEC));
    ASSERT_TRUE(fd_.valid());
    // Three windows' worth, sparse.
    ASSERT_EQ(ftruncate(fd_.get(), 3 * kWindow), 0);
  }
  SpanMaps::MapFn Counting() {
    return [this](uint64_t offset, uint64_t bytes, Pages pages) {
      ++maps_;
      return HostMemory::MapShared(fd_.get(), offset, bytes, pages);
    };
  }
  // What the file holds at `offset`, read past every mapping.
  uint32_t FileAt(uint64_t offset) {
    uint32_t v = 0;
    EXPECT_EQ(pread(fd_.get(), &v, sizeof(v), static_cast<off_t>(offset)),
              static_cast<ssize_t>(sizeof(v)));
    return v;
  }

  UniqueFd fd_;
  int maps_ = 0;
};

TEST_F(SpanMapsTest, SmallSpansInAWindowShareOneMappingThatGoesWithTheLast) {
  SpanMaps maps(Counting());
  const int64_t before = HostMemory::LiveMappings();
  std::vector<MappedSpan> spans;
  // 1,000 spans of 12 KiB laid end to end: all in the first window.
  for (uint64_t i = 0; i < 1000; ++i) {
    auto s = maps.Map(i * 12288, 12288, Pages::kSmall);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_TRUE(s->shared());
    EXPECT_EQ(s->size(), 12288u);
    std::memcpy(s->data(), &i, sizeof(uint32_t));
    spans.push_back(*std::move(s));
  }
  EXPECT_EQ(maps_, 1);
  EXPECT_EQ(maps.windows(), 1);
  EXPECT_EQ(HostMemory::LiveMappings(), before + 1);
  // Each wrote its own bytes of the file.
  for (uint32_t i = 0; i < 1000; ++i) EXPECT_EQ(FileAt(i * 12288), i);
  spans.erase(spans.begin(), spans.begin() + 999);
  EXPECT_EQ(HostMemory::LiveMappings(), before + 1);  // one span still holds it
  spans.clear();
  EXPECT_EQ(HostMemory::LiveMappings(), before);
  EXPECT_EQ(maps.windows(), 0);
  // Mapped again when a span needs it, the file's bytes as they were.
  auto again = maps.Map(5 * 12288, 12288, Pages::kSmall);
  ASSERT_TRUE(again.ok()) << again.status();
  uint32_t v;
  std::memcpy(&v, again->data(), sizeof(v));
  EXPECT_EQ(v, 5u);
  EXPECT_EQ(maps_, 2);
}

TEST_F(SpanMapsTest, LargeHugeAndStraddlingSpansMapOnTheirOwn) {
  SpanMaps maps(Counting());
  const int64_t before = HostMemory::LiveMappings();
  auto large = maps.Map(0, SpanMaps::kSharedMaxBytes + 4096, Pages::kSmall);
  auto huge = maps.Map(8 << 20, 4096, Pages::kHuge);
  auto plain = maps.Map(12 << 20, 4096, Pages::kSystemDefault);
  // Crosses the first window's end: its own, the windows either side
  // untouched.
  auto straddling = maps.Map(kWindow - 4096, 8192, Pages::kSmall);
  for (auto* s : {&large, &huge, &plain, &straddling}) {
    ASSERT_TRUE(s->ok()) << s->status();
    EXPECT_FALSE((*s)->shared());
  }
  EXPECT_EQ(maps.windows(), 0);
  EXPECT_EQ(HostMemory::LiveMappings(), before + 4);
  const uint32_t v = 0xfeedu;
  std::memcpy(straddling->data() + 4096, &v, sizeof(v));
  EXPECT_EQ(FileAt(kWindow), v);
  // Spans in the second and third windows: one mapping each.
  auto a = maps.Map(kWindow + 8192, 4096, Pages::kSmall);
  auto b = maps.Map(2 * kWindow, 4096, Pages::kSmall);
  auto c = maps.Map(kWindow, 4096, Pages::kSmall);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(maps.windows(), 2);
  EXPECT_EQ(HostMemory::LiveMappings(), before + 6);
  // The straddler and the window after it map the same bytes.
  uint32_t seen;
  std::memcpy(&seen, c->data(), sizeof(seen));
  EXPECT_EQ(seen, v);
}

TEST_F(SpanMapsTest, SpansUpToAWindowsEndAndOfTheLargestSharedSizeShare) {
  auto counted = std::make_shared<std::atomic<int64_t>>(0);
  SpanMaps maps(Counting(), counted);
  constexpr uint64_t kMax = SpanMaps::kSharedMaxBytes;
  auto last = maps.Map(kWindow - kMax, kMax, Pages::kSmall);  // ends at the window's end
  auto first = maps.Map(0, kMax, Pages::kSmall);
  auto larger = maps.Map(kMax, kMax + 4096, Pages::kSmall);
  auto next = maps.Map(kWindow, 4096, Pages::kSmall);  // starts the next window
  ASSERT_TRUE(last.ok() && first.ok() && larger.ok() && next.ok());
  EXPECT_TRUE(last->shared());
  EXPECT_TRUE(first->shared());
  EXPECT_FALSE(larger->shared());
  EXPECT_TRUE(next->shared());
  EXPECT_EQ(last->data() - first->data(), static_cast<std::ptrdiff_t>(kWindow - kMax));
  EXPECT_EQ(maps.windows(), 2);
  // Every mapping counted while it lives: two windows and one of its own.
  EXPECT_EQ(counted->load(), 3);
  larger = MappedSpan();
  next = MappedSpan();
  EXPECT_EQ(counted->load(), 1);
  last = MappedSpan();
  first = MappedSpan();
  EXPECT_EQ(counted->load(), 0);
}

TEST_F(SpanMapsTest, ThreadsMappingOneWindowAtOnceShareOneMapping) {
  auto counted = std::make_shared<std::atomic<int64_t>>(0);
  SpanMaps maps(Counting(), counted);
  std::vector<MappedSpan> spans(64);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < 64; i += 4) {
        auto s = maps.Map(static_cast<uint64_t>(i) * 4096, 4096, Pages::kSmall);
        ASSERT_TRUE(s.ok()) << s.status();
        spans[i] = *std::move(s);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(counted->load(), 1);
  EXPECT_EQ(maps_, 1);
  for (int i = 1; i < 64; ++i) EXPECT_EQ(spans[i].data() - spans[0].data(), i * 4096);
}

TEST_F(SpanMapsTest, AFailedWindowMappingIsTheCallersErrorAndTriedAgain) {
  bool refuse = true;
  SpanMaps maps([&](uint64_t offset, uint64_t bytes, Pages pages) -> absl::StatusOr<HostMemory> {
    if (refuse) return absl::ResourceExhaustedError("mmap refused (test)");
    return HostMemory::MapShared(fd_.get(), offset, bytes, pages);
  });
  auto refused = maps.Map(4096, 4096, Pages::kSmall);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(maps.windows(), 0);
  refuse = false;
  auto mapped = maps.Map(4096, 4096, Pages::kSmall);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  EXPECT_EQ(maps.windows(), 1);
}

}  // namespace
}  // namespace offload
