#include "swapper/swapper.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/env.h"
#include "base/host_memory.h"
#include "base/smaps_testing.h"
#include "base/unique_fd.h"
#include "gtest/gtest.h"
#include "nvme/fault_injection.h"
#include "nvme/io_backend_factory.h"
#include "nvme/swap_space.h"
#include "swapper/pool_shares.h"

namespace offload {
namespace {

constexpr uint64_t kMiB = 1 << 20;

// Fills or checks a block with bytes derived from `seed`.
void Fill(const Swapper::Pin& p, uint32_t seed) {
  auto* w = reinterpret_cast<uint32_t*>(p.data());
  for (uint64_t i = 0; i < p.size() / 4; ++i) w[i] = seed * 2654435761u + static_cast<uint32_t>(i);
}
bool Holds(const std::byte* data, uint64_t bytes, uint32_t seed) {
  const auto* w = reinterpret_cast<const uint32_t*>(data);
  for (uint64_t i = 0; i < bytes / 4; ++i) {
    if (w[i] != seed * 2654435761u + static_cast<uint32_t>(i)) return false;
  }
  return true;
}
bool Holds(const Swapper::Pin& p, uint32_t seed) { return Holds(p.data(), p.size(), seed); }

// Waits, yielding, until `done()`; fails the test after 20 s.
template <typename Fn>
void AwaitTrue(Fn done, const char* what) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!done()) {
    ASSERT_LT(absl::Now(), deadline) << "timed out waiting for " << what;
    std::this_thread::yield();
  }
}

class SwapperTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::string(getenv("TEST_TMPDIR")) + "/swap";
    mkdir(dir_.c_str(), 0700);
    auto inner = MakeIoBackend(IoOptions{});
    ASSERT_TRUE(inner.ok()) << inner.status();
    auto faulty = std::make_unique<FaultInjectingBackend>(std::move(*inner));
    faults_ = faulty.get();
    backend_ = std::move(faulty);
    NvmeOptions o;
    o.dirs = dir_;
    o.bytes_per_dir = int64_t{256} << 20;
    auto space = SwapSpace::Create(o, backend_.get());
    ASSERT_TRUE(space.ok()) << space.status();
    space_ = std::move(*space);
  }

  // A swapper over a pool of `pool_bytes`.
  void Make(uint64_t pool_bytes, int64_t prefetch_depth = 0, int64_t io_threads = 4,
            Pages host_home_pages = Pages::kHuge) {
    CheckIndex();
    swapper_.reset();  // a second Make in a test: before the pool it uses
    pool_ = std::make_unique<HostPool>(Env::Default(), pool_bytes, false);
    SwapperOptions o;
    o.prefetch_depth = prefetch_depth;
    o.io_threads = io_threads;
    o.host_home_pages = host_home_pages;
    o.stalled_io_seconds = stalled_io_seconds_;
    auto s = Swapper::Create(o, pool_.get(), space_.get());
    ASSERT_TRUE(s.ok()) << s.status();
    swapper_ = std::move(*s);
    swapper_->CheckVictimsForTesting();
  }

  // Eviction's index agrees with the blocks now (`where`: the test's step).
  void ExpectIndexAgrees(const std::string& where) {
    for (const std::string& error : swapper_->IndexErrorsForTesting()) {
      ADD_FAILURE() << where << ": " << error;
    }
  }
  // Below its tests (RandomOperations...).
  void RandomOperations(bool shares);
  // Whatever the test did, eviction's index agrees with the blocks, and
  // every victim ranked as the one a walk over all of them would have chosen.
  void CheckIndex() {
    if (swapper_ == nullptr) return;
    for (const std::string& error : swapper_->IndexErrorsForTesting()) ADD_FAILURE() << error;
    EXPECT_EQ(swapper_->VictimMismatchForTesting(), "");
  }

  // Acquires `id` for writing, fills it with `seed`, releases it.
  void Write(uint64_t id, uint32_t seed) {
    auto p = swapper_->Acquire(id, /*for_write=*/true);
    ASSERT_TRUE(p.ok()) << p.status();
    Fill(*p, seed);
  }
  // Acquires block `id` `n` times, each let go at once.
  void AcquireTimes(uint64_t id, int n, Swapper::Use use) {
    for (int i = 0; i < n; ++i) {
      auto p = swapper_->Acquire(id, /*for_write=*/false, use);
      ASSERT_TRUE(p.ok()) << p.status();
    }
  }
  void ExpectHolds(uint64_t id, uint32_t seed) {
    auto p = swapper_->Acquire(id, /*for_write=*/false);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(Holds(*p, seed)) << "block " << id;
  }
  BlockState StateOf(uint64_t id) { return *swapper_->State(id); }
  // The NVMe tier's next `op` fails with `error`.
  void FailNext(IoOp op, int error) {
    FaultRule rule;
    rule.any_op = false;
    rule.op = op;
    rule.error = error;
    faults_->AddRule(rule);
  }
  // Blocks 1 (holding 11, on NVMe) and 2 (holding 22, resident) in a pool
  // of one block, and a buffer that CopyOut can fill with either.
  HostMemory OneOnNvmeOneResident() {
    Make(kMiB);
    EXPECT_TRUE(swapper_->Add(1, kMiB, Tier::kNvme, 7).ok());
    EXPECT_TRUE(swapper_->Add(2, kMiB, Tier::kNvme, 7).ok());
    Write(1, 11);
    Write(2, 22);  // evicts 1
    auto buffer = HostMemory::Allocate(swapper_->CopyOutBytes(kMiB));
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    return buffer.ok() ? *std::move(buffer) : HostMemory();
  }
  // The I/O thread about to write (or read) block `id` stops there:
  // `reached` is notified, and it goes on once `release` is.
  void HoldIo(uint64_t id, bool write, absl::Notification* reached, absl::Notification* release) {
    swapper_->SetIoHookForTesting([=](uint64_t block, bool is_write) {
      if (block == id && is_write == write) {
        reached->Notify();
        release->WaitForNotification();
      }
    });
  }

  // The swapper's clock for idle traces and shares stands still from here
  // until AdvanceClock moves it.
  void UseFakeClock() {
    swapper_->SetClockForTesting([this] {
      return std::chrono::steady_clock::time_point{} + std::chrono::hours(1) +
             std::chrono::milliseconds(clock_ms_.load());
    });
  }
  void AdvanceClock(std::chrono::milliseconds by) { clock_ms_ += by.count(); }

  void TearDown() override {
    CheckIndex();
    swapper_.reset();  // before the pool and the space it uses
    if (pool_ != nullptr) {
      EXPECT_EQ(pool_->used(), 0u);
    }
  }

  int64_t stalled_io_seconds_ = 30;  // Make's
  std::string dir_;
  FaultInjectingBackend* faults_ = nullptr;
  std::unique_ptr<IoBackend> backend_;
  std::unique_ptr<SwapSpace> space_;
  std::unique_ptr<HostPool> pool_;
  std::unique_ptr<Swapper> swapper_;
  std::atomic<int64_t> clock_ms_{0};
};

// A trace's learned order goes with it, so that a daemon serving session
// after session does not keep one per session it ever served.
TEST_F(SwapperTest, AForgottenTracesOrderGoes) {
  Make(4 * kMiB);
  for (uint64_t id = 1; id <= 4; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  ASSERT_TRUE(swapper_->Add(9, kMiB, Tier::kNvme, 8).ok());
  for (uint64_t id : {1, 2, 3, 4, 9}) Write(id, static_cast<uint32_t>(id));
  for (uint64_t id = 1; id <= 4; ++id) ExpectHolds(id, static_cast<uint32_t>(id));
  swapper_->EndIteration(7);
  EXPECT_EQ(swapper_->Stats().traces, 2u);
  for (uint64_t id = 1; id <= 4; ++id) swapper_->Remove(id);
  swapper_->ForgetTrace(7);
  EXPECT_EQ(swapper_->Stats().traces, 1u);
  ExpectHolds(9, 9);  // the other trace's block is unaffected
}

TEST_F(SwapperTest, ManyTimesThePoolRoundTripsThroughNvme) {
  Make(4 * kMiB);
  for (uint64_t id = 1; id <= 16; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  for (uint64_t id = 1; id <= 16; ++id) {
    Write(id, static_cast<uint32_t>(id));
    EXPECT_LE(pool_->used(), pool_->limit());
  }
  for (uint64_t id = 1; id <= 16; ++id) {
    ExpectHolds(id, static_cast<uint32_t>(id));
    EXPECT_LE(pool_->used(), pool_->limit());
  }
  SwapperStats s = swapper_->Stats();
  EXPECT_GE(s.swap_outs, 12u);
  EXPECT_GE(s.swap_ins, 12u);
  EXPECT_EQ(s.io_errors, 0u);
  EXPECT_EQ(s.nvme_home_bytes, 16 * kMiB);
}

// A tier as full as what is homed there admits (here all of it), the
// blocks rewritten over and over as optimizer state is: each write-out
// still finds room (a rewrite in place where no second copy fits), and
// every block holds what was last written.
TEST_F(SwapperTest, ATierFullOfStateRewrittenEveryStepKeepsTraining) {
  constexpr uint64_t kBlock = 64 * kMiB;  // the tier holds four
  Make(kBlock);
  for (uint64_t id = 1; id <= 4; ++id) ASSERT_TRUE(swapper_->Add(id, kBlock, Tier::kNvme, 7).ok());
  for (uint32_t round = 0; round < 3; ++round) {
    for (uint64_t id = 1; id <= 4; ++id) Write(id, static_cast<uint32_t>(10 * round + id));
  }
  for (uint64_t id = 1; id <= 4; ++id) ExpectHolds(id, static_cast<uint32_t>(20 + id));
  EXPECT_EQ(swapper_->Stats().io_errors, 0u);
  EXPECT_GT(space_->Stats().in_place_rewrites, 0u);
}

// A transfer that does not complete (a frozen filesystem) is said in the
// log and in the stats: fetches and steps waited with nothing saying why.
TEST_F(SwapperTest, AStalledTransferIsSaid) {
  stalled_io_seconds_ = 1;
  Make(kMiB);
  ASSERT_TRUE(swapper_->Add(1, kMiB, Tier::kNvme, 7).ok());
  ASSERT_TRUE(swapper_->Add(2, kMiB, Tier::kNvme, 7).ok());
  Write(1, 11);
  absl::Notification reached, release;
  HoldIo(1, /*write=*/true, &reached, &release);
  char log_path[] = "/tmp/swapper_log.XXXXXX";
  const int log_fd = mkstemp(log_path);
  ASSERT_GE(log_fd, 0);
  const int saved_stderr = dup(2);
  dup2(log_fd, 2);
  std::thread writer([&] { Write(2, 22); });  // evicts 1: its write-out stalls
  reached.WaitForNotification();
  // Polled: the log line and the gauge are what is observed, and nothing
  // announces them.
  std::string log;
  uint64_t oldest = 0;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(20); absl::Now() < deadline;) {
    log.assign(4096, '\0');
    log.resize(std::max<ssize_t>(0, pread(log_fd, log.data(), log.size(), 0)));
    oldest = swapper_->Stats().io_oldest_running_seconds;
    if (absl::StrContains(log, "has been running for") && oldest >= 1) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  release.Notify();
  writer.join();
  dup2(saved_stderr, 2);
  close(saved_stderr);
  close(log_fd);
  unlink(log_path);
  swapper_->SetIoHookForTesting(nullptr);
  EXPECT_TRUE(absl::StrContains(log, "an NVMe task has been running for")) << log;
  EXPECT_GE(oldest, 1u);
  EXPECT_EQ(swapper_->Stats().io_oldest_running_seconds, 0u);
  ExpectHolds(2, 22);
}

// Pinning and unpinning a resident block is the hot path of every fetch
// (tens of thousands a second): it must not wake the idle I/O threads and
// the mover, which find nothing to do and cost a context switch each on the
// cores the callers need.
TEST_F(SwapperTest, PinningResidentBlocksWakesNoIdleWorker) {
  Make(4 * kMiB, /*prefetch_depth=*/0, /*io_threads=*/4);
  ASSERT_TRUE(swapper_->Add(1, kMiB, Tier::kHost, 7).ok());
  ASSERT_TRUE(swapper_->Add(2, kMiB, Tier::kNvme, 7).ok());
  Write(1, 11);
  Write(2, 22);
  absl::SleepFor(absl::Milliseconds(50));  // every worker idle
  const SwapperStats before = swapper_->Stats();
  for (int i = 0; i < 500; ++i) {  // paced as calls arrive
    {
      auto p = swapper_->Acquire(1 + i % 2, /*for_write=*/i % 3 == 0);
      ASSERT_TRUE(p.ok()) << p.status();
    }
    absl::SleepFor(absl::Microseconds(50));
  }
  absl::SleepFor(absl::Milliseconds(50));
  const SwapperStats d = swapper_->Stats().Since(before);
  EXPECT_EQ(d.hits, 500u);
  // Five workers woken by each of 500 unpins would be hundreds or more.
  EXPECT_LT(d.idle_wakeups, 20u);
}

// A session whose state is on the host pins, releases and discards its
// blocks thousands of times a second beside a session waiting for room:
// none of that makes room (a block homed on the host keeps its memory), so
// it wakes no waiter, which would only go through the lock to find nothing
// changed.
TEST_F(SwapperTest, ReleasingAHostBlockWakesNoWaiterForRoom) {
  Make(3 * kMiB);
  // (Of a session with state on NVMe too: through the lock. One all on the
  // host pins without it: ASessionOnTheHostPinsWithoutTheSwappersLock.)
  ASSERT_TRUE(swapper_->Add(1, kMiB, Tier::kHost, 7).ok());
  for (uint64_t id : {2, 3, 4}) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  Write(1, 1);
  Write(2, 2);
  Write(3, 3);  // the pool is full
  absl::Notification reached, release;
  std::atomic<bool> held{false};
  swapper_->SetIoHookForTesting([&](uint64_t, bool is_write) {
    if (is_write && !held.exchange(true)) {  // the first write-out stops here
      reached.Notify();
      release.WaitForNotification();
    }
  });
  std::thread waiter([&] {
    auto p = swapper_->Acquire(4, /*for_write=*/true);  // waits for the write-out
    EXPECT_TRUE(p.ok()) << p.status();
  });
  reached.WaitForNotification();
  absl::SleepFor(absl::Milliseconds(20));  // the waiter waits for room
  const SwapperStats before = swapper_->Stats();
  for (int i = 0; i < 300; ++i) {  // paced as calls arrive
    {
      auto p = swapper_->Acquire(1, /*for_write=*/i % 2 == 0);
      if (!p.ok()) {
        ADD_FAILURE() << p.status();
        break;
      }
    }
    // A step's gradients consumed: their bytes dead (the host keeps the memory).
    if (i % 2 == 1) {
      EXPECT_TRUE(swapper_->Discard(1).ok());
    }
    absl::SleepFor(absl::Microseconds(50));
  }
  const SwapperStats d = swapper_->Stats().Since(before);
  release.Notify();
  waiter.join();
  swapper_->SetIoHookForTesting(nullptr);
  EXPECT_EQ(d.hits, 300u);
  EXPECT_EQ(d.unlocked_pins, 0u);
  // Woken by each release and discard: about 450.
  EXPECT_LT(d.waiter_wakeups, 10u);
}

// A session whose state is all on the host pins, releases and discards
// its blocks without the swapper's lock: while another session's call holds
// the lock (here: stopped in the swapper's clock, which it reads under the
// lock), its calls go on.
TEST_F(SwapperTest, ASessionOnTheHostPinsWithoutTheSwappersLock) {
  Make(4 * kMiB);
  ASSERT_TRUE(swapper_->Add(1, kMiB, Tier::kHost, 8).ok());  // trace 8: all on the host
  ASSERT_TRUE(swapper_->Add(2, kMiB, Tier::kNvme, 7).ok());
  Write(1, 1);
  Write(2, 2);
  std::atomic<bool> stop_in_clock{false};
  absl::Notification in_clock, open_clock;
  swapper_->SetClockForTesting([&] {
    if (stop_in_clock.exchange(false)) {
      in_clock.Notify();
      open_clock.WaitForNotification();
    }
    return std::chrono::steady_clock::now();
  });
  const SwapperStats before = swapper_->Stats();
  stop_in_clock = true;
  std::thread other([&] {  // trace 7's Acquire holds the lock until open_clock
    auto p = swapper_->Acquire(2, /*for_write=*/false);
    EXPECT_TRUE(p.ok()) << p.status();
  });
  in_clock.WaitForNotification();
  absl::Notification done;
  std::thread mine([&] {
    for (int i = 0; i < 100; ++i) {
      auto p = swapper_->Acquire(1, /*for_write=*/i % 2 == 0);
      if (!p.ok()) {
        ADD_FAILURE() << p.status();
        break;
      }
      if (i % 2 == 0) Fill(*p, 100 + i);
      if (!Holds(*p, 100 + i - i % 2)) ADD_FAILURE() << "pin " << i;
      p->Reset();
      if (i % 2 == 1) {
        EXPECT_TRUE(swapper_->Discard(1).ok());
      }
    }
    done.Notify();
  });
  const bool went_on = done.WaitForNotificationWithTimeout(absl::Seconds(5));
  open_clock.Notify();  // (unblocks both where they waited for the lock)
  mine.join();
  other.join();
  swapper_->SetClockForTesting(nullptr);
  EXPECT_TRUE(went_on) << "trace 8's calls waited for the lock another session held";
  const SwapperStats d = swapper_->Stats().Since(before);
  EXPECT_EQ(d.hits, 101u);  // (trace 7's one too)
  EXPECT_EQ(d.unlocked_pins, 100u);
  EXPECT_EQ(d.discards, 50u);
  ExpectHolds(1, 198);
}

// Pins taken without the lock count wherever pins count: a block moved to
// NVMe while so pinned is not evicted until they go; one removed goes when
// they do; a pinned one is not discarded.
TEST_F(SwapperTest, PinsTakenWithoutTheLockHoldTheBlock) {
  Make(2 * kMiB);
  ASSERT_TRUE(swapper_->Add(1, kMiB, Tier::kHost, 8).ok());
  Write(1, 11);
  const uint64_t unlocked = swapper_->Stats().unlocked_pins;
  auto held = swapper_->Acquire(1, /*for_write=*/true);  // without the lock
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(swapper_->Stats().unlocked_pins - unlocked, 1u);
  EXPECT_EQ(swapper_->Discard(1).code(), absl::StatusCode::kFailedPrecondition);
  Fill(*held, 12);
  ASSERT_TRUE(swapper_->SetHome(1, Tier::kNvme).ok());  // trace 8 goes through the lock now
  ASSERT_TRUE(swapper_->Add(2, kMiB, Tier::kNvme, 8).ok());
  ASSERT_TRUE(swapper_->Add(3, kMiB, Tier::kNvme, 8).ok());
  Write(2, 2);
  const uint64_t outs = swapper_->Stats().swap_outs;
  Write(3, 3);  // room: 2 goes, never 1 (not even tried: no write-out of it)
  swapper_->WaitIdle();
  swapper_->SetIoHookForTesting(nullptr);
  EXPECT_EQ(swapper_->Stats().swap_outs - outs, 1u);
  EXPECT_EQ(StateOf(1), BlockState::kResident);
  EXPECT_EQ(StateOf(2), BlockState::kOnNvme);
  EXPECT_EQ(swapper_->Stats().pinned_bytes, kMiB);
  held->Reset();
  ExpectHolds(2, 2);  // room: 1 goes now, written out with what the pin wrote
  EXPECT_EQ(StateOf(1), BlockState::kOnNvme);
  ExpectHolds(1, 12);
  ExpectHolds(3, 3);

  // Removed while so pinned: its memory stays until the pin goes.
  ASSERT_TRUE(swapper_->Add(4, kMiB, Tier::kHost, 9).ok());
  Write(4, 4);
  auto last = swapper_->Acquire(4, /*for_write=*/true);
  ASSERT_TRUE(last.ok()) << last.status();
  const uint64_t used = pool_->used();
  swapper_->Remove(4);
  EXPECT_EQ(pool_->used(), used);
  Fill(*last, 5);  // (its memory, still the block's)
  last->Reset();
  EXPECT_LT(pool_->used(), used);
  for (uint64_t id : {1, 2, 3}) swapper_->Remove(id);
  EXPECT_EQ(swapper_->Stats().blocks, 0u);
}

// Pins without the lock against everything that turns them off and on
// again, at once: two threads pin (and write, each its own blocks) a
// session's blocks while a third moves them to NVMe and back (its session
// then pins through the lock, they are evicted and read back, under the
// pressure of a fourth session's swapping). No write is lost, no block is
// evicted while pinned, the index agrees.
TEST_F(SwapperTest, PinsWithoutTheLockSurviveMovesToNvmeAndBack) {
  constexpr uint64_t kBlock = 256 << 10;
  Make(8 * kBlock);
  constexpr int kOwn = 4;  // blocks 100..103 of trace 9, two a writer
  for (uint64_t id = 100; id < 100 + kOwn; ++id) {
    ASSERT_TRUE(swapper_->Add(id, kBlock, Tier::kHost, 9).ok());
  }
  for (uint64_t id = 1; id <= 8; ++id) ASSERT_TRUE(swapper_->Add(id, kBlock, Tier::kNvme, 7).ok());
  std::vector<std::atomic<uint32_t>> seeds(kOwn);
  for (int i = 0; i < kOwn; ++i) {
    seeds[i] = 1000 * (i + 1);
    Write(100 + i, seeds[i]);
  }
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0};
  auto writer = [&](int first) {
    std::mt19937 rng(first);
    for (int n = 1; !stop; ++n) {
      // (Now and then off the cores: the mover and the I/O threads need them.)
      if (n % 16 == 0) absl::SleepFor(absl::Microseconds(50));
      const int i = first + static_cast<int>(rng() % 2);
      const bool write = rng() % 3 == 0;
      auto p = swapper_->Acquire(100 + i, write);
      if (!p.ok()) {  // (room for the block read back: the pool is small)
        if (!absl::IsResourceExhausted(p.status())) ++errors;
        continue;
      }
      if (!Holds(*p, seeds[i])) ++errors;  // a write lost, or bytes moved under the pin
      if (write) {
        seeds[i] = seeds[i] + 1;
        Fill(*p, seeds[i]);
      }
    }
  };
  std::thread a(writer, 0), b(writer, 2);
  // (Trace 7 never ahead of its share, its order learned: trace 9's block
  // on NVMe gives room first.) One of them on NVMe while trace 7 goes
  // through the pool, 60 times, and until 16 of trace 9's blocks were read
  // back (at most 600 times, or longer than a turn without an end: trace 9,
  // whose iterations never end, wins the pool's first turn now and then,
  // and its blocks give no room while it lasts, PoolShares::kUnmeasuredTurn;
  // 2 runs in 300 with the 2 cores busy, before this bound).
  swapper_->SetIoWeight(7, 1000);
  {
    std::mt19937 rng(3);
    const absl::Time until =
        absl::Now() + absl::FromChrono(PoolShares::kUnmeasuredTurn) + absl::Seconds(5);
    for (int n = 0;
         (n < 600 || absl::Now() < until) && (n < 60 || swapper_->IoOf(9).bytes_in < 16 * kBlock);
         ++n) {
      const uint64_t id = 100 + rng() % kOwn;
      if (!swapper_->SetHome(id, Tier::kNvme).ok()) ++errors;
      for (uint64_t other = 1; other <= 8; ++other) {
        auto p = swapper_->Acquire(other, /*for_write=*/rng() % 2 == 0);
        (void)p;  // (RESOURCE_EXHAUSTED now and then, the pool full of pins: fine)
      }
      swapper_->EndIteration(7);  // (its order learned: trace 9's, unfollowed, goes first)
      if (!swapper_->SetHome(id, Tier::kHost).ok()) ++errors;
      absl::SleepFor(absl::Microseconds(rng() % 1000));  // all on the host: pinned without the lock
    }
  }
  stop = true;
  a.join();
  b.join();
  EXPECT_EQ(errors.load(), 0);
  for (int i = 0; i < kOwn; ++i) ExpectHolds(100 + i, seeds[i]);
  const SwapperStats st = swapper_->Stats();
  EXPECT_GT(st.unlocked_pins, 0u);
  EXPECT_GT(swapper_->IoOf(9).bytes_in, 0u) << "trace 9's blocks were never evicted and read back";
  swapper_->WaitIdle();
  ExpectIndexAgrees("at the end");
}

TEST_F(SwapperTest, HostPlacedBlocksAreNeverEvicted) {
  Make(3 * kMiB);
  ASSERT_TRUE(swapper_->Add(100, kMiB, Tier::kHost, 7).ok());
  Write(100, 100);
  for (uint64_t id = 1; id <= 6; ++id) {
    ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
    Write(id, static_cast<uint32_t>(id));
    EXPECT_EQ(StateOf(100), BlockState::kResident);
  }
  ExpectHolds(100, 100);
  for (uint64_t id = 1; id <= 6; ++id) ExpectHolds(id, static_cast<uint32_t>(id));
  // The pool cannot hold more host-placed blocks than it has room for.
  ASSERT_TRUE(swapper_->Add(101, kMiB, Tier::kHost, 7).ok());
  ASSERT_TRUE(swapper_->Add(102, kMiB, Tier::kHost, 7).ok());
  EXPECT_EQ(swapper_->Add(103, kMiB, Tier::kHost, 7).code(), absl::StatusCode::kResourceExhausted);
}

// A block homed on the host lives on the pages SwapperOptions::host_home_pages
// names; a block homed on NVMe is brought in on huge pages whatever it says.
TEST_F(SwapperTest, BlocksHomedOnTheHostLiveOnTheirPagesAndOnesFromNvmeOnHugePages) {
  for (Pages pages : {Pages::kSmall, Pages::kHuge}) {
    const bool small = pages == Pages::kSmall;
    Make(4 * kMiB, 0, 4, pages);
    ASSERT_TRUE(swapper_->Add(1, kMiB, Tier::kHost, 7).ok());
    ASSERT_TRUE(swapper_->Add(2, kMiB, Tier::kNvme, 7).ok());
    Write(2, 22);
    auto host = swapper_->Acquire(1, false);
    auto from_nvme = swapper_->Acquire(2, false);
    ASSERT_TRUE(host.ok() && from_nvme.ok());
    if (!TransparentHugePagesAt(host->data())) {
      GTEST_SKIP() << "this kernel has no transparent huge pages";
    }
    const std::string h = VmFlagsAt(host->data()), n = VmFlagsAt(from_nvme->data());
    EXPECT_NE(h.find(small ? " nh " : " hg "), std::string::npos) << small << h;
    EXPECT_NE(n.find(" hg "), std::string::npos) << small << n;
  }
}

// A block moved home to the host while in memory, on a huge-page lease, is
// copied to a lease of the host's pages once nothing uses it: at once if
// idle, at its last pin's release if pinned. Its bytes stay.
TEST_F(SwapperTest, ABlockMovedToTheHostInMemoryTakesTheHostsPagesOnceIdle) {
  Make(8 * kMiB, 0, 4, Pages::kSmall);
  ASSERT_TRUE(swapper_->Add(1, kMiB, Tier::kNvme, 7).ok());
  ASSERT_TRUE(swapper_->Add(2, kMiB, Tier::kNvme, 7).ok());
  Write(1, 11);
  Write(2, 22);
  auto flags = [&](uint64_t id) {
    auto p = swapper_->Acquire(id, false);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? VmFlagsAt(p->data()) : std::string();
  };
  if (!TransparentHugePagesAt(swapper_->Acquire(1, false)->data())) {
    GTEST_SKIP() << "this kernel has no transparent huge pages";
  }
  EXPECT_NE(flags(1).find(" hg "), std::string::npos);
  const uint64_t before = swapper_->Stats().repages;
  // Idle: copied at once.
  ASSERT_TRUE(swapper_->SetHome(1, Tier::kHost).ok());
  EXPECT_NE(flags(1).find(" nh "), std::string::npos) << flags(1);
  ExpectHolds(1, 11);
  // Pinned: copied when the pin goes.
  {
    auto held = swapper_->Acquire(2, false);
    ASSERT_TRUE(held.ok());
    ASSERT_TRUE(swapper_->SetHome(2, Tier::kHost).ok());
    EXPECT_NE(VmFlagsAt(held->data()).find(" hg "), std::string::npos);
    EXPECT_TRUE(Holds(*held, 22));
  }
  EXPECT_NE(flags(2).find(" nh "), std::string::npos) << flags(2);
  ExpectHolds(2, 22);
  EXPECT_EQ(swapper_->Stats().repages - before, 2u);
  EXPECT_EQ(pool_->used(), 2 * kMiB) << "the huge-page leases were given back";
}

TEST_F(SwapperTest, PinnedBlocksStayAndPinningMoreThanThePoolIsResourceExhausted) {
  Make(2 * kMiB);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  auto a = swapper_->Acquire(1, true);
  auto b = swapper_->Acquire(2, true);
  ASSERT_TRUE(a.ok() && b.ok());
  Fill(*a, 1);
  auto c = swapper_->Acquire(3, true);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("held by callers"), std::string::npos) << c.status();
  EXPECT_EQ(StateOf(1), BlockState::kResident);
  a->Reset();
  auto again = swapper_->Acquire(3, true);
  ASSERT_TRUE(again.ok()) << again.status();
  again->Reset();
  b->Reset();
  ExpectHolds(1, 1);
}

// An evicted block's lease waits as a spare, and a read from NVMe lands on
// it (its bytes all overwritten); a block never written out still reads as
// zeros (a fresh lease), whatever spares there are.
TEST_F(SwapperTest, ReadsLandOnSparesAndNeverWrittenBlocksStayZeros) {
  Make(3 * kMiB);  // three blocks fill it: each read evicts one
  for (uint64_t id = 1; id <= 3; ++id) {
    ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
    Write(id, static_cast<uint32_t>(id));
  }
  ASSERT_TRUE(swapper_->Add(4, kMiB, Tier::kNvme, 7).ok());
  {
    auto fresh = swapper_->Acquire(4, /*for_write=*/false);
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    for (uint64_t i = 0; i < kMiB; ++i) ASSERT_EQ(static_cast<int>(fresh->data()[i]), 0) << i;
  }
  const uint64_t taken = pool_->spares_taken();
  for (int round = 0; round < 2; ++round) {
    for (uint64_t id = 1; id <= 3; ++id) ExpectHolds(id, static_cast<uint32_t>(id));
  }
  EXPECT_GT(pool_->spares_taken(), taken);
  EXPECT_LE(pool_->used() + pool_->spare_bytes(), 3 * kMiB);
}

TEST_F(SwapperTest, TrimGivesMemoryBackWhenTheLimitIsLowered) {
  Make(8 * kMiB);
  ASSERT_TRUE(swapper_->Add(100, kMiB, Tier::kHost, 7).ok());
  for (uint64_t id = 1; id <= 6; ++id) {
    ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
    Write(id, static_cast<uint32_t>(id));
  }
  auto pinned = swapper_->Acquire(6, false);
  ASSERT_TRUE(pinned.ok());
  EXPECT_EQ(pool_->used(), 7 * kMiB);
  pool_->SetLimit(3 * kMiB);
  swapper_->Trim();
  swapper_->WaitIdle();
  // The host-placed block and the pinned one stay; one more fits. What was
  // evicted is unmapped or a spare, within the limit too.
  EXPECT_EQ(pool_->used(), 3 * kMiB);
  EXPECT_LE(pool_->used() + pool_->spare_bytes(), 3 * kMiB);
  EXPECT_EQ(StateOf(100), BlockState::kResident);
  EXPECT_EQ(StateOf(6), BlockState::kResident);
  pinned->Reset();
  for (uint64_t id = 1; id <= 6; ++id) ExpectHolds(id, static_cast<uint32_t>(id));
}

TEST_F(SwapperTest, ConcurrentAcquiresShareOneSwapIn) {
  Make(2 * kMiB);
  ASSERT_TRUE(swapper_->Add(1, kMiB, Tier::kNvme, 7).ok());
  ASSERT_TRUE(swapper_->Add(2, kMiB, Tier::kNvme, 7).ok());
  ASSERT_TRUE(swapper_->Add(3, kMiB, Tier::kNvme, 7).ok());
  Write(1, 11);
  Write(2, 22);
  Write(3, 33);  // evicts 1
  ASSERT_EQ(StateOf(1), BlockState::kOnNvme);
  const SwapperStats before = swapper_->Stats();
  absl::Notification release;
  swapper_->SetIoHookForTesting([&](uint64_t id, bool is_write) {
    if (id == 1 && !is_write) release.WaitForNotification();
  });
  std::vector<std::thread> readers;
  // Not vector<bool>: its elements share words, and four threads setting
  // theirs at once may lose one another's.
  std::vector<int> ok(4, 0);
  for (int i = 0; i < 4; ++i) {
    readers.emplace_back([&, i] {
      auto p = swapper_->Acquire(1, false);
      ok[i] = p.ok() && Holds(*p, 11);
    });
  }
  // All four are inside Acquire while the one read is held.
  AwaitTrue([&] { return swapper_->Stats().acquires >= before.acquires + 4; }, "four readers");
  AwaitTrue([&] { return StateOf(1) == BlockState::kReadingIn; }, "the read");
  release.Notify();
  for (auto& t : readers) t.join();
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(ok[i]) << i;
  EXPECT_EQ(swapper_->Stats().swap_ins, before.swap_ins + 1);
}

TEST_F(SwapperTest, AFailedSwapInIsDataLossAndTheCopyStaysIntact) {
  Make(kMiB);
  ASSERT_TRUE(swapper_->Add(1, kMiB, Tier::kNvme, 7).ok());
  ASSERT_TRUE(swapper_->Add(2, kMiB, Tier::kNvme, 7).ok());
  Write(1, 11);
  Write(2, 22);  // evicts 1
  FailNext(IoOp::kRead, EIO);
  // Said in the log too (the operator's sign of a failing disk: only the
  // trainer heard of it).
  char log_path[] = "/tmp/swapper_log.XXXXXX";
  const int log_fd = mkstemp(log_path);
  ASSERT_GE(log_fd, 0);
  const int saved_stderr = dup(2);
  dup2(log_fd, 2);
  auto failed = swapper_->Acquire(1, false);
  dup2(saved_stderr, 2);
  close(saved_stderr);
  std::string log(4096, '\0');
  log.resize(std::max<ssize_t>(0, pread(log_fd, log.data(), log.size(), 0)));
  close(log_fd);
  unlink(log_path);
  EXPECT_TRUE(absl::StrContains(log, "swapping block 1 in failed")) << log;
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
  EXPECT_NE(failed.status().message().find("swapping in block 1"), std::string::npos);
  EXPECT_EQ(StateOf(1), BlockState::kOnNvme);
  ExpectIndexAgrees("after the failed swap-in");
  EXPECT_EQ(swapper_->Stats().io_errors, 1u);
  ExpectHolds(1, 11);
  ExpectHolds(2, 22);
}

// Many operations at random, on blocks of three traces in a pool of six,
// with prefetch and the mover running; most uses follow each trace's order
// (its blocks by id, an iteration ending after the last), so that learned
// orders, their repeats and their skips are exercised too. Eviction's index
// agrees with the blocks throughout, and every victim ranks as the one a
// walk over all blocks would have chosen (CheckIndex at the end counts those
// that did not). With `shares`: blocks of 1 MiB, the traces weighted 1, 2
// and 3, a fake clock moving on 0-49 ms a step, and one trace quiet for each
// stretch of 300 steps, so that traces go idle and get ahead of their
// shares (the ranks before Belady's distances).
void SwapperTest::RandomOperations(bool shares) {
  const uint64_t block = shares ? kMiB : 64 << 10;
  constexpr uint64_t kBlocks = 15;
  constexpr uint64_t kTraces = 3;
  Make(6 * block, /*prefetch_depth=*/2);
  Swapper* swapper = swapper_.get();
  if (shares) {
    UseFakeClock();
    for (uint64_t trace = 0; trace < kTraces; ++trace) {
      swapper->SetIoWeight(trace, static_cast<int64_t>(trace + 1));
    }
  }
  std::mt19937 rng(20261128);
  auto pick = [&](uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng); };
  std::vector<bool> added(kBlocks + 1, false);
  auto add = [&](uint64_t id) {
    const Tier home = pick(8) == 0 ? Tier::kHost : Tier::kNvme;
    absl::Status s = swapper->Add(id, block, home, /*trace=*/id % kTraces);
    // (A removed block being written out is still there: added later. The
    // pool full of pins and blocks homed on the host: likewise.)
    ASSERT_TRUE(s.ok() || absl::IsAlreadyExists(s) || absl::IsResourceExhausted(s)) << s;
    added[id] = s.ok();
  };
  for (uint64_t id = 1; id <= kBlocks; ++id) add(id);
  std::vector<uint64_t> next_in_order(kTraces, 0);  // each trace's next block
  std::vector<Swapper::Pin> pins;
  int failed = 0;
  uint64_t quiet = kTraces;  // (none)
  Swapper::Pin held_long;    // now and then, the quiet trace's: busy, not idle
  for (int step = 0; step < 6000; ++step) {
    if (shares) {
      AdvanceClock(std::chrono::milliseconds(pick(50)));
      if (step % 300 == 0) {
        held_long.Reset();
        quiet = pick(kTraces);
        const uint64_t id = kTraces * pick(kBlocks / kTraces) + (quiet == 0 ? kTraces : quiet);
        if (pick(2) == 0 && added[id]) {
          auto p = swapper->Acquire(id, /*for_write=*/false, Swapper::Use::kExtra);
          if (p.ok()) held_long = std::move(*p);
        }
      }
    }
    uint64_t id = 1 + pick(kBlocks);
    const uint64_t what = pick(100);
    if (what < 60) {            // a use, held for a while (at most three at once)
      uint64_t ends = kTraces;  // (none)
      // (An odd use now and then enters the order.)
      Swapper::Use use = pick(10) == 0  ? Swapper::Use::kInOrder
                         : pick(2) == 0 ? Swapper::Use::kBackground
                                        : Swapper::Use::kExtra;
      if (what < 45) {  // the next along its trace's order
        if (pick(10) != 0) use = Swapper::Use::kInOrder;
        const uint64_t trace = pick(kTraces);
        id = kTraces * next_in_order[trace] + (trace == 0 ? kTraces : trace);
        next_in_order[trace] = (next_in_order[trace] + 1) % (kBlocks / kTraces);
        if (next_in_order[trace] == 0) ends = trace;  // its last block
      }
      if (added[id] && id % kTraces != quiet) {
        auto p = swapper->Acquire(id, /*for_write=*/pick(2) == 0, use);
        if (p.ok()) {
          pins.push_back(std::move(*p));
          if (pins.size() > 3) pins.erase(pins.begin());
        } else {
          ++failed;
        }
      }
      if (ends != kTraces && ends != quiet) swapper->EndIteration(ends);
    } else if (what < 82) {
      if (!pins.empty()) pins.erase(pins.begin() + static_cast<ptrdiff_t>(pick(pins.size())));
    } else if (what < 84) {
      if (added[id]) swapper->Discard(id).IgnoreError();  // (busy: refused)
    } else if (what < 90) {
      if (added[id]) {
        ASSERT_TRUE(swapper->SetHome(id, pick(6) == 0 ? Tier::kHost : Tier::kNvme).ok());
      }
    } else if (what < 91) {
      if (id % kTraces != quiet) swapper->EndIteration(id % kTraces);  // (an iteration cut short)
    } else if (what < 94) {  // a block gone (its pins released first), and back
      if (id % kTraces == quiet) {
        // (Adding touches its trace: the quiet one stays quiet.)
      } else if (added[id]) {
        pins.erase(std::remove_if(pins.begin(), pins.end(),
                                  [&](const Swapper::Pin& p) { return p.id() == id; }),
                   pins.end());
        if (held_long.data() != nullptr && held_long.id() == id) held_long.Reset();
        swapper->Remove(id);
        added[id] = false;
      } else {
        add(id);
      }
    } else {
      swapper->WaitIdle();  // (prefetches and write-outs done: the next uses hit)
    }
    if (step % 100 == 0) ExpectIndexAgrees(absl::StrCat("step ", step));
  }
  pins.clear();
  held_long.Reset();
  swapper->WaitIdle();
  ExpectIndexAgrees("at the end");
  const SwapperStats st = swapper->Stats();
  EXPECT_GT(st.swap_outs + st.clean_drops, 100u);  // evictions: victims chosen
  EXPECT_GT(st.prefetches, 25u);
  EXPECT_LT(failed, 300);  // (room for three pins at most: rare)
  if (shares) {            // the ranks before the distances were in play
    EXPECT_GT(st.idle_evictions, 0u);
    EXPECT_GT(st.share_evictions, 10u);
  }
}

TEST_F(SwapperTest, RandomOperationsKeepEvictionsIndexTrue) { RandomOperations(false); }

TEST_F(SwapperTest, RandomOperationsAcrossSharesKeepEvictionsIndexTrue) { RandomOperations(true); }

// A prefetch whose read fails gives its room back: nobody waits for it to
// say so.
TEST_F(SwapperTest, AFailedPrefetchGivesItsRoomBack) {
  Make(3 * kMiB);
  for (uint64_t id = 1; id <= 4; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  for (uint64_t id = 1; id <= 4; ++id) Write(id, static_cast<uint32_t>(id));  // evicts 1
  swapper_->EndIteration(7);
  swapper_->SetPrefetch(1, 64 * kMiB);
  ASSERT_EQ(StateOf(1), BlockState::kOnNvme);
  FailNext(IoOp::kRead, EIO);
  ExpectHolds(3, 3);  // a hit; the window reaches 1, next iteration's first
  swapper_->WaitIdle();
  EXPECT_EQ(swapper_->Stats().io_errors, 1u);
  EXPECT_EQ(StateOf(1), BlockState::kOnNvme);
  ExpectIndexAgrees("after the failed prefetch");
  ExpectHolds(1, 1);
}

// A block removed while pinned holds no more room for eviction to give,
// nor does one whose session ends (RemoveAll); both go at their release.
TEST_F(SwapperTest, ABlockRemovedWhilePinnedGivesNoRoom) {
  Make(4 * kMiB);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  for (uint64_t id = 1; id <= 3; ++id) Write(id, static_cast<uint32_t>(id));
  {
    auto one = swapper_->Acquire(1, false);
    auto two = swapper_->Acquire(2, false);
    ASSERT_TRUE(one.ok() && two.ok());
    swapper_->Remove(1);
    ExpectIndexAgrees("block 1 removed, pinned");
    std::vector<PoolCharge> charges;
    swapper_->RemoveAll({2}, &charges);
    ExpectIndexAgrees("block 2 removed with RemoveAll, pinned");
    // Evictions beside them (CheckIndex: chosen as the walk would).
    ASSERT_TRUE(swapper_->Add(4, kMiB, Tier::kNvme, 8).ok());
    ASSERT_TRUE(swapper_->Add(5, kMiB, Tier::kNvme, 8).ok());
    Write(4, 4);
    Write(5, 5);
    EXPECT_GE(swapper_->Stats().swap_outs + swapper_->Stats().clean_drops, 1u);
  }
  ExpectIndexAgrees("both released");
  EXPECT_EQ(swapper_->State(1).status().code(), absl::StatusCode::kNotFound);
  ExpectHolds(3, 3);
  ExpectHolds(5, 5);
}

TEST_F(SwapperTest, AFailedWriteOutKeepsTheBlockAndTheNextOneWorks) {
  Make(kMiB);
  ASSERT_TRUE(swapper_->Add(1, kMiB, Tier::kNvme, 7).ok());
  ASSERT_TRUE(swapper_->Add(2, kMiB, Tier::kNvme, 7).ok());
  Write(1, 11);
  FailNext(IoOp::kWrite, ENOSPC);
  // Room for 2 needs 1 written out, which fails: the write's error, 1
  // untouched.
  auto two = swapper_->Acquire(2, true);
  EXPECT_EQ(two.status().code(), absl::StatusCode::kResourceExhausted) << two.status();
  EXPECT_NE(two.status().message().find("writing block 1 out"), std::string::npos) << two.status();
  EXPECT_EQ(StateOf(1), BlockState::kResident);
  EXPECT_EQ(swapper_->Stats().io_errors, 1u);
  // Short writes are completed by the engine; data survives them.
  FaultRule half;
  half.kind = FaultRule::Kind::kShort;
  half.any_op = false;
  half.op = IoOp::kWrite;
  faults_->AddRule(half);
  Write(2, 22);
  ExpectHolds(1, 11);
  ExpectHolds(2, 22);
}

// Capacity two blocks, prefetch off, iterations using 1 2 3 1 4 2. The first
// iteration learns the order (LRU meanwhile); in the second, each miss evicts
// the resident block used farthest in the future:
//   use 1: resident {4,2}; next uses 2 in 0, 4 in 3  -> evict 4
//   use 2: hit
//   use 3: resident {2,1}; 1 in 0, 2 in 2            -> evict 2
//   use 1: hit
//   use 4: resident {1,3}; 1 in 1, 3 in 3 (wrapped)  -> evict 3
//   use 2: resident {1,4}; 1 in 0, 4 in 4 (wrapped)  -> evict 4
// (LRU would have evicted 4, 1, 2, 3, 1 with one hit instead of two.)
TEST_F(SwapperTest, EvictsTheBlockNeededFarthestAway) {
  Make(2 * kMiB);
  for (uint64_t id = 1; id <= 4; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  const std::vector<uint64_t> order = {1, 2, 3, 1, 4, 2};
  for (uint64_t id : order) Write(id, static_cast<uint32_t>(id));
  swapper_->EndIteration(7);
  ASSERT_EQ(StateOf(4), BlockState::kResident);
  ASSERT_EQ(StateOf(2), BlockState::kResident);
  const std::vector<std::vector<uint64_t>> resident_after = {{1, 2}, {1, 2}, {1, 3},
                                                             {1, 3}, {1, 4}, {1, 2}};
  const uint64_t hits_before = swapper_->Stats().hits;
  for (size_t i = 0; i < order.size(); ++i) {
    ExpectHolds(order[i], static_cast<uint32_t>(order[i]));
    for (uint64_t id = 1; id <= 4; ++id) {
      const bool want = id == resident_after[i][0] || id == resident_after[i][1];
      EXPECT_EQ(StateOf(id) == BlockState::kResident, want)
          << "after use " << i << " of block " << order[i] << ": block " << id;
    }
  }
  EXPECT_EQ(swapper_->Stats().hits - hits_before, 2u);
}

// Two traces in a pool of four blocks: trace 7 uses blocks 1 and 5, trace 8
// uses 2, 3, 4, in those orders; both orders are learned, and 1, 5, 3 and 4
// are resident. The clock stands still until the test moves it.
class IdleTraceTest : public SwapperTest {
 protected:
  void SetUp() override {
    SwapperTest::SetUp();
    Make(4 * kMiB);
    UseFakeClock();
    for (uint64_t id : {1, 5}) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
    for (uint64_t id : {2, 3, 4}) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 8).ok());
    for (uint64_t id : {1, 5}) Write(id, static_cast<uint32_t>(id));
    swapper_->EndIteration(7);
    for (uint64_t id : {2, 3, 4}) Write(id, static_cast<uint32_t>(id));  // evicts 2
    swapper_->EndIteration(8);
    for (uint64_t id : {1, 5, 3, 4}) ASSERT_EQ(StateOf(id), BlockState::kResident) << id;
  }
  // Trace 7 idle from now on unless it holds or waits for a block: nothing
  // of it acquired for 10 s (its iterations took no time on this clock).
  void MakeTrace7Idle() { AdvanceClock(std::chrono::seconds(10)); }
};

// Belady's distances count each trace's own uses: trace 7's blocks are next
// in its order however long it has not run. While trace 7 is at work they
// keep their room; once it is idle, they make room before any block a trace
// at work will use.
TEST_F(IdleTraceTest, AnIdleTracesBlocksMakeRoomFirst) {
  ExpectHolds(1, 1);
  ExpectHolds(2, 2);  // room: 4, trace 8's farthest
  for (uint64_t id : {1, 5}) EXPECT_EQ(StateOf(id), BlockState::kResident) << id;
  EXPECT_EQ(StateOf(4), BlockState::kOnNvme);
  EXPECT_EQ(swapper_->Stats().idle_evictions, 0u);

  MakeTrace7Idle();
  ExpectHolds(3, 3);
  ExpectHolds(4, 4);  // room: 1 (trace 7's farther), where Belady would take 3
  EXPECT_EQ(StateOf(1), BlockState::kOnNvme);
  for (uint64_t id : {5, 2, 3, 4}) EXPECT_EQ(StateOf(id), BlockState::kResident) << id;
  EXPECT_EQ(swapper_->Stats().idle_evictions, 1u);
  ExpectHolds(1, 1);  // and its bytes come back
}

// A trace that holds a block (or waits for one) is at work, however long ago
// its last Acquire began.
TEST_F(IdleTraceTest, ATraceHoldingABlockIsNotIdle) {
  auto held = swapper_->Acquire(5, /*for_write=*/false);
  ASSERT_TRUE(held.ok()) << held.status();
  MakeTrace7Idle();
  ExpectHolds(2, 2);  // room: 4, trace 8's farthest
  EXPECT_EQ(StateOf(1), BlockState::kResident);
  EXPECT_EQ(StateOf(4), BlockState::kOnNvme);
  EXPECT_EQ(swapper_->Stats().idle_evictions, 0u);
  held->Reset();
  ExpectHolds(3, 3);
  ExpectHolds(4, 4);  // room: one of trace 7's, idle now
  for (uint64_t id : {2, 3, 4}) EXPECT_EQ(StateOf(id), BlockState::kResident) << id;
  EXPECT_EQ(swapper_->Stats().idle_evictions, 1u);
}

// Two traces at work in a pool of four blocks: trace 7 (weight 1) uses
// blocks 1-4, trace 8 (weight 2) uses 11-13, in those orders, both learned.
// Resident: 1 (next used by trace 7 three uses from now), 2 (next), 3, and
// 13 (two uses after 11, trace 8's next, on NVMe): Belady alone would make
// room for 11 with 1. Trace 7 holds three quarters of the pool (not more:
// not over its room); each has acquired about 5 MiB over its weight so far.
// The clock stands still.
class PoolShareTest : public SwapperTest {
 protected:
  void SetUp() override {
    SwapperTest::SetUp();
    Make(4 * kMiB);
    UseFakeClock();
    swapper_->SetIoWeight(8, 2);
    for (uint64_t id : {1, 2, 3, 4}) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
    for (uint64_t id : {11, 12, 13}) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 8).ok());
    for (uint64_t id : {1, 2, 3, 4}) Write(id, static_cast<uint32_t>(id));
    swapper_->EndIteration(7);
    // Evicts 4, then 11 and 12 (trace 8's order not learned yet).
    for (uint64_t id : {11, 12, 13}) Write(id, static_cast<uint32_t>(id));
    swapper_->EndIteration(8);
    ExpectHolds(1, 1);
    for (uint64_t id : {1, 2, 3, 13}) ASSERT_EQ(StateOf(id), BlockState::kResident) << id;
    share_evictions_ = swapper_->Stats().share_evictions;
  }
  uint64_t ShareEvictionsSinceSetUp() {
    return swapper_->Stats().share_evictions - share_evictions_;
  }
  uint64_t share_evictions_ = 0;
  // Trace 8 acquires `mib` MiB more (a resident block, untraced: its order
  // stays as learned).
  void Trace8Acquires(int mib) { AcquireTimes(13, mib, Swapper::Use::kExtra); }
};

// 50 MiB more at weight 2 is 25 MiB of its share: within the slack (32 MiB)
// of trace 7's, so Belady's choice stands (counted at weight 1, trace 8
// would be far ahead and give room itself).
TEST_F(PoolShareTest, WithinItsShareBeladyChooses) {
  Trace8Acquires(50);
  ExpectHolds(11, 11);
  EXPECT_EQ(StateOf(1), BlockState::kOnNvme);
  for (uint64_t id : {2, 3, 11, 13}) EXPECT_EQ(StateOf(id), BlockState::kResident) << id;
  EXPECT_EQ(ShareEvictionsSinceSetUp(), 0u);
}

// 100 MiB more at weight 2 is 50 MiB ahead: trace 8 makes room for its own
// block with its own farthest (13), though trace 7's block 1 is farther in
// trace 7's order.
TEST_F(PoolShareTest, ATraceAheadOfItsShareGivesRoomFirst) {
  Trace8Acquires(100);
  ExpectHolds(11, 11);
  EXPECT_EQ(StateOf(13), BlockState::kOnNvme);
  for (uint64_t id : {1, 2, 3, 11}) EXPECT_EQ(StateOf(id), BlockState::kResident) << id;
  EXPECT_EQ(ShareEvictionsSinceSetUp(), 1u);
  ExpectHolds(13, 13);
}

// Acquires of a block in the trace's order count once an iteration (a
// fetch's hold and the step's of the same state): 100 of block 13 in one
// iteration leave trace 8 within its share, and the room goes by Belady's
// distances (13: off trace 8's order now, never used again as far as the
// swapper knows), not by the share rule as the untraced 100 MiB above.
TEST_F(PoolShareTest, AcquiresInTheOrderCountOnceAnIteration) {
  AcquireTimes(13, 100, Swapper::Use::kInOrder);
  ExpectHolds(11, 11);
  EXPECT_EQ(StateOf(13), BlockState::kOnNvme);
  EXPECT_EQ(ShareEvictionsSinceSetUp(), 0u);
}

// So do those of the iteration's work out of its order (gradients measured
// in the background, a micro-batch at a time): 100 of block 13 leave trace
// 8 within its share, and Belady's choice stands (as for 50 MiB counted
// each time, WithinItsShareBeladyChooses; 100 counted each time are past
// it, ATraceAheadOfItsShareGivesRoomFirst).
TEST_F(PoolShareTest, UsesInTheBackgroundCountOnceAnIteration) {
  AcquireTimes(13, 100, Swapper::Use::kBackground);
  ExpectHolds(11, 11);
  EXPECT_EQ(StateOf(1), BlockState::kOnNvme);
  for (uint64_t id : {2, 3, 11, 13}) EXPECT_EQ(StateOf(id), BlockState::kResident) << id;
  EXPECT_EQ(ShareEvictionsSinceSetUp(), 0u);
}

// Where one trace holds the floor low (trace 9: slow, its one block fits)
// and the others are both ahead of it, the one farthest ahead gives room
// first: trace 8 (100 MiB of reads past the floor) before trace 7 (40), so
// that their weights still tell them apart. Belady alone would take trace
// 7's block 2 (its next use is after block 1's; trace 8's 11 is next).
TEST_F(SwapperTest, TheTraceFarthestAheadGivesRoomFirst) {
  Make(4 * kMiB);
  UseFakeClock();
  ASSERT_TRUE(swapper_->Add(21, kMiB, Tier::kNvme, 9).ok());
  for (uint64_t id : {1, 2}) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  for (uint64_t id : {11, 12}) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 8).ok());
  Write(21, 21);
  swapper_->EndIteration(9);
  for (uint64_t id : {1, 2}) Write(id, static_cast<uint32_t>(id));
  swapper_->EndIteration(7);
  Write(11, 11);
  swapper_->EndIteration(8);
  // Reads outside the orders (a checkpoint's, say): each one counts.
  AcquireTimes(1, 40, Swapper::Use::kExtra);
  AcquireTimes(11, 100, Swapper::Use::kExtra);
  const uint64_t before = swapper_->Stats().share_evictions;
  Write(12, 12);
  EXPECT_EQ(StateOf(11), BlockState::kOnNvme);
  for (uint64_t id : {21, 1, 2, 12}) EXPECT_EQ(StateOf(id), BlockState::kResident) << id;
  EXPECT_EQ(swapper_->Stats().share_evictions - before, 1u);
}

// Turns (pool_shares.h): trace 7 (blocks 1-3) and trace 8 (11-13), within
// the slack of each other, have both had blocks evicted or missed. While
// trace 7 holds block 3 (at work, the least served: it holds the turn),
// trace 8's new block takes the room of its own least recently used (12),
// not of trace 7's (2), which the shares alone would take (least recently
// used of all, the orders not learned); only one trace at work, no turns.
// Then trace 7 reads block 1 back: the room comes from trace 8 (out of
// turn), and trace 8's Acquire of that block while it is being written out
// waits for the write and reads it back, rather than keep it in the pool.
// Where that write fails, the block stays, and trace 8's Acquire finds it
// there; trace 7's room comes from its own block 2.
TEST_F(SwapperTest, TracesWantingRoomAtOnceTakeTurns) {
  enum Variant { kOneAtATime, kAtOnce, kTheWriteFails };
  for (const Variant variant : {kOneAtATime, kAtOnce, kTheWriteFails}) {
    SCOPED_TRACE(variant);
    const bool at_once = variant != kOneAtATime;
    Make(4 * kMiB);
    UseFakeClock();
    for (uint64_t id : {1, 2, 3}) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
    for (uint64_t id : {11, 12, 13}) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 8).ok());
    for (uint64_t id : {1, 2, 3, 11}) Write(id, static_cast<uint32_t>(id));
    Write(12, 12);  // evicts block 1: trace 7 gave, trace 8 missed
    ASSERT_EQ(StateOf(1), BlockState::kOnNvme);
    AcquireTimes(11, 5, Swapper::Use::kExtra);  // trace 8: 7 MiB served, trace 7: 3
    std::optional<Swapper::Pin> held;
    if (at_once) {
      auto p = swapper_->Acquire(3, /*for_write=*/false, Swapper::Use::kExtra);
      ASSERT_TRUE(p.ok()) << p.status();
      held = std::move(*p);
    }
    const uint64_t turns = swapper_->Stats().turns;
    Write(13, 13);
    if (!at_once) {
      EXPECT_EQ(StateOf(2), BlockState::kOnNvme);
      EXPECT_EQ(StateOf(12), BlockState::kResident);
      EXPECT_EQ(swapper_->Stats().turns, turns);
      continue;
    }
    EXPECT_EQ(StateOf(12), BlockState::kOnNvme);
    EXPECT_EQ(StateOf(2), BlockState::kResident);
    EXPECT_EQ(swapper_->Stats().turns, turns + 1);
    // Trace 7 reads block 1 back while trace 8, at work (holding 13), has
    // its 11 written out for it; trace 8 asks for 11 meanwhile.
    auto held_by_8 = swapper_->Acquire(13, /*for_write=*/false, Swapper::Use::kExtra);
    ASSERT_TRUE(held_by_8.ok()) << held_by_8.status();
    absl::Notification writing, release;
    swapper_->SetIoHookForTesting([&](uint64_t id, bool is_write) {
      if (id == 11 && is_write && !writing.HasBeenNotified()) {
        writing.Notify();
        release.WaitForNotification();
      }
    });
    if (variant == kTheWriteFails) FailNext(IoOp::kWrite, EIO);
    const uint64_t io_errors = swapper_->Stats().io_errors;
    std::thread reader([&] { ExpectHolds(1, 1); });
    if (!writing.WaitForNotificationWithTimeout(absl::Seconds(10))) {
      release.Notify();
      reader.join();
      swapper_->SetIoHookForTesting(nullptr);
      FAIL() << "block 11 was not written out for trace 7";
    }
    const uint64_t read_by_8 = swapper_->IoOf(8).bytes_in;
    const uint64_t misses = swapper_->Stats().misses;
    std::atomic<bool> got{false};
    std::thread taker([&] {
      ExpectHolds(11, 11);
      got = true;
    });
    AwaitTrue([&] { return swapper_->Stats().misses > misses; }, "trace 8 waiting for block 11");
    EXPECT_FALSE(got.load());  // it waits for the write-out
    release.Notify();
    reader.join();
    taker.join();
    swapper_->SetIoHookForTesting(nullptr);
    if (variant == kTheWriteFails) {
      EXPECT_EQ(swapper_->Stats().io_errors, io_errors + 1);
      EXPECT_EQ(swapper_->IoOf(8).bytes_in, read_by_8);  // found in the pool
      EXPECT_EQ(StateOf(11), BlockState::kResident);
      EXPECT_EQ(StateOf(2), BlockState::kOnNvme);
    } else {
      EXPECT_EQ(swapper_->IoOf(8).bytes_in, read_by_8 + kMiB);  // read back
    }
    held_by_8->Reset();
    held.reset();
  }
}

// A prefetch (speculative) for a trace ahead of its share takes room only
// from traces that give as much: trace 8 (100 MiB of reads past the floor
// trace 9 holds) prefetches its block 12, which a demand of trace 7 (40 MiB
// past) evicted; the only blocks needed later than 12 are trace 7's, which
// is less far ahead, so the prefetch gives up instead of taking them.
TEST_F(SwapperTest, APrefetchTakesNoRoomFromTracesLessFarAhead) {
  Make(4 * kMiB);
  UseFakeClock();
  ASSERT_TRUE(swapper_->Add(21, kMiB, Tier::kNvme, 9).ok());
  for (uint64_t id : {1, 2, 3}) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  ASSERT_TRUE(swapper_->Add(12, kMiB, Tier::kNvme, 8).ok());
  Write(21, 21);
  swapper_->EndIteration(9);
  for (uint64_t id : {1, 2, 3}) Write(id, static_cast<uint32_t>(id));
  swapper_->EndIteration(7);
  Write(12, 12);  // room: 3, the farthest (trace 8's order not learned)
  ASSERT_EQ(StateOf(3), BlockState::kOnNvme);
  // Reads outside the orders: each counts.
  AcquireTimes(2, 40, Swapper::Use::kExtra);
  AcquireTimes(12, 100, Swapper::Use::kExtra);
  ExpectHolds(3, 3);  // room: 12, of the trace farthest ahead
  ASSERT_EQ(StateOf(12), BlockState::kOnNvme);
  swapper_->SetPrefetch(1, 64 * kMiB);
  swapper_->EndIteration(8);  // learns [12]: its prefetch is due
  swapper_->WaitIdle();
  EXPECT_EQ(StateOf(12), BlockState::kOnNvme);
  for (uint64_t id : {21, 1, 2, 3}) EXPECT_EQ(StateOf(id), BlockState::kResident) << id;
}

// A prefetch takes any block of a trace that gives more room than its own:
// next uses count in each trace's own order, so a block trace 8 (far ahead)
// needs next is no reason to spare it. Trace 7 holds block 1 and prefetches
// 3 (two uses on); every other candidate (2, 11, 12) is needed sooner in its
// own order, and only trace 8's may go.
TEST_F(SwapperTest, APrefetchTakesRoomFromTracesThatGiveMore) {
  Make(8 * kMiB);
  UseFakeClock();
  for (uint64_t id : {1, 2, 3}) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  for (uint64_t id : {11, 12}) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 8).ok());
  for (uint64_t id : {1, 2, 3}) Write(id, static_cast<uint32_t>(id));
  swapper_->EndIteration(7);  // its order: 1, 2, 3
  for (uint64_t id : {11, 12}) Write(id, static_cast<uint32_t>(id));
  swapper_->EndIteration(8);  // its order: 11, 12
  // Trace 7 ahead: a smaller pool takes its farthest, 3.
  AcquireTimes(2, 100, Swapper::Use::kExtra);
  pool_->SetLimit(4 * kMiB);
  swapper_->Trim();
  swapper_->WaitIdle();
  ASSERT_EQ(StateOf(3), BlockState::kOnNvme);
  // Now trace 8 is the one far ahead (trace 7 holds the floor).
  AcquireTimes(11, 300, Swapper::Use::kExtra);
  swapper_->SetPrefetch(1, 64 * kMiB);
  auto one = swapper_->Acquire(1, /*for_write=*/false);
  ASSERT_TRUE(one.ok()) << one.status();
  swapper_->WaitIdle();
  EXPECT_EQ(StateOf(3), BlockState::kResident);
  EXPECT_EQ(StateOf(2), BlockState::kResident);
  EXPECT_NE(StateOf(11) == BlockState::kOnNvme, StateOf(12) == BlockState::kOnNvme);
  ExpectHolds(3, 3);
}

// A trace that never gets ahead of its share of the traffic (slow, or
// light) keeps no more than three quarters of the pool's room (or its
// weight's share and half the rest, where that is more): trace 7 holds four
// of five blocks when trace 8 needs room, and gives one (its farthest, 4)
// where Belady would take trace 8's block 11 (its order not learned: never
// used again, as far as the swapper knows).
TEST_F(SwapperTest, ATraceHoldingMoreThanItsRoomGivesRoom) {
  Make(5 * kMiB);
  UseFakeClock();
  for (uint64_t id : {1, 2, 3, 4, 5}) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  for (uint64_t id : {11, 12}) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 8).ok());
  for (uint64_t id : {1, 2, 3, 4, 5}) Write(id, static_cast<uint32_t>(id));
  swapper_->EndIteration(7);
  Write(11, 11);  // evicts 5: trace 7 alone used the pool
  EXPECT_EQ(StateOf(5), BlockState::kOnNvme);
  EXPECT_EQ(swapper_->Stats().share_evictions, 0u);
  Write(12, 12);
  EXPECT_EQ(StateOf(4), BlockState::kOnNvme);
  for (uint64_t id : {1, 2, 3, 11, 12}) EXPECT_EQ(StateOf(id), BlockState::kResident) << id;
  EXPECT_EQ(swapper_->Stats().share_evictions, 1u);
}

TEST_F(SwapperTest, ChangedOrderIsLearnedAgain) {
  Make(2 * kMiB);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  for (uint64_t id : {1, 2, 3}) Write(id, static_cast<uint32_t>(id));
  swapper_->EndIteration(7);
  for (uint64_t id : {3, 1, 2}) ExpectHolds(id, static_cast<uint32_t>(id));
  swapper_->EndIteration(7);
  EXPECT_EQ(swapper_->Stats().relearned, 1u);
  for (uint64_t id : {3, 1, 2}) ExpectHolds(id, static_cast<uint32_t>(id));
  swapper_->EndIteration(7);
  EXPECT_EQ(swapper_->Stats().relearned, 1u);
}

TEST_F(SwapperTest, PrefetchAlongTheTraceMakesEveryUseAHit) {
  Make(4 * kMiB, /*prefetch_depth=*/2);
  for (uint64_t id = 1; id <= 8; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  for (uint64_t id = 1; id <= 8; ++id) Write(id, static_cast<uint32_t>(id));
  swapper_->EndIteration(7);
  swapper_->WaitIdle();
  const SwapperStats before = swapper_->Stats();
  for (uint64_t id = 1; id <= 8; ++id) {
    ExpectHolds(id, static_cast<uint32_t>(id));
    swapper_->WaitIdle();  // a compute phase long enough for the prefetch
  }
  const SwapperStats after = swapper_->Stats();
  EXPECT_EQ(after.hits - before.hits, 8u);
  EXPECT_EQ(after.misses, before.misses);
  // Every prefetch was used, or waits for the next iteration; none was
  // evicted unused. (Which blocks make way depends on whether the one just
  // used is still pinned when the mover runs; the identity does not.)
  EXPECT_GE(after.prefetches - before.prefetches, 4u);
  EXPECT_EQ(after.prefetch_used + after.prefetch_pending, after.prefetches);
  EXPECT_GE(after.prefetch_pending, 1u);
  EXPECT_EQ(after.prefetch_wasted, 0u);
}

// Evaluation after training, its parameters on NVMe: forward passes with
// no step between them went off the learned order (forward, backward) and
// were never prefetched; their own order is learned from them (passes),
// and with prefetch every use is a hit again.
TEST_F(SwapperTest, ForwardPassesWithoutAStepArePrefetched) {
  Make(4 * kMiB, /*prefetch_depth=*/2);
  for (uint64_t id = 1; id <= 8; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  for (uint64_t id = 1; id <= 8; ++id) Write(id, static_cast<uint32_t>(id));
  swapper_->EndIteration(7);
  auto use = [&](uint64_t id) {
    ExpectHolds(id, static_cast<uint32_t>(id));
    swapper_->WaitIdle();  // a compute phase long enough for the prefetch
  };
  for (int i = 0; i < 2; ++i) {  // training: forward, backward, a step
    for (uint64_t id = 1; id <= 8; ++id) use(id);
    for (uint64_t id = 8; id >= 1; --id) use(id);
    swapper_->EndIteration(7);
  }
  for (int i = 0; i < 6; ++i) {
    for (uint64_t id = 1; id <= 8; ++id) use(id);
  }
  const SwapperStats before = swapper_->Stats();
  EXPECT_GT(before.order_passes, 0u);
  for (int i = 0; i < 3; ++i) {
    for (uint64_t id = 1; id <= 8; ++id) use(id);
  }
  const SwapperStats after = swapper_->Stats();
  EXPECT_EQ(after.hits - before.hits, 24u);
  EXPECT_EQ(after.misses, before.misses);
  EXPECT_EQ(after.order_passes - before.order_passes, 3u);
}

// Uses out of the order (measuring gradients in the background, writing a
// checkpoint) interleave with the caller's order differently every
// iteration: as such (Use::kBackground, kExtra) they neither look like a
// changed order nor stop the prefetch; the same uses in order do both.
TEST_F(SwapperTest, UsesOutOfTheOrderLeaveTheLearnedOrderAlone) {
  Make(4 * kMiB, /*prefetch_depth=*/2);
  for (uint64_t id = 1; id <= 8; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  for (uint64_t id = 1; id <= 8; ++id) Write(id, static_cast<uint32_t>(id));
  swapper_->EndIteration(7);
  swapper_->WaitIdle();
  // One iteration in the learned order, with an out-of-order use after
  // each use (9 - id: 8, 7, ...).
  auto iteration = [&](Swapper::Use use) {
    for (uint64_t id = 1; id <= 8; ++id) {
      ExpectHolds(id, static_cast<uint32_t>(id));
      auto other = swapper_->Acquire(9 - id, /*for_write=*/false, use);
      ASSERT_TRUE(other.ok()) << other.status();
      EXPECT_TRUE(Holds(*other, static_cast<uint32_t>(9 - id)));
      other->Reset();
      swapper_->WaitIdle();
    }
    swapper_->EndIteration(7);
    swapper_->WaitIdle();
  };
  SwapperStats before = swapper_->Stats();
  for (Swapper::Use use : {Swapper::Use::kBackground, Swapper::Use::kExtra}) {
    iteration(use);
    SwapperStats after = swapper_->Stats();
    EXPECT_EQ(after.relearned, before.relearned);
    EXPECT_GE(after.prefetches - before.prefetches, 4u);
    before = after;
  }
  iteration(Swapper::Use::kInOrder);
  const SwapperStats after = swapper_->Stats();
  EXPECT_EQ(after.relearned, before.relearned + 1);
}

// Blocks homed on the host take turns between iterations (the delayed
// update's two working-copy buffers: the trainer reads one, then the
// other), while the blocks homed on NVMe keep their order: the order is
// learned once and prefetch keeps going, since only NVMe blocks' uses enter
// it (they made the order look new at every step, and a step with its
// optimizer state on NVMe ran 2.2x slower with the delayed update on).
TEST_F(SwapperTest, UsesOfBlocksHomedOnTheHostLeaveTheLearnedOrderAlone) {
  Make(4 * kMiB, /*prefetch_depth=*/2);
  for (uint64_t id = 1; id <= 8; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  for (uint64_t id : {101, 102}) ASSERT_TRUE(swapper_->Add(id, 4096, Tier::kHost, 7).ok());
  for (uint64_t id = 1; id <= 8; ++id) Write(id, static_cast<uint32_t>(id));
  swapper_->EndIteration(7);
  swapper_->WaitIdle();
  const SwapperStats before = swapper_->Stats();
  for (int iteration = 0; iteration < 4; ++iteration) {
    const uint64_t host = iteration % 2 == 0 ? 101 : 102;  // the buffers take turns
    for (uint64_t id = 1; id <= 8; ++id) {
      auto held = swapper_->Acquire(host, /*for_write=*/false);
      ASSERT_TRUE(held.ok()) << held.status();
      held->Reset();
      ExpectHolds(id, static_cast<uint32_t>(id));
      swapper_->WaitIdle();
    }
    swapper_->EndIteration(7);
    swapper_->WaitIdle();
  }
  const SwapperStats after = swapper_->Stats();
  EXPECT_EQ(after.relearned, before.relearned);
  EXPECT_EQ(after.misses, before.misses);  // every NVMe use prefetched
  EXPECT_GE(after.prefetches - before.prefetches, 4u * 4);
}

TEST_F(SwapperTest, RemoveDuringReadInFreesItWhenTheReadEnds) {
  Make(kMiB);
  ASSERT_TRUE(swapper_->Add(1, kMiB, Tier::kNvme, 7).ok());
  ASSERT_TRUE(swapper_->Add(2, kMiB, Tier::kNvme, 7).ok());
  Write(1, 11);
  Write(2, 22);
  ASSERT_EQ(StateOf(1), BlockState::kOnNvme);
  ASSERT_EQ(space_->Stats().extents, 1u);  // block 1's copy
  absl::Notification reading, release;
  HoldIo(1, /*write=*/false, &reading, &release);
  absl::StatusOr<Swapper::Pin> got;
  std::thread reader([&] { got = swapper_->Acquire(1, false); });
  reading.WaitForNotification();
  swapper_->Remove(1);
  release.Notify();
  reader.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(swapper_->State(1).status().code(), absl::StatusCode::kNotFound);
  swapper_->WaitIdle();
  // Block 2 was written out to make room; block 1's copy is gone.
  EXPECT_EQ(space_->Stats().extents, 1u);
}

TEST_F(SwapperTest, AcquireDuringWriteOutKeepsTheBlockResident) {
  Make(2 * kMiB);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  Write(1, 11);  // least recently used: the first victim
  Write(2, 22);
  absl::Notification writing, release;
  HoldIo(1, /*write=*/true, &writing, &release);
  absl::Status third;
  std::thread evicter([&] { third = swapper_->Acquire(3, true).status(); });
  writing.WaitForNotification();
  ASSERT_EQ(StateOf(1), BlockState::kWritingOut);
  {
    auto p = swapper_->Acquire(1, false);  // no wait for the write
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(Holds(*p, 11));
    release.Notify();
    AwaitTrue([&] { return StateOf(1) != BlockState::kWritingOut; }, "the write-out to end");
    EXPECT_EQ(StateOf(1), BlockState::kResident);  // pinned: it stayed
    ExpectIndexAgrees("pinned, after its write-out");
  }
  evicter.join();
  EXPECT_TRUE(third.ok()) << third;
  EXPECT_EQ(StateOf(2), BlockState::kOnNvme);  // the next victim went instead
  ExpectHolds(1, 11);
  ExpectHolds(2, 22);
}

// A write pin taken while the block's write-out is queued (not started)
// makes that write's copy stale, even if the bytes change only after the
// write: the block must be written again, never dropped as clean.
TEST_F(SwapperTest, AWritePinWhileTheWriteIsQueuedKeepsTheChange) {
  Make(2 * kMiB, /*prefetch_depth=*/0, /*io_threads=*/1);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  Write(1, 11);
  Write(2, 22);
  absl::Notification writing, release;
  HoldIo(1, /*write=*/true, &writing, &release);
  // Both are written out; the one I/O thread is held in 1's write, so 2's
  // waits in the queue.
  pool_->SetLimit(0);
  swapper_->Trim();
  writing.WaitForNotification();
  AwaitTrue([&] { return StateOf(2) == BlockState::kWritingOut; }, "2's write-out queued");
  auto two = swapper_->Acquire(2, /*for_write=*/true);
  ASSERT_TRUE(two.ok()) << two.status();
  release.Notify();
  swapper_->WaitIdle();
  ASSERT_EQ(StateOf(2), BlockState::kResident);  // pinned: it stayed
  Fill(*two, 99);                                // the update lands after that write
  two->Reset();
  swapper_->SetIoHookForTesting(nullptr);
  pool_->SetLimit(2 * kMiB);
  // Make 2 leave memory again: its new bytes must be written, not dropped.
  Write(3, 33);
  Write(1, 11);
  ASSERT_EQ(StateOf(2), BlockState::kOnNvme);
  ExpectHolds(2, 99);
  ExpectHolds(3, 33);
}

// Blocks of several traces waiting for the I/O threads go by their traces'
// weights (SetIoWeight): with one I/O thread held while 24 reads of trace 1
// (weight 2) and 24 of trace 2 (weight 1) queue, the next 24 reads are 16 of
// trace 1 and 8 of trace 2; then the rest.
TEST_F(SwapperTest, ReadsWaitingForTheDiskGoByTheirTracesWeights) {
  constexpr int kEach = 24;
  Make(64 * kMiB, /*prefetch_depth=*/0, /*io_threads=*/1);
  swapper_->SetIoWeight(1, 2);
  for (int i = 0; i < kEach; ++i) {
    ASSERT_TRUE(swapper_->Add(100 + i, kMiB, Tier::kNvme, 1).ok());
    ASSERT_TRUE(swapper_->Add(200 + i, kMiB, Tier::kNvme, 2).ok());
    Write(100 + i, 100 + i);
    Write(200 + i, 200 + i);
  }
  ASSERT_TRUE(swapper_->Add(1, kMiB, Tier::kNvme, 3).ok());
  Write(1, 1);
  // Everything out to NVMe.
  pool_->SetLimit(0);
  swapper_->Trim();
  swapper_->WaitIdle();
  pool_->SetLimit(64 * kMiB);
  for (uint64_t id : {uint64_t{1}, uint64_t{100}, uint64_t{200}}) {
    ASSERT_EQ(StateOf(id), BlockState::kOnNvme) << id;
  }
  // The one I/O thread stops in block 1's read until every other read is
  // queued; the order of the reads after it is recorded.
  absl::Notification reached, release;
  absl::Mutex mu;
  std::vector<uint64_t> order;
  swapper_->SetIoHookForTesting([&](uint64_t id, bool is_write) {
    if (is_write) return;
    if (id == 1) {
      reached.Notify();
      release.WaitForNotification();
      return;
    }
    absl::MutexLock lock(&mu);
    order.push_back(id);
  });
  std::thread first([&] { ExpectHolds(1, 1); });
  reached.WaitForNotification();
  std::vector<std::thread> readers;
  std::atomic<int> wrong{0};
  for (int i = 0; i < kEach; ++i) {
    for (uint64_t id : {uint64_t(100 + i), uint64_t(200 + i)}) {
      readers.emplace_back([&, id] {
        auto p = swapper_->Acquire(id, /*for_write=*/false);
        if (!p.ok() || !Holds(*p, static_cast<uint32_t>(id))) ++wrong;
      });
    }
  }
  AwaitTrue([&] { return swapper_->Stats().io_queue >= 2 * kEach + 1; }, "the reads queued");
  release.Notify();
  first.join();
  for (std::thread& t : readers) t.join();
  EXPECT_EQ(wrong.load(), 0);
  ASSERT_EQ(order.size(), 2u * kEach);
  int of_one = 0;
  for (int i = 0; i < kEach; ++i) of_one += order[i] < 200 ? 1 : 0;
  EXPECT_NEAR(of_one, 2 * kEach / 3, 1) << "of the first " << kEach << " reads";
  // Each trace's traffic: its blocks evicted (written out) once and read in
  // once, all of them in the pool now; its reads queued while block 1's
  // was held.
  for (uint64_t trace : {1, 2}) {
    const Swapper::TraceIo io = swapper_->IoOf(trace);
    EXPECT_EQ(io.bytes_out, kEach * kMiB) << trace;
    EXPECT_EQ(io.bytes_in, kEach * kMiB) << trace;
    EXPECT_EQ(io.evictions, uint64_t{kEach}) << trace;
    EXPECT_EQ(io.room, kEach * kMiB) << trace;
    EXPECT_GT(io.queued_nanos, 0) << trace;
  }
  EXPECT_EQ(swapper_->IoOf(99).bytes_in, 0u);  // a trace with no blocks
  // Forgotten, a trace's weight and counts go; its blocks' later transfers
  // are not counted anew, and the queue goes on.
  swapper_->ForgetTrace(1);
  swapper_->SetIoHookForTesting(nullptr);
  pool_->SetLimit(0);
  swapper_->Trim();
  swapper_->WaitIdle();
  pool_->SetLimit(64 * kMiB);
  for (int i = 0; i < kEach; ++i) ExpectHolds(100 + i, 100 + i);
  EXPECT_EQ(swapper_->IoOf(1).bytes_in, 0u);
  EXPECT_EQ(swapper_->IoOf(1).evictions, 0u);
  EXPECT_EQ(swapper_->IoOf(2).bytes_in, kEach * kMiB);
  EXPECT_EQ(swapper_->IoOf(2).evictions, uint64_t{2 * kEach});  // (the trim's too)
  EXPECT_EQ(swapper_->IoOf(2).room, 0u);
}

// A write-out never waits for a heavier trace that is using the disk (that
// trace may be waiting for the room it makes): with trace 1 (weight 4) reading
// and trace 2 (weight 1) ahead of it, trace 2's write-out still goes while
// trace 1's read runs.
TEST_F(SwapperTest, WriteOutsDoNotWaitForAHeavierTrace) {
  Make(4 * kMiB, /*prefetch_depth=*/0, /*io_threads=*/2);
  swapper_->SetIoWeight(1, 4);
  ASSERT_TRUE(swapper_->Add(1, kMiB, Tier::kNvme, 1).ok());
  for (uint64_t id : {2, 3, 4, 5}) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 2).ok());
  Write(1, 1);
  pool_->SetLimit(0);
  swapper_->Trim();
  swapper_->WaitIdle();
  pool_->SetLimit(4 * kMiB);
  for (uint64_t id : {2, 3, 4, 5}) Write(id, static_cast<uint32_t>(id));  // fills the pool
  // Trace 1's read of block 1 is held running; it needs no room (the pool's
  // limit allows one more block), but trace 2 is far ahead of it in bytes.
  pool_->SetLimit(5 * kMiB);
  absl::Notification reached, release;
  HoldIo(1, /*write=*/false, &reached, &release);
  std::thread reader([&] { ExpectHolds(1, 1); });
  reached.WaitForNotification();
  // Now room for trace 2 is needed: its write-out goes at once.
  const uint64_t outs = swapper_->Stats().swap_outs;
  pool_->SetLimit(4 * kMiB);
  swapper_->Trim();
  AwaitTrue([&] { return swapper_->Stats().swap_outs > outs; }, "trace 2's write-out");
  release.Notify();
  reader.join();
}

// A move to the host is not lost behind a prefetch of the same block that
// was queued first (a prefetch may give up; the move must not).
TEST_F(SwapperTest, AMoveToTheHostOverridesAQueuedPrefetch) {
  Make(4 * kMiB, /*prefetch_depth=*/2, /*io_threads=*/1);
  for (uint64_t id = 1; id <= 6; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  for (uint64_t id = 1; id <= 6; ++id) Write(id, static_cast<uint32_t>(id));
  // Hold the mover's first prefetch in its read, so the next one queues.
  absl::Notification reading, release;
  swapper_->SetIoHookForTesting([&](uint64_t, bool is_write) {
    if (!is_write && !reading.HasBeenNotified()) {
      reading.Notify();
      release.WaitForNotification();
    }
  });
  swapper_->EndIteration(7);  // prefetches 1 and 2
  reading.WaitForNotification();
  ASSERT_TRUE(swapper_->SetHome(2, Tier::kHost).ok());
  release.Notify();
  swapper_->WaitIdle();
  swapper_->SetIoHookForTesting(nullptr);
  EXPECT_EQ(*swapper_->Home(2), Tier::kHost);
  EXPECT_EQ(StateOf(2), BlockState::kResident);
  // Host-placed now: it stays while everything else cycles through.
  for (uint64_t id : {3, 4, 5, 6, 1}) ExpectHolds(id, static_cast<uint32_t>(id));
  EXPECT_EQ(StateOf(2), BlockState::kResident);
  ExpectHolds(2, 2);
}

// Destroying the swapper while prefetches and write-outs are queued
// finishes or drops them cleanly: no hang, nothing left charged.
TEST_F(SwapperTest, DestroyedWithWorkInFlight) {
  Make(2 * kMiB, /*prefetch_depth=*/4, /*io_threads=*/1);
  for (uint64_t id = 1; id <= 8; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  for (uint64_t id = 1; id <= 8; ++id) Write(id, static_cast<uint32_t>(id));
  swapper_->SetIoHookForTesting([](uint64_t, bool) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // slow disk
  });
  swapper_->EndIteration(7);
  pool_->SetLimit(kMiB);
  swapper_->Trim();
  swapper_.reset();  // returns; TearDown checks the pool is empty
}

uint64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * PageSize();
}

TEST_F(SwapperTest, ResidentMemoryStaysWithinThePool) {
  constexpr uint64_t kPool = 32 * kMiB;
  Make(kPool, /*prefetch_depth=*/4);
  // 4x the pool, in 16 blocks of 8 MiB.
  for (uint64_t id = 1; id <= 16; ++id) {
    ASSERT_TRUE(swapper_->Add(id, 8 * kMiB, Tier::kNvme, 7).ok());
  }
  const uint64_t baseline = ResidentBytes();
  uint64_t peak = 0;
  for (int iteration = 0; iteration < 3; ++iteration) {
    for (uint64_t id = 1; id <= 16; ++id) {
      Write(id, static_cast<uint32_t>(id + iteration));
      peak = std::max(peak, ResidentBytes());
    }
    swapper_->EndIteration(7);
  }
  for (uint64_t id = 1; id <= 16; ++id) ExpectHolds(id, static_cast<uint32_t>(id + 2));
  peak = std::max(peak, ResidentBytes());
  // The pool plus a little for stacks and allocator slack.
  EXPECT_LE(peak, baseline + kPool + 4 * kMiB) << "peak " << peak << " baseline " << baseline;
}

// Memory the caller maps from a memfd, as a session arena is mapped by the
// daemon and by its trainer: the swapper writes it out, frees its pages and
// reads it back where it was, and the other mapping sees the same bytes.
// Blocks in it are handed to the swapper with its file (`through_file`, as
// offloadd does: on small pages their bytes move through the file) or as
// the mapping alone.
class SharedArena {
 public:
  explicit SharedArena(uint64_t bytes, Pages pages = Pages::kSystemDefault,
                       bool through_file = true)
      : through_file_(through_file) {
    auto fd = Env::Default()->CreateMemfd("swapper-test");
    EXPECT_TRUE(fd.ok()) << fd.status();
    fd_ = std::move(*fd);
    EXPECT_TRUE(Env::Default()->ResizeFile(fd_.get(), bytes).ok());
    auto mine = HostMemory::MapShared(fd_.get(), 0, bytes, pages);
    auto theirs = HostMemory::MapShared(fd_.get(), 0, bytes, pages);
    EXPECT_TRUE(mine.ok() && theirs.ok());
    mine_ = std::move(*mine);
    theirs_ = std::move(*theirs);
  }
  std::byte* mine(uint64_t offset = 0) const { return mine_.data() + offset; }
  // The block of the arena at `offset`, for AddExternal.
  offload::ExternalMemory at(uint64_t offset = 0, uint64_t page_bytes = 0) const {
    return {mine(offset), page_bytes, through_file_ ? fd_.get() : -1, offset};
  }
  std::byte* theirs(uint64_t offset = 0) const { return theirs_.data() + offset; }
  // Bytes of the file backed by pages.
  uint64_t populated() const {
    struct stat st;
    EXPECT_EQ(fstat(fd_.get(), &st), 0);
    return static_cast<uint64_t>(st.st_blocks) * 512;
  }

 private:
  const bool through_file_;
  UniqueFd fd_;
  HostMemory mine_, theirs_;
};

// Both ways external memory on small pages moves: through its file and a
// staging buffer (offloadd's), and by direct I/O into the mapping.
TEST_F(SwapperTest, ExternalMemoryIsWrittenOutFreedAndReadBackInPlace) {
  for (const bool through_file : {true, false}) {
    SCOPED_TRACE(through_file ? "through the file" : "through the mapping");
    Make(2 * kMiB);
    SharedArena arena(4 * kMiB, Pages::kSmall, through_file);
    // Blocks of a bit less than a MiB (one partial staging window), at
    // their own offsets of the file.
    const uint64_t bytes = kMiB - 4096 - 100;
    for (uint64_t i = 0; i < 4; ++i) {
      ASSERT_TRUE(swapper_->AddExternal(i + 1, arena.at(i * kMiB), bytes, Tier::kNvme, 7).ok());
    }
    EXPECT_EQ(arena.populated(), 0u);
    for (uint64_t id = 1; id <= 4; ++id) {
      auto p = swapper_->Acquire(id, /*for_write=*/true);
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_EQ(p->data(), arena.mine((id - 1) * kMiB));
      Fill(*p, static_cast<uint32_t>(id));
      EXPECT_LE(pool_->used(), pool_->limit());
    }
    swapper_->WaitIdle();
    // At most the pool's worth of pages exists; the rest is on NVMe.
    EXPECT_LE(arena.populated(), 2 * kMiB);
    EXPECT_EQ(StateOf(1), BlockState::kOnNvme);
    for (uint64_t id = 1; id <= 4; ++id) {
      auto p = swapper_->Acquire(id, /*for_write=*/false);
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_TRUE(Holds(*p, static_cast<uint32_t>(id)));
      // The trainer's mapping sees what was read back.
      EXPECT_EQ(std::memcmp(arena.theirs((id - 1) * kMiB), p->data(), bytes), 0);
    }
    const SwapperStats stats = swapper_->Stats();
    EXPECT_GE(stats.swap_ins, 2u);
    const bool staged = through_file && !SharedFileWritesMayGetLargePages();
    EXPECT_EQ(stats.staged_bytes, staged ? (stats.swap_ins + stats.swap_outs) * bytes : 0u);
    for (uint64_t id = 1; id <= 4; ++id) swapper_->Remove(id);
    EXPECT_EQ(arena.populated(), 0u);
    EXPECT_EQ(pool_->used(), 0u);
    swapper_.reset();
  }
}

// RemoveAll (a session's teardown) removes many blocks at once: its
// external blocks' pages stay for the caller to free (no I/O thread round
// trip each), their pool charges come back to the caller, and the pool
// counts them until it lets them go; blocks on NVMe and host blocks go as
// with Remove.
TEST_F(SwapperTest, RemoveAllLeavesTheExternalPagesAndTheirChargesToTheCaller) {
  Make(4 * kMiB);
  SharedArena arena(4 * kMiB, Pages::kSmall);
  const uint64_t bytes = kMiB;
  for (uint64_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(swapper_->AddExternal(i + 1, arena.at(i * kMiB), bytes, Tier::kHost, 7).ok());
    Write(i + 1, static_cast<uint32_t>(i + 1));
  }
  ASSERT_TRUE(swapper_->Add(10, bytes, Tier::kHost, 7).ok());  // pool memory of its own
  Write(10, 10);
  swapper_->WaitIdle();
  const uint64_t used = pool_->used();
  EXPECT_EQ(used, 4 * kMiB);
  std::vector<PoolCharge> charges;
  swapper_->RemoveAll({1, 2, 3, 10, 99}, &charges);  // 99: never added
  EXPECT_EQ(charges.size(), 3u);
  EXPECT_EQ(pool_->used(), 3 * kMiB);      // the pool block's memory went; the arena's is counted
  EXPECT_EQ(arena.populated(), 3 * kMiB);  // left to the caller
  EXPECT_EQ(swapper_->Acquire(1, false).status().code(), absl::StatusCode::kNotFound);
  swapper_->ReleaseCharges(&charges);
  EXPECT_TRUE(charges.empty());
  EXPECT_EQ(pool_->used(), 0u);
}

// Through the file, a read that fails after some of the block's bytes were
// put in place leaves none of them: its pages are freed, the NVMe copy
// stays, and the next read gets the block whole.
TEST_F(SwapperTest, AFailedStagedSwapInLeavesNoPagesAndTheCopyIntact) {
  if (SharedFileWritesMayGetLargePages()) {
    GTEST_SKIP() << "shmem_enabled gives writes through a memfd huge pages here: the swapper "
                    "does not stage";
  }
  Make(6 * kMiB);
  SharedArena arena(12 * kMiB, Pages::kSmall);
  const uint64_t bytes = 6 * kMiB;  // two staging windows of 4 MiB
  ASSERT_TRUE(swapper_->AddExternal(1, arena.at(), bytes, Tier::kNvme, 7).ok());
  ASSERT_TRUE(swapper_->AddExternal(2, arena.at(bytes), bytes, Tier::kNvme, 7).ok());
  Write(1, 11);
  Write(2, 22);  // evicts 1
  swapper_->WaitIdle();
  ASSERT_EQ(StateOf(1), BlockState::kOnNvme);
  swapper_->Remove(2);  // room for 1
  // The fifth stripe's read fails: the first window (4 MiB) is in place by
  // then (each 1 MiB stripe is one read: the engine's requests are 1 MiB).
  FaultRule rule;
  rule.any_op = false;
  rule.op = IoOp::kRead;
  rule.skip = 4;
  rule.error = EIO;
  faults_->AddRule(rule);
  const uint64_t before = arena.populated();
  auto failed = swapper_->Acquire(1, false);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
  EXPECT_NE(failed.status().message().find("swapping in block 1"), std::string::npos);
  swapper_->WaitIdle();
  EXPECT_EQ(StateOf(1), BlockState::kOnNvme);
  EXPECT_EQ(arena.populated(), before);  // the first window's pages went too
  faults_->ClearRules();
  ExpectHolds(1, 11);
  EXPECT_EQ(swapper_->Stats().staged_bytes, 2 * bytes);  // one out, one whole in
}

TEST_F(SwapperTest, ExternalMemoryMustBePageAligned) {
  Make(2 * kMiB);
  SharedArena arena(kMiB);
  EXPECT_EQ(swapper_->AddExternal(1, arena.at(8), 4096, Tier::kNvme, 7).code(),
            absl::StatusCode::kInvalidArgument);
  HostMemory private_memory = *HostMemory::Allocate(kMiB);
  EXPECT_EQ(swapper_->AddExternal(2, {private_memory.data()}, kMiB, Tier::kNvme, 7).code(),
            absl::StatusCode::kInvalidArgument);
}

// External memory laid out for huge pages (as a session arena is where the
// kernel gives shared memory huge pages): a block is charged, and freed, in
// whole huge pages, so the pages that exist never exceed what the pool
// counts, also where the kernel does hand out huge pages (each touch then
// brings a whole one).
TEST_F(SwapperTest, ExternalBlocksOnHugePagesAreChargedAndFreedWhole) {
  constexpr uint64_t kHuge = 2 * kMiB;
  Make(2 * kHuge);
  SharedArena arena(4 * kHuge, Pages::kHuge);
  // Misaligned for its pages, or pages that are no power of two.
  EXPECT_EQ(swapper_->AddExternal(9, arena.at(kMiB, kHuge), kMiB, Tier::kNvme, 7).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(swapper_->AddExternal(9, arena.at(0, 3 * kMiB), kMiB, Tier::kNvme, 7).code(),
            absl::StatusCode::kInvalidArgument);
  // Two blocks of 3 MiB, each in its own 4 MiB (two huge pages).
  const uint64_t block = 3 * kMiB;
  ASSERT_TRUE(swapper_->AddExternal(1, arena.at(0, kHuge), block, Tier::kNvme, 7).ok());
  ASSERT_TRUE(swapper_->AddExternal(2, arena.at(2 * kHuge, kHuge), block, Tier::kNvme, 7).ok());
  {
    auto p = swapper_->Acquire(1, /*for_write=*/true);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->size(), block);
    Fill(*p, 1);
    EXPECT_EQ(pool_->used(), 2 * kHuge);  // the whole span, not 3 MiB
    EXPECT_LE(arena.populated(), pool_->used());
  }
  {
    // Block 1 leaves for block 2: all of its span goes, the tail its last
    // huge page covers too.
    auto p = swapper_->Acquire(2, /*for_write=*/true);
    ASSERT_TRUE(p.ok()) << p.status();
    Fill(*p, 2);
    EXPECT_EQ(pool_->used(), 2 * kHuge);
    EXPECT_LE(arena.populated(), pool_->used());
  }
  swapper_->WaitIdle();
  EXPECT_LE(arena.populated(), pool_->used());
  ExpectHolds(1, 1);
  ExpectHolds(2, 2);
  swapper_->WaitIdle();
  EXPECT_LE(arena.populated(), pool_->used());
  swapper_->Remove(1);
  swapper_->Remove(2);
  EXPECT_EQ(arena.populated(), 0u);
  EXPECT_EQ(pool_->used(), 0u);
}

TEST_F(SwapperTest, RemovingExternalMemoryWaitsForItsRead) {
  Make(kMiB);
  SharedArena arena(2 * kMiB);
  ASSERT_TRUE(swapper_->AddExternal(1, arena.at(), kMiB, Tier::kNvme, 7).ok());
  ASSERT_TRUE(swapper_->AddExternal(2, arena.at(kMiB), kMiB, Tier::kNvme, 7).ok());
  Write(1, 11);
  Write(2, 22);
  ASSERT_EQ(StateOf(1), BlockState::kOnNvme);
  absl::Notification reading, release;
  HoldIo(1, /*write=*/false, &reading, &release);
  absl::StatusOr<Swapper::Pin> got;
  std::thread reader([&] { got = swapper_->Acquire(1, false); });
  reading.WaitForNotification();
  std::atomic<bool> removed{false};
  std::thread remover([&] {
    swapper_->Remove(1);
    removed = true;
  });
  // Remove has marked the block (it is unknown from then on) and waits for
  // the read that writes into the memory the caller is about to unmap.
  AwaitTrue([&] { return !swapper_->State(1).ok(); }, "remove to start");
  EXPECT_FALSE(removed.load());
  release.Notify();
  remover.join();
  reader.join();
  EXPECT_TRUE(removed.load());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  // Block 1's pages went with it; block 2's were written out.
  swapper_->WaitIdle();
  EXPECT_LE(arena.populated(), kMiB);
}

// What is homed on NVMe is counted against the tier's room when it is
// homed there (added or moved), not when its write-out fails later: past it
// the block is refused, nothing changes, and removing blocks gives room back.
TEST_F(SwapperTest, HomingMoreOnNvmeThanTheTierHoldsIsRefusedAtOnce) {
  Make(64 * kMiB);
  const uint64_t capacity = space_->Stats().capacity;  // 256 MiB
  const uint64_t block = 64 * kMiB;
  uint64_t id = 1;
  for (; id * block <= capacity; ++id) {
    ASSERT_TRUE(swapper_->Add(id, block, Tier::kNvme, 0).ok()) << id;
  }
  absl::Status full = swapper_->Add(id, block, Tier::kNvme, 0);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_TRUE(absl::StrContains(full.message(), "nvme.bytes_per_dir")) << full;
  // A block on the host cannot move there either; it stays on the host.
  ASSERT_TRUE(swapper_->Add(100, kMiB, Tier::kHost, 0).ok());
  EXPECT_EQ(swapper_->SetHome(100, Tier::kNvme).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(swapper_->Stats().host_home_bytes, kMiB);
  EXPECT_GE(swapper_->Stats().host_home_charged_bytes, kMiB);  // (its pages, rounded up)
  // Room comes back with a removal, and with a block moved home.
  swapper_->Remove(1);
  ASSERT_TRUE(swapper_->Add(id, block, Tier::kNvme, 0).ok());
  ASSERT_TRUE(swapper_->SetHome(2, Tier::kHost).ok());
  EXPECT_TRUE(swapper_->SetHome(100, Tier::kNvme).ok());
}

TEST_F(SwapperTest, DiscardedBlocksAreZerosWithoutIo) {
  Make(2 * kMiB);
  SharedArena arena(2 * kMiB);
  ASSERT_TRUE(swapper_->AddExternal(1, arena.at(), kMiB, Tier::kNvme, 7).ok());
  ASSERT_TRUE(swapper_->Add(2, kMiB, Tier::kNvme, 7).ok());
  ASSERT_TRUE(swapper_->Add(3, kMiB, Tier::kNvme, 7).ok());
  Write(1, 1);
  Write(2, 2);
  Write(3, 3);  // evicts block 1: written out
  swapper_->WaitIdle();
  const uint64_t outs = swapper_->Stats().swap_outs;
  ASSERT_GE(outs, 1u);
  {
    auto pinned = swapper_->Acquire(2, false);
    ASSERT_TRUE(pinned.ok());
    EXPECT_EQ(swapper_->Discard(2).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(Holds(*pinned, 2));
  }
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(swapper_->Discard(id).ok());
  ExpectIndexAgrees("after the discards");
  EXPECT_EQ(pool_->used(), 0u);
  EXPECT_EQ(arena.populated(), 0u);
  EXPECT_EQ(space_->Stats().extents, 0u);
  const SwapperStats before = swapper_->Stats();
  for (uint64_t id = 1; id <= 3; ++id) {
    auto p = swapper_->Acquire(id, false);
    ASSERT_TRUE(p.ok());
    const std::vector<std::byte> zeros(kMiB);
    EXPECT_EQ(std::memcmp(p->data(), zeros.data(), kMiB), 0) << "block " << id;
  }
  const SwapperStats d = swapper_->Stats().Since(before);
  EXPECT_EQ(d.swap_ins, 0u);
  EXPECT_EQ(d.zero_fills, 3u);
  EXPECT_EQ(swapper_->Discard(99).code(), absl::StatusCode::kNotFound);
  // Homed on the host: memory and bytes stay (nothing to give back).
  ASSERT_TRUE(swapper_->AddExternal(4, arena.at(kMiB), kMiB, Tier::kHost, 7).ok());
  Write(4, 4);
  const uint64_t used = pool_->used();
  ASSERT_TRUE(swapper_->Discard(4).ok());
  EXPECT_EQ(pool_->used(), used);
  ExpectHolds(4, 4);
}

// A block moved home to the host gives its NVMe copy back (the tier's
// room was given back at the move), once nothing may read that copy: not
// while a checkpoint's CopyOut reads it, even as other write-outs take new
// extents, but at its first use after.
TEST_F(SwapperTest, ABlockMovedHomeGivesItsNvmeCopyBackOnceNothingReadsIt) {
  Make(2 * kMiB);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  Write(1, 11);
  Write(2, 22);
  Write(3, 33);  // 1 goes to NVMe
  swapper_->WaitIdle();
  ASSERT_EQ(StateOf(1), BlockState::kOnNvme);
  auto allocated = HostMemory::Allocate(swapper_->CopyOutBytes(kMiB));
  ASSERT_TRUE(allocated.ok()) << allocated.status();
  HostMemory buffer = *std::move(allocated);
  absl::Notification reached, release;
  std::atomic<bool> first{true};
  swapper_->SetIoHookForTesting([&](uint64_t id, bool is_write) {
    if (id == 1 && !is_write && first.exchange(false)) {  // the CopyOut's read
      reached.Notify();
      release.WaitForNotification();
    }
  });
  std::thread copier([&] {
    auto copied = swapper_->CopyOut(1, absl::Span<std::byte>(buffer.data(), buffer.size()));
    ASSERT_TRUE(copied.ok()) << copied.status();
    EXPECT_TRUE(Holds(buffer.data(), kMiB, 11)) << "its NVMe copy changed under the CopyOut";
  });
  reached.WaitForNotification();
  EXPECT_TRUE(swapper_->SetHome(1, Tier::kHost).ok());  // (no ASSERT: the copier must be joined)
  swapper_->WaitIdle();                                 // read in by the mover
  ExpectHolds(1, 11);
  Write(2, 222);  // write-outs of the others take extents
  Write(3, 333);
  Write(2, 2222);
  swapper_->WaitIdle();
  const uint64_t extents = space_->Stats().extents;
  release.Notify();
  copier.join();
  swapper_->SetIoHookForTesting(nullptr);
  ExpectHolds(1, 11);  // nothing reads its copy now
  EXPECT_EQ(space_->Stats().extents, extents - 1);
}

// A block pinned during its write-out and removed meanwhile keeps its
// memory until the pin is let go: the write's completion must not free it
// under the pin (its lease would be the next swap-in's).
TEST_F(SwapperTest, ABlockRemovedWhilePinnedDuringItsWriteOutKeepsItsMemory) {
  Make(2 * kMiB);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  Write(1, 11);
  Write(2, 22);
  swapper_->WaitIdle();
  absl::Notification reached, release;
  HoldIo(1, /*write=*/true, &reached, &release);
  std::thread writer([&] { Write(3, 33); });  // evicts 1: its write-out stops in the hook
  reached.WaitForNotification();
  auto pin = swapper_->Acquire(1, /*for_write=*/false);  // (no ASSERT: the hook must be released)
  EXPECT_TRUE(pin.ok()) << pin.status();
  swapper_->Remove(1);
  release.Notify();
  writer.join();
  swapper_->WaitIdle();
  swapper_->SetIoHookForTesting(nullptr);
  ASSERT_TRUE(pin.ok());
  EXPECT_TRUE(Holds(*pin, 11));
  ExpectHolds(2, 22);  // read in again (3 evicted): a freed lease would be taken
  EXPECT_TRUE(Holds(*pin, 11)) << "block 1's memory was reused under its pin";
  *pin = Swapper::Pin();
  EXPECT_EQ(swapper_->State(1).status().code(), absl::StatusCode::kNotFound);
  ExpectHolds(2, 22);
  ExpectHolds(3, 33);
}

// Moved home while its write-out is in flight: the copy that write makes
// is given back when it completes (the tier's room went at the move).
TEST_F(SwapperTest, ABlockMovedHomeDuringItsWriteOutKeepsNoCopy) {
  Make(2 * kMiB);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(swapper_->Add(id, kMiB, Tier::kNvme, 7).ok());
  Write(1, 11);
  Write(2, 22);
  swapper_->WaitIdle();
  const uint64_t extents = space_->Stats().extents;
  absl::Notification reached, release;
  HoldIo(1, /*write=*/true, &reached, &release);
  std::thread writer([&] { Write(3, 33); });  // evicts 1: its write-out stops in the hook
  reached.WaitForNotification();
  EXPECT_TRUE(swapper_->SetHome(1, Tier::kHost).ok());  // (no ASSERT: the hook must be released)
  release.Notify();
  writer.join();
  swapper_->WaitIdle();
  swapper_->SetIoHookForTesting(nullptr);
  EXPECT_EQ(StateOf(1), BlockState::kResident);
  ASSERT_EQ(StateOf(2), BlockState::kOnNvme);  // (room for 3: 2 went instead)
  EXPECT_EQ(space_->Stats().extents, extents + 1) << "block 1 kept the copy its write-out made";
  ExpectHolds(1, 11);
}

// CopyOut gives a block's bytes wherever it rests (in the pool, on NVMe,
// never written) without taking pool memory or changing where it is.
TEST_F(SwapperTest, CopyOutReadsABlockWhereverItIsWithoutThePool) {
  HostMemory buffer = OneOnNvmeOneResident();
  ASSERT_TRUE(swapper_->Add(3, kMiB, Tier::kNvme, 7).ok());
  ASSERT_EQ(StateOf(1), BlockState::kOnNvme);
  const absl::Span<std::byte> dst(buffer.data(), buffer.size());
  {
    auto held = swapper_->Acquire(2, false);  // the pool is full and held
    ASSERT_TRUE(held.ok());
    auto copied = swapper_->CopyOut(1, dst);
    ASSERT_TRUE(copied.ok()) << copied.status();
    EXPECT_EQ(*copied, kMiB);
    EXPECT_TRUE(Holds(buffer.data(), kMiB, 11));
    EXPECT_EQ(StateOf(1), BlockState::kOnNvme);  // still there
    EXPECT_EQ(pool_->used(), kMiB);
    EXPECT_EQ(swapper_->Stats().copy_outs, 1u);
    ASSERT_TRUE(swapper_->CopyOut(2, dst).ok());  // resident: from memory
    EXPECT_TRUE(Holds(buffer.data(), kMiB, 22));
    EXPECT_EQ(swapper_->Stats().copy_outs, 1u);
  }
  std::memset(buffer.data(), 0xff, kMiB);
  ASSERT_TRUE(swapper_->CopyOut(3, dst).ok());  // never written: zeros
  EXPECT_TRUE(std::all_of(buffer.data(), buffer.data() + kMiB,
                          [](std::byte b) { return b == std::byte{0}; }));
  EXPECT_EQ(swapper_->Stats().acquires, 3u);  // CopyOut acquired nothing
  EXPECT_EQ(swapper_->CopyOut(9, dst).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(swapper_->CopyOut(1, dst.subspan(0, kMiB / 2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(swapper_->CopyOut(1, dst.subspan(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  ExpectHolds(1, 11);
  ExpectHolds(2, 22);
}

// While a CopyOut reads a block's NVMe copy, the block may be swapped in
// and changed, but not evicted: its NVMe copy is neither rewritten nor
// freed under the read, which returns the bytes as they were when it began.
// An Acquire that needs the block's room waits for the read to end.
TEST_F(SwapperTest, ACopyOutInFlightKeepsTheBlocksNvmeCopy) {
  HostMemory buffer = OneOnNvmeOneResident();
  absl::Notification reading, release;
  // The CopyOut's read runs on its caller's thread and stops before its I/O.
  swapper_->SetIoHookForTesting([&](uint64_t block, bool is_write) {
    if (block == 1 && !is_write && !reading.HasBeenNotified()) {
      reading.Notify();
      release.WaitForNotification();
    }
  });
  absl::StatusOr<uint64_t> copied;
  std::thread reader(
      [&] { copied = swapper_->CopyOut(1, absl::MakeSpan(buffer.data(), buffer.size())); });
  reading.WaitForNotification();
  swapper_->SetIoHookForTesting(nullptr);
  Write(1, 33);  // swapped in (evicting 2) and changed
  // Room for 2 again means evicting 1, which the read in flight keeps.
  const uint64_t acquires = swapper_->Stats().acquires;
  absl::Status second;
  std::thread acquirer([&] { second = swapper_->Acquire(2, false).status(); });
  AwaitTrue([&] { return swapper_->Stats().acquires > acquires; }, "the Acquire of 2");
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(StateOf(1), BlockState::kResident);
  EXPECT_EQ(StateOf(2), BlockState::kOnNvme);
  EXPECT_EQ(swapper_->Discard(1).code(), absl::StatusCode::kFailedPrecondition);
  release.Notify();
  reader.join();
  acquirer.join();
  ASSERT_TRUE(copied.ok()) << copied.status();
  EXPECT_TRUE(Holds(buffer.data(), kMiB, 11));
  EXPECT_TRUE(second.ok()) << second;  // it waited, and 1 went then
  EXPECT_EQ(StateOf(1), BlockState::kOnNvme);
  ExpectHolds(2, 22);
  ExpectHolds(1, 33);
}

// A failed read of the NVMe copy is the read's error naming the block;
// nothing changes and the next try reads it.
TEST_F(SwapperTest, AFailedCopyOutIsDataLossAndChangesNothing) {
  HostMemory buffer = OneOnNvmeOneResident();
  const absl::Span<std::byte> dst(buffer.data(), buffer.size());
  FailNext(IoOp::kRead, EIO);
  auto failed = swapper_->CopyOut(1, dst);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
  EXPECT_NE(failed.status().message().find("copying block 1 out"), std::string::npos);
  EXPECT_EQ(StateOf(1), BlockState::kOnNvme);
  EXPECT_EQ(swapper_->Stats().io_errors, 1u);
  ASSERT_TRUE(swapper_->CopyOut(1, dst).ok());
  EXPECT_TRUE(Holds(buffer.data(), kMiB, 11));
}

}  // namespace
}  // namespace offload
