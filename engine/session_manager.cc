#include "engine/session_manager.h"

#include <fcntl.h>
#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "base/posix_error.h"
#include "base/status_macros.h"
#include "engine/shm_arena.h"

namespace offload {
namespace {

// fp32 master weights, exp_avg, exp_avg_sq.
constexpr uint64_t kPrivateBytesPerParam = 12;

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using FloatBuffer = std::unique_ptr<float[], FreeDeleter>;

absl::StatusOr<FloatBuffer> AllocateZeroedFloats(uint64_t n, absl::string_view what) {
  const uint64_t bytes = (n * sizeof(float) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of host memory allocating ", bytes, " bytes for ", what));
  }
  std::memset(p, 0, bytes);
  return FloatBuffer(static_cast<float*>(p));
}

bool TokensEqual(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;  // constant time: no early exit on mismatch
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

absl::StatusOr<std::string> RandomToken(size_t bytes) {
  std::string token(bytes, '\0');
  size_t got = 0;
  while (got < bytes) {
    ssize_t n = getrandom(token.data() + got, bytes - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError("getrandom for session token", errno);
    }
    got += static_cast<size_t>(n);
  }
  return token;
}

}  // namespace

struct SessionManager::Partition {
  PartitionInfo info;
  FloatBuffer master, exp_avg, exp_avg_sq;
  bool master_initialized = false;
  bool grads_ready = false;
  uint64_t reserved_bytes = 0;
};

class SessionManager::Session {
 public:
  Session(uint64_t id, std::string token, std::string name, std::unique_ptr<ShmArena> arena,
          MemoryBudget* host)
      : id_(id), token_(std::move(token)), name_(std::move(name)), arena_(std::move(arena)),
        host_(host) {}
  ~Session() {
    absl::MutexLock lock(&mu);
    for (const auto& [id, p] : partitions) host_->Release(p->reserved_bytes);
  }

  uint64_t id() const { return id_; }
  const std::string& token() const { return token_; }
  const std::string& name() const { return name_; }
  ShmArena& arena() const { return *arena_; }

  absl::Mutex mu;
  // Ordered by id so that steps visit partitions in registration order.
  std::map<uint64_t, std::unique_ptr<Partition>> partitions ABSL_GUARDED_BY(mu);
  absl::flat_hash_set<std::string> names ABSL_GUARDED_BY(mu);
  uint64_t steps ABSL_GUARDED_BY(mu) = 0;

 private:
  const uint64_t id_;
  const std::string token_;
  const std::string name_;
  const std::unique_ptr<ShmArena> arena_;
  MemoryBudget* const host_;
};

SessionManager::SessionManager(MemoryBudget* host, Optimizer* optimizer, Stats* stats,
                               uint64_t arena_capacity)
    : host_(host), optimizer_(optimizer), stats_(stats), arena_capacity_(arena_capacity) {}

SessionManager::~SessionManager() = default;

void SessionManager::SetArenaCapacity(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  arena_capacity_ = bytes / ShmArena::kAlignment * ShmArena::kAlignment;
}

absl::StatusOr<OpenedSession> SessionManager::Open(absl::string_view name) {
  if (name.size() > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("session name is ", name.size(), " bytes; at most 256 allowed"));
  }
  ASSIGN_OR_RETURN(std::string token, RandomToken(kTokenBytes));
  uint64_t id, capacity;
  {
    absl::MutexLock lock(&mu_);
    id = next_session_id_++;
    capacity = arena_capacity_;
  }
  ASSIGN_OR_RETURN(std::unique_ptr<ShmArena> arena,
                   ShmArena::Create(absl::StrCat("session-", id), capacity));
  auto session = std::make_shared<Session>(id, token, std::string(name), std::move(arena), host_);
  {
    absl::MutexLock lock(&mu_);
    sessions_[id] = std::move(session);
  }
  stats_->sessions_opened.fetch_add(1, std::memory_order_relaxed);
  return OpenedSession{SessionKey{id, std::move(token)}, capacity};
}

absl::StatusOr<std::shared_ptr<SessionManager::Session>> SessionManager::Find(
    const SessionKey& key) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(key.id);
  if (it == sessions_.end()) {
    if (closed_sessions_.contains(key.id)) {
      return absl::FailedPreconditionError(absl::StrCat("session ", key.id, " is closed"));
    }
    return absl::NotFoundError(absl::StrCat("no session ", key.id, " was ever opened"));
  }
  if (!TokensEqual(it->second->token(), key.token)) {
    return absl::PermissionDeniedError(
        absl::StrCat("wrong token for session ", key.id, ": it belongs to another client"));
  }
  return it->second;
}

absl::Status SessionManager::CheckOwner(const Session& session, uint64_t partition_id) const {
  absl::MutexLock lock(&mu_);
  auto it = partition_owner_.find(partition_id);
  if (it == partition_owner_.end()) {
    return absl::NotFoundError(
        absl::StrCat("partition ", partition_id, " is not registered (register it first)"));
  }
  if (it->second != session.id()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "partition ", partition_id, " belongs to another session, not session ", session.id()));
  }
  return absl::OkStatus();
}

absl::Status SessionManager::Close(const SessionKey& key) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  // Another Close may have won the race since Find().
  if (!CloseById(key.id)) {
    return absl::FailedPreconditionError(absl::StrCat("session ", key.id, " is closed"));
  }
  return absl::OkStatus();
}

bool SessionManager::Abandon(uint64_t id) {
  if (!CloseById(id)) return false;
  stats_->sessions_abandoned.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool SessionManager::CloseById(uint64_t id) {
  // Destroyed after mu_ is released: ~Session takes the session's own lock,
  // which is ordered before mu_ (Register holds it while taking mu_).
  std::shared_ptr<Session> doomed;
  absl::MutexLock lock(&mu_);
  auto found = sessions_.find(id);
  if (found == sessions_.end()) return false;
  doomed = std::move(found->second);
  sessions_.erase(found);
  closed_sessions_.insert(id);
  for (auto it = partition_owner_.begin(); it != partition_owner_.end();) {
    if (it->second == id) {
      partition_owner_.erase(it++);
    } else {
      ++it;
    }
  }
  stats_->sessions_closed.fetch_add(1, std::memory_order_relaxed);
  // Memory is released when the last in-flight call drops its reference.
  return true;
}

absl::StatusOr<PartitionInfo> SessionManager::Register(const SessionKey& key,
                                                       const PartitionSpec& spec) {
  if (spec.numel == 0 || spec.numel > kMaxNumel) {
    return absl::InvalidArgumentError(absl::StrCat("partition '", spec.name, "' numel ",
                                                   spec.numel, " must be in [1, 2^40]"));
  }
  if (spec.name.empty() || spec.name.size() > 256) {
    return absl::InvalidArgumentError("partition name must be 1 to 256 bytes");
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  absl::MutexLock lock(&session->mu);
  if (session->names.contains(spec.name)) {
    return absl::AlreadyExistsError(absl::StrCat("session ", key.id,
                                                 " already has a partition named '", spec.name,
                                                 "'"));
  }
  const uint64_t param_bytes = spec.numel * DTypeSize(spec.param_dtype);
  const uint64_t grad_bytes = spec.numel * DTypeSize(spec.grad_dtype);
  // Exactly what the arena will take, plus the private fp32 state.
  const uint64_t reserved = ShmArena::RoundedSize(param_bytes) +
                            ShmArena::RoundedSize(grad_bytes) +
                            spec.numel * kPrivateBytesPerParam;
  const std::string what = absl::StrCat("partition '", spec.name, "' of session ", key.id);
  RETURN_IF_ERROR(host_->Reserve(reserved, what));

  auto partition = std::make_unique<Partition>();
  partition->reserved_bytes = reserved;
  // From here on a failure must give the reservation back. (Arena space
  // already handed out stays unused: the arena only grows.)
  absl::Status status = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(uint64_t params_off, session->arena().Allocate(param_bytes));
    ASSIGN_OR_RETURN(uint64_t grads_off, session->arena().Allocate(grad_bytes));
    ASSIGN_OR_RETURN(partition->master, AllocateZeroedFloats(spec.numel, what));
    ASSIGN_OR_RETURN(partition->exp_avg, AllocateZeroedFloats(spec.numel, what));
    ASSIGN_OR_RETURN(partition->exp_avg_sq, AllocateZeroedFloats(spec.numel, what));
    PartitionInfo& info = partition->info;
    info.name = spec.name;
    info.numel = spec.numel;
    info.param_dtype = spec.param_dtype;
    info.grad_dtype = spec.grad_dtype;
    info.params = {params_off, param_bytes};
    info.grads = {grads_off, grad_bytes};
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    host_->Release(reserved);
    return status;
  }
  {
    absl::MutexLock manager_lock(&mu_);
    partition->info.id = next_partition_id_++;
    partition_owner_[partition->info.id] = key.id;
  }
  PartitionInfo info = partition->info;
  session->names.insert(spec.name);
  session->partitions[info.id] = std::move(partition);
  stats_->partitions_registered.fetch_add(1, std::memory_order_relaxed);
  return info;
}

absl::StatusOr<std::vector<PartitionInfo>> SessionManager::Fetch(const SessionKey& key,
                                                                 absl::Span<const uint64_t> ids) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  for (uint64_t id : ids) RETURN_IF_ERROR(CheckOwner(*session, id));
  absl::MutexLock lock(&session->mu);
  std::vector<PartitionInfo> out;
  if (ids.empty()) {
    for (const auto& [id, p] : session->partitions) out.push_back(p->info);
  } else {
    for (uint64_t id : ids) {
      auto it = session->partitions.find(id);
      if (it == session->partitions.end()) {
        return absl::NotFoundError(absl::StrCat("partition ", id, " is not registered"));
      }
      out.push_back(it->second->info);
    }
  }
  stats_->fetches.fetch_add(static_cast<int64_t>(out.size()), std::memory_order_relaxed);
  return out;
}

absl::Status SessionManager::ReturnGradients(const SessionKey& key, uint64_t partition_id,
                                             uint64_t numel, DType grad_dtype) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  RETURN_IF_ERROR(CheckOwner(*session, partition_id));
  absl::MutexLock lock(&session->mu);
  auto it = session->partitions.find(partition_id);
  if (it == session->partitions.end()) {
    return absl::NotFoundError(absl::StrCat("partition ", partition_id, " is not registered"));
  }
  Partition& p = *it->second;
  if (numel != p.info.numel) {
    return absl::InvalidArgumentError(absl::StrCat("gradients for partition ", partition_id,
                                                   " ('", p.info.name, "') have ", numel,
                                                   " elements; it was registered with ",
                                                   p.info.numel));
  }
  if (grad_dtype != p.info.grad_dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gradients for partition ", partition_id, " ('", p.info.name, "') are ",
        DTypeName(grad_dtype), "; it was registered with ", DTypeName(p.info.grad_dtype)));
  }
  p.grads_ready = true;
  stats_->gradients_returned.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::StatusOr<StepSummary> SessionManager::Step(const SessionKey& key, const AdamHyperparams& h) {
  RETURN_IF_ERROR(ValidateHyperparams(h));
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  const auto start = std::chrono::steady_clock::now();
  absl::MutexLock lock(&session->mu);
  std::vector<Partition*> ready;
  for (auto& [id, p] : session->partitions) {
    if (p->grads_ready) ready.push_back(p.get());
  }
  if (ready.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", key.id, " has no partition with gradients returned since the last step"));
  }
  std::byte* base = session->arena().base();
  std::vector<AdamTask> tasks;
  StepSummary summary;
  for (Partition* p : ready) {
    void* working = base + p->info.params.offset;
    if (!p->master_initialized) {
      WidenToFloat(working, p->info.param_dtype, p->master.get(), p->info.numel);
    }
    AdamTask task;
    task.span = AdamSpan{p->master.get(), p->exp_avg.get(), p->exp_avg_sq.get(),
                         base + p->info.grads.offset, p->info.grad_dtype, working,
                         p->info.param_dtype, p->info.numel};
    task.step = p->info.step + 1;
    tasks.push_back(task);
    summary.params_updated += p->info.numel;
  }
  ASSIGN_OR_RETURN(StepReport report, optimizer_->Step(tasks, h));
  for (Partition* p : ready) {
    p->master_initialized = true;
    p->grads_ready = false;
    if (!report.skipped) ++p->info.step;
  }
  if (report.skipped) {
    stats_->steps_skipped.fetch_add(1, std::memory_order_relaxed);
    return StepSummary{0, 0, true, report.nonfinite};
  }
  ++session->steps;
  summary.partitions_updated = ready.size();
  stats_->steps.fetch_add(1, std::memory_order_relaxed);
  stats_->params_updated.fetch_add(static_cast<int64_t>(summary.params_updated),
                                   std::memory_order_relaxed);
  stats_->step_nanos.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now() - start)
                                   .count(),
                               std::memory_order_relaxed);
  return summary;
}

absl::StatusOr<UniqueFd> SessionManager::DupArenaFd(const SessionKey& key) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(key));
  UniqueFd fd(fcntl(session->arena().fd(), F_DUPFD_CLOEXEC, 0));
  if (!fd.valid()) return PosixError("duplicating arena descriptor", errno);
  stats_->arena_attaches.fetch_add(1, std::memory_order_relaxed);
  return fd;
}

std::vector<SessionSummary> SessionManager::Sessions() const {
  std::vector<std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, s] : sessions_) sessions.push_back(s);
  }
  std::vector<SessionSummary> out;
  for (const auto& s : sessions) {
    absl::MutexLock lock(&s->mu);
    out.push_back({s->id(), s->name(), s->partitions.size(), s->arena().size(), s->steps});
  }
  std::sort(out.begin(), out.end(),
            [](const SessionSummary& a, const SessionSummary& b) { return a.id < b.id; });
  return out;
}

}  // namespace offload
