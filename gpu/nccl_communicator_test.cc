// The NCCL communicator on a real device (one rank: NCCL's own code paths,
// grouped calls and ordering on the stream). Skips, saying why, without
// NCCL in the build or a CUDA device on the machine.
#include "gpu/nccl_communicator.h"

#include <vector>

#include "gpu/cuda_device.h"
#include "gtest/gtest.h"

namespace offload::gpu {
namespace {

TEST(NcclCommunicatorTest, AnIdOfTheWrongSizeIsRefused) {
  if (!BuiltWithNccl()) GTEST_SKIP() << NewNcclId().status();
  auto comm = OpenNcclCommunicator(0, "short", 0, 1);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument) << comm.status();
}

TEST(NcclCommunicatorTest, OneRankGathersAndReducesInOrderOnItsStream) {
  if (!BuiltWithNccl()) GTEST_SKIP() << NewNcclId().status();
  auto device = OpenCudaDevice(0);
  if (!device.ok()) GTEST_SKIP() << "no CUDA device: " << device.status();
  auto id = NewNcclId();
  ASSERT_TRUE(id.ok()) << id.status();
  auto comm = OpenNcclCommunicator(0, *id, 0, 1);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->name(), "nccl rank 0 of 1");
  Device& dev = **device;
  constexpr size_t kN = 1 << 17;  // floats
  auto mem = dev.Allocate(8 * kN * sizeof(float));
  auto stream = dev.CreateStream();
  auto done = dev.CreateEvent();
  ASSERT_TRUE(mem.ok() && stream.ok() && done.ok());
  float* a = static_cast<float*>(mem->get());  // the input
  float* g = a + kN;                           // a, gathered
  float* h = a + 2 * kN;                       // a[4096, 5120), gathered
  float* r = a + 3 * kN;                       // g, reduce-scattered
  std::vector<float> host(kN), out(3 * kN);
  for (size_t i = 0; i < kN; ++i) host[i] = static_cast<float>(i);
  ASSERT_TRUE(dev.CopyAsync(a, host.data(), kN * 4, Direction::kHostToDevice, *stream).ok());
  // Two gathers in one group, then an averaging reduce-scatter of the
  // first's output: each sees what the work before it on the stream wrote.
  const Communicator::GatherItem gathers[] = {{a, g, kN * 4}, {a + 4096, h, 4096}};
  ASSERT_TRUE((*comm)->AllGather(gathers, *stream).ok());
  ASSERT_TRUE((*comm)->ReduceScatter({{g, r, kN}}, ReduceOp::kAvg, *stream).ok());
  ASSERT_TRUE(dev.CopyAsync(out.data(), g, 3 * kN * 4, Direction::kDeviceToHost, *stream).ok());
  ASSERT_TRUE(dev.Record(*done, *stream).ok());
  ASSERT_TRUE(dev.Synchronize(*done).ok());
  for (size_t i = 0; i < kN; ++i) ASSERT_EQ(out[i], host[i]) << "gathered " << i;
  for (size_t i = 0; i < 1024; ++i) ASSERT_EQ(out[kN + i], host[4096 + i]) << "second " << i;
  for (size_t i = 0; i < kN; ++i) ASSERT_EQ(out[2 * kN + i], host[i]) << "reduced " << i;
}

}  // namespace
}  // namespace offload::gpu
