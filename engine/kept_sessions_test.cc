#include "engine/kept_sessions.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/host_memory.h"
#include "engine/test_engine.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

// KeepSessions keeps every session a checkpoint can hold and logs the rest; a
// manager of the next offloadd reopens what was kept (the same session id,
// token, partition id and bytes, detached until its trainer resumes it) and
// leaves in place what it cannot read.
TEST(KeptSessions, AreReopenedAsTheyWere) {
  const std::string tmp = getenv("TEST_TMPDIR");
  const std::string dir = tmp + "/kept";
  TestEngine engine(tmp + "/nvme", 64 << 20);
  SessionManager& sessions_ = *engine.sessions;
  auto Open = [&] {
    auto s = sessions_.Open("t");
    EXPECT_TRUE(s.ok()) << s.status();
    return s->key;
  };
  const SessionKey kept = Open();
  auto p = sessions_.Register(kept, {"w", 1000, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(p.ok()) << p.status();
  {
    auto fd = sessions_.DupArenaFd(kept);
    ASSERT_TRUE(fd.ok());
    auto region = HostMemory::MapShared(fd->get(), 0, p->span.offset + p->span.bytes);
    ASSERT_TRUE(region.ok()) << region.status();
    auto* w = reinterpret_cast<float*>(region->data() + p->params.offset);
    for (int i = 0; i < 1000; ++i) w[i] = 0.25f * static_cast<float>(i);
  }
  ASSERT_TRUE(sessions_.Release(kept, {}).ok());
  ASSERT_TRUE(sessions_.Fetch(kept, {p->id}).ok());  // held: the holds are dropped
  // fp32 initial values never committed: no checkpoint can hold this one.
  const SessionKey lost = Open();
  ASSERT_TRUE(sessions_.Register(lost, {"u", 1000, DType::kBf16, DType::kBf16, true}).ok());

  EXPECT_EQ(KeepSessions(sessions_, dir), 1);
  EXPECT_TRUE(std::filesystem::exists(absl::StrCat(dir, "/", kept.id)));
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(dir, "/", lost.id)));
  ASSERT_TRUE(sessions_.Close(kept).ok());
  ASSERT_TRUE(sessions_.Close(lost).ok());
  // Something the next offloadd cannot read stays where it is.
  std::filesystem::create_directories(dir + "/7");
  FILE* junk = fopen((dir + "/7/session.binpb").c_str(), "w");
  ASSERT_NE(junk, nullptr);
  fputs("not a session", junk);
  fclose(junk);

  SessionManager next(Env::Default(), engine.store, engine.steps, &engine.stats);
  EXPECT_EQ(ReopenKeptSessions(next, dir), 1);
  EXPECT_TRUE(std::filesystem::exists(dir + "/7/session.binpb"));
  EXPECT_EQ(next.Resume(SessionKey{kept.id, "wrong token....."}).status().code(),
            absl::StatusCode::kPermissionDenied);
  // Kept on disk until its trainer takes it back (a crash of this offloadd
  // meanwhile leaves it for the next); stale from then on.
  EXPECT_TRUE(std::filesystem::exists(absl::StrCat(dir, "/", kept.id, "/session.binpb")));
  ASSERT_TRUE(next.Resume(kept).ok());
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(dir, "/", kept.id)));
  auto all = next.Fetch(kept, {});
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0].id, p->id);
  auto fd = next.DupArenaFd(kept);
  ASSERT_TRUE(fd.ok());
  auto region = HostMemory::MapShared(fd->get(), 0, (*all)[0].span.offset + (*all)[0].span.bytes);
  ASSERT_TRUE(region.ok()) << region.status();
  const auto* w = reinterpret_cast<const float*>(region->data() + (*all)[0].params.offset);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(w[i], 0.25f * static_cast<float>(i)) << i;
  // New partitions get ids after the kept ones.
  auto q = next.Register(kept, {"v", 10, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_GT(q->id, p->id);
  // Closed, its id (an earlier offloadd's) is said to be closed, not one
  // this offloadd never knew; the lost one's still is.
  ASSERT_TRUE(next.Close(kept).ok());
  const absl::Status closed = next.Resume(kept).status();
  EXPECT_EQ(closed.code(), absl::StatusCode::kFailedPrecondition) << closed;
  EXPECT_TRUE(absl::StrContains(closed.message(), "is closed")) << closed;
  EXPECT_EQ(next.Resume(lost).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace offload
