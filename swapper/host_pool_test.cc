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

// A lease of its own mapping that ends keeps its pages as a spare (still
// charged, up to the spare bytes set, the oldest making way): only a caller
// that overwrites it all (kOverwritten) gets it back, of the same size; a
// zeroed lease is never one. Spares give way to any lease past the limit
// and to a lower cap.
TEST(HostPool, SparesServeOverwrittenLeasesAndGiveWay) {
  const uint64_t mib = uint64_t{1} << 20;
  HostPool pool(Env::Default(), 8 * mib, false);
  pool.SetSpareBytes(4 * mib);
  auto a = pool.Allocate(2 * mib, "a");
  ASSERT_TRUE(a.ok()) << a.status();
  std::memset(a->data(), 0x5a, 2 * mib);
  const std::byte* was = a->data();
  a->Reset();
  EXPECT_EQ(pool.spare_bytes(), 2 * mib);
  EXPECT_EQ(pool.used(), 0u);  // spares are not in use
  EXPECT_TRUE(pool.Fits(8 * mib));
  // Zeroed: fresh pages, the spare stays.
  auto zeroed = pool.Allocate(2 * mib, "zeroed");
  ASSERT_TRUE(zeroed.ok());
  EXPECT_NE(zeroed->data(), was);
  EXPECT_EQ(static_cast<int>(zeroed->data()[123]), 0);
  EXPECT_EQ(pool.spare_bytes(), 2 * mib);
  // Another size: fresh pages too.
  auto other = pool.Allocate(mib, "other", Pages::kHuge, HostPool::Contents::kOverwritten);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(pool.spares_taken(), 0u);
  other->Reset();  // 1 MiB: a spare too
  EXPECT_EQ(pool.spare_bytes(), 3 * mib);
  // Overwritten, same size and pages: the spare, as it was left.
  auto reused = pool.Allocate(2 * mib, "reused", Pages::kHuge, HostPool::Contents::kOverwritten);
  ASSERT_TRUE(reused.ok());
  EXPECT_EQ(reused->data(), was);
  EXPECT_EQ(static_cast<int>(reused->data()[123]), 0x5a);
  EXPECT_EQ(pool.spares_taken(), 1u);
  EXPECT_EQ(pool.spare_bytes(), mib);
  EXPECT_EQ(pool.used(), 4 * mib);
  // Past the cap, the oldest spare makes way for the newest.
  reused->Reset();
  zeroed->Reset();
  EXPECT_EQ(pool.spare_bytes(), 4 * mib);
  // A lease needing the spares' room gets it: 6 MiB leased, 3 of spares, a
  // limit of 8.
  auto big = pool.Allocate(6 * mib, "big");
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_LE(pool.spare_bytes(), 2 * mib);
  EXPECT_EQ(pool.used(), 6 * mib);
  big->Reset();  // 6 MiB: past the cap, unmapped
  pool.SetSpareBytes(0);
  EXPECT_EQ(pool.spare_bytes(), 0u);
  auto last = pool.Allocate(8 * mib, "last");
  EXPECT_TRUE(last.ok()) << last.status();
}

// Spares give back exactly what they must: a limit lowered below what the
// pool holds with them drops them down to it, a lease that lacks room drops
// as many as it lacks (Fits counts them as free, and Take then agrees), and
// a full cap makes the oldest make way for a newer one.
TEST(HostPool, SparesGiveWayToALowerLimitAndToWhatALeaseLacks) {
  const uint64_t mib = uint64_t{1} << 20;
  HostPool pool(Env::Default(), 9 * mib, false);
  pool.SetSpareBytes(3 * mib);
  auto lease = pool.Allocate(5 * mib, "lease");
  ASSERT_TRUE(lease.ok());
  for (int i = 0; i < 3; ++i) {
    auto s = pool.Allocate(mib, "spare");
    ASSERT_TRUE(s.ok());
    std::memset(s->data(), i + 1, mib);
  }  // each a spare as it goes: 3 MiB of them, 8 MiB charged
  EXPECT_EQ(pool.spare_bytes(), 3 * mib);
  EXPECT_EQ(pool.used(), 5 * mib);
  // 3 MiB more: Fits says yes, and the Take drops 2 MiB of spares for it.
  EXPECT_TRUE(pool.Fits(3 * mib));
  auto more = pool.Allocate(3 * mib, "more");
  ASSERT_TRUE(more.ok()) << more.status();
  EXPECT_EQ(pool.spare_bytes(), mib);
  more->Reset();  // past the cap with the spare: the oldest spare goes
  EXPECT_LE(pool.spare_bytes(), 3 * mib);
  // A lower limit: spares go down to it at once.
  pool.SetLimit(6 * mib);
  EXPECT_LE(pool.used() + pool.spare_bytes(), 6 * mib);
  EXPECT_EQ(pool.used(), 5 * mib);
}

// A pool that locks its memory keeps no spares (a lock would be lost or
// need redoing); small leases (slab slots) never become spares.
TEST(HostPool, NoSparesOfLockedOrSmallLeases) {
  const uint64_t mib = uint64_t{1} << 20;
  HostPool locking(Env::Default(), 8 * mib, /*lock_memory=*/true);
  locking.SetSpareBytes(4 * mib);
  auto a = locking.Allocate(2 * mib, "a");
  ASSERT_TRUE(a.ok());
  a->Reset();
  EXPECT_EQ(locking.spare_bytes(), 0u);
  HostPool pool(Env::Default(), 8 * mib, false);
  pool.SetSpareBytes(4 * mib);
  auto small = pool.Allocate(PageSize(), "small");
  ASSERT_TRUE(small.ok());
  small->Reset();
  EXPECT_EQ(pool.spare_bytes(), 0u);
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
