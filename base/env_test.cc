#include "base/env.h"

#include <cerrno>

#include "base/fault_injecting_env.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(Env, DefaultDoesWhatItSays) {
  Env* env = Env::Default();
  auto fd = env->CreateMemfd("env_test");
  ASSERT_TRUE(fd.ok()) << fd.status();
  ASSERT_TRUE(env->ResizeFile(fd->get(), 4096).ok());
  auto shared = env->MapShared(fd->get(), 0, 4096, Pages::kSystemDefault);
  ASSERT_TRUE(shared.ok());
  auto mem = env->Allocate(100, Pages::kHuge);
  ASSERT_TRUE(mem.ok());
  char a[16] = {}, b[16] = {};
  ASSERT_TRUE(env->RandomBytes(a, sizeof(a)).ok());
  ASSERT_TRUE(env->RandomBytes(b, sizeof(b)).ok());
  EXPECT_NE(std::string(a, 16), std::string(b, 16));
}

TEST(FaultInjectingEnv, FailsExactlyTheNthCallWithTheRealCode) {
  FaultInjectingEnv env(Env::Default());
  env.FailNth(EnvOp::kAllocate, 2, ENOMEM);
  EXPECT_TRUE(env.Allocate(10, Pages::kSystemDefault).ok());
  auto failed = env.Allocate(10, Pages::kSystemDefault);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(failed.status().message().find("ENOMEM"), std::string::npos) << failed.status();
  EXPECT_TRUE(env.Allocate(10, Pages::kSystemDefault).ok());
  EXPECT_EQ(env.calls(EnvOp::kAllocate), 3);

  env.FailNth(EnvOp::kCreateMemfd, 1, EMFILE);
  EXPECT_EQ(env.CreateMemfd("x").status().code(), absl::StatusCode::kResourceExhausted);
  env.FailNth(EnvOp::kResizeFile, 1, ENOSPC);
  EXPECT_EQ(env.ResizeFile(-1, 1).code(), absl::StatusCode::kResourceExhausted);
  env.FailNth(EnvOp::kRandomBytes, 1, EIO);
  char buf[4];
  EXPECT_EQ(env.RandomBytes(buf, 4).code(), absl::StatusCode::kDataLoss);
  env.FailNth(EnvOp::kMapShared, 1, ENOMEM);
  EXPECT_EQ(env.MapShared(-1, 0, 4096, Pages::kSystemDefault).status().code(),
            absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace offload
