#include "engine/partition_store.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace offload {
namespace {

constexpr int kStateKinds = 3;  // master, exp_avg, exp_avg_sq

// Where a partition whose state is `add` bytes goes, given `host` of `total`
// state bytes before it on the host: there while the host share stays at or
// under `percent` (registration and placement changes alike).
Tier HomeFor(uint64_t host, uint64_t total, uint64_t add, int percent) {
  return (host + add) * 100 <= static_cast<uint64_t>(percent) * (total + add) ? Tier::kHost
                                                                              : Tier::kNvme;
}

}  // namespace

struct PartitionSet::Partition {
  PartitionInfo info;
  PoolCharge arena_charge;  // its params and grads pages in the arena
  HostMemory region;        // those pages mapped: params, then grads
  std::byte* params = nullptr;
  std::byte* grads = nullptr;
  Tier state_home = Tier::kHost;
  bool master_initialized = false;
  bool grads_ready = false;
  bool in_step = false;
  uint64_t resume_chunk = 0;  // a failed step updated the chunks before it
};

absl::Status CheckName(absl::string_view name, absl::string_view what, bool may_be_empty) {
  if ((name.empty() && !may_be_empty) || name.size() > 256) {
    return absl::InvalidArgumentError(absl::StrCat(what, " must be ", may_be_empty ? 0 : 1,
                                                   " to 256 bytes, got ", name.size()));
  }
  for (char c : name) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " holds a control character (byte ", static_cast<int>(u), "); use printable text"));
    }
  }
  return absl::OkStatus();
}

PartitionStore::PartitionStore(Env* env, Swapper* swapper, Stats* stats, uint64_t arena_capacity,
                               int state_host_percent, uint64_t state_chunk_elems)
    : env_(env), swapper_(swapper), stats_(stats),
      state_chunk_elems_(std::max<uint64_t>(state_chunk_elems, 1024)), arena_capacity_(0),
      state_host_percent_(state_host_percent) {
  SetArenaCapacity(arena_capacity);
}

void PartitionStore::SetArenaCapacity(uint64_t bytes) {
  arena_capacity_.store(bytes / ShmArena::kAlignment * ShmArena::kAlignment,
                        std::memory_order_relaxed);
}

absl::Status PartitionStore::CheckPlacement(int percent, bool has_nvme) {
  if (percent < 0 || percent > 100) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer state placement must keep 0 to 100 percent on the host, got ", percent));
  }
  if (percent < 100 && !has_nvme) {
    return absl::FailedPreconditionError(absl::StrCat(
        "optimizer state cannot be placed on NVMe (", 100 - percent,
        "% asked for): this offloadd has no NVMe tier (set nvme.dirs)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PartitionSet>> PartitionStore::CreateSet(
    uint64_t session_id, std::optional<int> state_host_percent) {
  const int percent = state_host_percent.value_or(state_host_percent_.load());
  RETURN_IF_ERROR(CheckPlacement(percent, swapper_->has_nvme()));
  ASSIGN_OR_RETURN(std::unique_ptr<ShmArena> arena,
                   ShmArena::Create(absl::StrCat("session-", session_id), arena_capacity(), env_));
  return std::unique_ptr<PartitionSet>(
      new PartitionSet(session_id, std::move(arena), swapper_, stats_, percent,
                       state_chunk_elems_));
}

PartitionSet::PartitionSet(uint64_t session_id, std::unique_ptr<ShmArena> arena,
                           Swapper* swapper, Stats* stats, int state_host_percent,
                           uint64_t state_chunk_elems)
    : session_id_(session_id), arena_(std::move(arena)), swapper_(swapper), stats_(stats),
      state_chunk_elems_(state_chunk_elems), state_host_percent_(state_host_percent) {}

absl::Status PartitionSet::SetStateHostPercent(int percent) {
  RETURN_IF_ERROR(PartitionStore::CheckPlacement(percent, swapper_->has_nvme()));
  // Until every block has its new home: a second change, or a registration,
  // sees this one whole.
  absl::MutexLock placing(&placement_mu_);
  struct Move {
    uint64_t id;
    uint64_t chunks;
    Tier home;
  };
  std::vector<Move> moves;
  {
    absl::MutexLock lock(&mu_);
    state_host_percent_ = percent;
    uint64_t host = 0, total = 0;
    for (auto& [id, p] : partitions_) {
      const uint64_t add = kStateKinds * p->info.numel * sizeof(float);
      const Tier home = HomeFor(host, total, add, percent);
      total += add;
      if (home == Tier::kHost) host += add;
      if (home != p->state_home) {
        p->state_home = home;
        moves.push_back({id, ChunksOf(p->info.numel), home});
      }
    }
    state_bytes_[static_cast<int>(Tier::kHost)] = host;
    state_bytes_[static_cast<int>(Tier::kNvme)] = total - host;
  }
  // Outside the set's lock; each call returns at once.
  for (const Move& m : moves) {
    for (uint64_t c = 0; c < m.chunks; ++c) {
      for (int k = 0; k < kStateKinds; ++k) {
        RETURN_IF_ERROR(swapper_->SetHome(PartitionStore::StateBlock(m.id, c, k), m.home));
      }
    }
  }
  return absl::OkStatus();
}

PartitionSet::~PartitionSet() {
  // No call can be in flight: the last reference is going. The swapper is
  // called without the set's lock, as everywhere.
  std::vector<std::pair<uint64_t, uint64_t>> chunks;  // partition, chunks
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, p] : partitions_) {
      chunks.emplace_back(id, ChunksOf(p->info.numel));
    }
  }
  for (const auto& [id, n] : chunks) {
    for (uint64_t c = 0; c < n; ++c) {
      for (int k = 0; k < kStateKinds; ++k) swapper_->Remove(PartitionStore::StateBlock(id, c, k));
    }
  }
}

uint64_t PartitionSet::ChunksOf(uint64_t numel) const {
  return (numel + state_chunk_elems_ - 1) / state_chunk_elems_;
}

uint64_t PartitionSet::StateChunks(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  Partition* p = Find(id);
  return p == nullptr ? 0 : ChunksOf(p->info.numel);
}

size_t PartitionSet::partitions() const {
  absl::MutexLock lock(&mu_);
  return partitions_.size();
}

uint64_t PartitionSet::steps() const {
  absl::MutexLock lock(&mu_);
  return steps_;
}

uint64_t PartitionSet::state_bytes(Tier home) const {
  absl::MutexLock lock(&mu_);
  return state_bytes_[static_cast<int>(home)];
}

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

PartitionSet::Partition* PartitionSet::Find(uint64_t id) const {
  auto it = partitions_.find(id);
  return it == partitions_.end() ? nullptr : it->second.get();
}

absl::StatusOr<PartitionSet::Partition*> PartitionSet::FindOrNotFound(uint64_t id) const {
  if (Partition* p = Find(id)) return p;
  return absl::NotFoundError(absl::StrCat("partition ", id, " is not registered"));
}

absl::StatusOr<PartitionInfo> PartitionSet::Register(uint64_t id, const PartitionSpec& spec) {
  // The name first: the messages below quote it.
  RETURN_IF_ERROR(CheckName(spec.name, "partition name", /*may_be_empty=*/false));
  if (spec.numel == 0 || spec.numel > PartitionStore::kMaxNumel) {
    return absl::InvalidArgumentError(absl::StrCat("partition '", spec.name, "' numel ",
                                                   spec.numel, " must be in [1, 2^40]"));
  }
  const uint64_t param_bytes = spec.numel * DTypeSize(spec.param_dtype);
  const uint64_t grad_bytes = spec.numel * DTypeSize(spec.grad_dtype);
  const uint64_t state_bytes = spec.numel * sizeof(float);  // per kind
  const std::string what = absl::StrCat("partition '", spec.name, "' of session ", session_id_);
  // Registrations and placement changes of this set, one at a time (see
  // SetStateHostPercent); held while the swapper makes room.
  absl::MutexLock placing(&placement_mu_);
  Tier home;
  {
    absl::MutexLock lock(&mu_);
    if (names_.contains(spec.name)) {
      return absl::AlreadyExistsError(absl::StrCat(
          "session ", session_id_, " already has a partition named '", spec.name, "'"));
    }
    // Claimed now; given back below if the registration fails.
    names_.insert(spec.name);
    const uint64_t host = state_bytes_[0], total = state_bytes_[0] + state_bytes_[1];
    const uint64_t add = kStateKinds * state_bytes;
    home = HomeFor(host, total, add, state_host_percent_);
  }
  // Outside the set's lock: making room may wait for write-outs.
  auto partition = std::make_unique<Partition>();
  partition->state_home = home;
  std::vector<uint64_t> added;  // state blocks, to remove if a later step fails
  absl::Status status = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(partition->arena_charge,
                     swapper_->ReserveHost(ShmArena::RoundedSize(param_bytes) +
                                               ShmArena::RoundedSize(grad_bytes),
                                           what));
    // One allocation, so that params and grads are adjacent and one mapping
    // (of just this partition: no address space for the rest) covers both.
    const uint64_t grads_at = ShmArena::RoundedSize(param_bytes);
    ASSIGN_OR_RETURN(uint64_t params_off, arena_->Allocate(grads_at + grad_bytes));
    const uint64_t grads_off = params_off + grads_at;
    ASSIGN_OR_RETURN(partition->region, arena_->Map(params_off, grads_at + grad_bytes));
    partition->params = partition->region.data();
    partition->grads = partition->region.data() + grads_at;
    for (uint64_t begin = 0, c = 0; begin < spec.numel; begin += state_chunk_elems_, ++c) {
      const uint64_t elems = std::min(state_chunk_elems_, spec.numel - begin);
      for (int k = 0; k < kStateKinds; ++k) {
        const uint64_t block = PartitionStore::StateBlock(id, c, k);
        absl::Status s = swapper_->Add(block, elems * sizeof(float), home, session_id_);
        if (!s.ok()) {
          return absl::Status(
              s.code(), absl::StrCat("allocating optimizer state of ", what, ": ", s.message()));
        }
        added.push_back(block);
      }
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
    // The arena charge and mapping go with `partition`; arena space already
    // handed out stays unused (the arena only grows).
    for (uint64_t block : added) swapper_->Remove(block);
    absl::MutexLock lock(&mu_);
    names_.erase(spec.name);
    return status;
  }
  absl::MutexLock lock(&mu_);
  state_bytes_[static_cast<int>(home)] += kStateKinds * state_bytes;
  PartitionInfo info = partition->info;
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
  if (p->resume_chunk != 0) {
    // Part of this partition was updated with the gradients it holds; new
    // ones would mix two steps in one.
    return absl::FailedPreconditionError(absl::StrCat(
        "partition ", id, " ('", p->info.name, "') is in a step that stopped midway; call Step "
        "again (with the gradients as they were) before returning new ones"));
  }
  p->grads_ready = true;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StepItem>> PartitionSet::BeginStep() {
  absl::MutexLock lock(&mu_);
  while (stepping_) step_ended_.Wait(&mu_);
  std::vector<StepItem> items;
  for (auto& [id, p] : partitions_) {
    if (!p->grads_ready) continue;
    p->in_step = true;
    StepItem item;
    item.id = id;
    item.init_master = !p->master_initialized;
    item.task.span.grads = p->grads;
    item.task.span.grad_dtype = p->info.grad_dtype;
    item.task.span.working = p->params;
    item.task.span.working_dtype = p->info.param_dtype;
    item.task.span.numel = p->info.numel;
    item.task.step = p->info.step + 1;
    item.first_chunk = p->resume_chunk;
    items.push_back(item);
  }
  if (items.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", session_id_, " has no partition with gradients returned since the last step"));
  }
  stepping_ = true;
  return items;
}

absl::StatusOr<StatePins> PartitionSet::PinState(uint64_t id, uint64_t chunk) {
  uint64_t numel;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(Partition * p, FindOrNotFound(id));
    numel = p->info.numel;
  }
  StatePins pins;
  pins.begin = chunk * state_chunk_elems_;
  if (pins.begin >= numel) {
    return absl::OutOfRangeError(absl::StrCat("partition ", id, " has no state chunk ", chunk));
  }
  pins.end = std::min(numel, pins.begin + state_chunk_elems_);
  Swapper::Pin* out[kStateKinds] = {&pins.master, &pins.exp_avg, &pins.exp_avg_sq};
  for (int k = 0; k < kStateKinds; ++k) {
    ASSIGN_OR_RETURN(*out[k], swapper_->Acquire(PartitionStore::StateBlock(id, chunk, k),
                                                /*for_write=*/true));
  }
  return pins;
}

void PartitionSet::EndStep(absl::Span<const StepItem> items,
                           absl::Span<const ItemOutcome> outcomes) {
  bool applied_any = false;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < items.size(); ++i) {
      Partition* p = Find(items[i].id);
      p->in_step = false;
      if (outcomes[i].outcome == StepOutcome::kFailed) {
        p->resume_chunk = outcomes[i].next_chunk;
        continue;
      }
      p->resume_chunk = 0;
      p->grads_ready = false;
      if (outcomes[i].outcome == StepOutcome::kApplied) {
        // Its master copy was initialised (if it had to be) and updated.
        p->master_initialized = true;
        ++p->info.step;
        applied_any = true;
      }
    }
    if (applied_any) ++steps_;
    stepping_ = false;
    step_ended_.SignalAll();
  }
  // One iteration of this session's state accesses ends here: the swapper
  // learns their order and prefetches the next step's first partitions.
  swapper_->EndIteration(session_id_);
}

}  // namespace offload
