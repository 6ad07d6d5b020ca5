#include "swapper/pool_file.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/directory.h"
#include "gtest/gtest.h"
#include "swapper/host_pool.h"

namespace offload {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

// A private directory on a memory file system, removed with its files.
class MemoryDir {
 public:
  MemoryDir() {
    char path[] = "/dev/shm/pool_file_test.XXXXXX";
    if (mkdtemp(path) != nullptr && CheckMemoryFileSystem(path).ok()) path_ = path;
  }
  ~MemoryDir() {
    if (!path_.empty()) RemoveDirectoryOfFiles(path_);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

uint64_t BlocksOf(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_blocks) * 512 : 0;
}

#define SKIP_WITHOUT_MEMORY_DIR(dir) \
  if ((dir).path().empty()) GTEST_SKIP() << "no tmpfs at /dev/shm to make a pool file in"

TEST(PoolFile, ExtentsAreZeroedAlignedAndTheirPagesGoBackWhenGiven) {
  MemoryDir dir;
  SKIP_WITHOUT_MEMORY_DIR(dir);
  auto file = PoolFile::Create(dir.path(), 64 * kMiB);
  ASSERT_TRUE(file.ok()) << file.status();
  PoolFile& f = **file;
  auto a = f.Take(kMiB + 1, PageSize());
  auto b = f.Take(3 * kMiB, 64 * 1024);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->offset, 0u);
  EXPECT_EQ(a->length, RoundUpToPage(kMiB + 1));
  EXPECT_EQ(b->offset % (64 * 1024), 0u);
  EXPECT_GE(b->offset, a->offset + a->length);
  EXPECT_EQ(f.OffsetOf(b->data + 10, 100), b->offset + 10);
  EXPECT_FALSE(f.OffsetOf(&f, 8).has_value());
  std::memset(a->data, 0x5a, kMiB + 1);
  std::memset(b->data, 0x6b, 3 * kMiB);
  EXPECT_GE(f.resident_bytes(), 4 * kMiB);
  EXPECT_FALSE(f.Give(*a));
  EXPECT_FALSE(f.Give(*b));
  EXPECT_LT(f.resident_bytes(), kMiB);  // punched out
  EXPECT_EQ(f.taken_bytes(), 0u);
  // Both given back and merged: one extent across them, zeroed.
  auto c = f.Take(4 * kMiB, PageSize());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->offset, 0u);
  for (uint64_t i = 0; i < 4 * kMiB; i += 4096) ASSERT_EQ(static_cast<int>(c->data[i]), 0) << i;
  // The region's end: no room past it.
  auto too_much = f.Take(64 * kMiB, PageSize());
  EXPECT_TRUE(absl::IsResourceExhausted(too_much.status())) << too_much.status();
}

TEST(PoolFile, RefusesADirectoryOnADiskOrOpenToOthers) {
  char disk[] = "/var/tmp/pool_file_test.XXXXXX";
  ASSERT_NE(mkdtemp(disk), nullptr);
  auto on_disk = PoolFile::Create(disk, 64 * kMiB);
  rmdir(disk);
  if (!CheckMemoryFileSystem("/var/tmp").ok()) {
    EXPECT_TRUE(absl::IsInvalidArgument(on_disk.status())) << on_disk.status();
    EXPECT_NE(on_disk.status().message().find("is not on tmpfs"), std::string::npos);
  }
  MemoryDir dir;
  SKIP_WITHOUT_MEMORY_DIR(dir);
  ASSERT_EQ(chmod(dir.path().c_str(), 0777), 0);
  auto open_to_others = PoolFile::Create(dir.path(), 64 * kMiB);
  EXPECT_TRUE(absl::IsPermissionDenied(open_to_others.status())) << open_to_others.status();
  EXPECT_TRUE(absl::IsInvalidArgument(PoolFile::Create("relative", 64 * kMiB).status()));
  // One at a time per directory.
  ASSERT_EQ(chmod(dir.path().c_str(), 0700), 0);
  auto first = PoolFile::Create(dir.path(), 64 * kMiB);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = PoolFile::Create(dir.path(), 64 * kMiB);
  EXPECT_TRUE(absl::IsFailedPrecondition(second.status())) << second.status();
  EXPECT_NE(second.status().message().find("in use by another offloadd"), std::string::npos);
  first->reset();
  EXPECT_TRUE(PoolFile::Create(dir.path(), 64 * kMiB).ok());
}

// Once linked, a retained extent given back stays as it is (a kept
// checkpoint names it), others go as before; the destructor punches what
// none retained, and the retained bytes stay in the named file for the next
// process.
TEST(PoolFile, LinkedItKeepsWhatIsRetainedAndDropsTheRestAtTheEnd) {
  MemoryDir dir;
  SKIP_WITHOUT_MEMORY_DIR(dir);
  const std::string name = dir.path() + "/kept.memory";
  uint64_t kept_offset = 0;
  {
    auto file = PoolFile::Create(dir.path(), 64 * kMiB);
    ASSERT_TRUE(file.ok()) << file.status();
    PoolFile& f = **file;
    auto kept = f.Take(2 * kMiB, PageSize());
    auto dropped = f.Take(2 * kMiB, PageSize());
    ASSERT_TRUE(kept.ok() && dropped.ok());
    std::memset(kept->data, 0x11, 2 * kMiB);
    std::memset(dropped->data, 0x22, 2 * kMiB);
    ASSERT_TRUE(f.Link(name).ok());
    ASSERT_TRUE(f.Link(name + ".2").ok());  // a second name, the same file
    EXPECT_TRUE(f.linked());
    kept_offset = kept->offset;
    f.Retain(kept->offset, 2 * kMiB);
    EXPECT_TRUE(f.Give(*kept));
    EXPECT_FALSE(f.Give(*dropped));
    // Not retained: punched and taken again; the retained one is not.
    auto next = f.Take(2 * kMiB, PageSize());
    ASSERT_TRUE(next.ok());
    EXPECT_EQ(next->offset, dropped->offset);
    EXPECT_EQ(static_cast<int>(next->data[5]), 0);
    EXPECT_EQ(static_cast<int>(kept->data[5]), 0x11);
    EXPECT_FALSE(f.Give(*next));
    EXPECT_FALSE(f.Link(name).ok());  // taken
  }
  EXPECT_GE(BlocksOf(name), 2 * kMiB);
  EXPECT_LT(BlocksOf(name), 3 * kMiB);  // the dropped extent punched out
  int fd = open(name.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  std::vector<unsigned char> back(2 * kMiB);
  ASSERT_EQ(pread(fd, back.data(), back.size(), static_cast<off_t>(kept_offset)),
            static_cast<ssize_t>(back.size()));
  close(fd);
  EXPECT_EQ(back.front(), 0x11);
  EXPECT_EQ(back.back(), 0x11);
}

// A host pool of `limit` bytes whose memory is a 16 MiB pool file in `dir`.
std::unique_ptr<HostPool> PoolInFile(const MemoryDir& dir, uint64_t limit) {
  auto file = PoolFile::Create(dir.path(), 16 * kMiB);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return nullptr;
  auto pool = std::make_unique<HostPool>(Env::Default(), limit, false);
  pool->UseFile(*std::move(file));
  return pool;
}

// A pool with a file: every lease (small ones too) is an extent of it,
// charged as before; once linked, a retained lease that ends keeps its
// charge (its memory stays), others give theirs back.
TEST(PoolFile, AHostPoolLeasesItsExtents) {
  MemoryDir dir;
  SKIP_WITHOUT_MEMORY_DIR(dir);
  std::unique_ptr<HostPool> owned = PoolInFile(dir, 32 * kMiB);
  ASSERT_NE(owned, nullptr);
  HostPool& pool = *owned;
  pool.SetSpareBytes(8 * kMiB);  // no spares with a file
  auto small = pool.Allocate(100, "small");
  auto large = pool.Allocate(4 * kMiB, "large", Pages::kHuge, HostPool::Contents::kOverwritten);
  ASSERT_TRUE(small.ok() && large.ok());
  EXPECT_TRUE(small->shared());
  EXPECT_EQ(small->size(), 100u);
  EXPECT_EQ(pool.used(), PageSize() + 4 * kMiB);
  EXPECT_EQ(pool.slabs(), 0);
  ASSERT_TRUE(pool.file()->OffsetOf(small->data(), small->size()).has_value());
  const uint64_t large_at = *pool.file()->OffsetOf(large->data(), large->size());
  large->Reset();
  EXPECT_EQ(pool.spare_bytes(), 0u);
  EXPECT_EQ(pool.used(), PageSize());
  auto kept = pool.Allocate(4 * kMiB, "kept");
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(*pool.file()->OffsetOf(kept->data(), 4 * kMiB), large_at);  // reused
  ASSERT_TRUE(pool.file()->Link(dir.path() + "/kept").ok());
  pool.file()->Retain(large_at, 4 * kMiB);
  kept->Reset();
  small->Reset();
  EXPECT_EQ(pool.used(), 4 * kMiB);  // the retained lease's charge stays
  // Larger than the file's room: private memory.
  auto outside = pool.Allocate(14 * kMiB, "outside");
  ASSERT_TRUE(outside.ok()) << outside.status();
  EXPECT_FALSE(pool.file()->OffsetOf(outside->data(), outside->size()).has_value());
}

// A lease in the file is charged as the file holds it: whole units of the
// alignment its I/O (or the file's huge pages) asks for, not the bytes
// rounded to a page.
TEST(PoolFile, AHostPoolChargesItsExtentsWhole) {
  MemoryDir dir;
  SKIP_WITHOUT_MEMORY_DIR(dir);
  std::unique_ptr<HostPool> owned = PoolInFile(dir, 32 * kMiB);
  ASSERT_NE(owned, nullptr);
  HostPool& pool = *owned;
  pool.SetIoAlignment(64 * 1024);
  auto lease = pool.Allocate(PageSize() + 1, "odd");
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(pool.file()->OffsetOf(lease->data(), lease->size()).has_value());
  EXPECT_EQ(pool.used(), pool.file()->taken_bytes());
  EXPECT_EQ(pool.used(), 64u * 1024);
  lease->Reset();
  EXPECT_EQ(pool.used(), 0u);
  // A pool without room for the alignment's rest: private memory, charged
  // as such.
  MemoryDir dir2;
  std::unique_ptr<HostPool> tight_owned = PoolInFile(dir2, 2 * PageSize());
  ASSERT_NE(tight_owned, nullptr);
  HostPool& tight = *tight_owned;
  tight.SetIoAlignment(64 * 1024);
  auto private_lease = tight.Allocate(PageSize() + 1, "odd");
  ASSERT_TRUE(private_lease.ok()) << private_lease.status();
  EXPECT_FALSE(tight.file()->OffsetOf(private_lease->data(), private_lease->size()).has_value());
  EXPECT_EQ(tight.used(), 2 * PageSize());
}

// The next process's pool takes a kept file over: kept ranges are claimed
// where they are (with their bytes), the rest of the file is free and
// punched; a claim given back before the release is a kept range again; at
// the release what no one claimed goes, except what is to stay. Taken over,
// the file can be named again (a second restart), and it takes no file
// over once it has extents taken.
TEST(PoolFile, TakesAKeptFileOverAndHandsOutItsRangesOnce) {
  MemoryDir dir;
  SKIP_WITHOUT_MEMORY_DIR(dir);
  const std::string name = dir.path() + "/kept-1.memory";
  uint64_t a_at = 0, b_at = 0, c_at = 0, d_at = 0;
  {
    auto file = PoolFile::Create(dir.path(), 64 * kMiB);
    ASSERT_TRUE(file.ok()) << file.status();
    auto a = (*file)->Take(kMiB, PageSize());
    auto junk = (*file)->Take(kMiB, PageSize());
    auto b = (*file)->Take(kMiB, PageSize());
    auto c = (*file)->Take(kMiB, PageSize());
    auto d = (*file)->Take(kMiB, PageSize());
    ASSERT_TRUE(a.ok() && junk.ok() && b.ok() && c.ok() && d.ok());
    std::memset(a->data, 0xa, kMiB);
    std::memset(junk->data, 0xf, kMiB);
    std::memset(b->data, 0xb, kMiB);
    std::memset(c->data, 0xc, kMiB);
    a_at = a->offset, b_at = b->offset, c_at = c->offset, d_at = d->offset;
    ASSERT_TRUE((*file)->Link(name).ok());
    for (const auto* e : {&*a, &*b, &*c, &*d}) (*file)->Retain(e->offset, kMiB);
    // Dies without giving anything back (the junk is not punched by it).
  }
  auto file = PoolFile::Create(dir.path(), 64 * kMiB);
  ASSERT_TRUE(file.ok()) << file.status();
  PoolFile& f = **file;
  ASSERT_TRUE(f.TakeOver(name, {{a_at, kMiB}, {b_at, kMiB}, {c_at, kMiB}, {d_at, kMiB}}).ok());
  EXPECT_TRUE(f.IsFile(name));
  auto a = f.Claim(a_at, kMiB);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(static_cast<int>(a->data[100]), 0xa);
  EXPECT_TRUE(absl::IsFailedPrecondition(f.Claim(a_at, kMiB).status()));         // once
  EXPECT_TRUE(absl::IsFailedPrecondition(f.Claim(a_at + kMiB, kMiB).status()));  // not kept
  // A reopening that fails gives its claim back: kept again.
  auto b = f.Claim(b_at, kMiB);
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(f.Give(*b));
  EXPECT_EQ(static_cast<int>(f.Claim(b_at, kMiB)->data[7]), 0xb);
  EXPECT_EQ(f.claimed_bytes(), 3 * kMiB);
  // The junk between was punched and is free: the next extent lands there.
  auto fresh = f.Take(kMiB, PageSize());
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh->offset, a_at + kMiB);
  EXPECT_EQ(static_cast<int>(fresh->data[9]), 0);
  // d is neither claimed nor kept: released. c is kept for a later start
  // (its session could not be reopened); claimed after the reopening (a
  // session opened to restore its directory), it is that session's for
  // good: given back, it is punched out and free, not kept again (its
  // pages outside the pool's budget for as long as the file lives).
  f.ReleaseUnclaimed({{c_at, kMiB}});
  EXPECT_TRUE(absl::IsFailedPrecondition(f.Claim(d_at, kMiB).status()));
  auto c = f.Claim(c_at, kMiB);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(static_cast<int>(c->data[3]), 0xc);
  EXPECT_FALSE(f.Give(*c));
  EXPECT_TRUE(absl::IsFailedPrecondition(f.Claim(c_at, kMiB).status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(f.TakeOver(name, {})));  // extents taken
  // Its kept name gone, it can still be named for the next restart.
  ASSERT_EQ(unlink(name.c_str()), 0);
  EXPECT_TRUE(f.Link(dir.path() + "/kept-2.memory").ok());
}

}  // namespace
}  // namespace offload
