#include "engine/session_manager.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <functional>
#include <system_error>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/directory.h"
#include "base/host_memory.h"
#include "base/log.h"
#include "base/posix_error.h"
#include "base/secret.h"
#include "base/status_macros.h"
#include "checkpoint/format.h"
#include "swapper/host_pool.h"

namespace offload {
struct SessionManager::Session {
  Session(uint64_t id, std::string token, std::string name, std::unique_ptr<PartitionStore> set,
          std::unique_ptr<LossScaler> scaler, std::unique_ptr<CheckpointRestore> restore)
      : id(id),
        token(std::move(token)),
        name(std::move(name)),
        partitions(std::move(set)),
        scaler(std::move(scaler)),
        restore(std::move(restore)) {}
  ~Session() {
    // Its partitions' mapping reservations go with it (ReserveMappings).
    if (committed_mappings != nullptr) committed_mappings->fetch_sub(mappings.load());
    // The request ring's thread ends (after its call, if it runs the call
    // that dropped the session's last reference).
    if (ring != nullptr) ring->Stop();
    // A background checkpoint stops at its next chunk (the previous
    // checkpoint stays); the set goes only after.
    checkpoint_cancel = true;
    if (checkpoint_thread.joinable()) checkpoint_thread.join();
    // Closed by its trainer: its automatic checkpoints are not wanted.
    for (const std::string& dir : remove_when_gone) RemoveDirectoryOfFiles(dir);
    // Its share of the optimizer goes once no step of it can run (a step
    // holds a reference): forgotten at Close, a step that began before and
    // took its first turn after would leave an entry behind for good.
    if (shares != nullptr) shares->Forget(id);
  }

  const uint64_t id;
  const std::string token;
  const std::string name;
  const std::unique_ptr<PartitionStore> partitions;
  const std::unique_ptr<LossScaler> scaler;  // fp16 sessions that asked for one
  // The checkpoint it restores, if any (from `restore_from`). A kept
  // session's (Reopen) is its original one again once it is reopened,
  // before any call can reach it.
  std::unique_ptr<CheckpointRestore> restore;
  std::string restore_from;
  std::optional<uint64_t> restore_steps;  // the step of restore_from's it restores, if asked
  // A kept session's directory (Reopen), removed once its trainer
  // resumed it or it closed: until then a crash of this offloadd leaves it
  // for the next. Guarded by the manager's mu_.
  std::string kept_dir;
  std::shared_ptr<RingServer> ring;  // set once, before the session is shared
  ArenaRegion ring_region;
  // Its steps' time (SessionSummary), added as each step ends.
  std::atomic<int64_t> step_wall_nanos{0}, step_wait_nanos{0}, step_compute_nanos{0};
  std::atomic<bool> stepped{false};  // a step ended since it opened
  bool keep_for_resume = false;      // RestoreFrom::keep_for_resume; set before it is shared
  std::optional<uid_t> user;         // who opened it, where bounded; set before it is shared
  void CountStep(const StepSummary& step) {
    stepped.store(true);
    step_wall_nanos.fetch_add(step.wall_nanos, std::memory_order_relaxed);
    step_wait_nanos.fetch_add(step.state_wait_nanos, std::memory_order_relaxed);
    step_compute_nanos.fetch_add(step.compute_nanos, std::memory_order_relaxed);
  }
  // Steps after which the delayed update switches itself on (-1: never).
  std::atomic<int64_t> delayed_update_after{-1};
  // Monotonic: a wall-clock step (NTP, a resumed VM) must not expire leases.
  const SteadyTime opened = std::chrono::steady_clock::now();
  // Guarded by the manager's mu_:
  bool attached = false;                     // a trainer received the arena
  std::optional<SteadyTime> detached_since;  // its trainer went away (Detach)
  // Resume answered, not attached yet (a takeover leaves it alone for a
  // while: TakeOverDetached).
  std::optional<SteadyTime> resuming_since;
  bool reopened = false;  // kept across a restart of offloadd (Reopen)
  // Its reopening failed midway: closed as unfinished, nothing of it
  // written (no final checkpoint of the part registered), and its automatic
  // checkpoints left whether or not it was kept for a resume: they are
  // what its job falls back on.
  bool reopen_failed = false;
  SteadyTime last_call = opened;     // the last call that found it, or ended
  std::optional<GpuTierReport> gpu;  // its GPU tier's last report
  // Mappings reserved for its partitions (ReserveMappings), in the
  // manager's total, which outlives neither.
  std::atomic<int64_t> mappings{0};
  std::shared_ptr<std::atomic<int64_t>> committed_mappings;
  OptimizerShares* shares = nullptr;  // the node's optimizer (outlives the manager)

  // A step's decision with its loss-scale update, and a checkpoint's image
  // with its read of the loss scaler, each happen whole under it: a
  // checkpoint never sees the steps of one moment and the scale of another.
  // Taken before the set's lock and before step_mu.
  absl::Mutex decide_mu;
  // The loss scaler counted the step under way when it began (overlapped:
  // decided before it ran); should it stop midway, the Step that finishes
  // it does not count it again.
  bool scaler_counted_step ABSL_GUARDED_BY(decide_mu) = false;
  // The loss scale the step under way was decided with.
  float scale_of_step ABSL_GUARDED_BY(decide_mu) = 1.0f;
  // What the last step was decided with (its loss scale applied): a step
  // stopped midway that must be finished without its trainer (to keep the
  // session at a stop) is finished with them.
  // A Step that resumes one stopped midway applies them too.
  AdamHyperparams decided_hyperparams ABSL_GUARDED_BY(decide_mu);
  std::vector<ParamGroup> decided_groups ABSL_GUARDED_BY(decide_mu);
  bool decided_valid ABSL_GUARDED_BY(decide_mu) = false;  // decided by this offloadd

  // The last overlapped step: running, or its outcome.
  absl::Mutex step_mu;
  bool step_started ABSL_GUARDED_BY(step_mu) = false;
  bool step_running ABSL_GUARDED_BY(step_mu) = false;
  // The last step decided was overlapped (step_result is its outcome), not
  // a synchronous one since, whose caller had its outcome.
  bool last_step_overlapped ABSL_GUARDED_BY(step_mu) = false;
  absl::StatusOr<StepSummary> step_result ABSL_GUARDED_BY(step_mu);
  // Until no overlapped step of it runs.
  void AwaitNoStep() ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu) {
    step_mu.Await(absl::Condition(
        +[](Session* x) ABSL_NO_THREAD_SAFETY_ANALYSIS { return !x->step_running; }, this));
  }
  void AwaitNoStepLocking() ABSL_LOCKS_EXCLUDED(step_mu) {
    absl::MutexLock lock(&step_mu);
    AwaitNoStep();
  }

  // The last background checkpoint: running, or its outcome.
  absl::Mutex checkpoint_mu;
  bool checkpoint_started ABSL_GUARDED_BY(checkpoint_mu) = false;
  bool checkpoint_running ABSL_GUARDED_BY(checkpoint_mu) = false;
  // Until no checkpoint of it is being written.
  void AwaitNoCheckpoint() ABSL_EXCLUSIVE_LOCKS_REQUIRED(checkpoint_mu) {
    checkpoint_mu.Await(absl::Condition(
        +[](Session* x) ABSL_NO_THREAD_SAFETY_ANALYSIS { return !x->checkpoint_running; }, this));
  }
  absl::StatusOr<CheckpointSummary> checkpoint_result ABSL_GUARDED_BY(checkpoint_mu);
  std::thread checkpoint_thread ABSL_GUARDED_BY(checkpoint_mu);
  std::atomic<bool> checkpoint_cancel{false};
  // The one running is automatic (its outcome is not the trainer's).
  bool checkpoint_automatic ABSL_GUARDED_BY(checkpoint_mu) = false;

  // Automatic checkpoints: where and when the last one began; failures
  // logged. Guarded by checkpoint_mu.
  uint64_t auto_step ABSL_GUARDED_BY(checkpoint_mu) = 0;
  SteadyTime auto_time ABSL_GUARDED_BY(checkpoint_mu) = opened;
  int auto_failures_logged ABSL_GUARDED_BY(checkpoint_mu) = 0;
  int64_t auto_committed ABSL_GUARDED_BY(checkpoint_mu) = 0;
  // An automatic checkpoint of another session it restored (restore_from):
  // removed once two of its own are committed (MaybeAutoCheckpoint), or when
  // it closes after a step.
  std::string restored_auto_dir;
  // Directories removed once the session is gone (set when it closes:
  // its automatic checkpoints; guarded by the manager's mu_ until then).
  std::vector<std::string> remove_when_gone;
  // Closed (CloseById), under the manager's mu_: a step still running then
  // starts no automatic checkpoint (it would make the directory the close
  // put aside again, for nobody to remove).
  bool closed = false;
};

namespace {

// Whether `path` is `root` or lies under it, as the file system resolves
// both (symbolic links, ".."), component by component ("/a/autumn" is not
// under "/a/auto"). False where either cannot be resolved.
bool InsideDirectory(const std::string& path, const std::string& root) {
  std::error_code path_error, root_error;
  const std::filesystem::path p = std::filesystem::weakly_canonical(path, path_error);
  const std::filesystem::path r = std::filesystem::weakly_canonical(root, root_error);
  if (path_error || root_error) return false;
  return std::mismatch(r.begin(), r.end(), p.begin(), p.end()).first == r.end();
}

// Who opened the checkpoint's session, where not offloadd's own user.
std::optional<uid_t> OpenedBy(const checkpoint::Manifest& m) {
  return m.has_opened_by() ? std::optional<uid_t>(m.opened_by()) : std::nullopt;
}

// A random 31-bit number, never 0 (ids stay below 2^63 and never 0).
uint64_t NewIncarnation(Env* env) {
  uint32_t r = 0;
  if (!env->RandomBytes(&r, sizeof(r)).ok()) {
    r = static_cast<uint32_t>(absl::ToUnixNanos(absl::Now()) >> 7);
  }
  r &= 0x7fffffff;
  return r == 0 ? 1 : r;
}

}  // namespace

SessionManager::SessionManager(Env* env, PartitionStoreFactory* store, StepRunner* steps,
                               Stats* stats)
    : env_(env),
      store_(store),
      steps_(steps),
      stats_(stats),
      incarnation_(NewIncarnation(env)),
      next_session_id_(incarnation_ << 32 | 1) {}

SessionManager::~SessionManager() {
  // The request rings' threads call into this manager: they end first,
  // while every session and everything they use still stands.
  std::vector<std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, s] : sessions_) sessions.push_back(s);
  }
  for (const auto& s : sessions) {
    if (s->ring != nullptr) s->ring->Stop(ring::kDaemonStopping);
  }
  // An overlapped step or a measurement still queued or running holds a
  // call's reference to its session, whose end locks this manager: they
  // end first (the runner outlives the manager).
  steps_->Quiesce();
}

absl::StatusOr<OpenedSession> SessionManager::Open(
    absl::string_view name, const PlacementChange& placement,
    const std::optional<LossScalingOptions>& loss_scaling,
    std::optional<uint64_t> delayed_update_after, const RestoreFrom& restore_from,
    std::optional<uid_t> user) {
  return OpenAs(name, placement, loss_scaling, delayed_update_after, restore_from, nullptr, user);
}

absl::StatusOr<OpenedSession> SessionManager::OpenAs(
    absl::string_view name, const PlacementChange& placement,
    const std::optional<LossScalingOptions>& loss_scaling,
    std::optional<uint64_t> delayed_update_after, const RestoreFrom& restore_spec,
    const SessionKey* reuse, std::optional<uid_t> user) {
  if (delayed_update_after.has_value() && *delayed_update_after > (uint64_t{1} << 40)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "delayed_update_after_steps must be at most 2^40, got ", *delayed_update_after));
  }
  RETURN_IF_ERROR(CheckName(name, "session name", /*may_be_empty=*/true));
  if (loss_scaling.has_value()) RETURN_IF_ERROR(ValidateLossScaling(*loss_scaling));
  // (Either would be ignored otherwise: a session opened afresh, or from
  // another checkpoint than asked.)
  if (!restore_spec.dir.empty() && restore_spec.lost) {
    return absl::InvalidArgumentError(
        "restore_from and resume_lost exclude each other: a checkpoint named, or a lost "
        "session's found by name");
  }
  if (restore_spec.steps.has_value() && restore_spec.dir.empty() && !restore_spec.lost) {
    return absl::InvalidArgumentError(
        absl::StrCat("restore_steps ", *restore_spec.steps,
                     " names a step of a checkpoint: give restore_from, or resume_lost"));
  }
  // A job that resumes by itself restarted: its sessions' trainers are
  // gone, what they held is this one's to find.
  if (reuse == nullptr && restore_spec.keep_for_resume) TakeOverDetached(name, user);
  if (reuse == nullptr) {
    // A user at its bound is refused before anything is built (after its
    // restarted job took its own sessions over: they no longer count).
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckRoomForUserLocked(user));
  }
  std::string restore_from = restore_spec.dir;
  std::vector<uint64_t> restorable_steps;
  // The name's lost directories that go once this session is open (a final
  // choice among them: RestoreFrom::steps).
  std::vector<std::string> superseded;
  if (restore_from.empty() && restore_spec.lost) {
    ASSIGN_OR_RETURN(LostCheckpoints lost, FindLost(name, restore_spec.steps, user));
    restorable_steps = std::move(lost.steps);
    if (restore_spec.steps.has_value()) {
      superseded = std::move(lost.others);
      if (*restore_spec.steps == 0 && !lost.dir.empty()) superseded.push_back(lost.dir);
    }
    if (restore_spec.steps.value_or(1) != 0) restore_from = std::move(lost.dir);
  }
  std::unique_ptr<CheckpointRestore> restore;
  PlacementChange placed = placement;
  std::optional<LossScalingOptions> scaling = loss_scaling;
  if (!restore_from.empty()) {
    std::optional<uint64_t> steps = restore_spec.steps;
    if (restore_spec.lost && !steps.has_value()) {
      // The newest of its checkpoints that reads back (a latest one the
      // disk corrupted leaves the one kept before it).
      const std::vector<uint64_t> readable =
          checkpoint::CheckpointSteps(restore_from, checkpoint::StemFor(name));
      if (!readable.empty()) steps = readable.front();
    }
    ASSIGN_OR_RETURN(restore, CheckpointRestore::Open(restore_from, std::string(name), steps));
    if (!restore_spec.lost) {
      restorable_steps = checkpoint::CheckpointSteps(restore_from, checkpoint::StemFor(name));
    }
    const checkpoint::Manifest& m = restore->session_manifest();
    for (int k = 0; k < kDataKinds; ++k) {
      const auto kind = static_cast<DataKind>(k);
      if (!placed[kind].has_value()) placed[kind] = static_cast<int>(m.host_percent(k));
    }
    if (!delayed_update_after.has_value() && m.delayed_update_after() >= 0) {
      delayed_update_after = static_cast<uint64_t>(m.delayed_update_after());
    }
    if (auto saved = restore->loss_scaler(); saved.has_value() && !scaling.has_value()) {
      scaling = saved->first;
    }
  }
  std::unique_ptr<LossScaler> scaler;
  if (scaling.has_value()) {
    RETURN_IF_ERROR(ValidateLossScaling(*scaling));
    scaler = std::make_unique<LossScaler>(*scaling);
    if (restore != nullptr) {
      if (auto saved = restore->loss_scaler(); saved.has_value()) {
        RETURN_IF_ERROR(scaler->Restore(saved->second));
      }
    }
  }
  std::string token(kTokenBytes, '\0');
  uint64_t id;
  if (reuse != nullptr) {
    id = reuse->id;
    token = reuse->token;
    absl::MutexLock lock(&mu_);
    if (sessions_.contains(id)) {
      return absl::AlreadyExistsError(absl::StrCat("session ", id, " is open already"));
    }
    kept_ids_.insert(id);
  } else {
    RETURN_IF_ERROR(env_->RandomBytes(token.data(), token.size()));
    absl::MutexLock lock(&mu_);
    id = NewSessionId();
  }
  ASSIGN_OR_RETURN(std::unique_ptr<PartitionStore> set,
                   store_->CreateStore(id, placed, committed_mappings_));
  if (restore != nullptr) {
    const checkpoint::Manifest& m = restore->session_manifest();
    RETURN_IF_ERROR(set->RestoreSetState(m.steps(), m.delayed_update()));
  }
  const uint64_t capacity = set->arena_capacity();
  auto session = std::make_shared<Session>(id, token, std::string(name), std::move(set),
                                           std::move(scaler), std::move(restore));
  session->committed_mappings = committed_mappings_;
  session->shares = &steps_->shares();
  if (delayed_update_after.has_value()) {
    session->delayed_update_after = static_cast<int64_t>(*delayed_update_after);
  }
  if (session->restore != nullptr) {
    session->restore_from = restore_from;
    // The step restored, named even where not asked for: a session kept
    // across a restart reopens its restore at that step, whatever the
    // directory holds by then (its ranks' later checkpoints into it, one
    // of them failed: a mix no restore takes).
    session->restore_steps =
        restore_spec.steps.value_or(session->restore->session_manifest().steps());
  }
  // The request ring: the first region of the arena, served by a thread of
  // its own.
  ASSIGN_OR_RETURN(auto ring, session->partitions->MapExtra(ring::RingBytes()));
  session->ring_region = {ring.first, ring::RingBytes()};
  const ArenaRegion ring_region = session->ring_region;
  const SessionKey key{id, token};
  session->ring = RingServer::Start(
      std::move(ring.second),
      [this, key](const RingRequest& r) {
        RingCalls* calls = ring_calls_.load(std::memory_order_acquire);
        if (calls == nullptr) {
          return RingAnswer{
              absl::UnimplementedError("this offloadd serves no request rings"), {}, {}};
        }
        return calls->Serve(key, r);
      },
      absl::ZeroDuration(), ring_pollers_);
  {
    absl::MutexLock lock(&mu_);
    if (max_sessions_ > 0 && static_cast<int64_t>(sessions_.size()) >= max_sessions_) {
      // Checked where it is counted: opens at once cannot pass it. (The
      // session made meanwhile goes as `session` does, outside the lock.)
      return absl::ResourceExhaustedError(absl::StrCat(
          "offloadd serves ", sessions_.size(), " sessions, its limit (server.max_sessions ",
          max_sessions_, "): close sessions that are done, or raise the limit"));
    }
    // Checked again where it is counted (opens at once); a kept session
    // reopened (`reuse`) counts for its user again, never refused: it was
    // within the bound when it was opened.
    if (reuse == nullptr) RETURN_IF_ERROR(CheckRoomForUserLocked(user));
    session->user = user;
    session->ring->SetSpin(ring_spin_);
    session->keep_for_resume = restore_spec.keep_for_resume;
    // Restoring another session's automatic checkpoint: it goes when this
    // session closes (its own automatic ones replace it); not another
    // user's, which it may read (restore_from), never remove.
    if (!auto_checkpoint_.dir.empty() && !session->restore_from.empty() &&
        absl::StartsWith(session->restore_from, absl::StrCat(auto_checkpoint_.dir, "/")) &&
        session->restore != nullptr && OpenedBy(session->restore->session_manifest()) == user) {
      session->restored_auto_dir = session->restore_from;
    }
    sessions_[id] = std::move(session);
  }
  stats_->sessions_opened.fetch_add(1, std::memory_order_relaxed);
  for (const std::string& dir : superseded) RemoveDirectoryOfFiles(dir);
  return OpenedSession{SessionKey{id, std::move(token)}, capacity, ring_region, restore_from,
                       std::move(restorable_steps)};
}

absl::StatusOr<SessionManager::LostCheckpoints> SessionManager::FindLost(
    absl::string_view name, std::optional<uint64_t> steps, std::optional<uid_t> user) const {
  std::string root;
  absl::flat_hash_set<std::string> taken;  // open sessions' own and restored ones
  {
    absl::MutexLock lock(&mu_);
    if (auto_checkpoint_.dir.empty()) {
      return absl::FailedPreconditionError(
          "resuming a lost session needs automatic checkpoints (checkpoint.auto_*)");
    }
    root = auto_checkpoint_.dir;
    // A session of the name that just closed unfinished writes its last
    // state first.
    const absl::Time deadline = absl::Now() + kFindLostWait;
    const NameOfUser mine{std::string(name), user};
    while (finalizing_.contains(mine)) {
      if (finalized_.WaitWithDeadline(&mu_, deadline) && finalizing_.contains(mine)) {
        return absl::UnavailableError(absl::StrCat(
            "a session named '", name, "' that went unfinished is still writing its last step (",
            absl::FormatDuration(kFindLostWait), " so far): retry"));
      }
    }
    for (const auto& [id, s] : sessions_) {
      taken.insert(absl::StrCat(root, "/", id));
      if (!s->restored_auto_dir.empty()) taken.insert(s->restored_auto_dir);
    }
  }
  // Read outside the lock: files. The newest directory wins (a job that
  // started anew left older ones, whose steps may be higher).
  const std::string stem = checkpoint::StemFor(name);
  struct Found {
    std::string dir;
    int64_t created;
    std::vector<uint64_t> steps;
  };
  std::vector<Found> found;
  for (const std::string& entry : ListDirectory(root)) {
    uint64_t id = 0;
    const std::string dir = absl::StrCat(root, "/", entry);
    if (!absl::SimpleAtoi(entry, &id) || taken.contains(dir)) continue;
    absl::StatusOr<checkpoint::Manifest> m =
        checkpoint::ReadManifest(absl::StrCat(dir, "/", stem, ".manifest"));
    if (!m.ok()) {
      // Its latest unreadable: its previous one, if intact, is what the
      // job can go on from (the steps below leave the unreadable one out).
      m = checkpoint::ReadManifest(absl::StrCat(dir, "/", stem, ".previous"));
    }
    if (!m.ok() || m->session_name() != name) continue;
    // Another user's job of the same name neither restores nor removes it.
    if (OpenedBy(*m) != user) continue;
    found.push_back({dir, m->created_unix_ms(), checkpoint::CheckpointSteps(dir, stem)});
  }
  std::sort(found.begin(), found.end(),
            [](const Found& a, const Found& b) { return a.created > b.created; });
  LostCheckpoints out;
  for (const Found& f : found) {
    const bool holds = !steps.has_value() || *steps == 0 ||
                       std::find(f.steps.begin(), f.steps.end(), *steps) != f.steps.end();
    if (out.dir.empty() && holds) {
      out.dir = f.dir;
    } else {
      out.others.push_back(f.dir);
    }
    out.steps.insert(out.steps.end(), f.steps.begin(), f.steps.end());
  }
  std::sort(out.steps.begin(), out.steps.end(), std::greater<>());
  out.steps.erase(std::unique(out.steps.begin(), out.steps.end()), out.steps.end());
  if (out.dir.empty() && steps.value_or(0) > 0) {
    return absl::NotFoundError(absl::StrCat("no automatic checkpoint of step ", *steps,
                                            " of a lost session named '", name, "' in ", root));
  }
  return out;
}

uint64_t SessionManager::NewSessionId() {
  // (Past the ids of sessions an earlier offloadd kept: one may have drawn
  // the same incarnation.)
  while (sessions_.contains(next_session_id_)) ++next_session_id_;
  return next_session_id_++;
}

void SessionManager::TakeOverDetached(absl::string_view name, std::optional<uid_t> user) {
  if (name.empty()) return;  // (a name no job claims)
  // Waiting for their trainers (not one resuming now), and themselves
  // kept for a resume: a job's, not any session that shares the name; and
  // opened by the same user (a bounded user's job takes over only its own).
  const SteadyTime now = std::chrono::steady_clock::now();
  auto taken = [name, now, user](const Session& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    const bool resuming = s.resuming_since.has_value() &&
                          now - *s.resuming_since < absl::ToChronoNanoseconds(kResumeAttachWait);
    return s.name == name && s.user == user && s.keep_for_resume && s.detached_since.has_value() &&
           !resuming;
  };
  std::vector<uint64_t> ids;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, s] : sessions_) {
      if (taken(*s)) ids.push_back(id);
    }
  }
  for (uint64_t id : ids) {
    if (CloseById(id, /*only_unattached=*/true, std::nullopt, &stats_->sessions_abandoned, nullptr,
                  /*finished=*/false, taken)) {
      LogInfo(
          "session %d ('%s'), whose trainer went away, is closed: a new session of its name "
          "opens (its job restarted)",
          static_cast<int64_t>(id), std::string(name));
    }
  }
}

bool SessionManager::FinalCheckpoint(const std::shared_ptr<Session>& session, bool reopened) {
  Session* s = session.get();
  // No call of its trainer's runs on from here: its ring's calls end; gRPC
  // calls that found it before it closed end too (waited for: they may
  // still step or return gradients), then a running overlapped step and
  // checkpoint. Nothing holds a partition (one held for writing would stop
  // the checkpoint).
  if (s->ring != nullptr) s->ring->Stop();
  const absl::Time deadline = absl::Now() + kFinalCheckpointWait;
  while (session.use_count() > 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  if (session.use_count() > 1) {
    LogWarning(
        "session %d ('%s') went unfinished; a call of its trainer's still runs after %s, "
        "so its last step is not kept for a resume (its automatic checkpoints stay)",
        static_cast<int64_t>(s->id), s->name, absl::FormatDuration(kFinalCheckpointWait));
    return false;
  }
  s->AwaitNoStepLocking();
  {
    absl::MutexLock lock(&s->checkpoint_mu);
    s->AwaitNoCheckpoint();
  }
  s->partitions->DropHolds();
  // A step that stopped midway: finished, as it was decided (the
  // checkpoint below takes no half step).
  if (absl::Status finished = FinishStoppedStep(*s); !finished.ok()) {
    LogWarning(
        "session %d ('%s') went unfinished; its last step is not kept for a resume (its "
        "automatic checkpoints stay): %s",
        static_cast<int64_t>(s->id), s->name, finished.ToString());
    return false;
  }
  // Only a state that is whole: one a step made since it opened, or a kept
  // session's (a restored one still registering is its source's subset).
  if (!s->stepped.load() && !reopened) return true;
  const uint64_t steps = s->partitions->steps();
  if (steps == 0) return true;  // a new session's state: nothing to go on from
  std::string own, restored;
  {
    absl::MutexLock lock(&mu_);
    own = absl::StrCat(auto_checkpoint_.dir, "/", s->id);
    restored = s->restored_auto_dir;
  }
  const std::string stem = checkpoint::StemFor(s->name);
  for (const std::string& d : {own, restored}) {
    if (d.empty()) continue;
    const std::vector<uint64_t> held = checkpoint::CheckpointSteps(d, stem);
    if (std::find(held.begin(), held.end(), steps) != held.end()) return true;
  }
  // In a directory of its own (a lost session's, as FindLost sees them),
  // so that its automatic pair stays: a rank one step behind may need it.
  std::string dir;
  {
    absl::MutexLock lock(&mu_);
    dir = absl::StrCat(auto_checkpoint_.dir, "/", NewSessionId());
  }
  absl::Status written = [&]() -> absl::Status {
    // The gradients of the iteration its trainer did not finish go: the
    // restarted job redoes it. (The step runner's own skip: no delayed
    // update switched on, no step counted.)
    if (s->partitions->Pending().partitions > 0) {
      RETURN_IF_ERROR(steps_->Run(*s->partitions, AdamHyperparams{}, /*skip=*/true, {}).status());
    }
    return StartCheckpoint(session, dir, /*background=*/false, CheckpointFor::kFinal).status();
  }();
  if (!written.ok()) {
    stats_->auto_checkpoint_failures.fetch_add(1, std::memory_order_relaxed);
    LogWarning(
        "session %d ('%s') went unfinished; its state after step %d could not be kept for "
        "a resume (its automatic checkpoints stay): %s",
        static_cast<int64_t>(s->id), s->name, static_cast<int64_t>(steps), written.ToString());
    RemoveDirectoryOfFiles(dir);
    return false;
  }
  stats_->auto_checkpoints.fetch_add(1, std::memory_order_relaxed);
  LogInfo("session %d ('%s') went unfinished; its state after step %d is kept for a resume in %s",
          static_cast<int64_t>(s->id), s->name, static_cast<int64_t>(steps), dir);
  return true;
}

void SessionManager::NotReopened(uint64_t id, std::string why) {
  absl::MutexLock lock(&mu_);
  if (sessions_.contains(id)) return;
  kept_ids_.erase(id);
  not_reopened_[id] = std::move(why);
}

absl::Status SessionManager::FromBeforeARestart(uint64_t id) const {
  std::string dir;
  std::string not_reopened;
  {
    absl::MutexLock lock(&mu_);
    if (!auto_checkpoint_.dir.empty()) dir = absl::StrCat(auto_checkpoint_.dir, "/", id);
    if (auto it = not_reopened_.find(id); it != not_reopened_.end()) not_reopened = it->second;
  }
  // Its automatic checkpoint, if the offloadd it died with left one (read
  // outside the lock: a file).
  std::string where;
  if (!dir.empty()) {
    absl::StatusOr<std::vector<std::pair<std::string, checkpoint::Manifest>>> manifests =
        checkpoint::ReadManifests(dir);
    if (manifests.ok() && !manifests->empty()) {
      where = absl::StrCat("; its automatic checkpoint of step ", manifests->front().second.steps(),
                           " is in ", dir, ": open a session with restore_from ", dir,
                           " to go on from there");
    }
  }
  return absl::NotFoundError(
      absl::StrCat("no session ", id, " in this offloadd: it is not one of its ids ",
                   not_reopened.empty()
                       ? "(offloadd was restarted since the session was opened, or the id is wrong)"
                       : absl::StrCat("(", not_reopened, ")"),
                   where.empty() ? "; open a new session" : where));
}

absl::StatusOr<std::shared_ptr<SessionManager::Session>> SessionManager::Find(
    const SessionKey& key, bool operator_call) const {
  if (key.id >> 32 != incarnation_) {
    bool kept;
    {
      absl::MutexLock lock(&mu_);
      kept = sessions_.contains(key.id) || kept_ids_.contains(key.id);
    }
    if (!kept) return FromBeforeARestart(key.id);
  }
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(key.id);
  if (it == sessions_.end()) {
    if (kept_ids_.contains(key.id)) {
      return absl::FailedPreconditionError(
          absl::StrCat("session ", key.id,
                       " is closed (offloadd kept it across its restart, and it was "
                       "closed since: its reconnect lease ran out, or it was closed)"));
    }
    if (key.id >> 32 != incarnation_) {
      return absl::NotFoundError(absl::StrCat("no session ", key.id, " in this offloadd"));
    }
    if (key.id < next_session_id_) {
      return absl::FailedPreconditionError(absl::StrCat("session ", key.id, " is closed"));
    }
    return absl::NotFoundError(absl::StrCat("no session ", key.id, " was ever opened"));
  }
  if (!(operator_call && key.token.empty()) && !SecretsEqual(it->second->token, key.token)) {
    return absl::PermissionDeniedError(
        absl::StrCat("wrong token for session ", key.id, ": it belongs to another client"));
  }
  Session* session = it->second.get();
  session->last_call = std::chrono::steady_clock::now();
  // The call's reference stamps the session again when the call ends, so
  // that a call longer than the idle lease does not leave it expired.
  // (Built in place: a temporary's destructor would run here, under mu_.)
  struct CallRef {
    CallRef(std::shared_ptr<Session> s, const SessionManager* m)
        : session(std::move(s)), manager(m) {}
    ~CallRef() {
      {
        absl::MutexLock lock(&manager->mu_);
        session->last_call = std::chrono::steady_clock::now();
      }
      // The trainer's next call usually follows at once (the first fetch
      // after a step, the next of a layer's).
      if (session->ring != nullptr) session->ring->ExpectCall();
    }
    const std::shared_ptr<Session> session;
    const SessionManager* const manager;
  };
  auto ref = std::make_shared<CallRef>(it->second, this);
  return std::shared_ptr<Session>(ref, session);
}

absl::Status SessionManager::CheckOwnerLocked(const Session& session, uint64_t partition_id) const {
  auto it = partition_owner_.find(partition_id);
  if (it == partition_owner_.end()) {
    return absl::NotFoundError(
        absl::StrCat("partition ", partition_id, " is not registered (register it first)"));
  }
  if (it->second != session.id) {
    return absl::PermissionDeniedError(absl::StrCat(
        "partition ", partition_id, " belongs to another session, not session ", session.id));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SessionManager::Session>> SessionManager::FindOwning(
    const SessionKey& key, absl::Span<const uint64_t> ids) const {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  // The manager's lock (every session's) once for a few dozen ids, not once
  // each, nor for all of a fetch's up to kMaxFetchIds at once (a long hold
  // would be another session's wait).
  constexpr size_t kIdsALock = 64;
  for (size_t at = 0; at < ids.size(); at += kIdsALock) {
    absl::MutexLock lock(&mu_);
    for (uint64_t id : ids.subspan(at, kIdsALock)) {
      RETURN_IF_ERROR(CheckOwnerLocked(*session, id));
    }
  }
  return session;
}

absl::Status SessionManager::Close(const SessionKey& key, bool finished) {
  // (No reference kept: the teardown may wait for the last one to go.)
  RETURN_IF_ERROR(Find(key).status());
  // Another Close may have won the race since Find().
  if (!CloseById(key.id, /*only_unattached=*/false, std::nullopt, nullptr, nullptr, finished)) {
    return absl::FailedPreconditionError(absl::StrCat("session ", key.id, " is closed"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SessionManager::ClosedByOperator> SessionManager::CloseUnattached(uint64_t id) {
  RETURN_IF_ERROR(Find(SessionKey{id, ""}, /*operator_call=*/true).status());  // (see Close)
  ClosedByOperator closed;
  absl::Status refused;
  const SteadyTime now = std::chrono::steady_clock::now();
  auto left = [&](const Session& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    closed.name = s.name;
    if (!s.detached_since.has_value()) {
      // No trainer attached yet (one may be between its open and its
      // attach): the attach lease closes it if none comes.
      refused = absl::FailedPreconditionError(absl::StrFormat(
          "session %d ('%s') has no trainer attached yet; not closed: one may be attaching, "
          "and if none does it closes by itself (server.attach_lease_seconds)",
          id, s.name));
      return false;
    }
    if (s.resuming_since.has_value() &&
        now - *s.resuming_since < absl::ToChronoNanoseconds(kResumeAttachWait)) {
      refused = absl::FailedPreconditionError(
          absl::StrFormat("session %d ('%s') is being resumed by a restarted trainer; not closed "
                          "(retry in %s if it does not attach)",
                          id, s.name, absl::FormatDuration(kResumeAttachWait)));
      return false;
    }
    closed.detached_seconds =
        std::chrono::duration_cast<std::chrono::seconds>(now - *s.detached_since).count();
    return true;
  };
  if (CloseById(id, /*only_unattached=*/true, std::nullopt, nullptr, nullptr,
                /*finished=*/false, left)) {
    return closed;
  }
  if (!refused.ok()) return refused;
  absl::MutexLock lock(&mu_);
  auto found = sessions_.find(id);
  if (found == sessions_.end()) {
    return absl::FailedPreconditionError(absl::StrCat("session ", id, " is closed"));
  }
  if (found->second->attached) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session %d ('%s') has its trainer attached; not closed: a session closes with its "
        "trainer (stop the trainer; with a reconnect lease, close it by id once it is gone)",
        id, found->second->name));
  }
  return absl::UnavailableError(absl::StrFormat(
      "session %d ('%s') changed while it was being closed; retry", id, found->second->name));
}

void SessionManager::SetRingSpin(absl::Duration spin) {
  absl::MutexLock lock(&mu_);
  ring_spin_ = spin;
  for (const auto& [id, session] : sessions_) {
    if (session->ring != nullptr) session->ring->SetSpin(spin);
  }
}

bool SessionManager::CloseNeverAttached(const SessionKey& key, Teardowns* later) {
  if (!Find(key).ok()) return false;  // (no reference kept: see Close)
  return CloseById(key.id, /*only_unattached=*/true, std::nullopt, nullptr, later,
                   /*finished=*/false, [](const Session& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                     return !s.detached_since.has_value() && !s.resuming_since.has_value() &&
                            !s.reopened;
                   });
}

bool SessionManager::Abandon(uint64_t id, Teardowns* later) {
  return CloseById(id, /*only_unattached=*/false, std::nullopt, &stats_->sessions_abandoned, later,
                   /*finished=*/false);
}

bool SessionManager::CloseById(uint64_t id, bool only_unattached,
                               std::optional<SteadyTime> only_idle_since, std::atomic<int64_t>* why,
                               Teardowns* later, bool finished,
                               const std::function<bool(const Session&)>& only_if) {
  // Destroyed after mu_ is released (mu_ is a leaf; ~PartitionStore takes the
  // set's lock). Memory is released when the last in-flight call drops its
  // reference.
  std::shared_ptr<Session> doomed;
  std::string kept_dir;
  bool final = false;
  {
    absl::MutexLock lock(&mu_);
    auto found = sessions_.find(id);
    if (found == sessions_.end()) return false;
    if (only_unattached && found->second->attached) return false;
    if (only_if && !only_if(*found->second)) return false;
    if (only_idle_since.has_value() &&
        (found->second->last_call > *only_idle_since || found->second.use_count() > 1)) {
      return false;
    }
    doomed = std::move(found->second);
    doomed->closed = true;
    kept_dir = std::exchange(doomed->kept_dir, "");
    // Closed, not lost: its automatic checkpoints go once it is gone (its
    // checkpoint thread ended); unless it is kept for a resume and did not
    // finish, when they stay as a crash of offloadd would leave them.
    const bool keep = (doomed->keep_for_resume || doomed->reopen_failed) && !finished;
    if (keep && auto_checkpoint_.on() && !doomed->reopen_failed) {
      final = true;
      ++finalizing_[NameOfUser(doomed->name, doomed->user)];
    }
    if (!auto_checkpoint_.dir.empty() && !keep) {
      doomed->remove_when_gone.push_back(absl::StrCat(auto_checkpoint_.dir, "/", id));
    }
    // (Only once it stepped: one that closes before, to open again at
    // another of its steps, leaves it for that.)
    if (!doomed->restored_auto_dir.empty() && doomed->stepped.load() && !keep) {
      doomed->remove_when_gone.push_back(doomed->restored_auto_dir);
    }
    // Out of FindLost's sight at once (they go when the session is gone,
    // after its calls in flight and its checkpoint): renamed aside.
    for (std::string& dir : doomed->remove_when_gone) {
      std::string aside = absl::StrCat(dir, SessionManager::kClosingSuffix, id);
      if (rename(dir.c_str(), aside.c_str()) == 0) dir = std::move(aside);
    }
    sessions_.erase(found);
    absl::erase_if(partition_owner_, [id](const auto& entry) { return entry.second == id; });
    stats_->sessions_closed.fetch_add(1, std::memory_order_relaxed);
    if (why != nullptr) why->fetch_add(1, std::memory_order_relaxed);
  }
  // Its state is not wanted any more: a later offloadd must not reopen it.
  // Then the last reference goes (unless a call in flight holds one).
  Teardowns own;
  (later != nullptr ? *later : own)
      .Add([this, doomed = std::move(doomed), kept_dir, final]() mutable {
        bool kept_elsewhere = true;
        if (final) {
          kept_elsewhere = FinalCheckpoint(doomed, doomed->reopened);
          absl::MutexLock lock(&mu_);
          const NameOfUser named(doomed->name, doomed->user);
          if (--finalizing_[named] == 0) finalizing_.erase(named);
          finalized_.SignalAll();
        }
        // (Unless its last step is nowhere else: then that copy stays, for
        // restore_from.)
        if (!kept_dir.empty() && kept_elsewhere) RemoveDirectoryOfFiles(kept_dir);
        const bool last = doomed.use_count() == 1;
        doomed.reset();
        // What it allocated on the heap (names, maps, records) back to the
        // kernel, not left in the arenas of the threads that served it.
        if (last) RequestHeapTrim();
      });
  return true;
}

absl::StatusOr<SessionManager::Reservation> SessionManager::ReserveMappings(
    Session& session, const PartitionSpec& spec) {
  const int64_t budget = mapping_budget_.load();
  if (budget <= 0) return Reservation{};
  // What the partition may map at most, now or later (blocks homed on NVMe
  // map when they are brought in, accumulators when first needed): per
  // chunk master, m, v and an accumulator: pool allocations, each its own
  // mapping, unless they are small enough for the pool's shared slabs: a
  // slab of 4 MiB holds the four blocks of at least 16 such chunks (slots
  // of at most 64 KiB), so every 16th small chunk of the node's reserves
  // one more, for the slab its blocks may need later (a ticket per chunk,
  // given back by a registration that does not go through: Unreserve).
  // Its span is mapped during the registration: its own mapping, or a view
  // of its arena window's (SpanMaps), a new one at most. The arena counts
  // each span mapping in committed_mappings_ as it is made and until it
  // goes (CreateStore); room for one is reserved with the rest and given
  // back once the registration is over (it counted what it mapped).
  const uint64_t chunk = std::max<uint64_t>(1, store_->state_chunk_elems());
  const uint64_t chunks = spec.numel / chunk + 1;
  const bool shared = std::min(spec.numel, chunk) * sizeof(float) <= HostPool::kSlabLeaseMaxBytes;
  constexpr uint64_t kSmallPerSlab = HostPool::kSlabBytes / HostPool::kSlabLeaseMaxBytes / 4;
  Reservation r;
  uint64_t blocks = 4 * chunks;
  if (shared) {
    r.ticket = small_chunks_.fetch_add(chunks);
    r.ticket_chunks = chunks;
    // The multiples of kSmallPerSlab among the tickets taken.
    blocks = (r.ticket + chunks + kSmallPerSlab - 1) / kSmallPerSlab -
             (r.ticket + kSmallPerSlab - 1) / kSmallPerSlab;
  }
  const int64_t need = static_cast<int64_t>(std::min<uint64_t>(blocks, budget + 1));
  r.mappings = need;
  r.span_room = 1;
  // Reserved for every registered partition, and held now (which counts
  // what partitions do not: rings, staging buffers, the pool's own).
  const int64_t reserved = committed_mappings_->fetch_add(need + r.span_room) + need + r.span_room;
  const int64_t live = HostMemory::LiveMappings();
  session.mappings.fetch_add(need);
  if (reserved <= budget && live + need + r.span_room <= budget) return r;
  Unreserve(session, r);
  std::vector<std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, s] : sessions_) sessions.push_back(s);
  }
  // Outside mu_: each set's lock is a leaf.
  const Session* most = nullptr;
  uint64_t most_partitions = 0;
  for (const auto& s : sessions) {
    const uint64_t n = s->partitions->partitions();
    if (n > most_partitions) {
      most_partitions = n;
      most = s.get();
    }
  }
  const std::string who = most == nullptr
                              ? std::string("no session holds partitions")
                              : absl::StrCat("the session with the most partitions is ", most->id,
                                             " ('", most->name, "') with ", most_partitions);
  const std::string advice =
      need > budget / 2
          ? "this partition alone needs much of it: larger chunks (placement.state_chunk_bytes) "
            "or a larger budget"
          : "fewer, larger partitions (flatten small tensors into one) or another node";
  return absl::ResourceExhaustedError(
      absl::StrCat("registering '", spec.name, "' in session ", session.id,
                   " could take offloadd past its "
                   "memory-mapping budget: ",
                   live, " mappings held and ", reserved - need - r.span_room,
                   " reserved for registered partitions and their arenas, up to ",
                   need + r.span_room, " more, budget ", budget,
                   " (memory.max_mappings; the kernel's vm.max_map_count bounds them all); ", who,
                   ": ", advice));
}

void SessionManager::Unreserve(Session& session, const Reservation& r) {
  committed_mappings_->fetch_sub(r.span_room);
  // Its tickets back, unless another registration took some since: then
  // the slabs they reserved stay reserved (with the session), for the
  // small chunks whose tickets come after them.
  uint64_t taken = r.ticket + r.ticket_chunks;
  const bool given_back =
      r.ticket_chunks == 0 || small_chunks_.compare_exchange_strong(taken, r.ticket);
  if (given_back) {
    session.mappings.fetch_sub(r.mappings);
    committed_mappings_->fetch_sub(r.mappings);
  }
}

absl::StatusOr<PartitionInfo> SessionManager::Register(const SessionKey& key,
                                                       const PartitionSpec& spec) {
  return RegisterAs(key, spec, std::nullopt);
}

absl::StatusOr<PartitionInfo> SessionManager::RegisterAs(const SessionKey& key,
                                                         const PartitionSpec& spec,
                                                         std::optional<uint64_t> reuse_id) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  // A size no partition may have is the caller's mistake, said as such:
  // not the mapping budget's refusal (its chunks counted first), nor a
  // checkpoint's mismatch; and it takes no id.
  RETURN_IF_ERROR(CheckPartitionSpec(spec));
  uint64_t id;
  {
    absl::MutexLock lock(&mu_);
    if (reuse_id.has_value()) {
      id = *reuse_id;
      if (id == 0 || id > (uint64_t{1} << 62) || partition_owner_.contains(id)) {
        return absl::AlreadyExistsError(absl::StrCat("partition id ", id, " is taken"));
      }
      next_partition_id_ = std::max(next_partition_id_, id + 1);
    } else {
      id = next_partition_id_++;  // an id lost to a failed registration stays unused
    }
  }
  std::optional<RestoredState> restored;
  if (session->restore != nullptr) {
    ASSIGN_OR_RETURN(restored, session->restore->StateFor(spec));
  }
  ASSIGN_OR_RETURN(Reservation reserved, ReserveMappings(*session, spec));
  absl::StatusOr<PartitionInfo> registered =
      session->partitions->Register(id, spec, restored ? &*restored : nullptr);
  // Its span is counted as mapped now: the room goes back.
  committed_mappings_->fetch_sub(std::exchange(reserved.span_room, 0));
  if (!registered.ok()) {
    Unreserve(*session, reserved);
    return registered.status();
  }
  PartitionInfo info = *std::move(registered);
  {
    absl::MutexLock lock(&mu_);
    // Closed meanwhile: the partition goes with the session's set; recording
    // an owner would leave a stale entry.
    if (!sessions_.contains(key.id)) {
      return absl::FailedPreconditionError(absl::StrCat("session ", key.id, " is closed"));
    }
    partition_owner_[id] = key.id;
  }
  stats_->partitions_registered.fetch_add(1, std::memory_order_relaxed);
  return info;
}

absl::StatusOr<std::vector<PartitionInfo>> SessionManager::Fetch(const SessionKey& key,
                                                                 absl::Span<const uint64_t> ids,
                                                                 FetchMode mode) {
  if (ids.size() > kMaxFetchIds) {
    return absl::InvalidArgumentError(
        absl::StrCat("a fetch may name at most ", kMaxFetchIds, " partitions, got ", ids.size()));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindOwning(key, ids));
  if (ids.empty() && session->partitions->partitions() > kMaxFetchIds) {
    // One reply for all would grow without bound (names and all): named.
    return absl::InvalidArgumentError(absl::StrCat(
        "a fetch of every partition (no ids) would hold ", session->partitions->partitions(),
        "; one fetch holds at most ", kMaxFetchIds, ": name them, ", kMaxFetchIds, " a call"));
  }
  // A gradient buffer handed over and not read by a step yet comes back
  // (its gradients copied into the accumulator) before it is held again.
  // (Asked if ready: refused before that, which may wait for a measurement.)
  if (mode.grads && mode.if_ready) RETURN_IF_ERROR(session->partitions->RefuseGradsNotReady(ids));
  if (mode.grads) RETURN_IF_ERROR(steps_->Reclaim(*session->partitions, ids));
  absl::StatusOr<std::vector<PartitionInfo>> out = session->partitions->Fetch(ids, mode);
  if (absl::IsFailedPrecondition(out.status()) &&
      absl::StrContains(out.status().message(), "stopped midway")) {
    // Why it stopped, where an overlapped step (whose call returned before)
    // has it: the trainer learns it here, in its next forward, first.
    absl::MutexLock lock(&session->step_mu);
    if (session->last_step_overlapped && !session->step_running && !session->step_result.ok()) {
      const absl::Status& why = session->step_result.status();
      return absl::FailedPreconditionError(absl::StrCat(
          out.status().message(), ". The overlapped step stopped on: ", why.ToString(),
          absl::IsResourceExhausted(why)
              ? " (with overlap_step its state chunks need room in the pool beside the next "
                "iteration's parameters)"
              : ""));
    }
  }
  if (!out.ok()) return out.status();
  stats_->fetches.fetch_add(static_cast<int64_t>(out->size()), std::memory_order_relaxed);
  return out;
}

absl::Status SessionManager::Release(const SessionKey& key, absl::Span<const uint64_t> ids) {
  if (ids.size() > kMaxFetchIds) {
    return absl::InvalidArgumentError(
        absl::StrCat("a release may name at most ", kMaxFetchIds, " partitions, got ", ids.size()));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindOwning(key, ids));
  return session->partitions->Release(ids);
}

absl::Status SessionManager::ReturnGradients(const SessionKey& key, uint64_t partition_id,
                                             uint64_t numel, DType grad_dtype, bool hand_over,
                                             const std::optional<GradStats>& stats) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                   FindOwning(key, absl::MakeConstSpan(&partition_id, 1)));
  return steps_->Accumulate(*session->partitions, partition_id, numel, grad_dtype, hand_over,
                            session, stats);
}

absl::Status SessionManager::ReturnGradients(const SessionKey& key,
                                             absl::Span<const GradientReturn> items, bool release,
                                             bool hand_over) {
  if (items.size() > kMaxFetchIds) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a gradient return may name at most ", kMaxFetchIds, " partitions, got ", items.size()));
  }
  // The dtypes and the trainer's statistics are checked for all before any
  // is returned: a refusal returns nothing.
  for (const GradientReturn& item : items) {
    if (!item.grad_dtype.ok()) {
      if (items.size() == 1) return item.grad_dtype.status();
      return absl::Status(
          item.grad_dtype.status().code(),
          absl::StrCat("partition ", item.partition_id, ": ", item.grad_dtype.status().message(),
                       "; none of the ", items.size(), " partitions' gradients were returned"));
    }
    if (!item.stats.has_value()) continue;
    if (absl::Status s = CheckGivenGradStats(item.partition_id, item.numel, hand_over, *item.stats);
        !s.ok()) {
      if (items.size() == 1) return s;
      return absl::Status(s.code(), absl::StrCat(s.message(), "; none of the ", items.size(),
                                                 " partitions' gradients were returned"));
    }
  }
  std::vector<uint64_t> ids;
  ids.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const GradientReturn& item = items[i];
    absl::Status s = item.grad_dtype.status();
    if (s.ok()) {
      s = ReturnGradients(key, item.partition_id, item.numel, *item.grad_dtype, hand_over,
                          item.stats);
    }
    if (!s.ok()) {
      if (items.size() == 1) return s;
      return absl::Status(s.code(), absl::StrCat("returned ", i, " of ", items.size(),
                                                 " partitions' gradients, then: ", s.message()));
    }
    ids.push_back(item.partition_id);
  }
  if (release) return Release(key, ids);
  return absl::OkStatus();
}

absl::StatusOr<PendingGradients> SessionManager::Pending(const SessionKey& key) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  PendingGradients out = session->partitions->Pending();
  if (session->scaler != nullptr) {
    // The trainer's global clipping works on the unscaled gradient.
    out.loss_scale = session->scaler->scale();
    out.stats.sq_norm /= out.loss_scale * out.loss_scale;
  }
  AutoCheckpointOptions options;
  {
    absl::MutexLock lock(&mu_);
    options = auto_checkpoint_;
  }
  if (options.on()) {
    // Due at the step about to be taken.
    const uint64_t next = session->partitions->steps() + 1;
    absl::MutexLock lock(&session->checkpoint_mu);
    out.auto_checkpoint_due =
        AutoCheckpointDue(options, *session, next, std::chrono::steady_clock::now());
  }
  return out;
}

absl::StatusOr<StepSummary> SessionManager::Step(const SessionKey& key, const AdamHyperparams& h,
                                                 const StepControl& control) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  // After a synchronous step: its boundary, nothing pending. An overlapped
  // one is still running when its call returns, and a checkpoint would wait
  // for all of it: the automatic one is taken at the next Step instead,
  // when the previous update is (nearly) done (this iteration's gradients
  // then go into the checkpoint too, handed-over ones copied out first).
  // The previous overlapped step counted first: its partitions leave it
  // (and the trainer's next gradients come) before it ends, and whether a
  // checkpoint is due, or the delayed update's warm-up over, goes by the
  // steps ended.
  session->AwaitNoStepLocking();
  if (control.overlap) MaybeAutoCheckpoint(session, control.auto_checkpoint);
  absl::StatusOr<StepSummary> summary = DecideStep(session, h, control);
  if (summary.ok() && !control.overlap) MaybeAutoCheckpoint(session, control.auto_checkpoint);
  return summary;
}

absl::StatusOr<StepSummary> SessionManager::DecideStep(const std::shared_ptr<Session>& session,
                                                       const AdamHyperparams& h,
                                                       const StepControl& control) {
  // Held from before the delayed update's scheduled switch-on: a checkpoint
  // (which reads the schedule and the store's delayed flag under it) sees
  // the switch pending or done, never the schedule cleared and the flag
  // not yet set (it recorded neither, and the restored job never switched).
  absl::MutexLock decided(&session->decide_mu);
  int64_t after = session->delayed_update_after.load();
  if (after >= 0 && session->partitions->steps() >= static_cast<uint64_t>(after) &&
      // Once, and not over a SetDelayedUpdate that cancelled it meanwhile.
      session->delayed_update_after.compare_exchange_strong(after, -1)) {
    absl::Status on = session->partitions->SetDelayedUpdate(true);
    if (!on.ok()) {
      int64_t cancelled = -1;  // try again at the next step, unless cancelled since
      session->delayed_update_after.compare_exchange_strong(cancelled, after);
      return on;
    }
  }
  LossScaler* scaler = session->scaler.get();
  // Whether this Step finishes one that stopped midway, which the scaler
  // counted already (it was overlapped); decided before it runs (a step
  // that fails here is not counted).
  const bool resuming = session->partitions->stopped_midway();
  const bool counted = resuming && session->scaler_counted_step;
  session->scaler_counted_step = counted;
  // With loss scaling: an overflow anywhere (the trainer's global flag, or
  // non-finite values here) skips the step and lowers the scale; otherwise
  // the gradients are unscaled in the update's pass.
  // A step resumed applies what it began with: its hyperparameters, groups
  // and gradient scale (a clipping coefficient the trainer computes again
  // from the gradients still pending, which the finished partitions no
  // longer count, or an lr a scheduler moved meanwhile, would make the
  // partitions of one step differ), and is unscaled as it began (an
  // overlapped one's start may have changed the scale since).
  const bool as_decided = resuming && session->decided_valid;
  AdamHyperparams applied = as_decided ? session->decided_hyperparams : h;
  std::vector<ParamGroup> groups = as_decided ? session->decided_groups : control.groups;
  if (scaler != nullptr && !as_decided) {
    if (!resuming) session->scale_of_step = scaler->scale();
    applied.grad_scale = h.grad_scale / session->scale_of_step;
  }
  // An overflow on any rank skips everywhere (the ranks must stay alike).
  // With loss scaling, one here too, whatever optimizer.check_finite says
  // (which decides for sessions without: a non-finite gradient applied
  // would make the master weights NaN, and the scaler count a clean step).
  // A Step that finishes one stopped midway applies what that one was
  // decided with (its gradients were finite, or it would have been
  // skipped): an overflow told now, or the next iteration's gradients
  // returned meanwhile, are not its. (An explicit skip is refused: a
  // half-applied step cannot be.)
  bool overflow = control.overflow && !resuming;
  if (scaler != nullptr && !overflow && !control.skip && !resuming && !steps_->check_finite()) {
    overflow = session->partitions->Pending().stats.nonfinite != 0;
  }
  const bool skip = control.skip || overflow;
  session->decided_hyperparams = applied;
  session->decided_groups = groups;
  session->decided_valid = true;
  StepSummary summary;
  if (control.overlap) {
    Session* s = session.get();
    {
      absl::MutexLock lock(&s->step_mu);
      // One at a time: the previous overlapped step's outcome is kept until
      // this one starts (BeginStep waits for it to end anyway).
      s->AwaitNoStep();
      s->step_running = true;
      s->step_started = true;
      s->last_step_overlapped = true;
    }
    absl::StatusOr<StepSummary> started =
        steps_->Start(*session->partitions, session, applied, skip, groups,
                      [s](absl::StatusOr<StepSummary> result) {
                        if (result.ok()) s->CountStep(*result);
                        absl::MutexLock lock(&s->step_mu);
                        s->step_result = std::move(result);
                        s->step_running = false;
                      });
    if (!started.ok()) {
      absl::MutexLock lock(&s->step_mu);
      s->step_running = false;
      s->step_result = started.status();
      return started.status();
    }
    summary = *started;
    CountDecidedSkip(control.skip, overflow);
  } else {
    {
      absl::MutexLock lock(&session->step_mu);
      session->last_step_overlapped = false;
    }
    ASSIGN_OR_RETURN(summary, steps_->Run(*session->partitions, applied, skip, groups));
    session->CountStep(summary);
    CountDecidedSkip(control.skip, overflow);
  }
  summary.delayed_update = session->partitions->delayed_update();
  if (scaler == nullptr) return summary;
  if ((!control.skip || overflow) && !counted) {
    scaler->Update(/*overflow=*/overflow || summary.nonfinite != 0);
    session->scaler_counted_step = control.overlap;  // (kept, should it stop)
  }
  summary.loss_scale = scaler->scale();
  return summary;
}

void SessionManager::CountDecidedSkip(bool skip, bool overflow) {
  if (overflow) {
    stats_->steps_skipped.fetch_add(1, std::memory_order_relaxed);  // (non-finite somewhere)
  } else if (skip) {
    stats_->steps_dropped.fetch_add(1, std::memory_order_relaxed);
  }
}

absl::Status SessionManager::SetPlacement(const SessionKey& key, const PlacementChange& change) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  return session->partitions->SetPlacement(change);
}

absl::StatusOr<GpuTierSettings> SessionManager::ReportGpuTier(const SessionKey& key,
                                                              const GpuTierReport& report) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  absl::MutexLock lock(&mu_);
  // What it did since its previous report into the node's totals (all of
  // it if its totals went down: a new tier on the same session). The
  // trainers' own counts: a total stops at INT64_MAX, so that no report
  // (each counter at most INT64_MAX) turns the node's negative.
  const GpuTierReport before = session->gpu.value_or(GpuTierReport{});
  auto add = [](std::atomic<int64_t>& total, uint64_t now, uint64_t was) {
    const uint64_t delta = std::min<uint64_t>(now >= was ? now - was : now, INT64_MAX);
    const int64_t was_total = total.load(std::memory_order_relaxed);  // (writers hold mu_)
    total.store(delta > static_cast<uint64_t>(INT64_MAX - was_total)
                    ? INT64_MAX
                    : was_total + static_cast<int64_t>(delta),
                std::memory_order_relaxed);
  };
  add(stats_->gpu_h2d_bytes, report.h2d_bytes, before.h2d_bytes);
  add(stats_->gpu_h2d_staged_bytes, report.h2d_staged_bytes, before.h2d_staged_bytes);
  add(stats_->gpu_d2h_bytes, report.d2h_bytes, before.d2h_bytes);
  add(stats_->gpu_tensor_uses, report.tensor_uses, before.tensor_uses);
  add(stats_->gpu_resident_hits, report.resident_hits, before.resident_hits);
  add(stats_->gpu_prefetch_hits, report.prefetch_hits, before.prefetch_hits);
  add(stats_->gpu_host_waits, report.host_waits, before.host_waits);
  add(stats_->gpu_evictions, report.evictions, before.evictions);
  session->gpu = report;
  return gpu_settings_;
}

void SessionManager::SetGpuTierSettings(const GpuTierSettings& settings) {
  absl::MutexLock lock(&mu_);
  gpu_settings_ = settings;
}

absl::Status SessionManager::CheckShareWeight(int64_t weight) {
  if (weight < 1 || weight > kMaxShareWeight) {
    return absl::InvalidArgumentError(
        absl::StrCat("share weight ", weight, " is not in [1, ", kMaxShareWeight, "]"));
  }
  return absl::OkStatus();
}

absl::Status SessionManager::SetShare(const SessionKey& key, int64_t weight) {
  RETURN_IF_ERROR(CheckShareWeight(weight));
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key, /*operator_call=*/true));
  session->partitions->SetShareWeight(weight);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> SessionManager::ReadMoments(const SessionKey& key, uint64_t partition_id,
                                                     uint64_t begin, uint64_t count, float* exp_avg,
                                                     float* exp_avg_sq, float* master) {
  const uint64_t ids[] = {partition_id};
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindOwning(key, ids));
  return session->partitions->ReadMoments(partition_id, begin, count, exp_avg, exp_avg_sq, master);
}

absl::Status SessionManager::WriteMoments(const SessionKey& key, uint64_t partition_id,
                                          uint64_t step, uint64_t begin, uint64_t count,
                                          const float* exp_avg, const float* exp_avg_sq) {
  const uint64_t ids[] = {partition_id};
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindOwning(key, ids));
  return session->partitions->WriteMoments(partition_id, step, begin, count, exp_avg, exp_avg_sq);
}

absl::Status SessionManager::SetDelayedUpdate(const SessionKey& key, bool on) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  // Under decide_mu, as DecideStep's scheduled switch: a checkpoint reads
  // the schedule and the store's flag under it, and sees both as they were
  // or both as they are (not the schedule cancelled and the switch to come).
  absl::MutexLock decided(&session->decide_mu);
  session->delayed_update_after = -1;
  return session->partitions->SetDelayedUpdate(on);
}

absl::StatusOr<StepSummary> SessionManager::WaitStep(const SessionKey& key) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  Session* s = session.get();
  absl::MutexLock lock(&s->step_mu);
  if (!s->step_started) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", key.id, " has started no overlapped step"));
  }
  s->AwaitNoStep();
  return s->step_result;
}

absl::StatusOr<SessionManager::CheckpointOutcome> SessionManager::Checkpoint(const SessionKey& key,
                                                                             const std::string& dir,
                                                                             bool background) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key, /*operator_call=*/true));
  // Refused before anything is created; checked again on the directory
  // opened (StartCheckpoint), which its path may no longer name.
  RETURN_IF_ERROR(CheckOutsideManaged(dir));
  // The operator's (offloadctl checkpoint ID DIR: a directory chosen by
  // hand); a trainer's ranks, which share theirs, would each read every
  // other's manifest.
  if (key.token.empty()) RETURN_IF_ERROR(CheckNoOtherJobsCheckpoint(*session, dir));
  return StartCheckpoint(session, dir, background, CheckpointFor::kTrainer);
}

absl::Status SessionManager::CheckNoOtherJobsCheckpoint(const Session& session,
                                                        const std::string& dir) const {
  if (!IsDirectory(dir)) return absl::OkStatus();
  absl::StatusOr<std::vector<std::pair<std::string, checkpoint::Manifest>>> manifests =
      checkpoint::ReadManifests(dir);
  if (!manifests.ok()) return absl::OkStatus();  // (none, or unreadable: a restore says so)
  // A job's sessions ("job/rank0", "job/rank1") share a directory: their
  // slices are disjoint, and are not compared (each rank would read every
  // other's manifest).
  auto job_of = [](absl::string_view name) { return name.substr(0, name.rfind('/')); };
  absl::flat_hash_map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> mine;
  for (const PartitionStore::TensorSlice& t : session.partitions->TensorSlices()) {
    mine[t.tensor].push_back({t.offset, t.offset + t.numel});
  }
  for (const auto& [path, m] : *manifests) {
    if (m.session_name() == session.name || job_of(m.session_name()) == job_of(session.name)) {
      continue;  // (its own, replaced; or its job's)
    }
    for (const checkpoint::v1::Partition& p : m.partitions()) {
      auto it = mine.find(p.tensor());
      if (it == mine.end()) continue;
      for (const auto& [begin, end] : it->second) {
        if (p.offset() < end && begin < p.offset() + p.numel()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "checkpoint directory ", dir, " holds session '", m.session_name(),
              "''s checkpoint, with elements of tensor '", p.tensor(),
              "' that this session holds too: a directory holds one job's checkpoint (a "
              "restore would find the tensor twice); choose another directory"));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status SessionManager::CheckOutsideManaged(const std::string& dir) const {
  std::vector<std::pair<std::string, const char*>> roots;
  {
    absl::MutexLock lock(&mu_);
    roots = {{auto_checkpoint_.dir, "the automatic checkpoints'"},
             {kept_dir_, "the kept sessions'"}};
  }
  for (const auto& [root, whose] : roots) {
    if (!root.empty() && InsideDirectory(dir, root)) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint directory ", dir, " is inside ",
                                                     whose, " (", root,
                                                     "), which offloadd manages: choose another"));
    }
  }
  return absl::OkStatus();
}

void SessionManager::SetAutoCheckpoint(const AutoCheckpointOptions& options) {
  absl::MutexLock lock(&mu_);
  auto_checkpoint_ = options;
}

void SessionManager::SetKeptDirectory(std::string dir) {
  absl::MutexLock lock(&mu_);
  kept_dir_ = std::move(dir);
}

bool SessionManager::RestoresAutomaticCheckpoint(const std::string& dir) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, s] : sessions_) {
    if (s->restored_auto_dir == dir) return true;
  }
  return false;
}

std::string SessionManager::AutoCheckpointDir(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  return auto_checkpoint_.on() ? absl::StrCat(auto_checkpoint_.dir, "/", id) : "";
}

bool SessionManager::AutoCheckpointDue(const AutoCheckpointOptions& options, const Session& s,
                                       uint64_t steps, SteadyTime now)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {  // (s.checkpoint_mu held by the caller)
  // Aligned to multiples of every_steps, so that one skipped (the last
  // still being written) does not shift the ones after it.
  const bool by_steps =
      options.every_steps > 0 && steps / options.every_steps > s.auto_step / options.every_steps;
  const bool by_time = options.interval > absl::ZeroDuration() &&
                       now - s.auto_time >= absl::ToChronoNanoseconds(options.interval);
  return by_steps || by_time;
}

void SessionManager::MaybeAutoCheckpoint(const std::shared_ptr<Session>& session,
                                         std::optional<bool> decided) {
  Session* s = session.get();
  AutoCheckpointOptions options;
  {
    absl::MutexLock lock(&mu_);
    if (s->closed) return;  // (closed during its step)
    options = auto_checkpoint_;
  }
  if (!options.on()) return;
  // Once two of its own are committed (a step a rank one checkpoint behind
  // can meet), the lost session's it restored is not needed any more.
  bool superseded;
  {
    absl::MutexLock lock(&s->checkpoint_mu);
    superseded = s->auto_committed >= 2;
  }
  if (superseded) {
    std::string restored;
    {
      absl::MutexLock lock(&mu_);
      restored = std::exchange(s->restored_auto_dir, "");
    }
    if (!restored.empty()) RemoveDirectoryOfFiles(restored);
  }
  if (decided.has_value() && !*decided) return;  // the job's ranks agreed: not at this step
  const uint64_t steps = s->partitions->steps();
  const SteadyTime now = std::chrono::steady_clock::now();
  {
    absl::MutexLock lock(&s->checkpoint_mu);
    if (decided.has_value()) {
      // The job's ranks agreed on this step: each takes it, after one of
      // its own still being written, so that all of theirs are of one step
      // (each rank's clock alone put them steps apart, and a crash then
      // left no step every rank held).
      s->checkpoint_mu.Await(absl::Condition(
          +[](Session* x) ABSL_NO_THREAD_SAFETY_ANALYSIS { return !x->checkpoint_running; }, s));
    } else {
      if (s->checkpoint_running) return;  // the trainer's, or the last one still
      if (!AutoCheckpointDue(options, *s, steps, now)) return;
    }
    s->auto_step = steps;
    s->auto_time = now;
  }
  const std::string dir = absl::StrCat(options.dir, "/", s->id);
  absl::Status started =
      StartCheckpoint(session, dir, /*background=*/true, CheckpointFor::kAutomatic).status();
  if (started.ok()) return;
  {
    absl::MutexLock lock(&mu_);
    if (s->closed) return;  // closed meanwhile: not a failure
  }
  stats_->auto_checkpoint_failures.fetch_add(1, std::memory_order_relaxed);
  absl::MutexLock lock(&s->checkpoint_mu);
  if (s->auto_failures_logged++ < 3) {
    LogWarning("session %d ('%s'): an automatic checkpoint into %s did not start: %s",
               static_cast<int64_t>(s->id), s->name, dir, started.ToString());
  }
}

absl::StatusOr<SessionManager::CheckpointOutcome> SessionManager::CheckpointForKeeping(
    uint64_t id, const std::string& dir, PoolFile* file, const std::string& memory_file) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                   Find(SessionKey{id, ""}, /*operator_call=*/true));
  return StartCheckpoint(session, dir, /*background=*/false, CheckpointFor::kKeeping, file,
                         memory_file);
}

absl::StatusOr<SessionManager::CheckpointOutcome> SessionManager::StartCheckpoint(
    const std::shared_ptr<Session>& session, const std::string& dir, bool background,
    CheckpointFor whose, PoolFile* by_reference, const std::string& memory_file) {
  Session* s = session.get();
  const bool automatic = whose == CheckpointFor::kAutomatic;
  const uint64_t id = s->id;
  // An automatic one being written finishes first: the trainer's is not
  // refused for it.
  auto await_automatic = [s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->checkpoint_mu) {
    s->checkpoint_mu.Await(absl::Condition(
        +[](Session* x) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return !x->checkpoint_running || !x->checkpoint_automatic;
        },
        s));
  };
  // Gradients handed over are checkpointed from the accumulator.
  RETURN_IF_ERROR(steps_->Reclaim(*s->partitions, {}));
  SessionCheckpointState state;
  state.name = s->name;
  state.scaler = s->scaler.get();
  // Each keeps the one it replaces: a job's ranks commit one by one, and a
  // crash (or a full disk) between their commits must leave every rank's
  // previous checkpoint there, the step all of them hold. (Not a stop's,
  // whose directory is its own.)
  state.keep_previous = whose != CheckpointFor::kKeeping;
  state.user = s->user;
  // Written while a call (or a stop) waits: as fast as the disk allows. In
  // the background, beside training: one write at a time.
  state.capture_threads = background ? 1 : capture_threads_.load();
  state.by_reference = by_reference;
  state.memory_file = memory_file;
  // The image and the scaler at the same step boundary.
  auto begin = [&]() -> absl::StatusOr<std::unique_ptr<CheckpointWriter>> {
    absl::MutexLock decided(&s->decide_mu);
    state.delayed_update_after = s->delayed_update_after.load();
    absl::StatusOr<checkpoint::Directory> prepared = checkpoint::Directory::Prepare(dir);
    if (prepared.ok() && whose == CheckpointFor::kAutomatic) {
      // Written only while the session is open, as CloseById sees it (it
      // puts the automatic checkpoints' directory aside under mu_): one
      // made again by a close meanwhile goes again (empty: rmdir).
      absl::MutexLock lock(&mu_);
      if (s->closed) {
        rmdir(dir.c_str());
        return absl::FailedPreconditionError(
            absl::StrCat("session ", s->id, " closed: no automatic checkpoint"));
      }
    }
    ASSIGN_OR_RETURN(checkpoint::Directory opened, std::move(prepared));
    if (whose == CheckpointFor::kTrainer) {
      // Where it is now: its path may have been made a link since
      // Checkpoint looked (by whoever may write one of its parents).
      ASSIGN_OR_RETURN(const std::string location, opened.Location());
      RETURN_IF_ERROR(CheckOutsideManaged(location));
    }
    return CheckpointWriter::Begin(s->partitions.get(), state, std::move(opened));
  };
  if (!background) {
    {
      // Marked running (not automatic) while it is written, so that no
      // automatic one starts beside it.
      absl::MutexLock lock(&s->checkpoint_mu);
      if (!automatic) await_automatic();
      if (s->checkpoint_running) {
        return absl::FailedPreconditionError(
            absl::StrCat("a checkpoint of session ", id, " is being written already"));
      }
      s->checkpoint_running = true;
      s->checkpoint_automatic = false;
    }
    absl::StatusOr<CheckpointSummary> summary = [&]() -> absl::StatusOr<CheckpointSummary> {
      ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer, begin());
      return writer->Finish(&s->checkpoint_cancel);
    }();
    {
      absl::MutexLock lock(&s->checkpoint_mu);
      s->checkpoint_running = false;
    }
    if (!summary.ok()) return summary.status();
    stats_->checkpoints.fetch_add(1, std::memory_order_relaxed);
    return CheckpointOutcome{*summary, false};
  }
  absl::MutexLock lock(&s->checkpoint_mu);
  if (!automatic) await_automatic();
  if (s->checkpoint_running) {
    return absl::FailedPreconditionError(
        absl::StrCat("a checkpoint of session ", id, " is being written already"));
  }
  // The previous one's thread has set its outcome: it is about to end.
  if (s->checkpoint_thread.joinable()) s->checkpoint_thread.join();
  ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer, begin());
  CheckpointOutcome out;
  out.running = true;
  out.summary = writer->begun();  // sizes and pause; the path once written
  s->checkpoint_running = true;
  s->checkpoint_automatic = automatic;
  if (!automatic) {
    s->checkpoint_started = true;
    s->checkpoint_result = absl::UnavailableError("running");
  }
  // The thread holds no reference to the session: ~Session cancels and
  // joins it before the set goes.
  Stats* stats = stats_;
  auto writer_owner = std::make_shared<std::unique_ptr<CheckpointWriter>>(std::move(writer));
  absl::StatusOr<std::thread> thread = env_->StartThread([s, stats, automatic, writer_owner]() {
    std::unique_ptr<CheckpointWriter> w = std::move(*writer_owner);
    absl::StatusOr<CheckpointSummary> result = w->Finish(&s->checkpoint_cancel);
    w.reset();
    if (result.ok()) stats->checkpoints.fetch_add(1, std::memory_order_relaxed);
    absl::MutexLock lock(&s->checkpoint_mu);
    s->checkpoint_running = false;
    if (!automatic) {
      s->checkpoint_result = std::move(result);
      return;
    }
    if (result.ok()) {
      stats->auto_checkpoints.fetch_add(1, std::memory_order_relaxed);
      ++s->auto_committed;
    } else if (!s->checkpoint_cancel) {
      stats->auto_checkpoint_failures.fetch_add(1, std::memory_order_relaxed);
      if (s->auto_failures_logged++ < 3) {
        LogWarning("session %d ('%s'): an automatic checkpoint failed (the previous one stays): %s",
                   static_cast<int64_t>(s->id), s->name, result.status().ToString());
      }
    }
  });
  if (!thread.ok()) {
    // (A limit on threads reached.) Nothing is written: the writer ends
    // the image and removes its data file; the previous checkpoint stays.
    writer_owner->reset();
    s->checkpoint_running = false;
    s->checkpoint_automatic = false;
    const absl::Status failed(
        thread.status().code(),
        absl::StrCat("checkpoint of session ", id, " not started: ", thread.status().message()));
    if (!automatic) s->checkpoint_result = failed;
    return failed;
  }
  s->checkpoint_thread = *std::move(thread);
  return out;
}

absl::StatusOr<SessionManager::CheckpointOutcome> SessionManager::WaitCheckpoint(
    const SessionKey& key) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key, /*operator_call=*/true));
  Session* s = session.get();
  absl::MutexLock lock(&s->checkpoint_mu);
  if (!s->checkpoint_started) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", key.id, " has started no background checkpoint"));
  }
  s->AwaitNoCheckpoint();
  ASSIGN_OR_RETURN(CheckpointSummary summary, s->checkpoint_result);
  return CheckpointOutcome{summary, false};
}

absl::StatusOr<UniqueFd> SessionManager::DupArenaFd(const SessionKey& key) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  UniqueFd fd(fcntl(session->partitions->arena_fd(), F_DUPFD_CLOEXEC, 0));
  if (!fd.valid()) return PosixError("duplicating arena descriptor", errno);
  stats_->arena_attaches.fetch_add(1, std::memory_order_relaxed);
  return fd;
}

bool SessionManager::MarkAttached(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto found = sessions_.find(id);
  if (found == sessions_.end()) return false;
  found->second->attached = true;
  found->second->detached_since.reset();
  found->second->resuming_since.reset();
  return true;
}

bool SessionManager::Detach(uint64_t id) {
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    auto found = sessions_.find(id);
    if (found == sessions_.end()) return false;
    session = found->second;
    session->attached = false;
    session->detached_since = std::chrono::steady_clock::now();
    session->resuming_since.reset();
  }
  // Outside mu_: what the dead trainer held goes (fp32 initial values it
  // may have been writing stay uncommitted), and its request ring is freed
  // of whatever call it died in, once that call ended (the ring's own
  // thread resets it, and drops what that call held).
  session->partitions->DropHolds();
  if (session->ring != nullptr) {
    PartitionStore* set = session->partitions.get();
    session->ring->Reset([set] { set->DropHolds(); });
  }
  return true;
}

absl::StatusOr<OpenedSession> SessionManager::Resume(const SessionKey& key) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  {
    // Being resumed from here on (an operator's close or a takeover by
    // name leaves it to this trainer, for kResumeAttachWait at most).
    absl::MutexLock lock(&mu_);
    if (session->detached_since.has_value()) {
      session->resuming_since = std::chrono::steady_clock::now();
    }
  }
  // The previous trainer's last call through the ring must have ended (and
  // its holds gone) before this trainer takes any.
  if (session->ring != nullptr && !session->ring->WaitForReset(absl::Seconds(5))) {
    return absl::UnavailableError(absl::StrCat(
        "session ", key.id, ": the previous trainer's last call is still running; retry"));
  }
  // What a call of the previous trainer that ended after it went away
  // (over gRPC) held goes too.
  session->partitions->DropHolds();
  std::string kept_dir;
  {
    absl::MutexLock lock(&mu_);
    // Closed meanwhile (its lease ran out, a new session of its name took
    // it over, a Close): no resume of it can attach.
    auto found = sessions_.find(key.id);
    if (found == sessions_.end() || found->second != session) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session ", key.id, " was closed while it was being resumed; open a new one"));
    }
    // The lease starts again: the trainer attaches next (no takeover
    // meanwhile).
    if (session->detached_since.has_value()) {
      session->detached_since = std::chrono::steady_clock::now();
      session->resuming_since = std::chrono::steady_clock::now();
    }
    kept_dir = std::exchange(session->kept_dir, "");
  }
  // Resumed, it changes from here on: what was kept is stale.
  if (!kept_dir.empty()) RemoveDirectoryOfFiles(kept_dir);
  return OpenedSession{key, session->partitions->arena_capacity(), session->ring_region, "", {}};
}

std::vector<SessionManager::Expired> SessionManager::CloseExpired(SteadyTime now,
                                                                  absl::Duration attach_lease,
                                                                  absl::Duration idle_lease,
                                                                  absl::Duration reconnect_lease,
                                                                  Teardowns* later) {
  const auto attach = absl::ToChronoNanoseconds(attach_lease);
  const auto idle = absl::ToChronoNanoseconds(idle_lease);
  const auto reconnect = absl::ToChronoNanoseconds(reconnect_lease);
  // Whether a detached or never attached session's lease ran out, as of
  // `now` (checked again when it is closed: a Resume in between starts its
  // lease again).
  // (Called under mu_.)
  auto unclaimed = [&](const Session& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return s.detached_since.has_value() ? now - *s.detached_since > reconnect
                                        : !s.attached && now - s.opened > attach;
  };
  std::vector<Expired> expired;
  {
    absl::MutexLock lock(&mu_);
    if (leases_paused_) return {};
    for (const auto& [id, s] : sessions_) {
      if (s->detached_since.has_value()) {
        if (unclaimed(*s)) expired.push_back({id, s->name, Expired::kNotResumed});
      } else if (!s->attached && now - s->opened > attach) {
        expired.push_back({id, s->name, Expired::kNeverAttached});
      } else if (idle_lease > absl::ZeroDuration() && now - s->last_call > idle &&
                 s.use_count() == 1) {  // no call in flight either
        expired.push_back({id, s->name, Expired::kIdle});
      }
    }
  }
  std::vector<Expired> closed;
  for (Expired& e : expired) {
    // Unless, checked under mu_ again, a trainer attached since (an
    // unattached or detached one) or a call came since (an idle one).
    std::atomic<int64_t>* counter =
        e.why == Expired::kNotResumed ? &stats_->sessions_abandoned : &stats_->sessions_expired;
    const bool closed_it =
        e.why == Expired::kIdle
            ? CloseById(e.id, /*only_unattached=*/false, /*only_idle_since=*/now - idle, counter,
                        later, /*finished=*/false)
            : CloseById(e.id, /*only_unattached=*/true, std::nullopt, counter, later,
                        /*finished=*/false, unclaimed);
    if (closed_it) closed.push_back(std::move(e));
  }
  return closed;
}

void SessionManager::PauseLeases() {
  absl::MutexLock lock(&mu_);
  leases_paused_ = true;
}

void SessionManager::SetMaxSessions(int64_t max) {
  absl::MutexLock lock(&mu_);
  max_sessions_ = max;
}

void SessionManager::SetMaxSessionsPerUser(int64_t max) {
  absl::MutexLock lock(&mu_);
  max_sessions_per_user_ = max;
}

absl::Status SessionManager::CheckRoomForUserLocked(std::optional<uid_t> user) const {
  if (!user.has_value() || max_sessions_per_user_ <= 0) return absl::OkStatus();
  int64_t held = 0;
  for (const auto& [id, session] : sessions_) held += session->user == user ? 1 : 0;
  if (held < max_sessions_per_user_) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "uid ", *user, " has ", held,
      " sessions open, attached or not (server.max_sessions_per_user ", max_sessions_per_user_,
      "): close sessions that are done (one never attached goes after the attach lease), or ask "
      "offloadd's operator to raise the bound"));
}

std::vector<SessionSummary> SessionManager::Sessions() const {
  std::vector<std::shared_ptr<Session>> sessions;
  std::vector<std::optional<GpuTierReport>> gpu;
  std::vector<int64_t> detached;
  {
    absl::MutexLock lock(&mu_);
    const auto now = std::chrono::steady_clock::now();
    for (const auto& [id, s] : sessions_) {
      sessions.push_back(s);
      gpu.push_back(s->gpu);
      detached.push_back(
          s->detached_since.has_value()
              ? std::chrono::duration_cast<std::chrono::seconds>(now - *s->detached_since).count()
              : -1);
    }
  }
  std::vector<SessionSummary> out;
  for (size_t i = 0; i < sessions.size(); ++i) {
    const auto& s = sessions[i];
    const PartitionStore& p = *s->partitions;
    SessionSummary summary;
    summary.gpu = gpu[i];
    summary.detached_seconds = detached[i];
    summary.id = s->id;
    summary.name = s->name;
    summary.partitions = p.partitions();
    summary.arena_bytes = p.arena_bytes();
    summary.steps = p.steps();
    summary.held = p.held();
    summary.step_wall_nanos = s->step_wall_nanos.load(std::memory_order_relaxed);
    summary.step_wait_nanos = s->step_wait_nanos.load(std::memory_order_relaxed);
    summary.step_compute_nanos = s->step_compute_nanos.load(std::memory_order_relaxed);
    summary.share_weight = p.share_weight();
    const OptimizerShares::Usage used = steps_->shares().UsageOf(s->id);
    summary.optimizer_params = used.elems;
    summary.optimizer_queued_nanos = used.queued_nanos;
    const Swapper::TraceIo io = p.Io();
    summary.nvme_read_bytes = io.bytes_in;
    summary.nvme_write_bytes = io.bytes_out;
    summary.io_queued_nanos = io.queued_nanos;
    summary.pool_room_bytes = io.room;
    summary.pool_evictions = io.evictions;
    for (int k = 0; k < kDataKinds; ++k) {
      summary.host_bytes[k] = p.bytes(static_cast<DataKind>(k), Tier::kHost);
      summary.nvme_bytes[k] = p.bytes(static_cast<DataKind>(k), Tier::kNvme);
    }
    out.push_back(std::move(summary));
  }
  std::sort(out.begin(), out.end(),
            [](const SessionSummary& a, const SessionSummary& b) { return a.id < b.id; });
  return out;
}

void SessionManager::DrainRings(absl::Duration timeout) {
  std::vector<std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, s] : sessions_) sessions.push_back(s);
  }
  // All at once, to one deadline: one after another, a trainer that leaves
  // each of its mailboxes mid-call would hold the stop for a patience a
  // session (past the service manager's stop timeout, keeping nothing).
  const absl::Time deadline = absl::Now() + timeout;
  for (const auto& s : sessions) {
    if (s->ring != nullptr) s->ring->BeginDrain(deadline);
  }
  for (const auto& s : sessions) {
    if (s->ring != nullptr) s->ring->EndDrain();
  }
}

std::vector<uint64_t> SessionManager::SessionIds() const {
  std::vector<uint64_t> ids;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, s] : sessions_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

absl::Status SessionManager::FinishStoppedStep(Session& session) {
  Session* s = &session;
  absl::MutexLock decided(&s->decide_mu);
  s->AwaitNoStepLocking();
  if (!s->partitions->stopped_midway()) return absl::OkStatus();
  absl::StatusOr<StepSummary> finished =
      steps_->Run(*s->partitions, s->decided_hyperparams, /*skip=*/false, s->decided_groups);
  if (!finished.ok()) {
    return absl::Status(finished.status().code(),
                        absl::StrCat("its step stopped midway and could not be finished: ",
                                     finished.status().message()));
  }
  s->CountStep(*finished);
  if (s->scaler != nullptr && !s->scaler_counted_step) s->scaler->Update(/*overflow=*/false);
  s->scaler_counted_step = false;
  return absl::OkStatus();
}

absl::StatusOr<SessionManager::KeptSession> SessionManager::QuiesceForKeeping(uint64_t id) {
  std::shared_ptr<Session> s;
  {
    absl::MutexLock lock(&mu_);
    auto found = sessions_.find(id);
    if (found == sessions_.end()) return absl::NotFoundError("it was closed meanwhile");
    s = found->second;
  }
  {
    // A background checkpoint being written ends first: an automatic one
    // is cancelled (the keep writes the same state; its previous one stays),
    // a trainer's is waited for.
    absl::MutexLock lock(&s->checkpoint_mu);
    const bool cancel = s->checkpoint_running && s->checkpoint_automatic;
    if (cancel) s->checkpoint_cancel = true;
    s->AwaitNoCheckpoint();
    if (cancel) s->checkpoint_cancel = false;
  }
  // What the trainer held goes, as when it goes away (it fetches again once
  // it resumed); a partition held for writing would stop the checkpoint,
  // and one held would stop the finishing below from making a newer
  // buffer of the delayed update current.
  s->partitions->DropHolds();
  // A step that stopped midway (its trainer backing off on a full pool,
  // or gone) is finished first: a checkpoint takes no half step, and the
  // session would not be kept.
  RETURN_IF_ERROR(FinishStoppedStep(*s));
  // Its partitions' ids, in the manifest's order (by id), taken before the
  // checkpoint (no lease runs out meanwhile: the stop paused them).
  KeptSession kept{SessionKey{s->id, s->token}, s->name,      "",          {},
                   s->keep_for_resume,          std::nullopt, std::nullopt};
  {
    absl::MutexLock lock(&mu_);
    if (!sessions_.contains(s->id)) return absl::NotFoundError("it was closed meanwhile");
    for (const auto& [partition, owner] : partition_owner_) {
      if (owner == s->id) kept.partition_ids.push_back(partition);
    }
    kept.restore_from = s->restore_from;
    kept.restore_steps = s->restore_steps;
    kept.user = s->user;
  }
  kept.share_weight = s->partitions->share_weight();
  std::sort(kept.partition_ids.begin(), kept.partition_ids.end());
  // (Again: a call of the trainer's may have fetched meanwhile.)
  s->partitions->DropHolds();
  return kept;
}

void SessionManager::ForgetKeptCopy(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto found = sessions_.find(id);
  if (found != sessions_.end()) found->second->kept_dir.clear();
}

bool SessionManager::ReopenedFrom(uint64_t id, const std::string& dir) const {
  absl::MutexLock lock(&mu_);
  auto found = sessions_.find(id);
  return found != sessions_.end() && found->second->kept_dir == dir;
}

absl::Status SessionManager::Reopen(const KeptSession& kept, const std::string& dir) {
  const SessionKey& key = kept.key;
  if (key.id == 0 || key.token.size() != kTokenBytes) {
    return absl::DataLossError(absl::StrCat(dir, " names no session"));
  }
  RestoreFrom from(dir);
  from.keep_for_resume = kept.keep_for_resume;
  RETURN_IF_ERROR(
      OpenAs(kept.name, {}, std::nullopt, std::nullopt, from, &key, kept.user).status());
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    session = sessions_.at(key.id);
  }
  absl::Status status = [&]() -> absl::Status {
    const checkpoint::Manifest& m = session->restore->session_manifest();
    if (m.partitions_size() != static_cast<int>(kept.partition_ids.size())) {
      return absl::DataLossError(absl::StrCat(dir, " names ", kept.partition_ids.size(),
                                              " partitions, its checkpoint holds ",
                                              m.partitions_size()));
    }
    // In the manifest's order, one at a time: the order decides which
    // partitions the placement keeps on the host, as when they were first
    // registered.
    for (int i = 0; i < m.partitions_size(); ++i) {
      const checkpoint::PartitionRecord& p = m.partitions(i);
      PartitionSpec spec;
      spec.name = p.name();
      spec.numel = p.numel();
      spec.param_dtype = static_cast<DType>(p.param_dtype());
      spec.grad_dtype = static_cast<DType>(p.grad_dtype());
      spec.tensor = p.tensor();
      spec.shape.assign(p.shape().begin(), p.shape().end());
      spec.tensor_offset = p.offset();
      RETURN_IF_ERROR(RegisterAs(key, spec, kept.partition_ids[i]).status());
    }
    // As it was: partitions registered later come from the checkpoint the
    // session was opened to restore, if any, else start anew.
    session->restore.reset();
    session->restore_from = kept.restore_from;
    session->restore_steps = kept.restore_steps;
    // Gone (a lost session's automatic checkpoint it restored goes once
    // two of its own are in): what it held is in this session's state;
    // partitions registered later start anew.
    if (!session->restore_from.empty() && !IsDirectory(session->restore_from)) {
      session->restore_from.clear();
    }
    if (!session->restore_from.empty()) {
      absl::StatusOr<std::unique_ptr<CheckpointRestore>> restore =
          CheckpointRestore::Open(session->restore_from, kept.name, kept.restore_steps);
      if (!restore.ok()) {
        // Changed since (the job's later checkpoints into it, one of them
        // failed): what the session holds is in its kept state, which is
        // not lost for it.
        LogWarning(
            "session %d ('%s'): its restore_from %s no longer restores (%s); partitions it "
            "registers from now on start anew",
            static_cast<int64_t>(key.id), kept.name, session->restore_from,
            restore.status().ToString());
        session->restore_from.clear();
      } else {
        session->restore = *std::move(restore);
        // A lost session's automatic checkpoint it restored goes once two
        // of its own are in, as it would have before the restart.
        absl::MutexLock lock(&mu_);
        if (!auto_checkpoint_.dir.empty() &&
            absl::StartsWith(session->restore_from, absl::StrCat(auto_checkpoint_.dir, "/")) &&
            OpenedBy(session->restore->session_manifest()) == session->user) {
          session->restored_auto_dir = session->restore_from;
        }
      }
    }
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    // Unfinished: its automatic checkpoints stay (they are what a resume
    // falls back to where the kept copy is bad). No reference held (its
    // teardown waits for the last one).
    {
      absl::MutexLock lock(&mu_);
      session->reopen_failed = true;
    }
    session.reset();
    CloseById(key.id, /*only_unattached=*/false, std::nullopt, nullptr, nullptr,
              /*finished=*/false);
    return status;
  }
  // As it was between jobs: its weight in the node's optimizer, I/O, pool.
  if (kept.share_weight > 0) session->partitions->SetShareWeight(kept.share_weight);
  // As a trainer that went away: nothing held, waiting for ResumeSession
  // (StartReconnectLeases starts the lease).
  session->partitions->DropHolds();
  absl::MutexLock lock(&mu_);
  session->attached = false;
  session->kept_dir = dir;
  session->reopened = true;
  return absl::OkStatus();
}

void SessionManager::StartReconnectLeases(absl::Span<const uint64_t> ids) {
  const SteadyTime now = std::chrono::steady_clock::now();
  absl::MutexLock lock(&mu_);
  for (uint64_t id : ids) {
    auto found = sessions_.find(id);
    if (found != sessions_.end()) found->second->detached_since = now;
  }
}

}  // namespace offload
