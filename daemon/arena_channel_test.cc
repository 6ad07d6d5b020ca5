#include "daemon/arena_channel.h"

#include <unistd.h>

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/env.h"
#include "engine/engine.h"
#include "gtest/gtest.h"
#include "ipc/arena_protocol.h"

namespace offload {
namespace {

class ArenaChannelTest : public ::testing::Test {
 protected:
  ArenaChannelTest()
      : dir_(absl::StrCat("/tmp/arena_channel_test.", getpid())) {  // (a socket path is short)
    EngineOptions o;
    o.host_budget_bytes = 1ull << 30;
    o.session_arena_bytes = 1ull << 30;
    auto engine = Engine::Create(o, Env::Default());
    EXPECT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    mkdir(dir_.c_str(), 0700);
    EXPECT_TRUE(channel_ == nullptr);
    auto channel = ArenaChannel::Start(dir_ + "/arena.sock", &engine_->sessions());
    EXPECT_TRUE(channel.ok()) << channel.status();
    if (channel.ok()) channel_ = *std::move(channel);
  }
  ~ArenaChannelTest() override {
    channel_.reset();
    engine_.reset();
    rmdir(dir_.c_str());
  }

  // A session of `partitions` small partitions.
  SessionKey OpenWith(const std::string& name, int partitions) {
    auto opened = engine_->sessions().Open(name);
    EXPECT_TRUE(opened.ok()) << opened.status();
    for (int i = 0; i < partitions; ++i) {
      auto p = engine_->sessions().Register(opened->key,
                                            {absl::StrCat("w", i), 64, DType::kFp32, DType::kFp32});
      EXPECT_TRUE(p.ok()) << p.status();
      if (!p.ok()) break;
      const uint64_t id = p->id;
      EXPECT_TRUE(engine_->sessions().Release(opened->key, {&id, 1}).ok());
    }
    return opened->key;
  }

  absl::StatusOr<Attachment> Attach(const SessionKey& key) {
    return AttachArena(channel_->path(), AttachRequest{key.id, key.token});
  }

  std::string dir_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ArenaChannel> channel_;
};

// One session's attached connections are bounded (each is a descriptor of
// offloadd's while it stays open): past them an attach is refused with the
// reason, and one connection closed makes room again.
TEST_F(ArenaChannelTest, ASessionsAttachedConnectionsAreBounded) {
  const SessionKey key = OpenWith("many", 1);
  std::vector<Attachment> kept;
  for (;;) {
    absl::StatusOr<Attachment> a = Attach(key);
    if (!a.ok()) {
      EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted) << a.status();
      EXPECT_NE(a.status().message().find("connections attached already"), std::string::npos)
          << a.status();
      break;
    }
    kept.push_back(*std::move(a));
    ASSERT_LE(kept.size(), 64u) << "attaches were never refused";
  }
  EXPECT_EQ(kept.size(), 16u);
  // Another session attaches all the same.
  EXPECT_TRUE(Attach(OpenWith("other", 1)).ok());
}

// A trainer of a large session goes away: the session is closed on the
// channel's closing thread, and an attach that comes meanwhile is answered
// at once, not after the teardown.
TEST_F(ArenaChannelTest, ALargeSessionsTeardownDelaysNoAttach) {
  constexpr int kPartitions = 20000;
  // The yardstick: how long closing such a session takes here.
  const SessionKey measured = OpenWith("yardstick", kPartitions);
  const absl::Time start = absl::Now();
  ASSERT_TRUE(engine_->sessions().Close(measured).ok());
  const absl::Duration teardown = absl::Now() - start;
  if (teardown < absl::Milliseconds(20)) {
    GTEST_SKIP() << "closing " << kPartitions << " partitions took " << teardown
                 << " here: too quick to tell an attach that waited for it";
  }

  const SessionKey big = OpenWith("big", kPartitions);
  const SessionKey small = OpenWith("small", 1);
  auto trainer = Attach(big);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  trainer->connection.reset();  // the trainer is gone
  // Once the closing thread has taken the session (counted before its
  // teardown), another trainer attaches.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (engine_->stats().sessions_abandoned.load() == 0) {
    ASSERT_LT(absl::Now(), deadline) << "the gone trainer's session was never closed";
    absl::SleepFor(absl::Microseconds(200));
  }
  const absl::Time asked = absl::Now();
  auto other = Attach(small);
  const absl::Duration waited = absl::Now() - asked;
  ASSERT_TRUE(other.ok()) << other.status();
  std::fprintf(stderr, "teardown of %d partitions: %s; the attach meanwhile: %s\n", kPartitions,
               absl::FormatDuration(teardown).c_str(), absl::FormatDuration(waited).c_str());
  EXPECT_LT(waited, teardown / 2) << "the attach waited " << waited << "; a teardown takes "
                                  << teardown;
}

}  // namespace
}  // namespace offload
