#include "engine/partition_store.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace offload {

struct PartitionSet::Partition {
  PartitionInfo info;
  HostMemory master, exp_avg, exp_avg_sq;
  uint64_t reserved_bytes = 0;
  bool master_initialized = false;
  bool grads_ready = false;
  bool in_step = false;
};

PartitionStore::PartitionStore(Env* env, MemoryBudget* host, Stats* stats,
                               uint64_t arena_capacity)
    : env_(env), host_(host), stats_(stats), arena_capacity_(0) {
  SetArenaCapacity(arena_capacity);
}

void PartitionStore::SetArenaCapacity(uint64_t bytes) {
  arena_capacity_.store(bytes / ShmArena::kAlignment * ShmArena::kAlignment,
                        std::memory_order_relaxed);
}

absl::StatusOr<std::unique_ptr<PartitionSet>> PartitionStore::CreateSet(uint64_t session_id) {
  ASSIGN_OR_RETURN(std::unique_ptr<ShmArena> arena,
                   ShmArena::Create(absl::StrCat("session-", session_id), arena_capacity(), env_));
  return std::unique_ptr<PartitionSet>(
      new PartitionSet(session_id, std::move(arena), env_, host_, stats_));
}

PartitionSet::PartitionSet(uint64_t session_id, std::unique_ptr<ShmArena> arena, Env* env,
                           MemoryBudget* host, Stats* stats)
    : session_id_(session_id), arena_(std::move(arena)), env_(env), host_(host), stats_(stats) {}

void PartitionSet::AwaitOutOfStep(absl::Span<Partition* const> partitions) {
  auto in_step = [partitions]() {
    for (const Partition* p : partitions) {
      if (p->in_step) return true;
    }
    return false;
  };
  if (!in_step()) return;
  stats_->waits_for_step.fetch_add(1, std::memory_order_relaxed);
  // Partitions are only ever removed with the whole set, which the caller
  // holds a reference to, so the pointers stay valid while waiting.
  do {
    step_ended_.Wait(&mu_);
  } while (in_step());
}

PartitionSet::~PartitionSet() {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, p] : partitions_) host_->Release(p->reserved_bytes);
}

size_t PartitionSet::partitions() const {
  absl::MutexLock lock(&mu_);
  return partitions_.size();
}

uint64_t PartitionSet::steps() const {
  absl::MutexLock lock(&mu_);
  return steps_;
}

PartitionSet::Partition* PartitionSet::Find(uint64_t id) const {
  auto it = partitions_.find(id);
  return it == partitions_.end() ? nullptr : it->second.get();
}

absl::StatusOr<PartitionSet::Partition*> PartitionSet::FindOrNotFound(uint64_t id) const {
  if (Partition* p = Find(id)) return p;
  return absl::NotFoundError(absl::StrCat("partition ", id, " is not registered"));
}

absl::StatusOr<PartitionInfo> PartitionSet::Register(uint64_t id, const PartitionSpec& spec) {
  if (spec.numel == 0 || spec.numel > PartitionStore::kMaxNumel) {
    return absl::InvalidArgumentError(absl::StrCat("partition '", spec.name, "' numel ",
                                                   spec.numel, " must be in [1, 2^40]"));
  }
  if (spec.name.empty() || spec.name.size() > 256) {
    return absl::InvalidArgumentError("partition name must be 1 to 256 bytes");
  }
  absl::MutexLock lock(&mu_);
  if (names_.contains(spec.name)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "session ", session_id_, " already has a partition named '", spec.name, "'"));
  }
  const uint64_t param_bytes = spec.numel * DTypeSize(spec.param_dtype);
  const uint64_t grad_bytes = spec.numel * DTypeSize(spec.grad_dtype);
  // Exactly what the arena will take, plus the private fp32 state.
  const uint64_t reserved = ShmArena::RoundedSize(param_bytes) +
                            ShmArena::RoundedSize(grad_bytes) +
                            spec.numel * PartitionStore::kPrivateBytesPerParam;
  const std::string what = absl::StrCat("partition '", spec.name, "' of session ", session_id_);
  RETURN_IF_ERROR(host_->Reserve(reserved, what));

  auto partition = std::make_unique<Partition>();
  partition->reserved_bytes = reserved;
  // From here on a failure must give the reservation back. (Arena space
  // already handed out stays unused: the arena only grows.)
  absl::Status status = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(uint64_t params_off, arena_->Allocate(param_bytes));
    ASSIGN_OR_RETURN(uint64_t grads_off, arena_->Allocate(grad_bytes));
    const uint64_t state_bytes = spec.numel * sizeof(float);
    for (HostMemory* m : {&partition->master, &partition->exp_avg, &partition->exp_avg_sq}) {
      absl::StatusOr<HostMemory> got = env_->Allocate(state_bytes, /*huge_pages=*/true);
      if (!got.ok()) {
        return absl::Status(got.status().code(),
                            absl::StrCat("allocating optimizer state of ", what, ": ",
                                         got.status().message()));
      }
      *m = std::move(*got);
    }
    PartitionInfo& info = partition->info;
    info.id = id;
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
  PartitionInfo info = partition->info;
  names_.insert(spec.name);
  partitions_[id] = std::move(partition);
  return info;
}

absl::StatusOr<std::vector<PartitionInfo>> PartitionSet::Fetch(absl::Span<const uint64_t> ids) {
  absl::MutexLock lock(&mu_);
  std::vector<Partition*> wanted;
  if (ids.empty()) {
    for (const auto& [id, p] : partitions_) wanted.push_back(p.get());
  } else {
    for (uint64_t id : ids) {
      ASSIGN_OR_RETURN(Partition * p, FindOrNotFound(id));
      wanted.push_back(p);
    }
  }
  // Parameters being updated are not handed out half-written.
  AwaitOutOfStep(wanted);
  std::vector<PartitionInfo> out;
  out.reserve(wanted.size());
  for (const Partition* p : wanted) out.push_back(p->info);
  return out;
}

absl::Status PartitionSet::ReturnGradients(uint64_t id, uint64_t numel, DType grad_dtype) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Partition * p, FindOrNotFound(id));
  if (numel != p->info.numel) {
    return absl::InvalidArgumentError(absl::StrCat("gradients for partition ", id, " ('",
                                                   p->info.name, "') have ", numel,
                                                   " elements; it was registered with ",
                                                   p->info.numel));
  }
  if (grad_dtype != p->info.grad_dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gradients for partition ", id, " ('", p->info.name, "') are ", DTypeName(grad_dtype),
        "; it was registered with ", DTypeName(p->info.grad_dtype)));
  }
  // The step in progress consumes the gradients it pinned; these are new.
  AwaitOutOfStep(absl::MakeConstSpan(&p, 1));
  p->grads_ready = true;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StepItem>> PartitionSet::BeginStep() {
  absl::MutexLock lock(&mu_);
  while (stepping_) step_ended_.Wait(&mu_);
  std::vector<StepItem> items;
  std::byte* base = arena_->base();
  for (auto& [id, p] : partitions_) {
    if (!p->grads_ready) continue;
    p->in_step = true;
    StepItem item;
    item.id = id;
    item.init_master = !p->master_initialized;
    item.task.span = AdamSpan{p->master.as<float>(), p->exp_avg.as<float>(),
                              p->exp_avg_sq.as<float>(), base + p->info.grads.offset,
                              p->info.grad_dtype, base + p->info.params.offset,
                              p->info.param_dtype, p->info.numel};
    item.task.step = p->info.step + 1;
    items.push_back(item);
  }
  if (items.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", session_id_, " has no partition with gradients returned since the last step"));
  }
  stepping_ = true;
  return items;
}

void PartitionSet::EndStep(absl::Span<const StepItem> items, StepOutcome outcome) {
  absl::MutexLock lock(&mu_);
  for (const StepItem& item : items) {
    Partition* p = Find(item.id);
    p->in_step = false;
    if (outcome == StepOutcome::kFailed) continue;
    // The master copy was initialised before the optimizer ran, whatever it
    // decided.
    p->master_initialized = true;
    p->grads_ready = false;
    if (outcome == StepOutcome::kApplied) ++p->info.step;
  }
  if (outcome == StepOutcome::kApplied) ++steps_;
  stepping_ = false;
  step_ended_.SignalAll();
}

}  // namespace offload
