// CudaDevice on CUDA device 0. Skips, saying why, where there is none (no
// GPU or driver here, or a build without the toolkit); the build without
// the toolkit is checked for its error instead.
#include "gpu/cuda_device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "base/host_memory.h"
#include "base/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace offload::gpu {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kMiB = uint64_t{1} << 20;

// `bytes` of a memfd mapped shared on 4 KiB pages, the way the client maps
// a session's arena, its pages touched.
struct SharedArena {
  UniqueFd fd;
  HostMemory memory;
};
SharedArena MapArena(uint64_t bytes) {
  SharedArena arena{UniqueFd(memfd_create("cuda_device_test", MFD_CLOEXEC)), HostMemory()};
  EXPECT_TRUE(arena.fd.valid());
  EXPECT_EQ(ftruncate(arena.fd.get(), static_cast<off_t>(bytes)), 0);
  absl::StatusOr<HostMemory> m = HostMemory::MapShared(arena.fd.get(), 0, bytes, Pages::kSmall);
  EXPECT_TRUE(m.ok()) << m.status();
  if (m.ok()) {
    arena.memory = *std::move(m);
    std::memset(arena.memory.data(), 0, bytes);
  }
  return arena;
}

void Fill(std::byte* data, uint64_t bytes, uint8_t seed) {
  for (uint64_t i = 0; i < bytes; ++i) data[i] = std::byte(static_cast<uint8_t>(i * 131 + seed));
}

TEST(CudaDeviceBuild, WithoutTheToolkitOpenSaysHowToRebuild) {
  if (BuiltWithCuda()) GTEST_SKIP() << "built with the CUDA toolkit";
  absl::StatusOr<std::unique_ptr<Device>> device = OpenCudaDevice(0);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(device.status().message()), HasSubstr("without the CUDA toolkit"));
  EXPECT_THAT(std::string(device.status().message()), HasSubstr("CUDA_PATH"));
}

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> device = OpenCudaDevice(0);
    if (!device.ok()) GTEST_SKIP() << "no CUDA device 0: " << device.status();
    device_ = *std::move(device);
  }

  std::unique_ptr<Device> device_;
};

TEST_F(CudaDeviceTest, NameAndOrdinals) {
  EXPECT_EQ(device_->name().rfind("cuda:0 (", 0), 0u) << device_->name();
  absl::StatusOr<std::unique_ptr<Device>> none = OpenCudaDevice(1 << 20);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument) << none.status();
  EXPECT_EQ(OpenCudaDevice(-1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CudaDeviceTest, AllocateTakesFreeBytes) {
  absl::StatusOr<uint64_t> before = device_->FreeBytes();
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_GT(*before, 256 * kMiB);
  absl::StatusOr<DeviceMemory> memory = device_->Allocate(256 * kMiB);
  ASSERT_TRUE(memory.ok()) << memory.status();
  EXPECT_NE(memory->get(), nullptr);
  EXPECT_EQ(memory->bytes(), 256 * kMiB);
  absl::StatusOr<uint64_t> after = device_->FreeBytes();
  ASSERT_TRUE(after.ok()) << after.status();
  // Other processes may allocate or free meanwhile; most of it shows.
  EXPECT_LE(*after, *before - 128 * kMiB);
}

TEST_F(CudaDeviceTest, AbsurdAllocationIsResourceExhaustedAndHarmless) {
  const uint64_t absurd = uint64_t{1} << 52;  // 4 PiB
  absl::StatusOr<DeviceMemory> memory = device_->Allocate(absurd);
  ASSERT_EQ(memory.status().code(), absl::StatusCode::kResourceExhausted) << memory.status();
  EXPECT_THAT(std::string(memory.status().message()),
              HasSubstr("cudaMalloc of " + std::to_string(absurd) + " bytes on cuda:0"));
  // Not a sticky error: the device goes on working.
  EXPECT_TRUE(device_->Allocate(kMiB).ok());
}

TEST_F(CudaDeviceTest, PinnedMemoryIsHostAddressable) {
  absl::StatusOr<PinnedMemory> pinned = device_->AllocatePinned(4 * kMiB);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  auto* bytes = static_cast<std::byte*>(pinned->get());
  Fill(bytes, 4 * kMiB, 3);
  EXPECT_EQ(bytes[4 * kMiB - 1], std::byte(static_cast<uint8_t>((4 * kMiB - 1) * 131 + 3)));
}

// H2D from a registered shared mapping, D2H into another, on one created
// stream, completion seen through an event.
TEST_F(CudaDeviceTest, RoundTripThroughRegisteredArena) {
  const uint64_t bytes = 64 * kMiB;
  SharedArena src = MapArena(bytes);
  SharedArena dst = MapArena(bytes);
  ASSERT_FALSE(src.memory.empty() || dst.memory.empty());
  Fill(src.memory.data(), bytes, 1);
  absl::StatusOr<HostRegistration> src_reg = device_->RegisterHost(src.memory.data(), bytes);
  ASSERT_TRUE(src_reg.ok()) << src_reg.status();
  absl::StatusOr<HostRegistration> dst_reg = device_->RegisterHost(dst.memory.data(), bytes);
  ASSERT_TRUE(dst_reg.ok()) << dst_reg.status();
  absl::StatusOr<DeviceMemory> on_device = device_->Allocate(bytes);
  ASSERT_TRUE(on_device.ok()) << on_device.status();
  absl::StatusOr<Stream> stream = device_->CreateStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  absl::StatusOr<Event> done = device_->CreateEvent();
  ASSERT_TRUE(done.ok()) << done.status();

  absl::StatusOr<bool> never_recorded = device_->Query(*done);
  ASSERT_TRUE(never_recorded.ok()) << never_recorded.status();
  EXPECT_TRUE(*never_recorded);

  ASSERT_TRUE(
      device_
          ->CopyAsync(on_device->get(), src.memory.data(), bytes, Direction::kHostToDevice, *stream)
          .ok());
  ASSERT_TRUE(
      device_
          ->CopyAsync(dst.memory.data(), on_device->get(), bytes, Direction::kDeviceToHost, *stream)
          .ok());
  ASSERT_TRUE(device_->Record(*done, *stream).ok());
  absl::StatusOr<bool> queried = device_->Query(*done);  // either answer, but no error
  ASSERT_TRUE(queried.ok()) << queried.status();
  ASSERT_TRUE(device_->Synchronize(*done).ok());
  queried = device_->Query(*done);
  ASSERT_TRUE(queried.ok()) << queried.status();
  EXPECT_TRUE(*queried);
  EXPECT_EQ(std::memcmp(src.memory.data(), dst.memory.data(), bytes), 0);
}

TEST_F(CudaDeviceTest, RegisteringTwiceIsAlreadyExists) {
  SharedArena arena = MapArena(kMiB);
  ASSERT_FALSE(arena.memory.empty());
  absl::StatusOr<HostRegistration> first = device_->RegisterHost(arena.memory.data(), kMiB);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<HostRegistration> second = device_->RegisterHost(arena.memory.data(), kMiB);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists) << second.status();
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("cudaHostRegister of 1048576"));
  // Once the first registration went, the memory can be registered again.
  *first = HostRegistration();
  EXPECT_TRUE(device_->RegisterHost(arena.memory.data(), kMiB).ok());
}

// Stream `reader` waits on an event recorded after `writer`'s copy into
// device memory: its copy out must see the bytes written, though both
// streams are non-blocking and run concurrently otherwise.
TEST_F(CudaDeviceTest, WaitOnOrdersTwoStreams) {
  const uint64_t bytes = 128 * kMiB;
  absl::StatusOr<PinnedMemory> src = device_->AllocatePinned(bytes);
  absl::StatusOr<PinnedMemory> dst = device_->AllocatePinned(bytes);
  absl::StatusOr<DeviceMemory> on_device = device_->Allocate(bytes);
  absl::StatusOr<Stream> writer = device_->CreateStream();
  absl::StatusOr<Stream> reader = device_->CreateStream();
  absl::StatusOr<Event> written = device_->CreateEvent();
  absl::StatusOr<Event> read = device_->CreateEvent();
  for (const absl::Status& s : {src.status(), dst.status(), on_device.status(), writer.status(),
                                reader.status(), written.status(), read.status()}) {
    ASSERT_TRUE(s.ok()) << s;
  }
  auto* s = static_cast<std::byte*>(src->get());
  auto* d = static_cast<std::byte*>(dst->get());

  // Device memory starts as zeros (copied, and finished, first).
  std::memset(s, 0, bytes);
  ASSERT_TRUE(
      device_->CopyAsync(on_device->get(), s, bytes, Direction::kHostToDevice, *writer).ok());
  ASSERT_TRUE(device_->Record(*written, *writer).ok());
  ASSERT_TRUE(device_->Synchronize(*written).ok());

  Fill(s, bytes, 9);
  std::memset(d, 0xff, bytes);
  ASSERT_TRUE(
      device_->CopyAsync(on_device->get(), s, bytes, Direction::kHostToDevice, *writer).ok());
  ASSERT_TRUE(device_->Record(*written, *writer).ok());
  ASSERT_TRUE(device_->WaitOn(*reader, *written).ok());
  ASSERT_TRUE(
      device_->CopyAsync(d, on_device->get(), bytes, Direction::kDeviceToHost, *reader).ok());
  ASSERT_TRUE(device_->Record(*read, *reader).ok());
  ASSERT_TRUE(device_->Synchronize(*read).ok());
  EXPECT_EQ(std::memcmp(s, d, bytes), 0);
}

// A borrowed stream (0: the legacy default stream) carries work like a
// created one, and its Handle destroys nothing.
TEST_F(CudaDeviceTest, BorrowedDefaultStream) {
  absl::StatusOr<PinnedMemory> host = device_->AllocatePinned(kMiB);
  absl::StatusOr<DeviceMemory> on_device = device_->Allocate(kMiB);
  absl::StatusOr<Event> done = device_->CreateEvent();
  ASSERT_TRUE(host.ok() && on_device.ok() && done.ok());
  {
    Stream borrowed = device_->BorrowStream(nullptr);
    EXPECT_TRUE(borrowed);
    ASSERT_TRUE(
        device_->CopyAsync(on_device->get(), host->get(), kMiB, Direction::kHostToDevice, borrowed)
            .ok());
    ASSERT_TRUE(device_->Record(*done, borrowed).ok());
  }
  EXPECT_TRUE(device_->Synchronize(*done).ok());
}

TEST_F(CudaDeviceTest, ForeignOrEmptyHandlesAreInvalidArguments) {
  absl::StatusOr<Event> event = device_->CreateEvent();
  ASSERT_TRUE(event.ok()) << event.status();
  Stream empty;
  absl::Status s = device_->Record(*event, empty);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(device_->Query(Event()).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace offload::gpu
