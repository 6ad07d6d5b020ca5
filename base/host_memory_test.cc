#include "base/host_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <utility>

#include "gtest/gtest.h"

namespace offload {
namespace {

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

TEST(HostMemory, ErrorsNameTheOperation) {
  auto bad = HostMemory::MapShared(-1, 8192, 4096);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("mmap 4096 bytes at offset 8192"), std::string::npos)
      << bad.status();
  EXPECT_EQ(RoundUpToPage(1), PageSize());
  EXPECT_EQ(RoundUpToPage(PageSize()), PageSize());
}

}  // namespace
}  // namespace offload
