#include "gpu/emulated_communicator.h"

#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace offload::gpu {
namespace {

// `ranks` emulated devices, one communicator each, and a stream and an
// event per rank.
struct Ranks {
  explicit Ranks(int n, absl::Duration timeout = absl::Seconds(60)) {
    std::vector<EmulatedDevice*> raw;
    for (int r = 0; r < n; ++r) {
      devices.push_back(std::make_unique<EmulatedDevice>(
          EmulatedDeviceOptions{.memory_bytes = 64 << 20, .seed = static_cast<uint64_t>(r + 1)}));
      raw.push_back(devices.back().get());
      streams.push_back(*devices.back()->CreateStream());
      events.push_back(*devices.back()->CreateEvent());
    }
    comms = EmulatedCommunicator::CreateGroup(raw, timeout);
  }
  // Runs fn(rank) on a thread per rank, as separate processes would.
  void Each(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (size_t r = 0; r < comms.size(); ++r) threads.emplace_back(fn, static_cast<int>(r));
    for (auto& t : threads) t.join();
  }
  absl::Status Finish(int r) {
    if (absl::Status s = devices[r]->Record(events[r], streams[r]); !s.ok()) return s;
    return devices[r]->Synchronize(events[r]);
  }
  std::vector<std::unique_ptr<EmulatedDevice>> devices;
  std::vector<Stream> streams;
  std::vector<Event> events;
  std::vector<std::unique_ptr<EmulatedCommunicator>> comms;
};

TEST(EmulatedCommunicatorTest, AllGatherOfSeveralItemsIsOneCollective) {
  Ranks ranks(3);
  // Two tensors, 5 and 2 floats a rank; rank r's values are 100 r + i.
  std::vector<std::vector<float>> a(3, std::vector<float>(15)), b(3, std::vector<float>(6));
  ranks.Each([&](int r) {
    std::vector<float> mine_a(5), mine_b(2);
    for (int i = 0; i < 5; ++i) mine_a[i] = 100.0f * r + i;
    for (int i = 0; i < 2; ++i) mine_b[i] = 100.0f * r + 50 + i;
    // Rank 1 gathers in place: its part of the output is its input.
    float* send_a = mine_a.data();
    if (r == 1) {
      std::memcpy(a[r].data() + 5, mine_a.data(), 20);
      send_a = a[r].data() + 5;
    }
    const Communicator::GatherItem items[] = {{send_a, a[r].data(), 20},
                                              {mine_b.data(), b[r].data(), 8}};
    ASSERT_TRUE(ranks.comms[r]->AllGather(items, ranks.streams[r]).ok());
    ASSERT_TRUE(ranks.Finish(r).ok());
  });
  for (int r = 0; r < 3; ++r) {
    for (int from = 0; from < 3; ++from) {
      for (int i = 0; i < 5; ++i) EXPECT_EQ(a[r][from * 5 + i], 100.0f * from + i);
      for (int i = 0; i < 2; ++i) EXPECT_EQ(b[r][from * 2 + i], 100.0f * from + 50 + i);
    }
    EXPECT_EQ(ranks.comms[r]->collectives(), 1u);
    EXPECT_EQ(ranks.comms[r]->items(), 2u);
  }
}

TEST(EmulatedCommunicatorTest, ReduceScatterSumsOrAveragesEachRanksPart) {
  Ranks ranks(2);
  std::vector<std::vector<float>> sum(2, std::vector<float>(3)), avg(2);
  ranks.Each([&](int r) {
    // send[to * 3 + j] = (r + 1) * (10 to + j)
    std::vector<float> send(6);
    for (int to = 0; to < 2; ++to) {
      for (int j = 0; j < 3; ++j) send[to * 3 + j] = (r + 1.0f) * (10.0f * to + j);
    }
    ASSERT_TRUE(
        ranks.comms[r]
            ->ReduceScatter({{send.data(), sum[r].data(), 3}}, ReduceOp::kSum, ranks.streams[r])
            .ok());
    // In place: the result lands on this rank's own part of its input.
    avg[r] = send;
    ASSERT_TRUE(ranks.comms[r]
                    ->ReduceScatter({{avg[r].data(), avg[r].data() + r * 3, 3}}, ReduceOp::kAvg,
                                    ranks.streams[r])
                    .ok());
    ASSERT_TRUE(ranks.Finish(r).ok());
  });
  for (int r = 0; r < 2; ++r) {
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(sum[r][j], 3.0f * (10.0f * r + j)) << r << " " << j;
      EXPECT_EQ(avg[r][r * 3 + j], 1.5f * (10.0f * r + j)) << r << " " << j;
    }
  }
}

TEST(EmulatedCommunicatorTest, RunsInOrderWithItsStreamsCopies) {
  Ranks ranks(2);
  std::vector<std::vector<char>> out(2, std::vector<char>(2 << 20));
  ranks.Each([&](int r) {
    EmulatedDevice& dev = *ranks.devices[r];
    auto in = dev.Allocate(1 << 20);
    auto gathered = dev.Allocate(2 << 20);
    ASSERT_TRUE(in.ok() && gathered.ok());
    std::vector<char> host(1 << 20, static_cast<char>('a' + r));
    // The copy into `in` runs in chunks after a random delay; the
    // collective after it on the same stream sees all of it, and the copy
    // out after the collective sees the collective's result.
    ASSERT_TRUE(dev.CopyAsync(in->get(), host.data(), host.size(), Direction::kHostToDevice,
                              ranks.streams[r])
                    .ok());
    ASSERT_TRUE(
        ranks.comms[r]->AllGather({{in->get(), gathered->get(), 1u << 20}}, ranks.streams[r]).ok());
    ASSERT_TRUE(dev.CopyAsync(out[r].data(), gathered->get(), 2 << 20, Direction::kDeviceToHost,
                              ranks.streams[r])
                    .ok());
    ASSERT_TRUE(ranks.Finish(r).ok());
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(std::vector<char>(out[r].begin(), out[r].begin() + (1 << 20)),
              std::vector<char>(1 << 20, 'a'));
    EXPECT_EQ(std::vector<char>(out[r].begin() + (1 << 20), out[r].end()),
              std::vector<char>(1 << 20, 'b'));
  }
}

TEST(EmulatedCommunicatorTest, RanksThatDisagreeBreakTheGroupWithBothCallsNamed) {
  Ranks ranks(2);
  float a[4] = {}, b[8] = {};
  ranks.Each([&](int r) {
    if (r == 0) {
      ASSERT_TRUE(ranks.comms[r]->AllGather({{a, b, 16}}, ranks.streams[r]).ok());
    } else {
      ASSERT_TRUE(
          ranks.comms[r]->ReduceScatter({{b, a, 4}}, ReduceOp::kSum, ranks.streams[r]).ok());
    }
    ASSERT_TRUE(ranks.Finish(r).ok());
  });
  for (int r = 0; r < 2; ++r) {
    absl::Status next = ranks.comms[r]->AllGather({{a, b, 16}}, ranks.streams[r]);
    EXPECT_EQ(next.code(), absl::StatusCode::kFailedPrecondition) << next;
    EXPECT_TRUE(absl::StrContains(next.message(), "all-gather of 1 items (16 bytes)")) << next;
    EXPECT_TRUE(absl::StrContains(next.message(), "reduce-scatter (sum) of 1 items (4 floats)"))
        << next;
  }
}

TEST(EmulatedCommunicatorTest, ARankThatNeverComesBreaksTheGroupAtItsTimeout) {
  Ranks ranks(2, absl::Milliseconds(100));
  char a[8] = {}, b[16] = {};
  ASSERT_TRUE(ranks.comms[0]->AllGather({{a, b, 8}}, ranks.streams[0]).ok());
  ASSERT_TRUE(ranks.Finish(0).ok());  // waited for rank 1 until the timeout
  absl::Status next = ranks.comms[0]->AllGather({{a, b, 8}}, ranks.streams[0]);
  EXPECT_EQ(next.code(), absl::StatusCode::kDeadlineExceeded) << next;
  EXPECT_TRUE(absl::StrContains(next.message(), "rank(s) 1 did not issue it")) << next;
  // The late rank finds the group broken instead of waiting forever.
  EXPECT_EQ(ranks.comms[1]->AllGather({{a, b, 8}}, ranks.streams[1]).code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(EmulatedCommunicatorTest, NullBuffersAreRefusedAtIssue) {
  Ranks ranks(1);
  char a[4];
  EXPECT_EQ(ranks.comms[0]->AllGather({{nullptr, a, 4}}, ranks.streams[0]).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ranks.comms[0]->collectives(), 0u);
}

}  // namespace
}  // namespace offload::gpu
