#include "swapper/host_pool.h"

#include <sys/mman.h>

#include <cerrno>
#include <string>

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

}  // namespace
}  // namespace offload
