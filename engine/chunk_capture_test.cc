#include "engine/chunk_capture.h"

#include <atomic>
#include <map>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

// Counts what reached it.
class CountingSink : public ChunkSink {
 public:
  absl::Status Write(uint64_t id, uint64_t chunk, int kind, absl::Span<const std::byte>) override {
    absl::MutexLock lock(&mu_);
    ++writes_[{id, chunk, kind}];
    return absl::OkStatus();
  }
  std::map<std::tuple<uint64_t, uint64_t, int>, int> writes() {
    absl::MutexLock lock(&mu_);
    return writes_;
  }

 private:
  absl::Mutex mu_;
  std::map<std::tuple<uint64_t, uint64_t, int>, int> writes_;
};

absl::Status WriteOne(uint64_t id, uint64_t chunk, int kind, ChunkSink* sink,
                      ChunkCapture::Staging*) {
  std::byte b{};
  return sink->Write(id, chunk, kind, absl::MakeConstSpan(&b, 1));
}

// Eight threads capture every chunk (as the writer and the calls about to
// change chunks do at once): each block of each chunk reaches the sink once.
TEST(ChunkCapture, EveryChunkGoesOnceWhoeverGetsThere) {
  CountingSink sink;
  ChunkCapture capture(&sink, WriteOne);
  capture.Add(1, {0, 3}, 50);
  capture.Add(2, {4}, 7);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (uint64_t c = 0; c < 50; ++c) capture.Capture(1, (c * (t + 1)) % 50);
      for (uint64_t c = 0; c < 7; ++c) capture.Capture(2, c);
    });
  }
  for (auto& t : threads) t.join();
  capture.Capture(3, 0);  // never added
  capture.Capture(2, 7);  // past its chunks
  EXPECT_TRUE(capture.Finish().ok());
  const auto writes = sink.writes();
  EXPECT_EQ(writes.size(), 50u * 2 + 7);
  for (const auto& [block, n] : writes) EXPECT_EQ(n, 1);
}

// A chunk being captured is not changed before its capture ended: a second
// Capture of it returns only after the first's read.
TEST(ChunkCapture, ACaptureOfAChunkBeingCapturedWaitsForIt) {
  CountingSink sink;
  absl::Notification reading, go_on;
  std::atomic<bool> read_done{false};
  ChunkCapture capture(&sink, [&](uint64_t id, uint64_t chunk, int kind, ChunkSink* s,
                                  ChunkCapture::Staging* staging) {
    reading.Notify();
    go_on.WaitForNotification();
    absl::Status status = WriteOne(id, chunk, kind, s, staging);
    read_done = true;
    return status;
  });
  capture.Add(1, {0}, 1);
  std::thread writer([&] { capture.Capture(1, 0); });
  reading.WaitForNotification();
  std::atomic<bool> second_returned{false};
  std::thread changer([&] {
    capture.Capture(1, 0);
    EXPECT_TRUE(read_done.load());
    second_returned = true;
  });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(second_returned.load());
  go_on.Notify();
  writer.join();
  changer.join();
  EXPECT_TRUE(second_returned.load());
  EXPECT_TRUE(capture.Finish().ok());
}

// After the first failure no more I/O is done for the checkpoint; Finish
// says the failure; a Capture after Finish does nothing.
TEST(ChunkCapture, AfterAFailureTheRestIsGivenUp) {
  CountingSink sink;
  std::atomic<int> reads{0};
  ChunkCapture capture(&sink, [&](uint64_t id, uint64_t chunk, int kind, ChunkSink* s,
                                  ChunkCapture::Staging* staging) {
    ++reads;
    if (chunk == 2) return absl::DataLossError("chunk 2 unreadable");
    return WriteOne(id, chunk, kind, s, staging);
  });
  capture.Add(1, {0, 1}, 5);
  for (uint64_t c = 0; c < 5; ++c) capture.Capture(1, c);
  EXPECT_EQ(reads.load(), 2 * 2 + 1);  // chunks 0 and 1, then chunk 2's first block
  const absl::Status status = capture.Finish();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  capture.Capture(1, 4);
  EXPECT_EQ(reads.load(), 5);
}

}  // namespace
}  // namespace offload
