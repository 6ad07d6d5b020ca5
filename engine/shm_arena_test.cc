#include "engine/shm_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(ShmArena, AllocationsArePageAlignedZeroedAndShared) {
  auto arena = ShmArena::Create("test", 1 << 20);
  ASSERT_TRUE(arena.ok()) << arena.status();
  auto a = (*arena)->Allocate(10);
  auto b = (*arena)->Allocate(5000);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, 0u);
  EXPECT_EQ(*b, ShmArena::kAlignment);
  EXPECT_EQ((*arena)->size(), 3 * ShmArena::kAlignment);
  auto region = (*arena)->Map(*b, 5000);
  ASSERT_TRUE(region.ok()) << region.status();
  std::byte* base = region->data() - *b;
  for (int i = 0; i < 5000; ++i) ASSERT_EQ(base[*b + i], std::byte{0});
  // A second mapping of the same descriptor (what a client does) sees writes.
  void* other = mmap(nullptr, 1 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, (*arena)->fd(), 0);
  ASSERT_NE(other, MAP_FAILED);
  std::memcpy(static_cast<char*>(other) + *b, "hello", 5);
  EXPECT_EQ(std::memcmp(base + *b, "hello", 5), 0);
  munmap(other, 1 << 20);
}

TEST(ShmArena, ClientCannotShrinkIt) {
  auto arena = ShmArena::Create("seal", 1 << 20);
  ASSERT_TRUE(arena.ok());
  ASSERT_TRUE((*arena)->Allocate(8192).ok());
  EXPECT_NE(ftruncate((*arena)->fd(), 0), 0);
  EXPECT_EQ(errno, EPERM);
  struct stat st;
  ASSERT_EQ(fstat((*arena)->fd(), &st), 0);
  EXPECT_EQ(st.st_size, 8192);
}

TEST(ShmArena, FullArenaIsResourceExhausted) {
  auto arena = ShmArena::Create("full", 4 * ShmArena::kAlignment);
  ASSERT_TRUE(arena.ok());
  ASSERT_TRUE((*arena)->Allocate(3 * ShmArena::kAlignment).ok());
  auto too_big = (*arena)->Allocate(2 * ShmArena::kAlignment);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE((*arena)->Allocate(ShmArena::kAlignment).ok());
  EXPECT_EQ((*arena)->Allocate(0).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(ShmArena, AlignedAllocationsShareNoPageOfTheirSize) {
  constexpr uint64_t kHuge = 2 << 20;
  auto arena = ShmArena::Create("aligned", 16 * kHuge);
  ASSERT_TRUE(arena.ok());
  auto small = (*arena)->Allocate(100);
  auto huge = (*arena)->Allocate(kHuge + 1, kHuge);
  auto next = (*arena)->Allocate(100);
  ASSERT_TRUE(small.ok() && huge.ok() && next.ok());
  EXPECT_EQ(*small, 0u);
  EXPECT_EQ(*huge, kHuge);      // past the small one, on a huge page
  EXPECT_EQ(*next, 3 * kHuge);  // not inside the huge one's last page
  EXPECT_EQ((*arena)->size(), 3 * kHuge + ShmArena::kAlignment);
  EXPECT_EQ((*arena)->Allocate(kHuge, 3 << 20).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*arena)->Allocate(kHuge, 1024).status().code(), absl::StatusCode::kInvalidArgument);
  // What no longer fits once aligned is refused, not placed past capacity.
  EXPECT_EQ((*arena)->Allocate(13 * kHuge, kHuge).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*arena)->Allocate(~uint64_t{0}, kHuge).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE((*arena)->Allocate(12 * kHuge, kHuge).ok());
}

TEST(ShmArena, RejectsBadCapacity) {
  EXPECT_EQ(ShmArena::Create("bad", 1000).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmArena::Create("bad", 0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace offload
