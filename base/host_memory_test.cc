#include "base/host_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/smaps_testing.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

// Each mapping's madvise flags say what it asked of the kernel: hg
// (MADV_HUGEPAGE), nh (MADV_NOHUGEPAGE), or neither. Skips where the kernel
// has no transparent huge pages.
void ExpectPagesAsked(const void* huge, const void* small, const void* plain) {
  const std::string h = VmFlagsAt(huge), s = VmFlagsAt(small), p = VmFlagsAt(plain);
  ASSERT_FALSE(h.empty() || s.empty() || p.empty()) << "no /proc/self/smaps";
  if (!TransparentHugePagesAt(huge)) {
    GTEST_SKIP() << "this kernel has no transparent huge pages";
  }
  EXPECT_NE(h.find(" hg "), std::string::npos) << h;
  EXPECT_NE(s.find(" nh "), std::string::npos) << s;
  EXPECT_EQ(p.find(" hg "), std::string::npos) << p;
  EXPECT_EQ(p.find(" nh "), std::string::npos) << p;
}

TEST(HostMemory, AllocateIsZeroedPageAlignedAndMovable) {
  auto m = HostMemory::Allocate(10000);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->size(), 10000u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(m->data()) % PageSize(), 0u);
  for (uint64_t i = 0; i < m->size(); ++i) ASSERT_EQ(m->data()[i], std::byte{0});
  m->data()[9999] = std::byte{7};
  HostMemory moved = std::move(*m);
  EXPECT_TRUE(m->empty());
  EXPECT_EQ(moved.data()[9999], std::byte{7});
  HostMemory assigned;
  assigned = std::move(moved);
  EXPECT_EQ(assigned.data()[9999], std::byte{7});
  EXPECT_TRUE(HostMemory::Allocate(0)->empty());
}

TEST(HostMemory, MapSharedSeesTheFileAndIsUnmappedOnce) {
  int fd = memfd_create("host_memory_test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 8192), 0);
  std::byte* seen = nullptr;
  {
    auto a = HostMemory::MapShared(fd, 0, 1 << 20);  // larger than the file: reserve only
    auto b = HostMemory::MapShared(fd, 0, 8192);
    auto c = HostMemory::MapShared(fd, 4096, 4096);  // a range
    ASSERT_TRUE(a.ok() && b.ok());
    std::memcpy(a->data() + 4096, "shared", 6);
    EXPECT_EQ(std::memcmp(b->data() + 4096, "shared", 6), 0);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(std::memcmp(c->data(), "shared", 6), 0);
    seen = a->data();
  }
  // Both mappings are gone: the address is no longer mapped.
  EXPECT_EQ(msync(seen, 4096, MS_ASYNC), -1);
  EXPECT_EQ(errno, ENOMEM);
  close(fd);
}

TEST(HostMemory, SharedHugePageBytesReadsTheSelectedMode) {
  const uint64_t pmd = 2 << 20;
  EXPECT_EQ(SharedHugePageBytesFrom("always within_size [advise] never deny force\n", pmd), pmd);
  EXPECT_EQ(SharedHugePageBytesFrom("[always] within_size advise never deny force", pmd), pmd);
  EXPECT_EQ(SharedHugePageBytesFrom("always within_size advise never deny [force]", pmd), pmd);
  EXPECT_EQ(SharedHugePageBytesFrom("always [within_size] advise never deny force", pmd), pmd);
  EXPECT_EQ(SharedHugePageBytesFrom("always within_size advise [never] deny force", pmd), 0u);
  EXPECT_EQ(SharedHugePageBytesFrom("always within_size advise never [deny] force", pmd), 0u);
  EXPECT_EQ(SharedHugePageBytesFrom("", pmd), 0u);                 // no THP in the kernel
  EXPECT_EQ(SharedHugePageBytesFrom("[advise]", 3 << 20), 0u);     // not a power of two
  EXPECT_EQ(SharedHugePageBytesFrom("[advise]", PageSize()), 0u);  // no larger than a page
}

TEST(HostMemory, SharedFileWritesGetLargePagesOnlyWhereNothingNeedsToAsk) {
  const std::string never = "always within_size advise [never] deny force";
  const std::string advise = "always within_size [advise] never deny force";
  const std::string always = "[always] within_size advise never deny force";
  const std::string within = "always [within_size] advise never deny force";
  // Kernels without per-size controls: the global one decides.
  EXPECT_FALSE(SharedFileWritesMayGetLargePagesFrom(never, {}));
  EXPECT_FALSE(SharedFileWritesMayGetLargePagesFrom(advise, {}));
  EXPECT_FALSE(SharedFileWritesMayGetLargePagesFrom("", {}));
  EXPECT_TRUE(SharedFileWritesMayGetLargePagesFrom(always, {}));
  EXPECT_TRUE(SharedFileWritesMayGetLargePagesFrom(within, {}));
  EXPECT_TRUE(SharedFileWritesMayGetLargePagesFrom("deny [force]", {}));
  // Per size: `inherit` takes the global value; any size that gives pages
  // unasked counts.
  const std::string size_never = "always inherit within_size advise [never]";
  const std::string size_inherit = "always [inherit] within_size advise never";
  const std::string size_always = "[always] inherit within_size advise never";
  EXPECT_FALSE(SharedFileWritesMayGetLargePagesFrom(never, {size_never, size_inherit}));
  EXPECT_TRUE(SharedFileWritesMayGetLargePagesFrom(always, {size_never, size_inherit}));
  EXPECT_FALSE(SharedFileWritesMayGetLargePagesFrom(always, {size_never, size_never}));
  EXPECT_TRUE(SharedFileWritesMayGetLargePagesFrom(never, {size_never, size_always}));
  EXPECT_FALSE(SharedFileWritesMayGetLargePagesFrom(
      advise, {"always inherit within_size [advise] never", size_inherit}));
}

TEST(HostMemory, SharedMappingsAskForTheirPages) {
  int fd = memfd_create("host_memory_test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  const uint64_t bytes = 4 << 20;
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  auto huge = HostMemory::MapShared(fd, 0, bytes, Pages::kHuge);
  auto small = HostMemory::MapShared(fd, 0, bytes, Pages::kSmall);
  auto plain = HostMemory::MapShared(fd, 0, bytes);
  ASSERT_TRUE(huge.ok() && small.ok() && plain.ok());
  ExpectPagesAsked(huge->data(), small->data(), plain->data());
  close(fd);
}

TEST(HostMemory, PrivateMappingsAskForTheirPages) {
  const uint64_t bytes = 4 << 20;
  auto huge = HostMemory::Allocate(bytes, Pages::kHuge);
  auto small = HostMemory::Allocate(bytes, Pages::kSmall);
  auto plain = HostMemory::Allocate(bytes, Pages::kSystemDefault);
  ASSERT_TRUE(huge.ok() && small.ok() && plain.ok());
  ExpectPagesAsked(huge->data(), small->data(), plain->data());
}

TEST(HostMemory, AHugeMappingStartsOnAHugePageOfItsFile) {
  int fd = memfd_create("host_memory_test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  const uint64_t huge = HugePageAlignment();
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(4 * huge)), 0);
  // Whatever the kernel's shmem_enabled: the address is congruent to the
  // offset modulo the huge page size.
  for (uint64_t offset : {uint64_t{0}, huge, 3 * PageSize(), huge + 5 * PageSize()}) {
    std::vector<HostMemory> maps;
    for (int i = 0; i < 4; ++i) {  // several, so that one aligned by chance proves nothing
      auto m = HostMemory::MapShared(fd, offset, 2 * huge + PageSize(), Pages::kHuge);
      ASSERT_TRUE(m.ok()) << m.status();
      EXPECT_EQ(reinterpret_cast<uintptr_t>(m->data()) % huge, offset % huge) << offset;
      m->data()[0] = std::byte{9};
      maps.push_back(*std::move(m));
    }
    EXPECT_EQ(maps[1].data()[0], std::byte{9});
  }
  close(fd);
}

TEST(HostMemory, AHugeSharedMappingGetsHugePagesAndGivesThemBack) {
  const uint64_t huge_bytes = SharedHugePageBytes();
  if (huge_bytes == 0) {
    GTEST_SKIP() << "shared memory gets no huge pages here "
                    "(/sys/kernel/mm/transparent_hugepage/shmem_enabled is never or deny)";
  }
  int fd = memfd_create("host_memory_test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  const uint64_t bytes = 2 * huge_bytes;
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  auto m = HostMemory::MapShared(fd, 0, bytes, Pages::kHuge);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(m->data()) % huge_bytes, 0u);
  std::memset(m->data(), 1, bytes);
  std::string smaps = SmapsAt(m->data());
  // The kernel may fall back to small pages when it finds no free huge one
  // (fragmented memory): then this test has nothing to check.
  if (SmapsKb(smaps, "ShmemPmdMapped") != static_cast<int64_t>(bytes / 1024)) {
    close(fd);
    GTEST_SKIP() << "the kernel gave small pages (no free huge page?): " << smaps;
  }
  EXPECT_EQ(SmapsKb(smaps, "Rss"), static_cast<int64_t>(bytes / 1024)) << smaps;
  // Freeing one whole huge page gives all of it back.
  ASSERT_TRUE(DiscardSharedPages(m->data(), huge_bytes).ok());
  smaps = SmapsAt(m->data());
  EXPECT_EQ(SmapsKb(smaps, "Rss"), static_cast<int64_t>(huge_bytes / 1024)) << smaps;
  EXPECT_EQ(m->data()[0], std::byte{0});
  EXPECT_EQ(m->data()[huge_bytes], std::byte{1});
  close(fd);
}

// Writes `text` to `path`, making its directories.
void WriteFile(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path) << text << "\n";
}

TEST(HostMemory, DamonMonitorsAreTheKdamondThreads) {
  const std::string root = std::string(getenv("TEST_TMPDIR")) + "/damon";
  const std::string proc = root + "/proc", admin = root + "/kdamonds";
  EXPECT_TRUE(DamonMonitorsIn(proc, admin).empty()) << "nothing to read: no monitor";
  WriteFile(proc + "/1/comm", "systemd");
  WriteFile(proc + "/self/comm", "kdamond.9");  // not a process id
  EXPECT_TRUE(DamonMonitorsIn(proc, admin).empty());
  // One started through the admin interface (its operations readable), one
  // by a module (DAMON_RECLAIM: no admin entry), one whose admin entry this
  // process cannot read (here: no pid file), and a stopped admin entry.
  // Kernel threads: PF_KTHREAD (0x00200000) among the flags of their stat.
  auto kthread = [&](const std::string& pid, const std::string& name) {
    WriteFile(proc + "/" + pid + "/comm", name);
    WriteFile(proc + "/" + pid + "/stat",
              pid + " (" + name + ") S 2 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 9 0 0");
  };
  kthread("507", "kdamond.0");
  WriteFile(admin + "/0/pid", "507");
  WriteFile(admin + "/0/contexts/0/operations", "paddr");
  kthread("612", "kdamond.1");
  kthread("88", "kdamond.2");
  // A user's process named kdamond (any user can run one; its name may
  // hold spaces and parentheses): not a monitor.
  WriteFile(proc + "/4242/comm", "kdamond.7");
  WriteFile(proc + "/4242/stat",
            "4242 (kdamond.7 (x) 1) S 1000 4242 4242 34816 4242 4194304 99 0 0 0 1 0 0 0 20 0");
  WriteFile(admin + "/1/contexts/0/operations", "vaddr");
  WriteFile(admin + "/2/pid", "-1");
  WriteFile(admin + "/2/contexts/0/operations", "fvaddr");
  EXPECT_EQ(DamonMonitorsIn(proc, admin),
            (std::vector<std::string>{"kdamond.0 (pid 507, paddr)", "kdamond.1 (pid 612)",
                                      "kdamond.2 (pid 88)"}));
}

TEST(HostMemory, PrivateHugePageBytesReadsTheSelectedMode) {
  const uint64_t pmd = 2 << 20;
  EXPECT_EQ(PrivateHugePageBytesFrom("always [madvise] never\n", pmd), pmd);
  EXPECT_EQ(PrivateHugePageBytesFrom("[always] madvise never", pmd), pmd);
  EXPECT_EQ(PrivateHugePageBytesFrom("always madvise [never]", pmd), 0u);
  EXPECT_EQ(PrivateHugePageBytesFrom("", pmd), 0u);  // no THP in the kernel
  EXPECT_EQ(PrivateHugePageBytesFrom("[madvise]", 3 << 20), 0u);
}

TEST(HostMemory, HugePageControlsAreReadUnderTheGivenSys) {
  const std::string sys = std::string(getenv("TEST_TMPDIR")) + "/thp/sys";
  const std::string thp = sys + "/kernel/mm/transparent_hugepage";
  EXPECT_EQ(TransparentHugePageMode(sys, "enabled"), "");
  EXPECT_EQ(SharedHugePageBytesIn(sys), 0u);
  EXPECT_EQ(PrivateHugePageBytesIn(sys), 0u);
  WriteFile(thp + "/enabled", "always [madvise] never\n");
  WriteFile(thp + "/shmem_enabled", "always within_size advise [never] deny force\n");
  WriteFile(thp + "/hpage_pmd_size", "2097152\n");
  EXPECT_EQ(TransparentHugePageMode(sys, "enabled"), "madvise");
  EXPECT_EQ(TransparentHugePageMode(sys, "shmem_enabled"), "never");
  EXPECT_EQ(PrivateHugePageBytesIn(sys), 2u << 20);
  EXPECT_EQ(SharedHugePageBytesIn(sys), 0u);
  WriteFile(thp + "/shmem_enabled", "always within_size [advise] never deny force\n");
  EXPECT_EQ(SharedHugePageBytesIn(sys), 2u << 20);
}

TEST(HostMemory, ErrorsNameTheOperation) {
  auto bad = HostMemory::MapShared(-1, 8192, 4096);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("mmap 4096 bytes at offset 8192"), std::string::npos)
      << bad.status();
  EXPECT_EQ(RoundUpToPage(1), PageSize());
  EXPECT_EQ(RoundUpToPage(PageSize()), PageSize());
}

}  // namespace
// Memory a thread freed in the middle of its malloc arena (what a session's
// teardown leaves: most of its allocations freed, a few that outlive it in
// between) stays resident until TrimHeap gives its pages back.
namespace {
int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, pages = 0;
  statm >> size >> pages;
  return pages * static_cast<int64_t>(PageSize());
}

// On a thread of its own: 40,000 blocks of 4,000 bytes written, all freed
// but every 64th (returned: outliving the rest, between freed ones).
std::vector<char*> LeaveFreedPagesInAThreadArena() {
  std::vector<char*> kept;
  std::thread([&] {
    std::vector<char*> all;
    for (int i = 0; i < 40000; ++i) {
      all.push_back(static_cast<char*>(std::malloc(4000)));
      std::memset(all.back(), 1, 4000);
    }
    for (size_t i = 0; i < all.size(); ++i) {
      if (i % 64 == 0) {
        kept.push_back(all[i]);
      } else {
        std::free(all[i]);
      }
    }
  }).join();
  return kept;
}
}  // namespace

TEST(TrimHeap, GivesAThreadArenasFreedPagesBack) {
#if !defined(__GLIBC__) || defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "glibc's malloc_trim only, without a sanitizer's allocator";
#endif
  auto resident = ResidentBytes;
  std::vector<char*> kept = LeaveFreedPagesInAThreadArena();
  const int64_t before = resident();
  // Only once asked for.
  EXPECT_FALSE(TrimHeapIfRequested());
  RequestHeapTrim();
  ASSERT_TRUE(TrimHeapIfRequested());
  const int64_t after = resident();
  EXPECT_LT(after, before - (100 << 20)) << before << " -> " << after;
  EXPECT_FALSE(TrimHeapIfRequested());
  for (char* p : kept) std::free(p);
}

// What nobody asked a trim for (a burst of gRPC streams) goes back once the
// heap hoards at least the amount given, and not before.
TEST(TrimHeap, GivesBackWhatTheHeapHoardsPastAnAmount) {
#if !defined(__GLIBC__) || defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "glibc's malloc_trim only, without a sanitizer's allocator";
#endif
  std::vector<char*> kept = LeaveFreedPagesInAThreadArena();
  const int64_t before = ResidentBytes();
  EXPECT_FALSE(TrimHeapIfHoarding(uint64_t{1} << 40));  // not that much
  EXPECT_GT(ResidentBytes(), before - (100 << 20));
  ASSERT_TRUE(TrimHeapIfHoarding(uint64_t{32} << 20));
  const int64_t after = ResidentBytes();
  EXPECT_LT(after, before - (100 << 20)) << before << " -> " << after;
  for (char* p : kept) std::free(p);
}

}  // namespace offload
