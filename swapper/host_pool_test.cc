#include "swapper/host_pool.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "base/fault_injecting_env.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(HostPool, ChargesWholePagesExactlyAndGivesThemBack) {
  HostPool pool(Env::Default(), 16 * PageSize(), false);
  auto a = pool.Allocate(1, "a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(pool.used(), PageSize());
  EXPECT_EQ(a->charged(), PageSize());
  auto b = pool.Allocate(3 * PageSize() + 5, "b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(pool.used(), 5 * PageSize());
  PoolMemory moved = std::move(*b);
  EXPECT_EQ(pool.used(), 5 * PageSize());
  moved.Reset();
  EXPECT_EQ(pool.used(), PageSize());
  a->Reset();
  EXPECT_EQ(pool.used(), 0u);
}

TEST(HostPool, RefusesWhatDoesNotFitWithTheNumbersAndChangesNothing) {
  HostPool pool(Env::Default(), 4 * PageSize(), false);
  auto a = pool.Allocate(3 * PageSize(), "a");
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(pool.Fits(PageSize()));
  EXPECT_FALSE(pool.Fits(PageSize() + 1));
  auto b = pool.Allocate(2 * PageSize(), "partition 'w'");
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("partition 'w'"), std::string::npos) << b.status();
  EXPECT_NE(b.status().message().find(std::to_string(3 * PageSize()) + " of " +
                                      std::to_string(4 * PageSize())),
            std::string::npos)
      << b.status();
  EXPECT_EQ(pool.used(), 3 * PageSize());
  pool.SetLimit(8 * PageSize());
  EXPECT_TRUE(pool.Allocate(2 * PageSize(), "b").ok());
}

TEST(HostPool, ReservationsForMemoryMappedElsewhereCountToo) {
  HostPool pool(Env::Default(), 4 * PageSize(), false);
  auto arena = pool.Reserve(2 * PageSize() + 1, "arena");
  ASSERT_TRUE(arena.ok());
  EXPECT_EQ(pool.used(), 3 * PageSize());
  EXPECT_EQ(pool.Reserve(2 * PageSize(), "more").status().code(),
            absl::StatusCode::kResourceExhausted);
  PoolCharge moved = std::move(*arena);
  moved.Reset();
  EXPECT_EQ(pool.used(), 0u);
}

TEST(HostPool, AFailedMappingChargesNothing) {
  FaultInjectingEnv env(Env::Default());
  HostPool pool(&env, 4 * PageSize(), false);
  env.FailNth(EnvOp::kAllocate, 1, ENOMEM);
  auto a = pool.Allocate(PageSize(), "a");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.used(), 0u);
}

TEST(HostPool, LocksWherePermitted) {
  HostPool pool(Env::Default(), 4 * PageSize(), true);
  auto a = pool.Allocate(PageSize(), "a");
  ASSERT_TRUE(a.ok());
  // What this process may lock decides what the pool could do.
  auto probe = HostMemory::Allocate(PageSize());
  const bool may_lock = mlock(probe->data(), PageSize()) == 0;
  EXPECT_EQ(pool.locked(), may_lock ? PageSize() : 0u);
  a->Reset();
  EXPECT_EQ(pool.locked(), 0u);
}

// Small leases are slots of shared slabs: thousands of blocks take a few
// mappings (vm.max_map_count bounds them all), each charged its own whole
// pages, zeroed when taken again; an empty slab goes while another of its
// size has room; larger leases are mappings of their own.
TEST(HostPool, SmallLeasesShareSlabs) {
  FaultInjectingEnv env(Env::Default());
  const uint64_t page = PageSize();
  HostPool pool(&env, uint64_t{1} << 30, false);
  const int64_t mappings = HostMemory::LiveMappings();
  const uint64_t per_slab = HostPool::kSlabBytes / page;
  std::vector<PoolMemory> leases;
  for (uint64_t i = 0; i < 2 * per_slab + 1; ++i) {
    auto a = pool.Allocate(100 + i % 7, "small");
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(a->shared());
    ASSERT_EQ(reinterpret_cast<uintptr_t>(a->data()) % page, 0u);
    leases.push_back(*std::move(a));
  }
  EXPECT_EQ(pool.slabs(), 3);
  EXPECT_EQ(HostMemory::LiveMappings(), mappings + 3);
  EXPECT_EQ(env.calls(EnvOp::kAllocate), 3);
  EXPECT_EQ(pool.used(), (2 * per_slab + 1) * page);
  // Another size (5 pages: slots of 8) has slabs of its own; its charge is
  // its own 5 pages.
  auto five = pool.Allocate(5 * page, "five");
  ASSERT_TRUE(five.ok());
  EXPECT_EQ(five->charged(), 5 * page);
  EXPECT_EQ(pool.slabs(), 4);
  // A slot given back and taken again reads zero.
  std::memset(leases.back().data(), 0xab, 100);
  std::byte* reused = leases.back().data();
  leases.pop_back();
  auto again = pool.Allocate(100, "again");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->data(), reused);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(again->data()[i], std::byte{0}) << i;
  // Everything given back: one slab per size stays for the next.
  leases.clear();
  again->Reset();
  five->Reset();
  EXPECT_EQ(pool.used(), 0u);
  EXPECT_EQ(pool.slabs(), 2);
  // Larger than a slot: a mapping of its own.
  auto big = pool.Allocate(HostPool::kSlabLeaseMaxBytes + 1, "big");
  ASSERT_TRUE(big.ok());
  EXPECT_FALSE(big->shared());
}

// A slab that cannot be mapped fails the lease that needed it, charging
// nothing; a lease that finds room in a slab maps nothing.
TEST(HostPool, ASlabThatCannotBeMappedChargesNothing) {
  FaultInjectingEnv env(Env::Default());
  HostPool pool(&env, uint64_t{1} << 30, false);
  env.FailNth(EnvOp::kAllocate, 1, ENOMEM);
  auto failed = pool.Allocate(100, "first");
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << failed.status();
  EXPECT_EQ(pool.used(), 0u);
  EXPECT_EQ(pool.slabs(), 0);
  auto a = pool.Allocate(100, "a");
  ASSERT_TRUE(a.ok());
  env.FailNth(EnvOp::kAllocate, 1, ENOMEM);
  auto b = pool.Allocate(100, "b");  // room in a's slab
  EXPECT_TRUE(b.ok()) << b.status();
}

// A pool that locks its memory, or whose leases take I/O in units above a
// page, gives small leases mappings of their own (a lock on part of a slab
// would split it; a slot could not take the longer transfer).
TEST(HostPool, LockingOrCoarseIoKeepsSmallLeasesApart) {
  HostPool coarse(Env::Default(), uint64_t{1} << 30, false);
  coarse.SetIoAlignment(4 * PageSize());
  auto c = coarse.Allocate(100, "c");
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->shared());
  EXPECT_EQ(coarse.slabs(), 0);
  HostPool pool(Env::Default(), uint64_t{1} << 30, true);
  auto a = pool.Allocate(100, "a");
  auto b = pool.Allocate(3 * PageSize(), "b");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_FALSE(a->shared());
  EXPECT_EQ(pool.slabs(), 0);
  auto probe = HostMemory::Allocate(PageSize());
  const bool may_lock = mlock(probe->data(), PageSize()) == 0;
  EXPECT_EQ(pool.locked(), may_lock ? 4 * PageSize() : 0u);
  a->Reset();
  b->Reset();
  EXPECT_EQ(pool.locked(), 0u);
}

}  // namespace
}  // namespace offload
