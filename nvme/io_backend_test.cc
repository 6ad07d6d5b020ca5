#include "nvme/io_backend.h"

#include <sys/statfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "base/host_memory.h"
#include "gtest/gtest.h"
#include "nvme/dio.h"
#include "nvme/fault_injection.h"
#include "nvme/io_backend_base.h"
#include "nvme/io_backend_factory.h"

namespace offload {
namespace {

constexpr uint64_t kMiB = 1 << 20;

void FillRandom(std::byte* p, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  for (size_t i = 0; i < n; i += 4) {
    uint32_t v = rng();
    std::memcpy(p + i, &v, std::min<size_t>(4, n - i));
  }
}

std::vector<IoRequest> Requests(IoOp op, int file, std::byte* buf, uint64_t bytes, uint64_t each) {
  std::vector<IoRequest> out;
  for (uint64_t off = 0; off < bytes; off += each) {
    out.push_back({op, file, off, buf + off, std::min(each, bytes - off)});
  }
  return out;
}

class BackendTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    IoOptions o;
    o.backend = GetParam();
    o.queue_depth = 8;
    o.request_bytes = 256 * 1024;
    auto inner = MakeIoBackend(o);
    if (!inner.ok()) GTEST_SKIP() << GetParam() << " unavailable here: " << inner.status();
    backend_ = std::make_unique<FaultInjectingBackend>(std::move(*inner));
    path_ = std::string(getenv("TEST_TMPDIR")) + "/io_" + GetParam() + ".dat";
    auto f = OpenIoFile(path_, /*create=*/true, /*want_direct=*/true);
    ASSERT_TRUE(f.ok()) << f.status();
    file_ = std::move(*f);
    ASSERT_EQ(ftruncate(file_.fd.get(), 16 * kMiB), 0);
    auto id = backend_->AddFile(file_.fd.get(), path_);
    ASSERT_TRUE(id.ok());
    id_ = *id;
    src_ = *HostMemory::Allocate(8 * kMiB);
    dst_ = *HostMemory::Allocate(8 * kMiB);
    FillRandom(src_.data(), src_.size(), 42);
  }

  absl::Status Write(uint64_t each = kMiB) {
    auto r = Requests(IoOp::kWrite, id_, src_.data(), src_.size(), each);
    return backend_->Run(r);
  }
  absl::Status Read(uint64_t each = kMiB) {
    std::memset(dst_.data(), 0, dst_.size());
    auto r = Requests(IoOp::kRead, id_, dst_.data(), dst_.size(), each);
    return backend_->Run(r);
  }
  bool Same() const { return std::memcmp(src_.data(), dst_.data(), src_.size()) == 0; }

  std::unique_ptr<FaultInjectingBackend> backend_;
  std::string path_;
  IoFile file_;
  int id_ = -1;
  HostMemory src_, dst_;
};

TEST_P(BackendTest, RoundTripsWithDirectIo) {
  EXPECT_TRUE(file_.direct) << "expected O_DIRECT on the test filesystem";
  ASSERT_TRUE(Write().ok());
  ASSERT_TRUE(Read().ok());
  EXPECT_TRUE(Same());
  // Requests larger than request_bytes are split; odd request sizes work.
  ASSERT_TRUE(Write(3 * kMiB).ok());
  ASSERT_TRUE(Read(512 * 1024).ok());
  EXPECT_TRUE(Same());
}

TEST_P(BackendTest, FixedBuffersWork) {
  ASSERT_TRUE(backend_->AddBuffer(src_.data(), src_.size()).ok());
  ASSERT_TRUE(backend_->AddBuffer(dst_.data(), dst_.size()).ok());
  ASSERT_TRUE(Write().ok());
  ASSERT_TRUE(Read().ok());
  EXPECT_TRUE(Same());
}

// A buffer forgotten before it is unmapped leaves nothing behind: memory
// mapped later at the same address gets what is read into it (a stale
// registration would send it to the old, still pinned, pages).
TEST_P(BackendTest, ARemovedBufferIsForgotten) {
  ASSERT_TRUE(backend_->AddBuffer(dst_.data(), dst_.size()).ok());
  ASSERT_TRUE(Write().ok());
  ASSERT_TRUE(Read().ok());
  EXPECT_TRUE(Same());
  const void* old = dst_.data();
  backend_->RemoveBuffer(dst_.data(), dst_.size());
  dst_ = HostMemory();
  dst_ = *HostMemory::Allocate(8 * kMiB);
  ASSERT_TRUE(Read().ok());
  EXPECT_TRUE(Same()) << (dst_.data() == old ? "mapped again at the same address"
                                             : "mapped at another address");
  // The next buffer declared (into the freed slot) works as the first did.
  ASSERT_TRUE(backend_->AddBuffer(dst_.data(), dst_.size()).ok());
  ASSERT_TRUE(Read().ok());
  EXPECT_TRUE(Same());
  backend_->RemoveBuffer(dst_.data(), dst_.size());
}

TEST_P(BackendTest, ShortTransfersAreResubmitted) {
  FaultRule r;
  r.kind = FaultRule::Kind::kShort;
  r.times = -1;
  size_t rule = backend_->AddRule(r);
  ASSERT_TRUE(Write().ok());
  ASSERT_TRUE(Read().ok());
  EXPECT_TRUE(Same());
  EXPECT_GT(backend_->fired(rule), 32);
}

TEST_P(BackendTest, EagainAndEintrAreRetried) {
  FaultRule again;
  again.error = EAGAIN;
  again.times = 5;
  FaultRule intr;
  intr.error = EINTR;
  intr.times = 5;
  intr.skip = 3;
  size_t a = backend_->AddRule(again), b = backend_->AddRule(intr);
  ASSERT_TRUE(Write().ok());
  ASSERT_TRUE(Read().ok());
  EXPECT_TRUE(Same());
  EXPECT_EQ(backend_->fired(a), 5);
  EXPECT_EQ(backend_->fired(b), 5);
}

TEST_P(BackendTest, EioIsDataLossWithTheOperationPathOffsetAndLength) {
  ASSERT_TRUE(Write().ok());
  FaultRule eio;
  eio.any_op = false;
  eio.op = IoOp::kRead;
  eio.offset_begin = 2 * kMiB;
  eio.offset_end = 2 * kMiB + 1;
  backend_->AddRule(eio);
  absl::Status s = Read();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  for (const char* part : {"read of 262144 bytes", "offset 2097152", "EIO"}) {
    EXPECT_TRUE(absl::StrContains(s.message(), part)) << part << " in " << s.message();
  }
  EXPECT_TRUE(absl::StrContains(s.message(), path_)) << s.message();
  // The backend keeps serving.
  backend_->ClearRules();
  ASSERT_TRUE(Read().ok());
  EXPECT_TRUE(Same());
}

// Run tells of each request once all its bytes are in (each 1 MiB request
// here is 4 chunks, with short transfers on top), and never of one that
// failed.
TEST_P(BackendTest, EachRequestIsToldOfOnceItsBytesAreIn) {
  ASSERT_TRUE(Write().ok());
  std::memset(dst_.data(), 0, dst_.size());
  const auto requests = Requests(IoOp::kRead, id_, dst_.data(), dst_.size(), kMiB);
  std::vector<std::atomic<int>> told(requests.size());
  std::vector<std::atomic<bool>> complete(requests.size());
  RequestDone done = [&](size_t r) {
    told[r].fetch_add(1);
    complete[r].store(
        std::memcmp(requests[r].buffer, src_.data() + requests[r].offset, requests[r].length) == 0);
  };
  FaultRule halves;
  halves.kind = FaultRule::Kind::kShort;
  halves.times = 16;
  backend_->AddRule(halves);
  ASSERT_TRUE(backend_->Run(requests, done).ok());
  for (size_t r = 0; r < requests.size(); ++r) {
    EXPECT_EQ(told[r].load(), 1) << r;
    EXPECT_TRUE(complete[r].load()) << r;
  }
  // A failed request is not told of.
  backend_->ClearRules();
  FaultRule eio;
  eio.any_op = false;
  eio.op = IoOp::kRead;
  eio.offset_begin = 2 * kMiB + 512 * 1024;
  eio.offset_end = eio.offset_begin + 1;
  backend_->AddRule(eio);
  for (auto& t : told) t.store(0);
  EXPECT_EQ(backend_->Run(requests, done).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(told[2].load(), 0);
  for (size_t r = 0; r < requests.size(); ++r) EXPECT_LE(told[r].load(), 1) << r;
}

TEST_P(BackendTest, EnospcIsResourceExhausted) {
  FaultRule full;
  full.any_op = false;
  full.op = IoOp::kWrite;
  full.error = ENOSPC;
  full.skip = 10;
  backend_->AddRule(full);
  absl::Status s = Write();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "write of")) << s.message();
  EXPECT_TRUE(absl::StrContains(s.message(), "ENOSPC")) << s.message();
}

TEST_P(BackendTest, DelaysOnlySlowThingsDown) {
  FaultRule slow;
  slow.kind = FaultRule::Kind::kDelay;
  slow.delay = absl::Milliseconds(2);
  slow.times = 8;
  size_t rule = backend_->AddRule(slow);
  ASSERT_TRUE(Write().ok());
  ASSERT_TRUE(Read().ok());
  EXPECT_TRUE(Same());
  EXPECT_EQ(backend_->fired(rule), 8);
}

TEST_P(BackendTest, BadRequestsAreRefused) {
  IoRequest r{IoOp::kRead, 7, 0, dst_.data(), 4096};
  EXPECT_EQ(backend_->Run({&r, 1}).code(), absl::StatusCode::kInvalidArgument);
  IoRequest past{IoOp::kRead, id_, 32 * kMiB, dst_.data(), 4096};
  EXPECT_EQ(backend_->Run({&past, 1}).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(backend_->SetQueueDepth(0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->SetRequestBytes(1000).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(backend_->SetQueueDepth(1).ok());
  EXPECT_TRUE(backend_->SetRequestBytes(64 * 1024).ok());
  ASSERT_TRUE(Write().ok());
  ASSERT_TRUE(Read().ok());
  EXPECT_TRUE(Same());
}

TEST_P(BackendTest, ConcurrentCallersOnDisjointRanges) {
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const uint64_t part = src_.size() / 4, off = part * t;
      IoRequest w{IoOp::kWrite, id_, off, src_.data() + off, part};
      absl::Status s = backend_->Run({&w, 1});
      IoRequest r{IoOp::kRead, id_, off, dst_.data() + off, part};
      if (s.ok()) s = backend_->Run({&r, 1});
      results[t] = s;
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& s : results) EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(Same());
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendTest, ::testing::Values("io_uring", "posix"),
                         [](const auto& info) { return info.param; });

// io_uring_enter failing hard after the kernel took requests (a "cannot
// happen"): Run returns only once the kernel is done with every one of
// them (the caller reuses their buffers at once), and the ring goes out of
// service while another serves the next calls.
TEST(UringBackend, AFailedRingHandsNoBufferBackBeforeTheKernelIsDone) {
  IoOptions o;
  o.backend = "io_uring";
  o.rings = 2;
  o.queue_depth = 8;
  o.submit_batch = 64;  // past the depth: the first entry submits and waits
  o.request_bytes = 256 * 1024;
  auto inner = MakeIoBackend(o);
  if (!inner.ok() || (*inner)->name() != "io_uring") GTEST_SKIP() << "no io_uring here";
  FaultInjectingBackend backend(std::move(*inner));
  const std::string path = std::string(getenv("TEST_TMPDIR")) + "/io_failed_ring.dat";
  auto f = OpenIoFile(path, /*create=*/true, /*want_direct=*/true);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(ftruncate(f->fd.get(), 8 * kMiB), 0);
  auto id = backend.AddFile(f->fd.get(), path);
  ASSERT_TRUE(id.ok());
  HostMemory src = *HostMemory::Allocate(8 * kMiB), dst = *HostMemory::Allocate(8 * kMiB);
  FillRandom(src.data(), src.size(), 7);
  FaultRule seen;  // counts the completions Run reaps (a delay of nothing)
  seen.kind = FaultRule::Kind::kDelay;
  seen.delay = absl::ZeroDuration();
  seen.times = -1;
  const size_t reaped = backend.AddRule(seen);
  std::atomic<int> taken{-1};
  backend.SetEnterHookForTesting([&taken](int rc) {
    int expected = -1;
    return rc > 0 && taken.compare_exchange_strong(expected, rc) ? -EBADFD : rc;
  });
  auto writes = Requests(IoOp::kWrite, *id, src.data(), src.size(), kMiB);
  absl::Status failed = backend.Run(writes);
  EXPECT_FALSE(failed.ok());
  EXPECT_TRUE(absl::StrContains(failed.message(), "io_uring")) << failed;
  ASSERT_GT(taken.load(), 0);
  EXPECT_EQ(backend.fired(reaped), taken.load());
  // The other ring serves on, every time.
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(backend.Run(writes).ok());
    auto reads = Requests(IoOp::kRead, *id, dst.data(), dst.size(), kMiB);
    ASSERT_TRUE(backend.Run(reads).ok());
    EXPECT_EQ(std::memcmp(src.data(), dst.data(), src.size()), 0);
  }
}

TEST(HandleResult, ShortTransfersAdvanceAndRequeueErrorsStop) {
  std::byte buf[8192];
  for (IoOp op : {IoOp::kRead, IoOp::kWrite}) {
    IoChunk c{op, 0, 4096, buf, 8192};
    ChunkOutcome outcome;
    EXPECT_TRUE(HandleResult(c, 4096, "/f", &outcome));  // short: go again
    EXPECT_EQ(c.offset, 8192u);
    EXPECT_EQ(c.buffer, buf + 4096);
    EXPECT_EQ(c.remaining, 4096u);
    EXPECT_TRUE(HandleResult(c, -EAGAIN, "/f", &outcome));
    EXPECT_TRUE(HandleResult(c, -EINTR, "/f", &outcome));
    EXPECT_FALSE(HandleResult(c, 4096, "/f", &outcome));  // done
    EXPECT_EQ(c.remaining, 0u);
    EXPECT_TRUE(outcome.ok());
    IoChunk d{op, 0, 0, buf, 4096};
    EXPECT_FALSE(HandleResult(d, -EIO, "/f", &outcome));
    EXPECT_EQ(outcome.status().code(), absl::StatusCode::kDataLoss);
  }
  IoChunk e{IoOp::kWrite, 0, 0, buf, 4096};
  ChunkOutcome outcome;
  for (int i = 0; i < kMaxIoRetries; ++i) ASSERT_TRUE(HandleResult(e, -EAGAIN, "/f", &outcome));
  EXPECT_FALSE(HandleResult(e, -EAGAIN, "/f", &outcome));  // retries are bounded
  EXPECT_EQ(outcome.status().code(), absl::StatusCode::kUnavailable);
}

TEST(DirectIo, AlignmentIsQueried) {
  std::string path = std::string(getenv("TEST_TMPDIR")) + "/align.dat";
  auto f = OpenIoFile(path, true, true);
  ASSERT_TRUE(f.ok());
  if (!f->direct) GTEST_SKIP() << "the test filesystem has no O_DIRECT";
  DirectIoAlignment a = QueryDirectIoAlignment(f->fd.get());
  ASSERT_TRUE(a.supported());
  EXPECT_EQ(a.offset & (a.offset - 1), 0u) << a.offset;
  EXPECT_GE(f->alignment, 512u);
  EXPECT_EQ(f->alignment % a.offset, 0u);
}

// Kernels before 6.1 (no STATX_DIOALIGN) learn the alignment from sysfs:
// a partition's directory has no queue, its disk's has. A tree laid out as
// /sys/dev/block is (the device's entry a link into its disk's directory).
TEST(DirectIo, APartitionsBlockSizeIsItsDisks) {
  const std::string root = std::string(getenv("TEST_TMPDIR")) + "/sysfs";
  const std::string disk = root + "/devices/nvme0n1";
  std::filesystem::remove_all(root);
  ASSERT_TRUE(std::filesystem::create_directories(disk + "/nvme0n1p1"));
  ASSERT_TRUE(std::filesystem::create_directories(disk + "/queue"));
  ASSERT_TRUE(std::filesystem::create_directories(root + "/dev/block"));
  std::ofstream(disk + "/queue/logical_block_size") << "512\n";
  std::filesystem::create_directory_symlink(disk, root + "/dev/block/259:0");
  std::filesystem::create_directory_symlink(disk + "/nvme0n1p1", root + "/dev/block/259:1");
  EXPECT_EQ(LogicalBlockSize(root + "/dev/block", 259, 0), 512u);  // the disk
  EXPECT_EQ(LogicalBlockSize(root + "/dev/block", 259, 1), 512u);  // its partition
  EXPECT_EQ(LogicalBlockSize(root + "/dev/block", 0, 42), 0u);     // btrfs' anonymous device
}

TEST(DirectIo, TmpfsFallsBackToBufferedIo) {
  struct statfs fs;
  if (statfs("/dev/shm", &fs) != 0 || fs.f_type != 0x01021994 /* TMPFS_MAGIC */) {
    GTEST_SKIP() << "no tmpfs at /dev/shm";
  }
  std::string path = "/dev/shm/offloadd_io_test_" + std::to_string(getpid());
  auto f = OpenIoFile(path, true, true);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE(f->direct);
  auto backend = MakeIoBackend(IoOptions{});
  ASSERT_TRUE(backend.ok());
  auto id = (*backend)->AddFile(f->fd.get(), path);
  ASSERT_TRUE(id.ok());
  HostMemory a = *HostMemory::Allocate(kMiB), b = *HostMemory::Allocate(kMiB);
  FillRandom(a.data(), a.size(), 7);
  IoRequest w{IoOp::kWrite, *id, 0, a.data(), kMiB}, r{IoOp::kRead, *id, 0, b.data(), kMiB};
  ASSERT_TRUE((*backend)->Run({&w, 1}).ok());
  ASSERT_TRUE((*backend)->Run({&r, 1}).ok());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), kMiB), 0);
  unlink(path.c_str());
}

TEST(Factory, FallsBackToPosixWithoutIoUring) {
  auto no_uring = [] { return -ENOSYS; };
  auto b = MakeIoBackendWithProbe(IoOptions{}, no_uring);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->name(), "posix");
  IoOptions strict;
  strict.backend = "io_uring";
  EXPECT_EQ(MakeIoBackendWithProbe(strict, no_uring).status().code(),
            absl::StatusCode::kFailedPrecondition);
  IoOptions bad;
  bad.queue_depth = 1000;
  EXPECT_EQ(MakeIoBackend(bad).status().code(), absl::StatusCode::kInvalidArgument);
  auto real = MakeIoBackend(IoOptions{});
  ASSERT_TRUE(real.ok());
  EXPECT_EQ((*real)->name(), "io_uring");
}

}  // namespace
}  // namespace offload
