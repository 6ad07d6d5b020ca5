#include "gpu/emulated_device.h"

#include <atomic>
#include <cstring>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace offload::gpu {
namespace {

TEST(EmulatedDeviceTest, BudgetIsEnforcedAndPeakRecorded) {
  EmulatedDevice dev({.memory_bytes = 1 << 20});
  auto a = dev.Allocate(600 << 10);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = dev.Allocate(600 << 10);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted) << b.status();
  EXPECT_EQ(dev.used_bytes(), 600u << 10);
  a->Reset();
  EXPECT_EQ(dev.used_bytes(), 0u);
  EXPECT_EQ(dev.peak_bytes(), 600u << 10);
}

TEST(EmulatedDeviceTest, RoundTripWithEventsAndOrderAcrossStreams) {
  EmulatedDevice dev({.memory_bytes = 16 << 20});
  auto mem = dev.Allocate(4 << 20);
  ASSERT_TRUE(mem.ok());
  auto h2d = dev.CreateStream();
  auto d2h = dev.CreateStream();
  auto copied = dev.CreateEvent();
  auto back = dev.CreateEvent();
  ASSERT_TRUE(h2d.ok() && d2h.ok() && copied.ok() && back.ok());
  std::vector<char> src(4 << 20), dst(4 << 20, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 7);
  ASSERT_TRUE(
      dev.CopyAsync(mem->get(), src.data(), src.size(), Direction::kHostToDevice, *h2d).ok());
  ASSERT_TRUE(dev.Record(*copied, *h2d).ok());
  // The second stream waits for the first: its copy sees the whole of it.
  ASSERT_TRUE(dev.WaitOn(*d2h, *copied).ok());
  ASSERT_TRUE(
      dev.CopyAsync(dst.data(), mem->get(), dst.size(), Direction::kDeviceToHost, *d2h).ok());
  ASSERT_TRUE(dev.Record(*back, *d2h).ok());
  ASSERT_TRUE(dev.Synchronize(*back).ok());
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), src.size()), 0);
  auto done = dev.Query(*copied);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);
}

TEST(EmulatedDeviceTest, CopyOutsideDeviceMemoryIsRefused) {
  EmulatedDevice dev;
  auto s = dev.CreateStream();
  ASSERT_TRUE(s.ok());
  char a[16], b[16];
  EXPECT_EQ(dev.CopyAsync(a, b, 16, Direction::kHostToDevice, *s).code(),
            absl::StatusCode::kInvalidArgument);
}

// A stream handle it did not make (a CUDA stream's given to the emulated
// device, a stale one) is refused, never taken for its own.
TEST(EmulatedDeviceTest, AStreamItDidNotMakeIsRefused) {
  EmulatedDevice dev;
  auto mem = dev.Allocate(16);
  auto event = dev.CreateEvent();
  ASSERT_TRUE(mem.ok() && event.ok());
  char host[16] = {};
  const Stream foreign = dev.BorrowStream(reinterpret_cast<void*>(uintptr_t{1}));
  EXPECT_EQ(dev.CopyAsync(mem->get(), host, 16, Direction::kHostToDevice, foreign).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dev.Record(*event, foreign).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dev.WaitOn(foreign, *event).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dev.Launch(foreign, [] {}).code(), absl::StatusCode::kInvalidArgument);
  // The host stream (null) and its own still work.
  EXPECT_TRUE(
      dev.CopyAsync(mem->get(), host, 16, Direction::kHostToDevice, dev.BorrowStream(nullptr))
          .ok());
}

TEST(EmulatedDeviceTest, FailedCopySurfacesOnceAtTheNextEvent) {
  EmulatedDevice dev;
  auto mem = dev.Allocate(4096);
  auto s = dev.CreateStream();
  auto e = dev.CreateEvent();
  ASSERT_TRUE(mem.ok() && s.ok() && e.ok());
  dev.SetCopyFault(
      [](void*, const void*, uint64_t, Direction) { return absl::DataLossError("injected"); });
  char host[4096] = {};
  ASSERT_TRUE(dev.CopyAsync(mem->get(), host, 4096, Direction::kHostToDevice, *s).ok());
  ASSERT_TRUE(dev.Record(*e, *s).ok());
  EXPECT_EQ(dev.Synchronize(*e).code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(dev.Synchronize(*e).ok());  // reported once
  dev.SetCopyFault(nullptr);
  ASSERT_TRUE(dev.Record(*e, *s).ok());
  EXPECT_TRUE(dev.Synchronize(*e).ok());
}

TEST(EmulatedDeviceTest, StreamsCompleteOutOfOrder) {
  // Two streams, many small copies each: with random delays, the order in
  // which their launched markers run is not the order of issue every time.
  EmulatedDevice dev({.max_copy_delay = absl::Microseconds(300), .seed = 7});
  auto mem = dev.Allocate(1 << 20);
  ASSERT_TRUE(mem.ok());
  std::vector<Stream> streams;
  for (int i = 0; i < 2; ++i) streams.push_back(*dev.CreateStream());
  std::vector<int> finished;
  absl::Mutex mu;
  char host[256] = {};
  for (int round = 0; round < 40; ++round) {
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(
          dev.CopyAsync(mem->get(), host, sizeof(host), Direction::kHostToDevice, streams[i]).ok());
      ASSERT_TRUE(dev.Launch(streams[i],
                             [&, i] {
                               absl::MutexLock l(&mu);
                               finished.push_back(i);
                             })
                      .ok());
    }
  }
  streams.clear();  // drains and joins
  int inversions = 0;
  for (size_t k = 0; k + 1 < finished.size(); ++k) inversions += finished[k] == finished[k + 1];
  EXPECT_EQ(finished.size(), 80u);
  EXPECT_GT(inversions, 0) << "streams ran in lockstep";
}

TEST(EmulatedDeviceTest, RegistrationOverlapAndInjectedFailure) {
  EmulatedDevice dev;
  std::vector<char> host(1 << 16);
  auto r = dev.RegisterHost(host.data(), host.size());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(dev.registered_bytes(), host.size());
  EXPECT_EQ(dev.RegisterHost(host.data() + 100, 10).status().code(),
            absl::StatusCode::kAlreadyExists);
  r->Reset();
  EXPECT_EQ(dev.registered_bytes(), 0u);
  dev.SetRegisterFault(
      [](void*, uint64_t) { return absl::ResourceExhaustedError("RLIMIT_MEMLOCK"); });
  EXPECT_EQ(dev.RegisterHost(host.data(), host.size()).status().code(),
            absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace offload::gpu
