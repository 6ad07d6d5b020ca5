#include "nvme/swap_space.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "base/host_memory.h"
#include "gtest/gtest.h"
#include "nvme/fault_injection.h"
#include "nvme/io_backend_factory.h"

namespace offload {
namespace {

constexpr uint64_t kMiB = 1 << 20;

std::string MakeDir(const std::string& name) {
  std::string dir = std::string(getenv("TEST_TMPDIR")) + "/" + name;
  mkdir(dir.c_str(), 0700);
  return dir;
}

HostMemory Random(size_t bytes, uint32_t seed) {
  HostMemory b = *HostMemory::Allocate(RoundUp(bytes, 1 << 16));
  std::mt19937 rng(seed);
  for (size_t i = 0; i < b.size(); ++i) b.data()[i] = static_cast<std::byte>(rng());
  return b;
}

class SwapSpaceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto inner = MakeIoBackend(IoOptions{});
    ASSERT_TRUE(inner.ok());
    backend_ = std::make_unique<FaultInjectingBackend>(std::move(*inner));
  }

  std::unique_ptr<SwapSpace> Make(std::vector<std::string> dirs, uint64_t bytes_per_dir,
                                  uint64_t stripe = kMiB) {
    NvmeOptions o;
    o.dirs = absl::StrJoin(dirs, ",");
    o.bytes_per_dir = static_cast<int64_t>(bytes_per_dir);
    o.stripe_bytes = static_cast<int64_t>(stripe);
    auto s = SwapSpace::Create(o, backend_.get());
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }

  void ExpectReadBack(SwapSpace& s, uint64_t id, const HostMemory& want, uint64_t bytes) {
    HostMemory got = *HostMemory::Allocate(RoundUp(bytes, 1 << 16));
    absl::Status r = s.Read(id, got.data());
    ASSERT_TRUE(r.ok()) << r;
    EXPECT_EQ(std::memcmp(got.data(), want.data(), bytes), 0) << "extent " << id;
  }

  std::unique_ptr<FaultInjectingBackend> backend_;
};

TEST_F(SwapSpaceTest, StripesExtentsOverEveryDirectoryAndReadsThemBack) {
  auto s = Make({MakeDir("a"), MakeDir("b"), MakeDir("c")}, 64 * kMiB);
  ASSERT_TRUE(s);
  SwapStats before = s->Stats();
  ASSERT_EQ(before.dirs.size(), 3u);
  EXPECT_EQ(before.capacity, 3 * 64 * kMiB);
  for (const auto& d : before.dirs) EXPECT_TRUE(d.direct) << d.path;
  std::vector<std::pair<uint64_t, uint64_t>> extents;  // id, bytes
  std::vector<HostMemory> data;
  uint32_t seed = 1;
  for (uint64_t bytes : {uint64_t{1}, uint64_t{4095}, kMiB, 5 * kMiB / 2, 10 * kMiB + 17}) {
    data.push_back(Random(bytes, seed++));
    auto id = s->Write(data.back().data(), bytes);
    ASSERT_TRUE(id.ok()) << id.status();
    extents.push_back({*id, bytes});
  }
  SwapStats after = s->Stats();
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_LT(after.dirs[i].free, before.dirs[i].free) << "no share in " << after.dirs[i].path;
  }
  for (size_t i = 0; i < extents.size(); ++i) {
    ExpectReadBack(*s, extents[i].first, data[i], extents[i].second);
  }
  // Freeing everything gives every byte back (holes coalesce).
  for (auto& [id, bytes] : extents) ASSERT_TRUE(s->Free(id).ok());
  EXPECT_EQ(s->Stats().free, before.free);
  auto big = Random(3 * 60 * kMiB, 9);
  auto id = s->Write(big.data(), 3 * 60 * kMiB);
  ASSERT_TRUE(id.ok()) << id.status();
  ExpectReadBack(*s, *id, big, 3 * 60 * kMiB);
}

TEST_F(SwapSpaceTest, FullTierIsResourceExhaustedAndKeepsEarlierData) {
  auto s = Make({MakeDir("full")}, 8 * kMiB);
  ASSERT_TRUE(s);
  auto a = Random(5 * kMiB, 1);
  auto id = s->Write(a.data(), 5 * kMiB);
  ASSERT_TRUE(id.ok());
  auto b = Random(5 * kMiB, 2);
  auto full = s->Write(b.data(), 5 * kMiB);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(full.status().message(), "NVMe tier full")) << full.status();
  EXPECT_EQ(s->Stats().free, 3 * kMiB);
  ExpectReadBack(*s, *id, a, 5 * kMiB);
}

// A tier whose free space is scattered in holes smaller than an extent
// (others freed between the ones still there) still holds it: in pieces of
// whole stripes, read back as written, their space given back whole.
TEST_F(SwapSpaceTest, AnExtentGoesInPiecesWhereTheFreeSpaceIsScattered) {
  auto s = Make({MakeDir("scattered")}, 34 * kMiB);
  ASSERT_TRUE(s);
  std::vector<uint64_t> ids;
  for (uint64_t bytes : {16 * kMiB, kMiB, 16 * kMiB, kMiB}) {
    auto data = Random(bytes, static_cast<uint32_t>(bytes));
    auto id = s->Write(data.data(), bytes);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  ASSERT_TRUE(s->Free(ids[1]).ok());
  ASSERT_TRUE(s->Free(ids[3]).ok());
  EXPECT_EQ(s->Stats().free, 2 * kMiB);    // two holes of one stripe each
  const uint64_t bytes = 2 * kMiB - 4096;  // the tail in the second piece
  auto e = Random(bytes, 77);
  auto id = s->Write(e.data(), bytes);
  ASSERT_TRUE(id.ok()) << id.status();
  ExpectReadBack(*s, *id, e, bytes);
  EXPECT_EQ(s->Stats().free, 4096u);
  auto more = Random(8192, 78);
  EXPECT_EQ(s->Write(more.data(), 8192).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(s->Free(*id).ok());
  EXPECT_EQ(s->Stats().free, 2 * kMiB);
  // The holes coalesce with the rest as it goes: all of it, one hole.
  ASSERT_TRUE(s->Free(ids[0]).ok());
  ASSERT_TRUE(s->Free(ids[2]).ok());
  auto whole = Random(34 * kMiB, 79);
  auto big = s->Write(whole.data(), 34 * kMiB);
  ASSERT_TRUE(big.ok()) << big.status();
  ExpectReadBack(*s, *big, whole, 34 * kMiB);
}

// A tier filled by what was admitted to it (state rewritten every step)
// has no room for a second copy: the rewrite goes over the first one. One
// that fails there leaves the extent unreadable, never half old and half
// new; the next rewrite makes it whole again.
TEST_F(SwapSpaceTest, ARewriteWithoutRoomForASecondCopyGoesInPlace) {
  auto s = Make({MakeDir("in_place")}, 8 * kMiB);
  ASSERT_TRUE(s);
  auto a = Random(5 * kMiB, 1), b = Random(5 * kMiB, 2), c = Random(5 * kMiB, 3);
  auto id = s->Write(a.data(), 5 * kMiB);
  ASSERT_TRUE(id.ok());
  absl::Status rewritten = s->Rewrite(*id, b.data(), 5 * kMiB);
  ASSERT_TRUE(rewritten.ok()) << rewritten;
  ExpectReadBack(*s, *id, b, 5 * kMiB);
  EXPECT_EQ(s->Stats().in_place_rewrites, 1u);
  EXPECT_EQ(s->Stats().free, 3 * kMiB);

  FaultRule eio;
  eio.any_op = false;
  eio.op = IoOp::kWrite;
  eio.skip = 1;  // the second stripe: the first is overwritten already
  backend_->AddRule(eio);
  EXPECT_FALSE(s->Rewrite(*id, c.data(), 5 * kMiB).ok());
  backend_->ClearRules();
  HostMemory got = *HostMemory::Allocate(5 * kMiB);
  absl::Status torn = s->Read(*id, got.data());
  EXPECT_EQ(torn.code(), absl::StatusCode::kDataLoss) << torn;
  EXPECT_TRUE(absl::StrContains(torn.message(), "in place")) << torn;
  EXPECT_EQ(s->Stats().free, 3 * kMiB);

  ASSERT_TRUE(s->Rewrite(*id, c.data(), 5 * kMiB).ok());
  ExpectReadBack(*s, *id, c, 5 * kMiB);
  EXPECT_EQ(s->Stats().in_place_rewrites, 3u);
  // With room again, a copy first.
  ASSERT_TRUE(s->Free(*id).ok());
  auto small = s->Write(a.data(), 2 * kMiB);
  ASSERT_TRUE(small.ok());
  ASSERT_TRUE(s->Rewrite(*small, b.data(), 2 * kMiB).ok());
  ExpectReadBack(*s, *small, b, 2 * kMiB);
  EXPECT_EQ(s->Stats().in_place_rewrites, 3u);
}

TEST_F(SwapSpaceTest, ChecksumCatchesCorruptionAndCanBeSwitchedOff) {
  const std::string dir = MakeDir("crc");
  auto s = Make({dir}, 8 * kMiB);
  ASSERT_TRUE(s);
  auto a = Random(2 * kMiB, 3);
  auto id = s->Write(a.data(), 2 * kMiB);
  ASSERT_TRUE(id.ok());
  // Flip one byte behind the daemon's back.
  int fd = open((dir + "/offloadd.swap").c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  char c;
  ASSERT_EQ(pread(fd, &c, 1, 12345), 1);
  c ^= 0x40;
  ASSERT_EQ(pwrite(fd, &c, 1, 12345), 1);
  fsync(fd);
  close(fd);
  HostMemory got = *HostMemory::Allocate(2 * kMiB);
  absl::Status r = s->Read(*id, got.data());
  EXPECT_EQ(r.code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(r.message(), "checksum mismatch")) << r;
  EXPECT_TRUE(absl::StrContains(r.message(), "extent " + std::to_string(*id))) << r;
  EXPECT_TRUE(absl::StrContains(r.message(),
                                "stripe 0 (1048576 bytes at " + dir + "/offloadd.swap offset 0)"))
      << r;
  // An extent written with checksums off is not verified.
  s->SetChecksum(false);
  auto unchecked = s->Write(a.data(), kMiB);
  ASSERT_TRUE(unchecked.ok());
  EXPECT_TRUE(s->Read(*unchecked, got.data()).ok());
}

// Each stripe has its checksum: a corrupted byte is found in its stripe,
// named with its file and offset, and the other stripes' reads are whole.
TEST_F(SwapSpaceTest, EachStripeIsCheckedAndAMismatchNamesItsFileAndOffset) {
  const std::string d0 = MakeDir("crc0"), d1 = MakeDir("crc1");
  auto s = Make({d0, d1}, 8 * kMiB);
  ASSERT_TRUE(s);
  // 3 MiB and a bit: stripes 0, 2 (and the 4th, partial) in d0, 1 and 3 in d1.
  const uint64_t bytes = 3 * kMiB + 5000;
  auto a = Random(RoundUp(bytes, 4096), 8);
  auto id = s->Write(a.data(), bytes);
  ASSERT_TRUE(id.ok());
  ExpectReadBack(*s, *id, a, bytes);
  auto flip = [](const std::string& path, off_t at) {
    int fd = open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    char c;
    ASSERT_EQ(pread(fd, &c, 1, at), 1);
    c ^= 0x01;
    ASSERT_EQ(pwrite(fd, &c, 1, at), 1);
    fsync(fd);
    close(fd);
  };
  // The padding after the extent's bytes (in d1's second stripe, the
  // extent's last) is in no checksum.
  flip(d1 + "/offloadd.swap", kMiB + 6000);
  ExpectReadBack(*s, *id, a, bytes);
  flip(d0 + "/offloadd.swap", kMiB + 7);  // d0's second stripe: the extent's stripe 2
  HostMemory got = *HostMemory::Allocate(RoundUp(bytes, 4096));
  absl::Status r = s->Read(*id, got.data());
  EXPECT_EQ(r.code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(
      r.message(), "stripe 2 (1048576 bytes at " + d0 + "/offloadd.swap offset 1048576)"))
      << r;
}

// Staged transfers: the extent goes through a staging buffer of a few
// stripes, a window at a time, and reads back the same through either path.
TEST_F(SwapSpaceTest, StagedTransfersMoveWindowsOfStripesAndMatchTheDirectOnes) {
  const std::string d0 = MakeDir("staged0"), d1 = MakeDir("staged1");
  auto s = Make({d0, d1}, 32 * kMiB);
  ASSERT_TRUE(s);
  // Two stripes per window; 5 stripes and a bit: three windows, the last
  // partial and padded.
  HostMemory staging = *HostMemory::Allocate(2 * kMiB + 4096);
  const absl::Span<std::byte> window(staging.data(), 2 * kMiB + 4096);
  const uint64_t bytes = 5 * kMiB + 5000;
  const HostMemory a = Random(bytes, 21);
  std::vector<std::pair<uint64_t, uint64_t>> filled;  // offset, bytes
  auto written = s->WriteStaged(bytes, window, [&](uint64_t at, absl::Span<std::byte> chunk) {
    filled.push_back({at, chunk.size()});
    std::memcpy(chunk.data(), a.data() + at, chunk.size());
    return absl::OkStatus();
  });
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(filled, (std::vector<std::pair<uint64_t, uint64_t>>{
                        {0, 2 * kMiB}, {2 * kMiB, 2 * kMiB}, {4 * kMiB, kMiB + 5000}}));
  ExpectReadBack(*s, *written, a, bytes);  // the direct read verifies the staged checksums
  {
    // The alignment's padding after the last byte was written as zeros,
    // not as what the staging buffer held before (the first window's).
    HostMemory got = *HostMemory::Allocate(RoundUp(bytes, 4096));
    std::memset(got.data(), 0xff, got.size());
    ASSERT_TRUE(s->Read(*written, got.data()).ok());
    const std::vector<std::byte> zeros(RoundUp(bytes, 4096) - bytes);
    EXPECT_EQ(std::memcmp(got.data() + bytes, zeros.data(), zeros.size()), 0);
  }

  auto direct = s->Write(a.data(), bytes);
  ASSERT_TRUE(direct.ok());
  for (uint64_t id : {*written, *direct}) {
    HostMemory got = *HostMemory::Allocate(RoundUp(bytes, 4096));
    std::vector<uint64_t> at;
    absl::Status r = s->ReadStaged(id, window, [&](uint64_t offset, absl::Span<std::byte> chunk) {
      at.push_back(offset);
      std::memcpy(got.data() + offset, chunk.data(), chunk.size());
      return absl::OkStatus();
    });
    ASSERT_TRUE(r.ok()) << r;
    EXPECT_EQ(at, (std::vector<uint64_t>{0, 2 * kMiB, 4 * kMiB}));
    EXPECT_EQ(std::memcmp(got.data(), a.data(), bytes), 0) << "extent " << id;
  }

  // A rewrite through staging replaces the contents; the sink's or the
  // source's error stops the transfer and is returned.
  const HostMemory b = Random(kMiB, 22);
  ASSERT_TRUE(
      s->RewriteStaged(*direct, kMiB, window, [&](uint64_t at, absl::Span<std::byte> chunk) {
         std::memcpy(chunk.data(), b.data() + at, chunk.size());
         return absl::OkStatus();
       }).ok());
  ExpectReadBack(*s, *direct, b, kMiB);
  const uint64_t free_before = s->Stats().free;
  auto refused = s->WriteStaged(bytes, window, [](uint64_t at, absl::Span<std::byte>) {
    return at == 0 ? absl::OkStatus() : absl::UnavailableError("source gone");
  });
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_EQ(s->Stats().free, free_before);  // its space given back
  int windows = 0;
  absl::Status stopped = s->ReadStaged(*written, window, [&](uint64_t, absl::Span<std::byte>) {
    ++windows;
    return absl::CancelledError("enough");
  });
  EXPECT_EQ(stopped.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(windows, 1);

  // Staging smaller than a stripe, or unaligned, is refused.
  EXPECT_EQ(s->ReadStaged(*written, window.first(kMiB / 2),
                          [](uint64_t, absl::Span<std::byte>) { return absl::OkStatus(); })
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s->WriteStaged(kMiB, window.subspan(8, kMiB),
                           [](uint64_t, absl::Span<std::byte>) { return absl::OkStatus(); })
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// A staged read hands on no window whose stripes fail their checksums: the
// windows before the corrupted one are handed on, it and later ones not.
TEST_F(SwapSpaceTest, AStagedReadHandsOnNoWindowThatFailsItsChecksum) {
  const std::string dir = MakeDir("staged_crc");
  auto s = Make({dir}, 16 * kMiB);
  ASSERT_TRUE(s);
  const HostMemory a = Random(4 * kMiB, 23);
  auto id = s->Write(a.data(), 4 * kMiB);
  ASSERT_TRUE(id.ok());
  int fd = open((dir + "/offloadd.swap").c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  char c;
  ASSERT_EQ(pread(fd, &c, 1, 2 * kMiB + 99), 1);  // stripe 2: the second window
  c ^= 0x10;
  ASSERT_EQ(pwrite(fd, &c, 1, 2 * kMiB + 99), 1);
  fsync(fd);
  close(fd);
  HostMemory staging = *HostMemory::Allocate(2 * kMiB);
  std::vector<uint64_t> at;
  absl::Status r = s->ReadStaged(*id, absl::Span<std::byte>(staging.data(), 2 * kMiB),
                                 [&](uint64_t offset, absl::Span<std::byte>) {
                                   at.push_back(offset);
                                   return absl::OkStatus();
                                 });
  EXPECT_EQ(r.code(), absl::StatusCode::kDataLoss) << r;
  EXPECT_TRUE(absl::StrContains(r.message(), "checksum mismatch")) << r;
  EXPECT_TRUE(absl::StrContains(
      r.message(), "stripe 2 (1048576 bytes at " + dir + "/offloadd.swap offset 2097152)"))
      << r;
  EXPECT_EQ(at, std::vector<uint64_t>{0});
}

TEST_F(SwapSpaceTest, FailedWritesLoseNothingAndLeakNothing) {
  auto s = Make({MakeDir("eio")}, 16 * kMiB);
  ASSERT_TRUE(s);
  auto a = Random(2 * kMiB, 4);
  auto id = s->Write(a.data(), 2 * kMiB);
  ASSERT_TRUE(id.ok());
  const uint64_t free_before = s->Stats().free;

  FaultRule eio;
  eio.any_op = false;
  eio.op = IoOp::kWrite;
  eio.skip = 1;
  backend_->AddRule(eio);
  auto b = Random(3 * kMiB, 5);
  auto failed = s->Write(b.data(), 3 * kMiB);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(failed.status().message(), "swapping out 3145728 bytes"))
      << failed.status();
  EXPECT_TRUE(absl::StrContains(failed.status().message(), "offloadd.swap")) << failed.status();
  EXPECT_EQ(s->Stats().free, free_before);

  // ENOSPC during a rewrite: the old contents stay readable.
  backend_->ClearRules();
  FaultRule enospc;
  enospc.any_op = false;
  enospc.op = IoOp::kWrite;
  enospc.error = ENOSPC;
  backend_->AddRule(enospc);
  absl::Status rw = s->Rewrite(*id, b.data(), 2 * kMiB);
  EXPECT_EQ(rw.code(), absl::StatusCode::kResourceExhausted) << rw;
  EXPECT_EQ(s->Stats().free, free_before);
  backend_->ClearRules();
  ExpectReadBack(*s, *id, a, 2 * kMiB);
  // A successful rewrite replaces the contents and keeps the space balance.
  ASSERT_TRUE(s->Rewrite(*id, b.data(), 2 * kMiB).ok());
  ExpectReadBack(*s, *id, b, 2 * kMiB);
  EXPECT_EQ(s->Stats().free, free_before);
}

TEST_F(SwapSpaceTest, ShortAndRetriedIoStillRoundTrips) {
  auto s = Make({MakeDir("short1"), MakeDir("short2")}, 16 * kMiB);
  ASSERT_TRUE(s);
  FaultRule shorter;
  shorter.kind = FaultRule::Kind::kShort;
  shorter.times = -1;
  FaultRule again;
  again.error = EAGAIN;
  again.times = 4;
  backend_->AddRule(shorter);
  backend_->AddRule(again);
  auto a = Random(7 * kMiB, 6);
  auto id = s->Write(a.data(), 7 * kMiB);
  ASSERT_TRUE(id.ok()) << id.status();
  ExpectReadBack(*s, *id, a, 7 * kMiB);
}

TEST_F(SwapSpaceTest, RefusesWhatItCannotDo) {
  NvmeOptions o;
  o.dirs = MakeDir("huge");
  o.bytes_per_dir = int64_t{1} << 50;  // 1 PiB: more than the disk holds
  auto huge = SwapSpace::Create(o, backend_.get());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_TRUE(absl::StrContains(huge.status().message(), "preallocating")) << huge.status();

  auto s = Make({MakeDir("locked")}, 4 * kMiB);
  ASSERT_TRUE(s);
  o.dirs = MakeDir("locked");
  o.bytes_per_dir = 4 * kMiB;
  EXPECT_EQ(SwapSpace::Create(o, backend_.get()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  o.dirs = MakeDir("stripe");
  o.stripe_bytes = 1000;
  EXPECT_EQ(SwapSpace::Create(o, backend_.get()).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.dirs = "/nonexistent/offloadd";
  o.stripe_bytes = kMiB;
  EXPECT_EQ(SwapSpace::Create(o, backend_.get()).status().code(), absl::StatusCode::kNotFound);

  auto a = Random(kMiB, 7);
  EXPECT_EQ(s->Write(a.data() + 1, 100).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s->Read(999, a.data()).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s->Free(999).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s->Write(a.data(), 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// One directory named twice (here through a link) is a mistake said as
// one, not "in use by another offloadd".
TEST_F(SwapSpaceTest, ADirectoryNamedTwiceIsSaidSo) {
  const std::string dir = MakeDir("twice");
  const std::string link = std::string(getenv("TEST_TMPDIR")) + "/twice_link";
  unlink(link.c_str());
  ASSERT_EQ(symlink(dir.c_str(), link.c_str()), 0);
  NvmeOptions o;
  o.dirs = dir + "," + link;
  o.bytes_per_dir = 8 * kMiB;
  auto s = SwapSpace::Create(o, backend_.get());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
  EXPECT_TRUE(absl::StrContains(s.status().message(), "twice")) << s.status();
}

TEST_F(SwapSpaceTest, WorksBufferedOnTmpfs) {
  struct statfs fs;
  if (statfs("/dev/shm", &fs) != 0 || fs.f_type != 0x01021994) GTEST_SKIP() << "no tmpfs";
  std::string dir = "/dev/shm/offloadd_swap_test_" + std::to_string(getpid());
  mkdir(dir.c_str(), 0700);
  {
    auto s = Make({dir}, 4 * kMiB);
    ASSERT_TRUE(s);
    EXPECT_FALSE(s->Stats().dirs[0].direct);
    auto a = Random(kMiB + 3, 8);
    auto id = s->Write(a.data(), kMiB + 3);
    ASSERT_TRUE(id.ok());
    ExpectReadBack(*s, *id, a, kMiB + 3);
  }
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace offload
