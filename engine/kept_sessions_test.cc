#include "engine/kept_sessions.h"

#include <stdlib.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/directory.h"
#include "base/host_memory.h"
#include "checkpoint/format.h"
#include "engine/test_engine.h"
#include "engine/trainer_testing.h"
#include "gtest/gtest.h"
#include "swapper/pool_file.h"

namespace offload {
namespace {

// One step of `m`'s session `key` whose partition `id` holds 1000 fp32
// values: its gradients fetched, returned and released, then stepped.
void StepOnce(SessionManager& m, const SessionKey& key, uint64_t id) {
  FetchMode with_grads;
  with_grads.grads = true;
  ASSERT_TRUE(m.Fetch(key, {id}, with_grads).ok());
  ASSERT_TRUE(m.ReturnGradients(key, id, 1000, DType::kFp32).ok());
  ASSERT_TRUE(m.Release(key, {id}).ok());
  ASSERT_TRUE(m.Step(key, AdamHyperparams{}).ok());
}

// Until `engine` has taken `n` automatic checkpoints (20 s at most).
void AwaitAutoCheckpoints(TestEngine& engine, int64_t n) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (engine.stats.auto_checkpoints.load() < n && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_EQ(engine.stats.auto_checkpoints.load(), n);
}

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

// A user other than offloadd's own opens at most SetMaxSessionsPerUser
// sessions (others and the unbounded are not counted against it); its job
// restarted at the bound takes its own detached session over, another
// user's of the name does not; its sessions kept across a restart are
// counted for it again once reopened.
TEST(KeptSessions, AUsersSessionsAreBoundedAndStayCountedOnceReopened) {
  const std::string tmp = getenv("TEST_TMPDIR");
  const std::string dir = tmp + "/kept_users";
  TestEngine engine(tmp + "/nvme_users", 64 << 20);
  SessionManager& sessions = *engine.sessions;
  sessions.SetMaxSessionsPerUser(2);
  const uid_t user = 1000, other = 1001;
  auto open = [](SessionManager& m, const std::string& name, std::optional<uid_t> who) {
    return m.Open(name, {}, std::nullopt, std::nullopt, {}, who);
  };
  auto a = open(sessions, "a", user);
  auto b = open(sessions, "b", user);
  ASSERT_TRUE(a.ok() && b.ok());
  const int64_t opened = engine.stats.sessions_opened.load();
  const absl::Status refused = open(sessions, "c", user).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "uid 1000 has 2 sessions open")) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "server.max_sessions_per_user 2")) << refused;
  EXPECT_EQ(engine.stats.sessions_opened.load(), opened);  // not counted as opened
  auto c = open(sessions, "c", other);
  auto d = open(sessions, "d", std::nullopt);
  ASSERT_TRUE(c.ok() && d.ok());
  // One closes: room for one more, not two.
  ASSERT_TRUE(sessions.Close(b->key).ok());
  auto e = open(sessions, "e", user);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(open(sessions, "f", user).status().code(), absl::StatusCode::kResourceExhausted);

  // The user's job restarts while at its bound: its new session takes its
  // detached one (kept for a resume) over and opens; another user's
  // session of the same name takes nothing of it over.
  ASSERT_TRUE(sessions.Close(e->key).ok());
  RestoreFrom keep;
  keep.keep_for_resume = true;
  auto job = sessions.Open("job", {}, std::nullopt, std::nullopt, keep, user);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(sessions.Detach(job->key.id));
  auto others = sessions.Open("job", {}, std::nullopt, std::nullopt, keep, other);
  ASSERT_TRUE(others.ok()) << others.status();
  EXPECT_TRUE(sessions.Fetch(job->key, {}).ok());  // not taken over
  auto restarted = sessions.Open("job", {}, std::nullopt, std::nullopt, keep, user);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  EXPECT_EQ(sessions.Fetch(job->key, {}).status().code(), absl::StatusCode::kFailedPrecondition);

  // Kept across a restart: reopened (never refused), and counted again.
  EXPECT_EQ(KeepSessions(sessions, dir), 5);
  for (const auto& s : {a, c, d, others, restarted}) ASSERT_TRUE(sessions.Close(s->key).ok());
  SessionManager next(Env::Default(), engine.store, engine.steps, &engine.stats);
  next.SetMaxSessionsPerUser(1);
  EXPECT_EQ(ReopenKeptSessions(next, dir), 5);
  EXPECT_EQ(open(next, "g", user).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(open(next, "g", other).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(open(next, "g", 1002).ok());
}

// A session opened to restore an earlier step of a checkpoint (restore_from
// with restore_steps: the step a job's ranks agreed on) registers its later
// partitions from that step after a restart too.
TEST(KeptSessions, KeepTheStepTheyRestore) {
  const std::string tmp = getenv("TEST_TMPDIR");
  TestEngine engine(tmp + "/nvme_steps", 64 << 20);
  SessionManager& sessions = *engine.sessions;
  SessionManager::AutoCheckpointOptions automatic;
  automatic.dir = tmp + "/auto_steps";
  automatic.every_steps = 1;
  sessions.SetAutoCheckpoint(automatic);
  // A checkpoint holding steps 2 and 1 (an automatic one keeps the one
  // before it), copied aside.
  auto first = sessions.Open("job");
  ASSERT_TRUE(first.ok()) << first.status();
  std::vector<uint64_t> ids;
  for (const char* name : {"w", "v"}) {
    auto p = sessions.Register(first->key, {name, 1000, DType::kFp32, DType::kFp32});
    ASSERT_TRUE(p.ok()) << p.status();
    ids.push_back(p->id);
  }
  ASSERT_TRUE(sessions.Release(first->key, {}).ok());
  FetchMode with_grads;
  with_grads.grads = true;
  for (int step = 1; step <= 2; ++step) {
    ASSERT_TRUE(sessions.Fetch(first->key, ids, with_grads).ok());
    for (uint64_t id : ids) {
      ASSERT_TRUE(sessions.ReturnGradients(first->key, id, 1000, DType::kFp32).ok());
    }
    ASSERT_TRUE(sessions.Release(first->key, ids).ok());
    ASSERT_TRUE(sessions.Step(first->key, AdamHyperparams{}).ok());
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (engine.stats.auto_checkpoints.load() < step && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    ASSERT_EQ(engine.stats.auto_checkpoints.load(), step);
  }
  const std::string ckpt = tmp + "/two_steps";
  std::filesystem::remove_all(ckpt);
  std::filesystem::copy(sessions.AutoCheckpointDir(first->key.id), ckpt);
  std::filesystem::permissions(ckpt, std::filesystem::perms::owner_all);
  ASSERT_TRUE(sessions.Close(first->key).ok());
  sessions.SetAutoCheckpoint({});

  RestoreFrom from(ckpt);
  from.steps = 1;
  auto second = sessions.Open("job", {}, std::nullopt, std::nullopt, from);
  ASSERT_TRUE(second.ok()) << second.status();
  auto w = sessions.Register(second->key, {"w", 1000, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->step, 1u);
  ASSERT_TRUE(sessions.Release(second->key, {}).ok());
  const std::string dir = tmp + "/kept_steps";
  EXPECT_EQ(KeepSessions(sessions, dir), 1);
  ASSERT_TRUE(sessions.Close(second->key).ok());

  SessionManager next(Env::Default(), engine.store, engine.steps, &engine.stats);
  EXPECT_EQ(ReopenKeptSessions(next, dir), 1);
  ASSERT_TRUE(next.Resume(second->key).ok());
  auto v = next.Register(second->key, {"v", 1000, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_TRUE(v->restored);
  EXPECT_EQ(v->step, 1u);  // not the checkpoint's latest, 2
  ASSERT_TRUE(next.Close(second->key).ok());

  // Its restore_from changed since it was kept, so that no restore takes it
  // (another session's checkpoint of another step beside its own): the
  // kept session is reopened all the same (what it holds is in its kept
  // state), and partitions it registers later start anew, said in the log.
  auto third = sessions.Open("job", {}, std::nullopt, std::nullopt, RestoreFrom(ckpt));
  ASSERT_TRUE(third.ok()) << third.status();
  ASSERT_TRUE(sessions.Register(third->key, {"w", 1000, DType::kFp32, DType::kFp32}).ok());
  ASSERT_TRUE(sessions.Release(third->key, {}).ok());
  const std::string dir3 = tmp + "/kept_changed";
  EXPECT_EQ(KeepSessions(sessions, dir3), 1);
  ASSERT_TRUE(sessions.Close(third->key).ok());
  auto other = sessions.Open("other");
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(sessions.Register(other->key, {"u", 10, DType::kFp32, DType::kFp32}).ok());
  ASSERT_TRUE(sessions.Release(other->key, {}).ok());
  ASSERT_TRUE(sessions.Checkpoint(other->key, ckpt, /*background=*/false).ok());  // step 0
  ASSERT_TRUE(sessions.Close(other->key).ok());
  SessionManager after(Env::Default(), engine.store, engine.steps, &engine.stats);
  EXPECT_EQ(ReopenKeptSessions(after, dir3), 1);
  ASSERT_TRUE(after.Resume(third->key).ok());
  auto later = after.Register(third->key, {"v", 1000, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_FALSE(later->restored);
  ASSERT_TRUE(after.Close(third->key).ok());
}

// A session restoring a lost session's automatic checkpoint (what a crashed
// offloadd left) removes it once two of its own are in; kept across a
// restart and reopened, it still does (it forgot it: the lost directory
// stayed for good, reported lost at every start).
TEST(KeptSessions, AReopenedSessionStillRemovesTheLostCheckpointItRestored) {
  const std::string tmp = getenv("TEST_TMPDIR");
  TestEngine engine(tmp + "/nvme_lost", 64 << 20);
  SessionManager& sessions = *engine.sessions;
  SessionManager::AutoCheckpointOptions automatic;
  automatic.dir = tmp + "/auto_lost";
  automatic.every_steps = 1;
  std::filesystem::remove_all(automatic.dir);
  sessions.SetAutoCheckpoint(automatic);
  // A lost session's automatic checkpoint (a copy of one, under another id).
  auto first = sessions.Open("job");
  ASSERT_TRUE(first.ok()) << first.status();
  auto w = sessions.Register(first->key, {"w", 1000, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(sessions.Release(first->key, {}).ok());
  StepOnce(sessions, first->key, w->id);
  AwaitAutoCheckpoints(engine, 1);
  const std::string lost = automatic.dir + "/4242";
  std::filesystem::copy(sessions.AutoCheckpointDir(first->key.id), lost);
  std::filesystem::permissions(lost, std::filesystem::perms::owner_all);
  ASSERT_TRUE(sessions.Close(first->key).ok());
  // Restored, kept at a stop, reopened.
  auto second = sessions.Open("job", {}, std::nullopt, std::nullopt, RestoreFrom(lost));
  ASSERT_TRUE(second.ok()) << second.status();
  auto again = sessions.Register(second->key, {"w", 1000, DType::kFp32, DType::kFp32});
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(sessions.Release(second->key, {}).ok());
  const std::string dir = tmp + "/kept_lost";
  EXPECT_EQ(KeepSessions(sessions, dir), 1);
  ASSERT_TRUE(sessions.Close(second->key).ok());
  sessions.SetAutoCheckpoint({});
  SessionManager next(Env::Default(), engine.store, engine.steps, &engine.stats);
  next.SetAutoCheckpoint(automatic);
  EXPECT_EQ(ReopenKeptSessions(next, dir), 1);
  ASSERT_TRUE(next.Resume(second->key).ok());
  const int64_t before = engine.stats.auto_checkpoints.load();
  StepOnce(next, second->key, again->id);
  AwaitAutoCheckpoints(engine, before + 1);
  StepOnce(next, second->key, again->id);
  AwaitAutoCheckpoints(engine, before + 2);
  StepOnce(next, second->key, again->id);  // two of its own in: the lost one goes
  EXPECT_FALSE(std::filesystem::exists(lost));
  ASSERT_TRUE(next.Close(second->key).ok());
  next.SetAutoCheckpoint({});
}

}  // namespace
}  // namespace offload

namespace offload {
namespace {

uint64_t AllocatedBytes(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_blocks) * 512 : 0;
}

// The records of the one manifest in `dir`: kind, begin, elems, hash.
std::vector<std::string> RecordsIn(const std::string& dir) {
  auto manifests = checkpoint::ReadManifests(dir);
  EXPECT_TRUE(manifests.ok()) << manifests.status();
  std::vector<std::string> out;
  if (!manifests.ok() || manifests->size() != 1) return out;
  for (const auto& p : (*manifests)[0].second.partitions()) {
    for (const auto& r : p.records()) {
      out.push_back(
          absl::StrCat(p.name(), " ", r.kind(), " ", r.begin(), " ", r.elems(), " ", r.xxh3()));
    }
  }
  return out;
}

// With the pool in a file on tmpfs (memory.pool_dir), a kept session's
// host-resident state is not written: its checkpoint names offsets in the
// file, which outlives the engine; the next one has the same bytes (the
// same records, hash for hash, as a checkpoint written before the stop),
// then removes the file's name and the kept directory. The next pool takes
// the file over: the kept bytes become the reopened blocks, nothing copied.
// Names no kept directory holds are swept.
TEST(KeptSessions, InThePoolsFileAreNamedNotWrittenAndTakenBack) {
  char made[] = "/dev/shm/kept_sessions_test.XXXXXX";
  if (mkdtemp(made) == nullptr || !CheckMemoryFileSystem(made).ok()) {
    GTEST_SKIP() << "no tmpfs at /dev/shm for the pool's file";
  }
  const std::string pool_dir = made;
  const std::string tmp = getenv("TEST_TMPDIR");
  const std::string dir = tmp + "/kept_memory";
  const std::string before = tmp + "/before_stop", after = tmp + "/after_restart";
  SessionKey key;
  KeptBytes bytes;
  std::string kept_name;
  uint64_t state_bytes = 0;
  {
    TestEngine engine(tmp + "/nvme_memory_a", 64 << 20, 8, trainer_testing::kChunkElems, 0,
                      pool_dir);
    ASSERT_NE(engine.pool->file(), nullptr);
    trainer_testing::Trainer t(&engine, {});
    for (int step = 1; step <= 2; ++step) {
      t.ReturnGradients(step);
      ASSERT_TRUE(t.Step().ok());
    }
    key = t.key();
    ASSERT_TRUE(engine.sessions->Checkpoint(key, before, false).ok());
    for (uint64_t n : trainer_testing::kSizes) state_bytes += 3 * n * sizeof(float);
    ASSERT_EQ(KeepSessions(*engine.sessions, dir, engine.pool->file(), &bytes), 1);
    kept_name = absl::StrCat(pool_dir, "/kept-", key.id, ".memory");
    EXPECT_TRUE(std::filesystem::exists(kept_name));
    // Master weights and both moments stay in the file; the working copy
    // (the arena's) is written.
    EXPECT_GE(bytes.referenced, state_bytes);
    EXPECT_GT(bytes.written, 0u);
    EXPECT_LT(bytes.written, bytes.referenced);
    uint64_t written_on_disk = 0;
    for (const std::string& name : ListDirectory(absl::StrCat(dir, "/", key.id))) {
      written_on_disk += AllocatedBytes(absl::StrCat(dir, "/", key.id, "/", name));
    }
    EXPECT_LT(written_on_disk, bytes.referenced / 2);
    ASSERT_TRUE(engine.sessions->Close(key).ok());
  }
  // The engine (and its pool's file) gone: what was named is still there.
  EXPECT_GE(AllocatedBytes(kept_name), bytes.referenced);
  const std::string orphan = pool_dir + "/kept-999.memory";
  FILE* f = fopen(orphan.c_str(), "w");
  ASSERT_NE(f, nullptr);
  fclose(f);

  // Another name for the kept file, to tell whether the next pool takes it.
  const std::string probe = pool_dir + "/probe";
  ASSERT_EQ(link(kept_name.c_str(), probe.c_str()), 0);

  TestEngine next(tmp + "/nvme_memory_b", 64 << 20, 8, trainer_testing::kChunkElems, 0, pool_dir);
  EXPECT_EQ(ReopenKeptSessions(*next.sessions, dir, next.pool->file()), 1);
  // Taken over: the kept bytes are the session's blocks now, not copied.
  EXPECT_TRUE(next.pool->file()->IsFile(probe));
  EXPECT_GE(next.pool->file()->claimed_bytes(), state_bytes);
  EXPECT_LT(AllocatedBytes(probe), 2 * bytes.referenced);
  unlink(probe.c_str());
  EXPECT_FALSE(std::filesystem::exists(kept_name));
  EXPECT_FALSE(std::filesystem::exists(orphan));
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(dir, "/", key.id)));
  ASSERT_TRUE(next.sessions->Resume(key).ok());
  ASSERT_TRUE(next.sessions->Checkpoint(key, after, false).ok());
  const std::vector<std::string> was = RecordsIn(before), is = RecordsIn(after);
  EXPECT_FALSE(was.empty());
  EXPECT_EQ(was, is);
  // A second restart: the taken-over file is named and kept again.
  KeptBytes again;
  ASSERT_EQ(KeepSessions(*next.sessions, dir, next.pool->file(), &again), 1);
  EXPECT_GE(again.referenced, state_bytes);
  ASSERT_TRUE(next.sessions->Close(key).ok());
  RemoveDirectoryOfFiles(pool_dir);
}

}  // namespace
}  // namespace offload

namespace offload {
namespace {

// A kept session the next offloadd cannot reopen (here its record names a
// partition its checkpoint lacks) is lost as a crash would lose it: its
// automatic checkpoints stay for its job to resume from, whether or not it
// was kept for a resume, and no final checkpoint of the part reopened
// replaces them. A session's share weight is kept with it.
TEST(KeptSessions, OneThatCannotBeReopenedLeavesItsAutomaticCheckpoints) {
  const std::string tmp = getenv("TEST_TMPDIR");
  TestEngine engine(tmp + "/nvme_unreopened", 64 << 20);
  SessionManager& sessions = *engine.sessions;
  SessionManager::AutoCheckpointOptions automatic;
  automatic.dir = tmp + "/auto_unreopened";
  automatic.every_steps = 1;
  std::filesystem::remove_all(automatic.dir);
  sessions.SetAutoCheckpoint(automatic);
  int64_t checkpoints = 0;
  for (bool keep_for_resume : {false, true}) {
    SCOPED_TRACE(keep_for_resume);
    RestoreFrom from;
    from.keep_for_resume = keep_for_resume;
    auto opened = sessions.Open("job", {}, std::nullopt, std::nullopt, from);
    ASSERT_TRUE(opened.ok()) << opened.status();
    const SessionKey key = opened->key;
    ASSERT_TRUE(sessions.SetShare(key, 3).ok());
    auto w = sessions.Register(key, {"w", 1000, DType::kFp32, DType::kFp32});
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE(sessions.Release(key, {}).ok());
    ASSERT_NO_FATAL_FAILURE(StepOnce(sessions, key, w->id));
    ASSERT_NO_FATAL_FAILURE(AwaitAutoCheckpoints(engine, ++checkpoints));
    const std::string dir = absl::StrCat(tmp, "/kept_unreopened_", keep_for_resume);
    EXPECT_EQ(KeepSessions(sessions, dir), 1);
    // The stopping offloadd is gone (its automatic checkpoints as it left
    // them): a Close here would remove them, so they are put back.
    const std::string autodir = sessions.AutoCheckpointDir(key.id);
    const std::string aside = tmp + "/auto_aside";
    std::filesystem::remove_all(aside);
    std::filesystem::copy(autodir, aside);
    ASSERT_TRUE(sessions.Close(key).ok());
    std::filesystem::remove_all(autodir);
    std::filesystem::rename(aside, autodir);

    // Its share weight comes back with it.
    const std::string spoilt = dir + "_spoilt";
    std::filesystem::remove_all(spoilt);
    std::filesystem::copy(dir, spoilt, std::filesystem::copy_options::recursive);
    SessionManager next(Env::Default(), engine.store, engine.steps, &engine.stats);
    ASSERT_EQ(ReopenKeptSessions(next, dir), 1);
    auto listed = next.Sessions();
    ASSERT_EQ(listed.size(), 1u);
    EXPECT_EQ(listed[0].share_weight, 3);
    std::filesystem::copy(autodir, aside);
    ASSERT_TRUE(next.Close(key).ok());
    std::filesystem::remove_all(autodir);
    std::filesystem::rename(aside, autodir);
    // Its record spoilt.
    const std::string sub_spoilt = absl::StrCat(spoilt, "/", key.id);
    checkpoint::v1::PreservedSession record;
    {
      std::ifstream in(sub_spoilt + "/session.binpb", std::ios::binary);
      ASSERT_TRUE(record.ParseFromIstream(&in));
    }
    record.add_partition_ids(w->id + 1000);
    {
      std::ofstream out(sub_spoilt + "/session.binpb", std::ios::binary | std::ios::trunc);
      ASSERT_TRUE(record.SerializeToOstream(&out));
    }

    SessionManager third(Env::Default(), engine.store, engine.steps, &engine.stats);
    third.SetAutoCheckpoint(automatic);
    EXPECT_EQ(ReopenKeptSessions(third, spoilt), 0);
    EXPECT_TRUE(third.Sessions().empty());
    // Its trainer is answered as after a crash (its id is not this
    // offloadd's, with why and its automatic checkpoint), so that it goes
    // on from that (it was told the session had been closed).
    const absl::Status answer = third.Close(key);
    EXPECT_EQ(answer.code(), absl::StatusCode::kNotFound) << answer;
    EXPECT_TRUE(absl::StrContains(answer.message(), "not one of its ids")) << answer;
    EXPECT_TRUE(absl::StrContains(answer.message(), "could not reopen it")) << answer;
    EXPECT_TRUE(absl::StrContains(answer.message(), "automatic checkpoint of step 1")) << answer;
    auto manifests = checkpoint::ReadManifests(autodir);
    ASSERT_TRUE(manifests.ok()) << manifests.status();
    ASSERT_EQ(manifests->size(), 1u);
    EXPECT_EQ((*manifests)[0].second.steps(), 1u);
    EXPECT_EQ((*manifests)[0].second.partitions_size(), 1);
    third.SetAutoCheckpoint({});
    std::filesystem::remove_all(autodir);
  }
  sessions.SetAutoCheckpoint({});
}

}  // namespace
}  // namespace offload
