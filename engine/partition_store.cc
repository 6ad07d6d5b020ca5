#include "engine/partition_store.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "ipc/request_ring.h"

namespace offload {
namespace {

// Where a partition whose data of a kind is `add` bytes goes, given `host`
// of `total` bytes of that kind before it on the host: there while the host
// share stays at or under `percent` (registration and placement changes
// alike).
Tier HomeFor(uint64_t host, uint64_t total, uint64_t add, int percent) {
  return (host + add) * 100 <= static_cast<uint64_t>(percent) * (total + add) ? Tier::kHost
                                                                              : Tier::kNvme;
}

constexpr DataKind kKinds[kDataKinds] = {DataKind::kParams, DataKind::kGrads,
                                         DataKind::kOptimizerState};

// The data kind a block kind belongs to.
DataKind KindOfBlock(int block_kind) {
  switch (block_kind) {
    case PartitionStore::kParamsBlock:
    case PartitionStore::kShadowBlock:
      return DataKind::kParams;
    case PartitionStore::kGradsBlock:
      return DataKind::kGrads;
    default:  // master, m, v, the accumulator (and the fp32 initial values)
      return DataKind::kOptimizerState;
  }
}

}  // namespace

const char* DataKindName(DataKind kind) {
  switch (kind) {
    case DataKind::kParams:
      return "params";
    case DataKind::kGrads:
      return "grads";
    case DataKind::kOptimizerState:
      return "optimizer_state";
  }
  return "?";
}

struct PartitionStore::Partition {
  PartitionInfo info;
  std::string tensor;  // of which it is a slice (never empty)
  std::vector<uint64_t> shape;
  uint64_t tensor_offset = 0;
  MappedSpan region;        // its span in the arena, mapped (ShmArena::MapSpan)
  uint64_t page_bytes = 0;  // the page size its span is laid out for
  // Where the fp32 initial values go, in its span (registered with them:
  // a 16-bit working copy); 0 bytes: none. A load (FetchMode::load) uses it
  // again.
  uint64_t init_at = 0, init_bytes = 0;
  // A load without that region: the release makes the working copy the
  // master weights.
  bool master_from_working = false;
  // A load under way (until its release), and the master weights' state
  // before it: a trainer that goes away first (DropHolds) leaves them so.
  bool loading = false;
  MasterState before_load = MasterState::kUnset;
  // Releases committing its initial values or a load (outside the lock):
  // DropHolds leaves the partition to them (the trainer released: the load
  // is whole), marking it dropped: a Release that then fails undoes the
  // load as DropHolds would have.
  int committing = 0;
  bool dropped = false;
  std::byte* grads = nullptr;
  Tier home[kDataKinds] = {Tier::kHost, Tier::kHost, Tier::kHost};
  MasterState master = MasterState::kUnset;
  GradState gradients = GradState::kNone;
  StepState step = StepState::kOut;
  // An accumulation, measurement or reclaim of its gradients is running
  // (GradState's transient phase).
  bool accumulating = false;
  // The working copy's two buffers (the second used by the delayed update):
  // `version` is the one the trainer reads; `swap_pending` means the other
  // holds a newer version, made current at the next step's commit.
  uint64_t params_offset[2] = {0, 0};
  std::byte* buffer[2] = {nullptr, nullptr};
  int version = 0;
  bool swap_pending = false;
  uint64_t micro_batches = 0;  // accumulated since the last step
  GradStats grad_stats;        // of the accumulated values
  uint64_t resume_chunk = 0;   // a failed step updated the chunks before it
  // In a step that stopped midway (updated in none, some or all chunks
  // before resume_chunk): until Step finishes it, no new gradients (they
  // would be added to this step's), no skip, no switch of the delayed
  // update, no checkpoint.
  bool stopped = false;
  // That step was a delayed update's: it writes the buffer the trainer
  // does not read.
  bool stopped_delayed = false;
  // The trainer's holds: every chunk pinned, or none.
  std::vector<Swapper::Pin> param_pins, grad_pins;
  // Held for writing (a writable fetch, or since registration): the trainer
  // may be changing the parameters; a checkpoint waits for the release.
  bool writable_hold = false;

  // Bytes of `kind` the partition has (placement counts these).
  uint64_t Bytes(DataKind kind) const {
    switch (kind) {
      case DataKind::kParams:
        return info.numel * DTypeSize(info.param_dtype);
      case DataKind::kGrads:
        return info.numel * DTypeSize(info.grad_dtype);
      case DataKind::kOptimizerState:  // master, m, v and the gradient accumulator
        return 4 * info.numel * sizeof(float);
    }
    return 0;
  }
  bool held() const { return !param_pins.empty() || !grad_pins.empty(); }
  // Ends the trainer's holds: their pins move to `out` (to be dropped
  // outside the set's lock).
  void TakeHolds(std::vector<Swapper::Pin>* out) {
    for (auto* pins : {&param_pins, &grad_pins}) {
      std::move(pins->begin(), pins->end(), std::back_inserter(*out));
      pins->clear();
    }
    writable_hold = false;
  }
};

absl::Status CheckName(absl::string_view name, absl::string_view what, bool may_be_empty) {
  if ((name.empty() && !may_be_empty) || name.size() > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be ", may_be_empty ? 0 : 1, " to 256 bytes, got ", name.size()));
  }
  for (char c : name) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat(what, " holds a control character (byte ",
                                                     static_cast<int>(u), "); use printable text"));
    }
  }
  if (const std::optional<size_t> bad = FirstInvalidUtf8(name); bad.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not UTF-8 (byte ", *bad, " of ", name.size(), ")"));
  }
  if (const std::optional<CodePointAt> unsafe = FirstUnsafeCodePoint(name); unsafe.has_value()) {
    const bool c1 = unsafe->code_point <= 0x9f;
    return absl::InvalidArgumentError(absl::StrCat(
        what, " holds ",
        c1 ? "a control character" : "a bidirectional override, which reorders text on screen,",
        absl::StrFormat(" (U+%04X at byte %d)", unsafe->code_point, unsafe->offset),
        "; use printable text"));
  }
  return absl::OkStatus();
}

PartitionStoreFactory::PartitionStoreFactory(Env* env, Swapper* swapper, Stats* stats,
                                             uint64_t arena_capacity, const Placement& placement,
                                             uint64_t state_chunk_elems, uint64_t huge_page_bytes)
    : env_(env),
      swapper_(swapper),
      stats_(stats),
      state_chunk_elems_(std::max(
          state_chunk_elems / PartitionStore::kChunkQuantum * PartitionStore::kChunkQuantum,
          PartitionStore::kChunkQuantum)),
      huge_page_bytes_(huge_page_bytes),
      arena_capacity_(0) {
  for (DataKind k : kKinds) SetDefaultPlacement(k, placement[k]);
  SetArenaCapacity(arena_capacity);
}

void PartitionStoreFactory::SetArenaCapacity(uint64_t bytes) {
  arena_capacity_.store(bytes / ShmArena::kAlignment * ShmArena::kAlignment,
                        std::memory_order_relaxed);
}

absl::Status PartitionStoreFactory::CheckPlacement(DataKind kind, int percent, bool has_nvme) {
  if (percent < 0 || percent > 100) {
    return absl::InvalidArgumentError(absl::StrCat(DataKindName(kind),
                                                   " placement must keep 0 to 100 percent on "
                                                   "the host, got ",
                                                   percent));
  }
  if (percent < 100 && !has_nvme) {
    return absl::FailedPreconditionError(
        absl::StrCat(DataKindName(kind), " cannot be placed on NVMe (", 100 - percent,
                     "% asked for): this offloadd has no NVMe tier (set nvme.dirs)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PartitionStore>> PartitionStoreFactory::CreateStore(
    uint64_t session_id, const PlacementChange& change,
    std::shared_ptr<std::atomic<int64_t>> span_mappings) {
  Placement placement;
  for (DataKind k : kKinds) {
    placement[k] = change[k].value_or(default_percent_[static_cast<int>(k)].load());
    RETURN_IF_ERROR(CheckPlacement(k, placement[k], swapper_->has_nvme()));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<ShmArena> arena,
                   ShmArena::Create(absl::StrCat("session-", session_id), arena_capacity(), env_,
                                    std::move(span_mappings)));
  return std::unique_ptr<PartitionStore>(new PartitionStore(session_id, std::move(arena), swapper_,
                                                            stats_, placement, state_chunk_elems_,
                                                            huge_page_bytes_));
}

PartitionStore::PartitionStore(uint64_t session_id, std::unique_ptr<ShmArena> arena,
                               Swapper* swapper, Stats* stats, const Placement& placement,
                               uint64_t state_chunk_elems, uint64_t huge_page_bytes)
    : session_id_(session_id),
      arena_(std::move(arena)),
      swapper_(swapper),
      stats_(stats),
      state_chunk_elems_(state_chunk_elems),
      huge_page_bytes_(huge_page_bytes),
      placement_(placement) {}

uint64_t ArenaLayoutPageBytes(uint64_t numel, DType param_dtype, DType grad_dtype, bool fp32_init,
                              uint64_t chunk_elems, uint64_t huge_page_bytes) {
  const uint64_t small = ShmArena::kAlignment, huge = huge_page_bytes;
  if (huge <= small) return small;
  // The regions: params, grads, the fp32 initial values, the second
  // working-copy buffer.
  const uint64_t element_sizes[] = {DTypeSize(param_dtype), DTypeSize(grad_dtype),
                                    fp32_init ? sizeof(float) : 0, DTypeSize(param_dtype)};
  uint64_t laid_out = 0, wasted = 0;
  for (uint64_t size : element_sizes) {
    if (size == 0) continue;
    if (chunk_elems * size % huge != 0) return small;
    const uint64_t bytes = numel * size;
    laid_out += ShmArena::RoundedSize(bytes);
    wasted += RoundUp(bytes, huge) - ShmArena::RoundedSize(bytes);
  }
  return wasted * 8 <= laid_out ? huge : small;
}

absl::Status PartitionStore::SetPlacement(const PlacementChange& change) {
  for (DataKind k : kKinds) {
    if (change[k].has_value()) {
      RETURN_IF_ERROR(PartitionStoreFactory::CheckPlacement(k, *change[k], swapper_->has_nvme()));
    }
  }
  // Until every block has its new home: a second change, or a registration,
  // sees this one whole.
  absl::MutexLock placing(&placement_mu_);
  struct Move {
    uint64_t id;
    uint64_t chunks;
    DataKind kind;
    Tier home;
    Tier was;  // (put back there, should the change fail)
  };
  std::vector<Move> moves;
  // Twice under the set's lock: first to see how much more would rest on
  // NVMe (refused before anything changes if the tier cannot hold it; the
  // swapper is asked between, without the set's lock), then to apply.
  // placement_mu_ keeps the partitions and their homes as they are between.
  auto plan = [&](bool apply) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    int64_t to_nvme = 0;
    for (DataKind k : kKinds) {
      if (!change[k].has_value()) continue;
      const int kind = static_cast<int>(k);
      uint64_t host = 0, total = 0;
      for (auto& [id, p] : partitions_) {
        const uint64_t add = p->Bytes(k);
        const Tier home = HomeFor(host, total, add, *change[k]);
        total += add;
        if (home == Tier::kHost) host += add;
        if (home != p->home[kind]) {
          // What moves now: not an accumulator not made yet (it is checked
          // against the tier when it is).
          const int64_t moving = static_cast<int64_t>(
              k == DataKind::kOptimizerState ? 3 * p->info.numel * sizeof(float) : add);
          to_nvme += home == Tier::kNvme ? moving : -moving;
          if (apply) {
            moves.push_back({id, ChunksOf(p->info.numel), k, home, p->home[kind]});
            p->home[kind] = home;
          }
        }
      }
      if (apply) {
        placement_[k] = *change[k];
        bytes_[kind][static_cast<int>(Tier::kHost)] = host;
        bytes_[kind][static_cast<int>(Tier::kNvme)] = total - host;
      }
    }
    return to_nvme;
  };
  int64_t to_nvme;
  {
    absl::MutexLock lock(&mu_);
    to_nvme = plan(/*apply=*/false);
  }
  if (to_nvme > 0 && static_cast<uint64_t>(to_nvme) > swapper_->NvmeRoom()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "placing ", to_nvme, " more bytes of this session on NVMe: the tier has room for ",
        swapper_->NvmeRoom(), " (nvme.bytes_per_dir in each of nvme.dirs); nothing moved"));
  }
  // As they were, should a block's move fail (the estimate above leaves
  // out accumulators and second working copies that exist): put back.
  Placement placement_was;
  uint64_t bytes_was[kDataKinds][2];
  {
    absl::MutexLock lock(&mu_);
    placement_was = placement_;
    std::memcpy(bytes_was, bytes_, sizeof(bytes_));
    plan(/*apply=*/true);
  }
  // Outside the set's lock; each call returns at once.
  std::vector<std::pair<Swapper::BlockId, Tier>> moved_blocks;  // and the home each had
  absl::Status status;
  for (const Move& m : moves) {
    for (uint64_t c = 0; c < m.chunks && status.ok(); ++c) {
      for (int b = 0; b < PartitionStore::kBlockKinds; ++b) {
        // The fp32 initial values stay on the host until committed.
        if (KindOfBlock(b) != m.kind || b == PartitionStore::kInitBlock) continue;
        const Swapper::BlockId block = PartitionStore::BlockOf(m.id, c, b);
        absl::Status moved = swapper_->SetHome(block, m.home);
        // The working-copy buffer not in use exists only with the delayed
        // update (either kind, by the version); the accumulator once used
        // (it is made with the home set here).
        const bool maybe_absent = b == PartitionStore::kShadowBlock ||
                                  b == PartitionStore::kParamsBlock ||
                                  b == PartitionStore::kAccumBlock;
        if (maybe_absent && absl::IsNotFound(moved)) continue;
        if (!moved.ok()) {
          status = std::move(moved);
          break;
        }
        moved_blocks.push_back({block, m.was});
      }
    }
    if (!status.ok()) break;
  }
  if (status.ok()) return absl::OkStatus();
  // Every block back where it was (what a move freed is there to take
  // again), and the set's homes and figures with them.
  for (auto it = moved_blocks.rbegin(); it != moved_blocks.rend(); ++it) {
    if (absl::Status back = swapper_->SetHome(it->first, it->second); !back.ok()) {
      LogWarning("placement: block %d not moved back: %s", static_cast<int64_t>(it->first),
                 back.ToString());
    }
  }
  {
    absl::MutexLock lock(&mu_);
    placement_ = placement_was;
    std::memcpy(bytes_, bytes_was, sizeof(bytes_));
    for (const Move& m : moves) {
      auto p = partitions_.find(m.id);
      if (p == partitions_.end()) continue;
      p->second->home[static_cast<int>(m.kind)] = m.was;
    }
  }
  return absl::Status(status.code(), absl::StrCat(status.message(), "; nothing moved"));
}

PartitionStore::~PartitionStore() {
  // No call can be in flight: the last reference is going. The trainer's
  // holds go first (an external block is removed only unpinned), then every
  // block, before the partitions' mappings go with partitions_. The
  // swapper is called without the set's lock, as everywhere.
  std::vector<Swapper::Pin> holds;
  std::vector<std::pair<uint64_t, uint64_t>> chunks;  // partition, chunks
  std::vector<ArenaRegion> spans;                     // in the arena
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, p] : partitions_) {
      chunks.emplace_back(id, ChunksOf(p->info.numel));
      spans.push_back(p->info.span);
      p->TakeHolds(&holds);
    }
  }
  holds.clear();
  std::vector<uint64_t> blocks;
  for (const auto& [id, n] : chunks) {
    for (uint64_t c = 0; c < n; ++c) {
      for (int b = 0; b < PartitionStore::kBlockKinds; ++b) {
        blocks.push_back(PartitionStore::BlockOf(id, c, b));
      }
    }
  }
  // The partitions' pages are freed a run of adjacent spans at a time
  // below, not block by block; the pool keeps their charges until then.
  // (Not the whole arena: its request ring says the session closed.)
  std::vector<PoolCharge> charges;
  swapper_->RemoveAll(blocks, &charges);
  std::sort(spans.begin(), spans.end(),
            [](const ArenaRegion& a, const ArenaRegion& b) { return a.offset < b.offset; });
  for (size_t i = 0; i < spans.size();) {
    const uint64_t begin = spans[i].offset;
    uint64_t end = begin + spans[i].bytes;
    for (++i; i < spans.size() && spans[i].offset <= end; ++i) {
      end = std::max(end, spans[i].offset + spans[i].bytes);
    }
    if (absl::Status freed = arena_->Discard(begin, end - begin); !freed.ok()) {
      LogWarning("session %d: %s (the pages go with the arena)", static_cast<int64_t>(session_id_),
                 freed.ToString());
    }
  }
  swapper_->ReleaseCharges(&charges);
  swapper_->ForgetTrace(session_id_);  // the session's learned access order and I/O weight
}

uint64_t PartitionStore::ChunksOf(uint64_t numel) const {
  return (numel + state_chunk_elems_ - 1) / state_chunk_elems_;
}

void PartitionStore::SetShareWeight(int64_t weight) {
  share_weight_.store(weight, std::memory_order_relaxed);
  swapper_->SetIoWeight(session_id_, weight);
}

size_t PartitionStore::partitions() const {
  absl::MutexLock lock(&mu_);
  return partitions_.size();
}

bool PartitionStore::Contains(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  return Find(id) != nullptr;
}

std::vector<PartitionStore::TensorSlice> PartitionStore::TensorSlices() const {
  absl::MutexLock lock(&mu_);
  std::vector<TensorSlice> out;
  out.reserve(partitions_.size());
  for (const auto& [id, p] : partitions_) {
    out.push_back({p->tensor, p->tensor_offset, p->info.numel});
  }
  return out;
}

size_t PartitionStore::held() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [id, p] : partitions_) n += p->held() ? 1 : 0;
  return n;
}

uint64_t PartitionStore::steps() const {
  absl::MutexLock lock(&mu_);
  return steps_;
}

bool PartitionStore::stopped_midway() const {
  absl::MutexLock lock(&mu_);
  return StoppedMidwayLocked();
}

bool PartitionStore::StoppedMidwayLocked() const {
  return absl::c_any_of(partitions_, [](const auto& e) { return e.second->stopped; });
}

uint64_t PartitionStore::bytes(DataKind kind, Tier home) const {
  absl::MutexLock lock(&mu_);
  return bytes_[static_cast<int>(kind)][static_cast<int>(home)];
}

int PartitionStore::ParamsKind(const Partition& p, bool next) {
  return (p.version == 1) != next ? PartitionStore::kShadowBlock : PartitionStore::kParamsBlock;
}

void PartitionStore::AwaitOutOfStep(absl::Span<Partition* const> partitions, bool delayed_ok) {
  auto in_step = [partitions, delayed_ok]() {
    for (const Partition* p : partitions) {
      if (p->step == StepState::kIn || (p->step == StepState::kInDelayed && !delayed_ok)) {
        return true;
      }
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

PartitionStore::Partition* PartitionStore::Find(uint64_t id) const {
  auto it = partitions_.find(id);
  return it == partitions_.end() ? nullptr : it->second.get();
}

absl::StatusOr<PartitionStore::Partition*> PartitionStore::FindOrNotFound(uint64_t id) const {
  if (Partition* p = Find(id)) return p;
  return absl::NotFoundError(absl::StrCat("partition ", id, " is not registered"));
}

absl::StatusOr<Swapper::Pin> PartitionStore::PinBlock(uint64_t id, uint64_t chunk, int block_kind,
                                                      bool for_write, Swapper::Use use) {
  const uint64_t block = PartitionStore::BlockOf(id, chunk, block_kind);
  absl::StatusOr<Swapper::Pin> pin = swapper_->Acquire(block, for_write, use);
  if (block_kind != PartitionStore::kAccumBlock || !absl::IsNotFound(pin.status())) return pin;
  // The gradient accumulator (fp32, 4 bytes a parameter) is made the first
  // time it is needed: a trainer that hands its gradients over (one
  // micro-batch a step) never needs one, and the pool does not hold one for
  // it. Placed with the optimizer state.
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(Partition * p, FindOrNotFound(id));
    if (chunk >= ChunksOf(p->info.numel)) {
      return absl::InternalError(absl::StrCat("partition ", id, " has no chunk ", chunk));
    }
  }
  // info.numel never changes after registration; home only under the lock
  // (AddAccumulator reads it so).
  RETURN_IF_ERROR(AddAccumulator(id, chunk, /*registering=*/nullptr));
  return swapper_->Acquire(block, for_write, use);
}

absl::Status PartitionStore::AddAccumulator(uint64_t id, uint64_t chunk,
                                            const Partition* registering) {
  uint64_t numel;
  Tier home;
  // A placement change (SetPlacement) waits until the block is made with the
  // home read here, so that it finds and moves it. Register holds
  // placement_mu_ already.
  std::optional<absl::MutexLock> placing;
  if (registering != nullptr) {  // not in partitions_ yet: nobody else sees it
    numel = registering->info.numel;
    home = registering->home[static_cast<int>(DataKind::kOptimizerState)];
  } else {
    placing.emplace(&placement_mu_);
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(Partition * p, FindOrNotFound(id));
    numel = p->info.numel;
    home = p->home[static_cast<int>(DataKind::kOptimizerState)];
  }
  const uint64_t begin = chunk * state_chunk_elems_;
  const uint64_t elems = std::min(state_chunk_elems_, numel - begin);
  absl::Status added =
      swapper_->Add(PartitionStore::BlockOf(id, chunk, PartitionStore::kAccumBlock),
                    elems * sizeof(float), home, session_id_);
  if (!added.ok() && !absl::IsAlreadyExists(added)) {  // made meanwhile: fine
    return absl::Status(added.code(), absl::StrCat("allocating the gradient accumulator of "
                                                   "partition ",
                                                   id, ": ", added.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<Swapper::Pin>> PartitionStore::Hold(const Partition& p, int kind,
                                                               bool for_write) {
  const bool grads = kind == PartitionStore::kGradsBlock;
  // info.id and info.numel never change after registration.
  const uint64_t chunks = ChunksOf(p.info.numel);
  std::vector<Swapper::Pin> pins;
  pins.reserve(chunks);
  for (uint64_t c = 0; c < chunks; ++c) {
    absl::StatusOr<Swapper::Pin> pin = PinBlock(p.info.id, c, kind, for_write);
    if (!pin.ok()) {
      return absl::Status(
          pin.status().code(),
          absl::StrCat("holding the ", grads ? "gradient buffer" : "parameters", " of partition ",
                       p.info.id, " ('", p.info.name, "'): ", pin.status().message()));
    }
    pins.push_back(*std::move(pin));
  }
  return pins;
}

absl::Status CheckPartitionSpec(const PartitionSpec& spec) {
  // The name first: the messages below quote it.
  RETURN_IF_ERROR(CheckName(spec.name, "partition name", /*may_be_empty=*/false));
  if (spec.numel == 0 || spec.numel > PartitionStore::kMaxNumel) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition '", spec.name, "' numel ", spec.numel, " must be in [1, 2^40]"));
  }
  if (!spec.tensor.empty()) {
    RETURN_IF_ERROR(CheckName(spec.tensor, "tensor name", /*may_be_empty=*/false));
  }
  if (spec.shape.size() > 16) {
    return absl::InvalidArgumentError(absl::StrCat("partition '", spec.name, "': a shape of ",
                                                   spec.shape.size(), " dimensions (at most 16)"));
  }
  uint64_t tensor_numel = 1;
  for (uint64_t d : spec.shape) {
    if (d == 0 || d > PartitionStore::kMaxNumel / tensor_numel) {
      return absl::InvalidArgumentError(absl::StrCat("partition '", spec.name,
                                                     "': its tensor's shape has a dimension of ", d,
                                                     " or more than 2^40 elements"));
    }
    tensor_numel *= d;
  }
  // A slice may lie wholly past its tensor's end (more ranks than
  // elements: all padding), not past 2^40.
  if (spec.tensor_offset > PartitionStore::kMaxNumel) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition '", spec.name, "': offset ", spec.tensor_offset, " is over 2^40"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PartitionInfo> PartitionStore::Register(uint64_t id, const PartitionSpec& spec,
                                                       const RestoredState* restored) {
  RETURN_IF_ERROR(CheckPartitionSpec(spec));
  // With restored state the fp32 initial values are not asked for.
  const bool fp32_init = spec.fp32_master && restored == nullptr;
  const std::string what = absl::StrCat("partition '", spec.name, "' of session ", session_id_);
  auto partition = std::make_unique<Partition>();
  partition->tensor = spec.tensor.empty() ? spec.name : spec.tensor;
  partition->shape = spec.shape;
  partition->tensor_offset = spec.tensor_offset;
  PartitionInfo& info = partition->info;
  info.id = id;
  info.name = spec.name;
  info.numel = spec.numel;
  info.param_dtype = spec.param_dtype;
  info.grad_dtype = spec.grad_dtype;
  // Registrations and placement changes of this set, one at a time (see
  // SetPlacement); held while the swapper makes room.
  absl::MutexLock placing(&placement_mu_);
  bool with_shadow = false;
  {
    absl::MutexLock lock(&mu_);
    if (names_.contains(spec.name)) {
      return absl::AlreadyExistsError(absl::StrCat(
          "session ", session_id_, " already has a partition named '", spec.name, "'"));
    }
    // Claimed now; given back below if the registration fails.
    names_.insert(spec.name);
    with_shadow = delayed_;  // stable: SetDelayedUpdate holds placement_mu_ too
    if (restored != nullptr && restored->next_params_pending && !with_shadow) {
      names_.erase(spec.name);
      return absl::FailedPreconditionError(
          absl::StrCat(what,
                       ": the checkpoint holds a newer working copy of the delayed update, but the "
                       "session's delayed update is off"));
    }
    for (DataKind k : kKinds) {
      const int kind = static_cast<int>(k);
      partition->home[kind] = HomeFor(bytes_[kind][0], bytes_[kind][0] + bytes_[kind][1],
                                      partition->Bytes(k), placement_[k]);
    }
  }
  // Outside the set's lock: making room may wait for write-outs.
  std::vector<uint64_t> added;                           // blocks, to remove if a later step fails
  std::optional<std::pair<uint64_t, uint64_t>> spanned;  // its arena span (offset, alignment)
  absl::flat_hash_set<uint64_t> adopted;  // of those, taken from the pool's file as kept
  absl::Status status = [&]() -> absl::Status {
    const uint64_t param_bytes = partition->Bytes(DataKind::kParams);
    const uint64_t grad_bytes = partition->Bytes(DataKind::kGrads);
    // One allocation, so that params, grads (and the fp32 initial values)
    // are adjacent and one mapping covers them (the partition's own, or
    // its window's, shared with the small partitions around it). Each
    // region starts on a page of the layout's size: a block (a chunk of one
    // region) never shares a page with another.
    const uint64_t page = ArenaLayoutPageBytes(spec.numel, spec.param_dtype, spec.grad_dtype,
                                               fp32_init, state_chunk_elems_, huge_page_bytes_);
    partition->page_bytes = page;
    info.huge_pages = page > ShmArena::kAlignment;
    auto rounded = [page](uint64_t bytes) { return RoundUp(bytes, page); };
    const uint64_t grads_at = rounded(param_bytes);
    const uint64_t init_at = grads_at + rounded(grad_bytes);
    const uint64_t init_bytes = fp32_init ? spec.numel * sizeof(float) : 0;
    // The working copy's second buffer (the delayed update) last: address
    // space only, until the delayed update is switched on.
    const uint64_t shadow_at = fp32_init ? init_at + rounded(init_bytes) : init_at;
    const uint64_t span = shadow_at + rounded(param_bytes);
    ASSIGN_OR_RETURN(uint64_t params_off, arena_->Allocate(span, page));
    spanned.emplace(params_off, page);
    info.params = {params_off, param_bytes};
    info.grads = {params_off + grads_at, grad_bytes};
    info.span = {params_off, span};
    if (fp32_init) info.master_init = {params_off + init_at, init_bytes};
    partition->init_at = init_at;
    partition->init_bytes = init_bytes;
    ASSIGN_OR_RETURN(
        partition->region,
        arena_->MapSpan(params_off, span, info.huge_pages ? Pages::kHuge : Pages::kSmall));
    partition->grads = partition->region.data() + grads_at;
    partition->params_offset[0] = params_off;
    partition->params_offset[1] = params_off + shadow_at;
    partition->buffer[0] = partition->region.data();
    partition->buffer[1] = partition->region.data() + shadow_at;
    if (fp32_init) partition->master = MasterState::kInitPending;
    const Tier* home = partition->home;
    // A block of the partition's span, `at` bytes into it, in the daemon's
    // mapping and in the arena's file.
    auto in_span = [&](uint64_t at) {
      return ExternalMemory{partition->region.data() + at, page, arena_->fd(), params_off + at};
    };
    for (uint64_t begin = 0, c = 0; begin < spec.numel; begin += state_chunk_elems_, ++c) {
      const uint64_t elems = std::min(state_chunk_elems_, spec.numel - begin);
      for (int b = 0; b < PartitionStore::kBlockKinds; ++b) {
        const uint64_t block = PartitionStore::BlockOf(id, c, b);
        const Tier where = home[static_cast<int>(KindOfBlock(b))];
        absl::Status s;
        if (b == PartitionStore::kShadowBlock) {
          if (!with_shadow) continue;
          const uint64_t size = DTypeSize(spec.param_dtype);
          s = swapper_->AddExternal(block, in_span(shadow_at + begin * size), elems * size, where,
                                    session_id_);
        } else if (b == PartitionStore::kInitBlock) {
          if (!fp32_init) continue;
          s = swapper_->AddExternal(block, in_span(init_at + begin * 4), elems * sizeof(float),
                                    Tier::kHost, session_id_);
        } else if (b == PartitionStore::kParamsBlock) {
          const uint64_t size = DTypeSize(spec.param_dtype);
          s = swapper_->AddExternal(block, in_span(begin * size), elems * size, where, session_id_);
        } else if (b == PartitionStore::kGradsBlock) {
          const uint64_t size = DTypeSize(spec.grad_dtype);
          s = swapper_->AddExternal(block, in_span(grads_at + begin * size), elems * size, where,
                                    session_id_);
        } else if (b == PartitionStore::kAccumBlock) {
          continue;  // made when first needed (PinBlock): handed-over gradients need none
        } else {
          // Kept in this pool's file by the previous offloadd: taken where
          // it is (FillRestored checks it), else a new block read into.
          std::optional<RestoredState::InMemory> kept;
          const PoolFile* file = swapper_->pool().file();
          if (restored != nullptr && restored->master_initialized && restored->in_memory &&
              file != nullptr) {
            kept = restored->in_memory(b, begin, elems);
            if (kept.has_value() &&
                (kept->bytes != elems * sizeof(float) || !file->IsFile(kept->file))) {
              kept.reset();
            }
          }
          if (kept.has_value()) {
            s = swapper_->AddKept(block, elems * sizeof(float), where, session_id_, kept->offset);
            if (s.ok()) adopted.insert(block);
          }
          if (!kept.has_value() || absl::IsFailedPrecondition(s)) {
            s = swapper_->Add(block, elems * sizeof(float), where, session_id_);
          }
        }
        if (!s.ok()) {
          return absl::Status(s.code(), absl::StrCat("allocating ", what, ": ", s.message()));
        }
        added.push_back(block);
      }
    }
    // Held for the trainer to write the initial values.
    ASSIGN_OR_RETURN(partition->param_pins,
                     Hold(*partition, PartitionStore::kParamsBlock, /*for_write=*/true));
    if (restored != nullptr) {
      absl::Status filled = FillRestored(*partition, *restored, with_shadow, adopted);
      if (!filled.ok()) {
        return absl::Status(filled.code(),
                            absl::StrCat("restoring ", what, ": ", filled.message()));
      }
    }
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    // Unpinned before the blocks go, their pages freed with them; the arena
    // span given back where it is still the last (else it stays unused:
    // the arena only grows), so that a registration retried for room does
    // not take new space each time.
    partition->param_pins.clear();
    for (uint64_t block : added) swapper_->Remove(block);
    // Accumulators a restore made (FillRestored); unknown ids are ignored.
    for (uint64_t c = 0; c < ChunksOf(spec.numel); ++c) {
      swapper_->Remove(PartitionStore::BlockOf(id, c, PartitionStore::kAccumBlock));
    }
    if (spanned) {
      partition->region = MappedSpan();
      arena_->GiveBack(spanned->first, partition->info.span.bytes, spanned->second);
    }
    absl::MutexLock lock(&mu_);
    names_.erase(spec.name);
    return status;
  }
  if (restored != nullptr) {
    partition->info.step = restored->step;
    partition->info.restored = true;
    partition->master =
        restored->master_initialized ? MasterState::kInitialized : MasterState::kUnset;
    partition->gradients = restored->grads_ready ? GradState::kAccumulated : GradState::kNone;
    partition->micro_batches = restored->micro_batches;
    partition->grad_stats = restored->grad_stats;
    partition->swap_pending = restored->next_params_pending;
  }
  absl::MutexLock lock(&mu_);
  for (DataKind k : kKinds) {
    const int kind = static_cast<int>(k);
    bytes_[kind][static_cast<int>(partition->home[kind])] += partition->Bytes(k);
  }
  PartitionInfo out = partition->info;
  partition->writable_hold = true;  // for the initial values
  partitions_[id] = std::move(partition);
  return out;
}

bool PartitionStore::GradsBusyLocked(absl::Span<Partition* const> wanted) const {
  for (const Partition* p : wanted) {
    if (p->gradients == GradState::kHandedOver && (p->accumulating || p->step != StepState::kOut)) {
      return true;
    }
  }
  return false;
}

absl::Status PartitionStore::NotReadyLocked() const {
  stats_->grad_holds_not_ready.fetch_add(1, std::memory_order_relaxed);
  return absl::AbortedError(absl::StrCat("session ", session_id_, ": a gradient buffer asked for ",
                                         ring::kNotReadyWords, ": nothing held)"));
}

absl::StatusOr<std::vector<PartitionStore::Partition*>> PartitionStore::WantedLocked(
    absl::Span<const uint64_t> ids) const {
  std::vector<Partition*> wanted;
  if (ids.empty()) {
    for (const auto& [id, p] : partitions_) wanted.push_back(p.get());
  } else {
    for (uint64_t id : ids) {
      ASSIGN_OR_RETURN(Partition * p, FindOrNotFound(id));
      wanted.push_back(p);
    }
  }
  return wanted;
}

absl::Status PartitionStore::RefuseGradsNotReady(absl::Span<const uint64_t> ids) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(std::vector<Partition*> wanted, WantedLocked(ids));
  return GradsBusyLocked(wanted) ? NotReadyLocked() : absl::OkStatus();
}

absl::StatusOr<std::vector<PartitionInfo>> PartitionStore::Fetch(absl::Span<const uint64_t> ids,
                                                                 FetchMode mode) {
  std::vector<Partition*> wanted;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(wanted, WantedLocked(ids));
    if (mode.grads) {
      // A gradient buffer handed over is the daemon's until the step has
      // read it: the trainer gets it back once it is measured and its
      // partition's update is done.
      if (mode.if_ready && GradsBusyLocked(wanted)) return NotReadyLocked();
      if (GradsBusyLocked(wanted)) {
        stats_->waits_for_step.fetch_add(1, std::memory_order_relaxed);
        do {
          step_ended_.Wait(&mu_);
        } while (GradsBusyLocked(wanted));
      }
      // (StepRunner::Reclaim takes buffers back before a fetch; this is a
      // return with hand_over that raced with it.)
      RETURN_IF_ERROR(RefuseHandedOverLocked(wanted));
    }
    if (mode.load && delayed_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session ", session_id_,
          ": loading parameters needs the delayed update off (SetDelayedUpdate(false) first)"));
    }
  }
  // A load: the fp32 values' regions of the partitions that have one,
  // taken before any hold (a failure then holds nothing and leaves nothing).
  std::vector<Partition*> with_init;
  if (mode.load) {
    mode.writable = true;
    for (Partition* p : wanted) {
      bool pending;
      {
        absl::MutexLock lock(&mu_);
        pending = p->master == MasterState::kInitPending;
      }
      if (pending || p->init_bytes == 0) continue;
      if (absl::Status added = AddInitBlocks(*p); !added.ok()) {
        for (Partition* q : with_init) RemoveInitBlocks(*q);
        return added;
      }
      with_init.push_back(p);
    }
  }
  absl::Cleanup drop_init = [&] {
    for (Partition* q : with_init) RemoveInitBlocks(*q);
  };
  // Outside the lock: swap-ins take time. Pins taken here that turn out not
  // to be needed (held meanwhile) are dropped when `spare` goes, also
  // outside the lock.
  struct Taken {
    std::vector<Swapper::Pin> params, grads;
  };
  std::vector<Swapper::Pin> spare;
  std::vector<PartitionInfo> out;
  bool recapture = false;  // a checkpoint began before this writable hold
  for (;;) {               // again only if a delayed update's commit swapped a buffer meanwhile
    std::vector<int> kinds(wanted.size());
    // What is held already is not acquired again (nor recorded in the
    // learned order again); a writable fetch pins for writing.
    std::vector<bool> need_params(wanted.size()), need_grads(wanted.size());
    {
      absl::MutexLock lock(&mu_);
      for (size_t i = 0; i < wanted.size(); ++i) {
        kinds[i] = ParamsKind(*wanted[i], false);
        need_params[i] = wanted[i]->param_pins.empty() || mode.writable;
        need_grads[i] = mode.grads && wanted[i]->grad_pins.empty();
      }
    }
    std::vector<Taken> taken(wanted.size());
    bool moved = false;  // a buffer went while holding: the version changed
    for (size_t i = 0; i < wanted.size() && !moved; ++i) {
      if (!need_params[i]) {
        if (need_grads[i]) {
          ASSIGN_OR_RETURN(taken[i].grads,
                           Hold(*wanted[i], PartitionStore::kGradsBlock, /*for_write=*/true));
        }
        continue;
      }
      absl::StatusOr<std::vector<Swapper::Pin>> held = Hold(*wanted[i], kinds[i], mode.writable);
      if (!held.ok()) {
        absl::MutexLock lock(&mu_);
        if (!absl::IsNotFound(held.status()) || kinds[i] == ParamsKind(*wanted[i], false)) {
          return held.status();
        }
        moved = true;
        break;
      }
      taken[i].params = *std::move(held);
      if (need_grads[i]) {
        ASSIGN_OR_RETURN(taken[i].grads,
                         Hold(*wanted[i], PartitionStore::kGradsBlock, /*for_write=*/true));
      }
    }
    absl::MutexLock lock(&mu_);
    // Parameters being updated are not handed out half-written (a delayed
    // update writes the other buffer: no wait).
    AwaitOutOfStep(wanted, /*delayed_ok=*/true);
    bool same = !moved;
    for (size_t i = 0; i < wanted.size(); ++i) same &= kinds[i] == ParamsKind(*wanted[i], false);
    if (!same) {
      for (Taken& t : taken) {
        for (auto* v : {&t.params, &t.grads}) {
          std::move(v->begin(), v->end(), std::back_inserter(spare));
        }
      }
      continue;
    }
    // Checked again: a return with hand_over may have finished while the
    // pins were taken (`taken` lets them go, after the lock).
    if (mode.grads) RETURN_IF_ERROR(RefuseHandedOverLocked(wanted));
    // Nor parameters a step that stopped midway updated in part (the
    // chunks before resume_chunk): they are of two steps until Step
    // finishes it.
    for (const Partition* p : wanted) {
      if (p->stopped && !p->stopped_delayed && p->resume_chunk > 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "partition ", p->info.id, " ('", p->info.name,
            "') is in a step that stopped midway, its parameters updated in part: Step again to "
            "finish it before fetching them"));
      }
    }
    out.reserve(wanted.size());
    // Marked under the lock a checkpoint begins under: either it sees the
    // hold (and refuses), or this sees it (and captures before returning).
    recapture = mode.writable && capture_ != nullptr;
    for (Partition* p : with_init) {
      if (!p->loading) {
        p->loading = true;
        p->before_load = p->master;
      }
      // Its release makes the fp32 values written there the master weights.
      p->master = MasterState::kInitPending;
      p->info.master_init = {p->info.span.offset + p->init_at, p->init_bytes};
    }
    for (size_t i = 0; i < wanted.size(); ++i) {
      Partition* p = wanted[i];
      if (mode.writable) p->writable_hold = true;
      if (mode.load && p->init_bytes == 0) {
        p->master_from_working = true;
        if (!p->loading) {
          p->loading = true;
          p->before_load = p->master;
        }
      }
      if (fetched_.insert(p->info.id).second) fetch_order_.push_back(p->info.id);
      for (auto [have, got] : {std::pair{&p->param_pins, &taken[i].params},
                               std::pair{&p->grad_pins, &taken[i].grads}}) {
        if (got->empty()) continue;
        if (have->empty()) {
          *have = std::move(*got);
        } else {
          std::move(got->begin(), got->end(), std::back_inserter(spare));
        }
      }
      out.push_back(p->info);
    }
    break;
  }
  std::move(drop_init).Cancel();  // the release commits them
  // A checkpoint being written keeps what the trainer is about to change:
  // before the trainer has the pointers.
  if (recapture) CaptureAll(wanted);
  return out;  // `spare` unpins after the lock went
}

absl::Status PartitionStore::Release(absl::Span<const uint64_t> ids) {
  std::vector<Partition*> which, commits, reloads, marked;
  {
    absl::MutexLock lock(&mu_);
    if (ids.empty()) {
      for (const auto& [id, p] : partitions_) {
        if (p->held()) which.push_back(p.get());
      }
    }
    for (uint64_t id : ids) {
      ASSIGN_OR_RETURN(Partition * p, FindOrNotFound(id));
      if (!p->held()) {
        return absl::FailedPreconditionError(absl::StrCat("partition ", id, " ('", p->info.name,
                                                          "') is not held; nothing was released"));
      }
      which.push_back(p);
    }
    for (Partition* p : which) {
      if (p->master == MasterState::kInitPending) commits.push_back(p);
      if (p->master_from_working) reloads.push_back(p);
      if (p->master == MasterState::kInitPending || p->master_from_working) {
        ++p->committing;
        marked.push_back(p);
      }
    }
  }
  auto committed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (Partition* p : marked) --p->committing;
  };
  // Outside the lock (swap-ins); the partitions stay held meanwhile.
  absl::Status commit;
  for (Partition* p : commits) {
    if (commit.ok()) commit = CommitMasterInit(*p);
  }
  for (Partition* p : reloads) {
    if (commit.ok()) commit = MasterFromWorking(*p);
  }
  if (!commit.ok()) {
    // Its trainer gone meanwhile (DropHolds left these to this commit): the
    // load is undone and the holds go, as DropHolds does.
    std::vector<Swapper::Pin> released;
    std::vector<Partition*> unloaded, rewritten;
    {
      absl::MutexLock lock(&mu_);
      committed();
      for (Partition* p : marked) {
        if (!p->dropped || p->committing > 0) continue;
        p->dropped = false;
        UndoLoadLocked(*p, &unloaded, &rewritten);
        p->TakeHolds(&released);
      }
    }
    released.clear();
    FinishUndo(unloaded, rewritten);
    return commit;
  }
  std::vector<Swapper::Pin> released;
  {
    absl::MutexLock lock(&mu_);
    committed();
    for (Partition* p : marked) {
      if (p->committing == 0) p->dropped = false;
    }
    for (Partition* p : commits) {
      p->master = MasterState::kInitialized;
      p->info.master_init = {};
    }
    for (Partition* p : reloads) p->master_from_working = false;
    for (Partition* p : which) {
      p->TakeHolds(&released);
      p->loading = false;
    }
  }
  // The fp32 initial values are in the master weights now: their pages go.
  for (Partition* p : commits) {
    for (uint64_t c = 0; c < ChunksOf(p->info.numel); ++c) {
      swapper_->Remove(PartitionStore::BlockOf(p->info.id, c, PartitionStore::kInitBlock));
    }
  }
  return absl::OkStatus();  // `released` unpins here, outside the lock
}

absl::Status PartitionStore::MasterFromWorking(const Partition& p) {
  const uint64_t id = p.info.id;
  for (uint64_t c = 0; c < ChunksOf(p.info.numel); ++c) {
    ASSIGN_OR_RETURN(Swapper::Pin params,
                     PinBlock(id, c, ParamsKind(p, /*next=*/false), /*for_write=*/false));
    ASSIGN_OR_RETURN(Swapper::Pin master, PinBlock(id, c, PartitionStore::kMaster, true));
    WidenToFloat(params.data(), p.info.param_dtype, reinterpret_cast<float*>(master.data()),
                 master.size() / sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status PartitionStore::WorkingFromMaster(const Partition& p) {
  const uint64_t id = p.info.id;
  for (uint64_t c = 0; c < ChunksOf(p.info.numel); ++c) {
    ASSIGN_OR_RETURN(Swapper::Pin master, PinBlock(id, c, PartitionStore::kMaster, false));
    ASSIGN_OR_RETURN(Swapper::Pin params,
                     PinBlock(id, c, ParamsKind(p, /*next=*/false), /*for_write=*/true));
    NarrowFromFloat(reinterpret_cast<const float*>(master.data()), p.info.param_dtype,
                    params.data(), master.size() / sizeof(float));
  }
  return absl::OkStatus();
}

namespace {

// INVALID_ARGUMENT unless [begin, begin + count) lies in a partition of
// `numel` elements.
absl::Status CheckMomentRange(uint64_t id, uint64_t numel, uint64_t begin, uint64_t count) {
  if (begin > numel || count > numel - begin) {
    return absl::InvalidArgumentError(absl::StrCat("partition ", id, " has ", numel,
                                                   " elements; asked for [", begin, ", ",
                                                   begin + count, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> PartitionStore::ReadMoments(uint64_t id, uint64_t begin, uint64_t count,
                                                     float* exp_avg, float* exp_avg_sq,
                                                     float* master) {
  uint64_t step;
  Partition* p;  // valid while the store lives (partitions go with it)
  bool widen = false;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(p, FindOrNotFound(id));
    RETURN_IF_ERROR(CheckMomentRange(id, p->info.numel, begin, count));
    AwaitOutOfStep(absl::MakeConstSpan(&p, 1));
    step = p->info.step;
    if (master != nullptr && p->master == MasterState::kInitPending) {
      return absl::FailedPreconditionError(absl::StrCat(
          "partition ", id,
          ": its fp32 initial values are the trainer's until it releases the partition"));
    }
    // Never stepped: the master weights are the working copy, widened (as
    // the first step makes them).
    widen = master != nullptr && p->master == MasterState::kUnset;
  }
  RETURN_IF_ERROR(CopyMoments(id, begin, count, exp_avg, exp_avg_sq, widen ? nullptr : master,
                              /*write=*/false));
  if (widen) RETURN_IF_ERROR(WidenWorking(*p, begin, count, master));
  return step;
}

absl::Status PartitionStore::WidenWorking(const Partition& p, uint64_t begin, uint64_t count,
                                          float* out) {
  const uint64_t esize = DTypeSize(p.info.param_dtype);
  for (uint64_t at = begin; at < begin + count;) {
    const uint64_t chunk = at / state_chunk_elems_;
    const uint64_t in_chunk = at - chunk * state_chunk_elems_;
    const uint64_t n = std::min(begin + count - at, state_chunk_elems_ - in_chunk);
    ASSIGN_OR_RETURN(Swapper::Pin params, PinBlock(p.info.id, chunk, ParamsKind(p, /*next=*/false),
                                                   /*for_write=*/false));
    WidenToFloat(params.data() + in_chunk * esize, p.info.param_dtype, out + (at - begin), n);
    at += n;
  }
  return absl::OkStatus();
}

absl::Status PartitionStore::WriteMoments(uint64_t id, uint64_t step, uint64_t begin,
                                          uint64_t count, const float* exp_avg,
                                          const float* exp_avg_sq) {
  // Values a step can take: the next step is step + 1 (its bias
  // corrections divide by 1 - beta^(step + 1)), and Adam takes the root of
  // the second moment. Checked before anything is written.
  if (step == std::numeric_limits<uint64_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition ", id, ": step ", step, " has no next step"));
  }
  for (uint64_t i = 0; i < count; ++i) {
    if (!std::isfinite(exp_avg[i]) || !std::isfinite(exp_avg_sq[i]) || exp_avg_sq[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "partition ", id, ": element ", begin + i, "'s moments (", exp_avg[i], ", ",
          exp_avg_sq[i], ") are not a finite first moment and a finite, non-negative second"));
    }
  }
  Partition* p;  // valid while the store lives (partitions go with it)
  {
    absl::MutexLock lock(&mu_);
    if (delayed_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "partition ", id,
          ": optimizer state is not written with the delayed update on (its step in flight would "
          "overwrite it); switch it off first"));
    }
    ASSIGN_OR_RETURN(p, FindOrNotFound(id));
    RETURN_IF_ERROR(CheckMomentRange(id, p->info.numel, begin, count));
    AwaitOutOfStep(absl::MakeConstSpan(&p, 1));
    ++moments_writing_;  // no step or checkpoint image begins until this ends
  }
  CaptureAll(absl::MakeConstSpan(&p, 1));  // a checkpoint being written keeps what was
  absl::Status copied = CopyMoments(id, begin, count, const_cast<float*>(exp_avg),
                                    const_cast<float*>(exp_avg_sq), /*master=*/nullptr,
                                    /*write=*/true);
  absl::MutexLock lock(&mu_);
  if (copied.ok()) p->info.step = step;
  --moments_writing_;
  step_ended_.SignalAll();
  return copied;
}

absl::Status PartitionStore::CopyMoments(uint64_t id, uint64_t begin, uint64_t count,
                                         float* exp_avg, float* exp_avg_sq, float* master,
                                         bool write) {
  const std::pair<float*, int> moments[] = {{exp_avg, PartitionStore::kExpAvg},
                                            {exp_avg_sq, PartitionStore::kExpAvgSq},
                                            {write ? nullptr : master, PartitionStore::kMaster}};
  for (uint64_t at = begin; at < begin + count;) {
    const uint64_t chunk = at / state_chunk_elems_;
    const uint64_t in_chunk = at - chunk * state_chunk_elems_;
    const uint64_t n = std::min(begin + count - at, state_chunk_elems_ - in_chunk);
    for (const auto& [buffer, kind] : moments) {
      if (buffer == nullptr) continue;
      ASSIGN_OR_RETURN(Swapper::Pin pin, PinBlock(id, chunk, kind, write));
      float* block = reinterpret_cast<float*>(pin.data()) + in_chunk;
      float* mine = buffer + (at - begin);
      if (write) {
        std::memcpy(block, mine, n * sizeof(float));
      } else {
        std::memcpy(mine, block, n * sizeof(float));
      }
    }
    at += n;
  }
  return absl::OkStatus();
}

absl::Status PartitionStore::AddInitBlocks(const Partition& p) {
  const uint64_t id = p.info.id;
  std::vector<uint64_t> added;
  for (uint64_t begin = 0, c = 0; begin < p.info.numel; begin += state_chunk_elems_, ++c) {
    const uint64_t elems = std::min(state_chunk_elems_, p.info.numel - begin);
    const uint64_t at = p.init_at + begin * sizeof(float);
    absl::Status s = swapper_->AddExternal(
        PartitionStore::BlockOf(id, c, PartitionStore::kInitBlock),
        ExternalMemory{p.region.data() + at, p.page_bytes, arena_->fd(), p.info.span.offset + at},
        elems * sizeof(float), Tier::kHost, session_id_);
    if (!s.ok()) {
      for (uint64_t b : added) swapper_->Remove(b);
      return s;
    }
    added.push_back(PartitionStore::BlockOf(id, c, PartitionStore::kInitBlock));
  }
  return absl::OkStatus();
}

void PartitionStore::RemoveInitBlocks(const Partition& p) {
  for (uint64_t c = 0; c < ChunksOf(p.info.numel); ++c) {
    swapper_->Remove(PartitionStore::BlockOf(p.info.id, c, PartitionStore::kInitBlock));
  }
}

absl::Status PartitionStore::CommitMasterInit(const Partition& p) {
  // info.id, numel and dtypes never change after registration.
  const uint64_t id = p.info.id;
  for (uint64_t c = 0; c < ChunksOf(p.info.numel); ++c) {
    ASSIGN_OR_RETURN(Swapper::Pin init, PinBlock(id, c, PartitionStore::kInitBlock, false));
    ASSIGN_OR_RETURN(Swapper::Pin master, PinBlock(id, c, PartitionStore::kMaster, true));
    // The buffer the trainer reads (after the delayed update, either; held:
    // no commit swaps them meanwhile).
    ASSIGN_OR_RETURN(Swapper::Pin params, PinBlock(id, c, ParamsKind(p, /*next=*/false), true));
    const size_t n = master.size() / sizeof(float);
    std::memcpy(master.data(), init.data(), n * sizeof(float));
    NarrowFromFloat(reinterpret_cast<const float*>(master.data()), p.info.param_dtype,
                    params.data(), n);
  }
  return absl::OkStatus();
}

absl::StatusOr<AccumulateItem> PartitionStore::BeginAccumulate(uint64_t id, uint64_t numel,
                                                               DType grad_dtype, bool hand_over) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Partition * p, FindOrNotFound(id));
  if (numel != p->info.numel) {
    return absl::InvalidArgumentError(
        absl::StrCat("gradients for partition ", id, " ('", p->info.name, "') have ", numel,
                     " elements; it was registered with ", p->info.numel));
  }
  if (grad_dtype != p->info.grad_dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gradients for partition ", id, " ('", p->info.name, "') are ", DTypeName(grad_dtype),
        "; it was registered with ", DTypeName(p->info.grad_dtype)));
  }
  // The step in progress consumes the gradients accumulated before it;
  // these are for the next one. One accumulation of a partition at a time.
  AwaitOutOfStep(absl::MakeConstSpan(&p, 1));
  // (Both at once: a step may begin while an earlier accumulation ends.)
  while (p->accumulating || p->step != StepState::kOut) step_ended_.Wait(&mu_);
  if (p->stopped) {
    // The step that stopped applies the gradients it holds when it is
    // resumed (its other partitions had theirs); new ones would be added
    // to them, two iterations in one step.
    return absl::FailedPreconditionError(
        absl::StrCat("partition ", id, " ('", p->info.name,
                     "') is in a step that stopped midway; call Step "
                     "again before returning new gradients"));
  }
  if (p->gradients == GradState::kHandedOver) {  // only a return racing with a fetch gets here
    return absl::FailedPreconditionError(
        absl::StrCat("partition ", id, " ('", p->info.name,
                     "'): its gradients were just handed over "
                     "(hand_over) by another call; fetch the buffer with grads again first"));
  }
  if (p->grad_pins.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("partition ", id, " ('", p->info.name,
                     "'): its gradient buffer is not held; fetch it "
                     "with grads before writing gradients into it"));
  }
  if (p->gradients == GradState::kLost) {
    return absl::FailedPreconditionError(
        absl::StrCat("partition ", id, " ('", p->info.name,
                     "'): its accumulated gradients were lost in a "
                     "failed accumulation; skip this step first"));
  }
  p->accumulating = true;
  AccumulateItem item;
  item.id = id;
  item.chunks = ChunksOf(p->info.numel);
  item.grad_dtype = grad_dtype;
  item.first = p->micro_batches == 0;
  // Only a step's sole micro-batch can stay where it is; a later one is
  // added to the accumulator as usual.
  item.hand_over = hand_over && item.first;
  // From now on the buffer is the daemon's (a fetch with grads waits).
  if (item.hand_over) p->gradients = GradState::kHandedOver;
  // (A retry after a failed first micro-batch appears twice; its first
  // place counts.)
  if (item.first) return_order_.push_back(id);
  item.numel = p->info.numel;
  return item;
}

absl::StatusOr<AccumulatePins> PartitionStore::PinAccumulate(const AccumulateItem& item,
                                                             uint64_t chunk) {
  CaptureChunk(item.id, chunk);  // before the accumulator changes
  AccumulatePins pins;
  pins.begin = chunk * state_chunk_elems_;
  pins.end = std::min(item.numel, pins.begin + state_chunk_elems_);
  // The gradients are held by the trainer (resident); the accumulator is
  // read in unless this is the first micro-batch (then it is overwritten).
  // Measuring in the background runs beside the trainer's next fetches, in
  // an order that differs every iteration: the iteration's work, out of its
  // order.
  ASSIGN_OR_RETURN(pins.grads,
                   PinBlock(item.id, chunk, PartitionStore::kGradsBlock, /*for_write=*/false,
                            item.background ? Swapper::Use::kBackground : Swapper::Use::kInOrder));
  if (item.hand_over) return pins;  // measured only: no accumulator
  ASSIGN_OR_RETURN(pins.accum,
                   PinBlock(item.id, chunk, PartitionStore::kAccumBlock, /*for_write=*/true));
  return pins;
}

std::vector<uint64_t> PartitionStore::HandedOver(absl::Span<const uint64_t> ids) const {
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t> out;
  auto check = [&out](const Partition* p) {
    if (p != nullptr && p->gradients == GradState::kHandedOver && p->step == StepState::kOut) {
      out.push_back(p->info.id);
    }
  };
  if (ids.empty()) {
    for (const auto& [id, p] : partitions_) check(p.get());
  } else {
    for (uint64_t id : ids) check(Find(id));
  }
  return out;
}

absl::StatusOr<std::optional<AccumulateItem>> PartitionStore::BeginReclaim(uint64_t id) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Partition * p, FindOrNotFound(id));
  if (p->accumulating) {  // a measurement under way
    stats_->waits_for_step.fetch_add(1, std::memory_order_relaxed);
    do {
      step_ended_.Wait(&mu_);
    } while (p->accumulating);
  }
  if (p->gradients != GradState::kHandedOver || p->step != StepState::kOut) return std::nullopt;
  p->accumulating = true;
  AccumulateItem item;
  item.id = id;
  item.numel = p->info.numel;
  item.chunks = ChunksOf(p->info.numel);
  item.grad_dtype = p->info.grad_dtype;
  item.first = true;
  item.reclaim = true;
  return item;
}

void PartitionStore::EndAccumulate(const AccumulateItem& item, const absl::Status& outcome,
                                   const GradStats& stats, uint64_t chunks_done) {
  std::vector<Swapper::Pin> handed_back;
  // (The buffer's bytes dropped while the partition is still accumulating:
  // once it is not, a step may consume it and the trainer hand over new
  // gradients in the buffer, which a Discard after would lose.)
  auto end = [&] {
    absl::MutexLock lock(&mu_);
    Find(item.id)->accumulating = false;
    step_ended_.SignalAll();
  };
  if (item.reclaim) {
    if (outcome.ok()) {
      {
        absl::MutexLock lock(&mu_);
        // The accumulator holds what the buffer held (the same statistics).
        Find(item.id)->gradients = GradState::kAccumulated;
      }
      for (uint64_t c = 0; c < item.chunks; ++c) {
        swapper_->Discard(PartitionStore::BlockOf(item.id, c, PartitionStore::kGradsBlock))
            .IgnoreError();
      }
    }
    end();  // (on failure the buffer still holds them)
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    Partition* p = Find(item.id);
    if (!outcome.ok()) {
      p->accumulating = false;
      step_ended_.SignalAll();
      // A first micro-batch that failed left the accumulator to be
      // overwritten again; an addition that failed midway left some chunks
      // added and some not. A measurement in the background was answered
      // as done: its gradients are lost. The buffer is the trainer's again.
      if ((!item.first && chunks_done > 0) || item.background) {
        p->gradients = GradState::kLost;
      } else if (item.first) {
        p->gradients = GradState::kNone;
      }
      return;
    }
    if (p->gradients == GradState::kNone) p->gradients = GradState::kAccumulated;
    ++p->micro_batches;
    p->grad_stats = stats;
    handed_back = std::move(p->grad_pins);
    p->grad_pins.clear();
  }
  handed_back.clear();    // unpinned outside the lock
  if (!item.hand_over) {  // (handed over: the step reads them there)
    // The trainer's gradients are in the accumulator now: the buffer's
    // bytes are dead (no write-back if it rests on NVMe).
    for (uint64_t c = 0; c < item.chunks; ++c) {
      swapper_->Discard(PartitionStore::BlockOf(item.id, c, PartitionStore::kGradsBlock))
          .IgnoreError();
    }
  }
  end();
}

PendingGradients PartitionStore::Pending() const {
  absl::MutexLock lock(&mu_);
  auto accumulating = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& [id, p] : partitions_) {
      if (p->accumulating) return true;
    }
    return false;
  };
  while (accumulating()) step_ended_.Wait(&mu_);
  PendingGradients out;
  out.delayed_update = delayed_;
  for (const auto& [id, p] : partitions_) {
    // A lost accumulation's earlier micro-batches still count (the step
    // will skip); one lost on its first has none.
    if (p->gradients == GradState::kNone ||
        (p->gradients == GradState::kLost && p->micro_batches == 0)) {
      continue;
    }
    out.stats += p->grad_stats;
    ++out.partitions;
    out.micro_batches = std::max(out.micro_batches, p->micro_batches);
  }
  return out;
}

void PartitionStore::AwaitStepBoundaryLocked() {
  auto busy = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stepping_ || moments_writing_ > 0) return true;
    for (const auto& [id, p] : partitions_) {
      if (p->accumulating) return true;
    }
    return false;
  };
  while (busy()) step_ended_.Wait(&mu_);
}

absl::StatusOr<std::vector<StepItem>> PartitionStore::BeginStep(bool skipping) {
  absl::MutexLock lock(&mu_);
  AwaitStepBoundaryLocked();
  // After a step stopped midway, the next finishes it: its partitions
  // alone (a finished partition's next gradients wait for the step after).
  const bool resuming = StoppedMidwayLocked();
  if (!skipping) {
    for (const auto& [id, p] : partitions_) {
      if (resuming && !p->stopped) continue;
      if (p->gradients == GradState::kLost) {
        return absl::FailedPreconditionError(
            absl::StrCat("partition ", id, " ('", p->info.name,
                         "') lost its accumulated gradients in a "
                         "failed accumulation: skip this step (Step with skip)"));
      }
    }
  }
  // Every check before anything changes: a refused step changes nothing.
  for (const auto& [id, p] : partitions_) {
    const bool ready = p->gradients != GradState::kNone;
    if (ready && p->master == MasterState::kInitPending) {
      return absl::FailedPreconditionError(
          absl::StrCat("partition ", id, " ('", p->info.name,
                       "') was registered with fp32 initial values "
                       "that are not committed yet: release it first"));
    }
    if (ready && skipping && p->stopped) {
      // Other partitions, or its own first chunks, are updated already:
      // skipping would leave them so.
      return absl::FailedPreconditionError(absl::StrCat("partition ", id, " ('", p->info.name,
                                                        "') is in a step that stopped midway: Step "
                                                        "again to finish it before skipping"));
    }
  }
  RETURN_IF_ERROR(CheckSwapsLocked());
  std::vector<StepItem> items;
  for (auto& [id, p] : partitions_) {
    if (p->gradients == GradState::kNone || (resuming && !p->stopped)) continue;
    StepItem item;
    item.id = id;
    item.delayed = delayed_;
    item.stats = p->grad_stats;
    item.init_master = p->master == MasterState::kUnset;
    item.hand_over = p->gradients == GradState::kHandedOver;
    // The accumulator, or the gradient buffer handed over.
    item.task.span.grad_dtype = item.hand_over ? p->info.grad_dtype : DType::kFp32;
    item.task.span.working_dtype = p->info.param_dtype;
    item.task.span.numel = p->info.numel;
    item.task.step = p->info.step + 1;
    item.chunks = ChunksOf(p->info.numel);
    item.first_chunk = p->resume_chunk;
    items.push_back(item);
  }
  if (items.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", session_id_, " has no partition with gradients returned since the last step"));
  }
  // The delayed update's newer buffers become current now, for the next
  // iteration; the partitions enter the step.
  CommitSwapsLocked();
  for (StepItem& item : items) {
    Partition* p = Find(item.id);
    p->step = item.delayed ? StepState::kInDelayed : StepState::kIn;
    item.current_kind = ParamsKind(*p, /*next=*/false);
    item.write_kind = ParamsKind(*p, /*next=*/item.delayed);
  }
  // The order the next iteration will wait in (see the header); its
  // fetches and returns start now.
  const std::vector<uint64_t>& order = delayed_ ? return_order_ : fetch_order_;
  absl::flat_hash_map<uint64_t, size_t> rank;
  for (size_t i = 0; i < order.size(); ++i) rank.emplace(order[i], i);
  if (!resuming) {  // (a resume's: what the trainer did since the step began, kept)
    fetch_order_.clear();
    fetched_.clear();
    return_order_.clear();
  }
  std::stable_sort(items.begin(), items.end(), [&rank](const StepItem& a, const StepItem& b) {
    auto ra = rank.find(a.id), rb = rank.find(b.id);
    const size_t x = ra == rank.end() ? SIZE_MAX : ra->second;
    const size_t y = rb == rank.end() ? SIZE_MAX : rb->second;
    return x < y;
  });
  stepping_ = true;
  return items;
}

absl::Status PartitionStore::CheckSwapsLocked() const {
  for (const auto& [id, p] : partitions_) {
    if (p->swap_pending && p->held()) {
      return absl::FailedPreconditionError(
          absl::StrCat("partition ", id, " ('", p->info.name,
                       "') is held: with the delayed update, release "
                       "every partition first (its newer parameters become current now)"));
    }
  }
  return absl::OkStatus();
}

void PartitionStore::CommitSwapsLocked() {
  for (const auto& [id, p] : partitions_) {
    if (!p->swap_pending) continue;
    p->version ^= 1;
    p->info.params.offset = p->params_offset[p->version];
    p->swap_pending = false;
  }
}

absl::StatusOr<ChunkPins> PartitionStore::PinChunk(const StepItem& item, uint64_t chunk) {
  const uint64_t id = item.id;
  const uint64_t numel = item.task.span.numel;
  ChunkPins pins;
  pins.begin = chunk * state_chunk_elems_;
  if (pins.begin >= numel) {
    return absl::OutOfRangeError(absl::StrCat("partition ", id, " has no chunk ", chunk));
  }
  pins.end = std::min(numel, pins.begin + state_chunk_elems_);
  const struct {
    Swapper::Pin* pin;
    int kind;
    bool for_write;
  } wanted[] = {
      {&pins.master, PartitionStore::kMaster, true},
      {&pins.exp_avg, PartitionStore::kExpAvg, true},
      {&pins.exp_avg_sq, PartitionStore::kExpAvgSq, true},
      {&pins.params, item.write_kind, true},
      {&pins.accum, GradsKind(item), false},
  };
  for (const auto& w : wanted) {
    ASSIGN_OR_RETURN(*w.pin, PinBlock(id, chunk, w.kind, w.for_write));
  }
  if (item.delayed && item.init_master) {
    ASSIGN_OR_RETURN(pins.current, PinBlock(id, chunk, item.current_kind, /*for_write=*/false));
  }
  // Before the update changes the chunk, and after its blocks are pinned:
  // the capture reads them where they are, needing no room for them (a
  // write pin changes no byte by itself).
  CaptureChunk(id, chunk);
  return pins;
}

absl::Status PartitionStore::SetDelayedUpdate(bool on) {
  absl::MutexLock placing(&placement_mu_);  // no registration meanwhile
  struct Buffer {
    uint64_t id;
    uint64_t numel;
    DType dtype;
    int kind;  // the second buffer's
    std::byte* data;
    uint64_t offset;  // of `data` in the arena
    Tier home;
    uint64_t page_bytes;
  };
  std::vector<Buffer> buffers;
  {
    absl::MutexLock lock(&mu_);
    // Switching moves and drops working-copy buffers a checkpoint may
    // still have to capture.
    while (stepping_ || capture_ != nullptr) {
      if (capture_ != nullptr) {
        captured_.Wait(&mu_);
      } else {
        step_ended_.Wait(&mu_);
      }
    }
    if (on == delayed_) return absl::OkStatus();
    for (const auto& [id, p] : partitions_) {
      if (p->stopped) {
        // The resumed update must write the buffers the interrupted one did.
        return absl::FailedPreconditionError(
            absl::StrCat("partition ", id, " ('", p->info.name,
                         "') is in a step that stopped midway: Step "
                         "again to finish it before switching the delayed update"));
      }
    }
    if (!on) {
      // Drain: the newest working copies become current now.
      RETURN_IF_ERROR(CheckSwapsLocked());
      CommitSwapsLocked();
      delayed_ = false;
    }
    for (const auto& [id, p] : partitions_) {
      const int next = ParamsKind(*p, /*next=*/true);
      const int buffer = next == PartitionStore::kShadowBlock ? 1 : 0;
      buffers.push_back({id, p->info.numel, p->info.param_dtype, next, p->buffer[buffer],
                         p->params_offset[buffer], p->home[static_cast<int>(DataKind::kParams)],
                         p->page_bytes});
    }
  }
  // Outside the set's lock: the swapper may wait for I/O.
  std::vector<uint64_t> added;
  for (const Buffer& b : buffers) {
    const uint64_t size = DTypeSize(b.dtype);
    for (uint64_t begin = 0, c = 0; begin < b.numel; begin += state_chunk_elems_, ++c) {
      const uint64_t block = PartitionStore::BlockOf(b.id, c, b.kind);
      if (!on) {
        swapper_->Remove(block);
        continue;
      }
      const uint64_t elems = std::min(state_chunk_elems_, b.numel - begin);
      const ExternalMemory memory{b.data + begin * size, b.page_bytes, arena_->fd(),
                                  b.offset + begin * size};
      absl::Status s = swapper_->AddExternal(block, memory, elems * size, b.home, session_id_);
      if (!s.ok()) {
        for (uint64_t undo : added) swapper_->Remove(undo);
        return absl::Status(s.code(), absl::StrCat("switching the delayed update on for session ",
                                                   session_id_, ": ", s.message()));
      }
      added.push_back(block);
    }
  }
  if (on) {
    absl::MutexLock lock(&mu_);
    delayed_ = true;
  }
  return absl::OkStatus();
}

bool PartitionStore::delayed_update() const {
  absl::MutexLock lock(&mu_);
  return delayed_;
}

absl::Status PartitionStore::RefuseHandedOverLocked(absl::Span<Partition* const> wanted) const {
  for (const Partition* p : wanted) {
    if (p->gradients != GradState::kHandedOver) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "partition ", p->info.id, " ('", p->info.name,
        "'): its gradient buffer was handed "
        "over (ReturnGradients with hand_over) while this fetch took it back; fetch again"));
  }
  return absl::OkStatus();
}

int PartitionStore::GradsKind(const StepItem& item) {
  return item.hand_over ? PartitionStore::kGradsBlock : PartitionStore::kAccumBlock;
}

void PartitionStore::ConsumeGrads(const StepItem& item, uint64_t chunk) {
  CaptureChunk(item.id, chunk);  // a skipped step's gradients, before they go
  swapper_->Discard(PartitionStore::BlockOf(item.id, chunk, GradsKind(item))).IgnoreError();
}

void PartitionStore::LeaveStepLocked(Partition* p, const StepItem& item, bool applied) {
  p->step = StepState::kOut;
  p->resume_chunk = 0;
  p->stopped = false;
  p->gradients = GradState::kNone;
  p->micro_batches = 0;
  p->grad_stats = GradStats{};
  if (!applied) return;
  // Its master copy was initialised (if it had to be) and updated.
  p->master = MasterState::kInitialized;
  ++p->info.step;
  if (item.delayed) p->swap_pending = true;
}

void PartitionStore::EndPartition(const StepItem& item) {
  absl::MutexLock lock(&mu_);
  LeaveStepLocked(Find(item.id), item, /*applied=*/true);
  step_ended_.SignalAll();
}

void PartitionStore::EndStep(absl::Span<const StepItem> items,
                             absl::Span<const ItemOutcome> outcomes) {
  // Gradients a skipped step consumed are dead too (an applied step
  // dropped its own chunk by chunk): dropped while the partitions are still
  // in the step, so that no fetch and return of the next gradients can
  // come between and lose theirs.
  for (size_t i = 0; i < items.size(); ++i) {
    if (outcomes[i].outcome != StepOutcome::kSkipped) continue;
    for (uint64_t c = 0; c < items[i].chunks; ++c) ConsumeGrads(items[i], c);
  }
  bool applied_any = false, stopped = false;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < items.size(); ++i) {
      if (outcomes[i].ended) {
        applied_any = true;
        continue;
      }
      Partition* p = Find(items[i].id);
      if (outcomes[i].outcome == StepOutcome::kFailed) {
        p->step = StepState::kOut;
        p->resume_chunk = outcomes[i].next_chunk;
        p->stopped = true;
        p->stopped_delayed = items[i].delayed;
        stopped = true;
        continue;
      }
      const bool applied = outcomes[i].outcome == StepOutcome::kApplied;
      LeaveStepLocked(p, items[i], applied);
      applied_any |= applied;
    }
    // A step counts once, when it is finished: one that stopped midway
    // counts when the Step that resumes it ends.
    step_applied_ |= applied_any;
    if (!stopped) {
      if (step_applied_) ++steps_;
      step_applied_ = false;
    }
    stepping_ = false;
    step_ended_.SignalAll();
  }
  // One iteration of this session's accesses ends here: the swapper learns
  // their order and prefetches the next iteration's first blocks.
  swapper_->EndIteration(session_id_);
}

absl::StatusOr<std::pair<uint64_t, HostMemory>> PartitionStore::MapExtra(uint64_t bytes) {
  absl::MutexLock placing(&placement_mu_);  // registrations allocate under it too
  ASSIGN_OR_RETURN(uint64_t offset, arena_->Allocate(bytes));
  // Small pages: the pool counts none of it (it is the session's fixed
  // overhead), and a kernel set to give shared memory huge pages unasked
  // must not make it more.
  ASSIGN_OR_RETURN(HostMemory memory, arena_->Map(offset, bytes, Pages::kSmall));
  return std::make_pair(offset, std::move(memory));
}

void PartitionStore::UndoLoadLocked(Partition& p, std::vector<Partition*>* unloaded,
                                    std::vector<Partition*>* rewritten) {
  if (!p.loading) return;
  // A load its trainer never released commits nothing: neither its fp32
  // values nor (later, at an ordinary release) its working copy, which the
  // master weights write again where they exist.
  p.loading = false;
  // (In a step, which writes it from the master weights itself.)
  if (p.master_from_working && p.master == MasterState::kInitialized && p.step == StepState::kOut) {
    rewritten->push_back(&p);
  }
  p.master_from_working = false;
  if (p.master == MasterState::kInitPending && p.before_load != MasterState::kInitPending) {
    p.master = p.before_load;
    p.info.master_init = {};
    unloaded->push_back(&p);
  }
}

void PartitionStore::DropHolds() {
  std::vector<Swapper::Pin> released;
  std::vector<Partition*> unloaded, rewritten;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, p] : partitions_) {
      if (p->committing > 0) {
        // Its Release commits a load its trainer finished (undone midway,
        // master and working copy were half the load's and half the old
        // values); that Release lets the holds go, or undoes the load if
        // it fails. (Not waited for: this may be the arena channel's
        // thread, and the commit may read from NVMe.)
        p->dropped = true;
        continue;
      }
      UndoLoadLocked(*p, &unloaded, &rewritten);
      p->TakeHolds(&released);
    }
  }
  released.clear();  // (the rewrite pins for writing)
  FinishUndo(unloaded, rewritten);
}

void PartitionStore::FinishUndo(const std::vector<Partition*>& unloaded,
                                const std::vector<Partition*>& rewritten) {
  for (Partition* p : unloaded) RemoveInitBlocks(*p);
  // Now, before any checkpoint (a keep, a final one) could save the
  // half-written copy; swap-ins where the master weights rest on NVMe, on
  // the caller's thread (the arena channel's: rare, a load cut short).
  for (Partition* p : rewritten) {
    if (absl::Status s = WorkingFromMaster(*p); !s.ok()) {
      LogWarning(
          "partition %d ('%s'): its working copy, half loaded by a trainer that went away, "
          "could not be written again from the master weights: %s",
          static_cast<int64_t>(p->info.id), p->info.name, s.ToString());
    }
  }
}

absl::Status PartitionStore::RestoreSetState(uint64_t steps, bool delayed) {
  absl::MutexLock placing(&placement_mu_);
  absl::MutexLock lock(&mu_);
  if (!partitions_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", session_id_, " has partitions already: restore before any"));
  }
  steps_ = steps;
  delayed_ = delayed;  // no partition: no second buffer to make
  return absl::OkStatus();
}

absl::Status PartitionStore::FillRestored(const Partition& p, const RestoredState& restored,
                                          bool with_shadow,
                                          const absl::flat_hash_set<uint64_t>& adopted) {
  std::vector<int> kinds;
  if (restored.master_initialized) {
    kinds.insert(kinds.end(),
                 {PartitionStore::kMaster, PartitionStore::kExpAvg, PartitionStore::kExpAvgSq});
  }
  if (restored.grads_ready) kinds.push_back(PartitionStore::kAccumBlock);
  kinds.push_back(PartitionStore::kParamsBlock);  // version 0: the current one
  if (restored.next_params_pending && with_shadow) kinds.push_back(PartitionStore::kShadowBlock);
  const uint64_t numel = p.info.numel;
  for (uint64_t begin = 0, c = 0; begin < numel; begin += state_chunk_elems_, ++c) {
    const uint64_t elems = std::min(state_chunk_elems_, numel - begin);
    for (int kind : kinds) {
      if (kind == PartitionStore::kAccumBlock) {
        RETURN_IF_ERROR(AddAccumulator(p.info.id, c, /*registering=*/&p));
      }
      const bool kept = adopted.contains(PartitionStore::BlockOf(p.info.id, c, kind));
      ASSIGN_OR_RETURN(Swapper::Pin pin, PinBlock(p.info.id, c, kind, /*for_write=*/!kept));
      const bool params =
          kind == PartitionStore::kParamsBlock || kind == PartitionStore::kShadowBlock;
      const uint64_t want = elems * (params ? DTypeSize(p.info.param_dtype) : sizeof(float));
      if (pin.size() != want) {
        return absl::InternalError(absl::StrCat("block of ", pin.size(), " bytes for ", want));
      }
      if (kept) {
        // Its bytes are the kept ones already: checked, not read.
        RETURN_IF_ERROR(restored.check_in_memory(kind, begin, elems,
                                                 absl::MakeConstSpan(pin.data(), pin.size())));
        continue;
      }
      RETURN_IF_ERROR(restored.read(kind, begin, elems, pin.data()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<SetImage> PartitionStore::BeginCheckpoint(ChunkSink* sink) {
  absl::MutexLock lock(&mu_);
  AwaitStepBoundaryLocked();
  // Checked after the wait (it let the lock go): one checkpoint at a time.
  if (capture_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("a checkpoint of session ", session_id_, " is being written already"));
  }
  SetImage image;
  image.steps = steps_;
  image.delayed = delayed_;
  image.placement = placement_;
  image.chunk_elems = state_chunk_elems_;
  auto capture = std::make_shared<ChunkCapture>(
      sink,
      [this](uint64_t id, uint64_t chunk, int kind, ChunkSink* to, ChunkCapture::Staging* staging) {
        return CaptureBlock(id, chunk, kind, to, staging);
      });
  for (const auto& [id, p] : partitions_) {
    const std::string why =
        p->master == MasterState::kInitPending
            ? "was registered with fp32 initial values not committed yet: release it first"
        : p->writable_hold ? "is held for writing (its parameters may be changing): release it "
                             "first"
        : p->stopped       ? "is in a step that stopped midway: Step again first"
        : p->gradients == GradState::kLost ? "lost its accumulated gradients: skip this step first"
        : p->gradients == GradState::kHandedOver
            ? "had gradients handed over (ReturnGradients with hand_over) while "
              "the checkpoint began: checkpoint again"
            : "";
    if (!why.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("cannot checkpoint session ", session_id_,
                                                        ": partition ", id, " ('", p->info.name,
                                                        "') ", why));
    }
    CheckpointedPartition c;
    c.info = p->info;
    c.tensor = p->tensor;
    c.shape = p->shape;
    c.tensor_offset = p->tensor_offset;
    c.master_initialized = p->master == MasterState::kInitialized;
    c.grads_ready = p->gradients == GradState::kAccumulated;
    c.micro_batches = p->micro_batches;
    c.grad_stats = p->grad_stats;
    c.chunks = ChunksOf(p->info.numel);
    if (c.master_initialized) {
      c.block_kinds = {PartitionStore::kMaster, PartitionStore::kExpAvg, PartitionStore::kExpAvgSq};
    }
    if (c.grads_ready) c.block_kinds.push_back(PartitionStore::kAccumBlock);
    c.current_kind = ParamsKind(*p, /*next=*/false);
    c.block_kinds.push_back(c.current_kind);
    if (p->swap_pending) {
      c.next_kind = ParamsKind(*p, /*next=*/true);
      c.block_kinds.push_back(c.next_kind);
    }
    capture->Add(id, c.block_kinds, c.chunks);
    image.partitions.push_back(std::move(c));
  }
  capture_ = std::move(capture);
  return image;
}

void PartitionStore::CaptureChunk(uint64_t id, uint64_t chunk) {
  std::shared_ptr<ChunkCapture> capture;
  {
    absl::MutexLock lock(&mu_);
    capture = capture_;
  }
  // Outside the lock: swap-ins and file writes take time.
  if (capture != nullptr) capture->Capture(id, chunk);
}

absl::Status PartitionStore::CaptureBlock(uint64_t id, uint64_t chunk, int block_kind,
                                          ChunkSink* sink, ChunkCapture::Staging* staging) {
  // A read pin: what is pinned for writing by another call is not being
  // changed yet (every change captures first). Beside the iteration's
  // work: a checkpoint's reads are no part of the order that repeats, and
  // count in the session's share of the pool each time.
  auto reading = [&](const absl::Status& s) {
    return absl::Status(
        s.code(), absl::StrCat("reading chunk ", chunk, " of partition ", id, ": ", s.message()));
  };
  absl::StatusOr<Swapper::Pin> pin =
      PinBlock(id, chunk, block_kind, /*for_write=*/false, Swapper::Use::kExtra);
  if (pin.ok()) {
    return sink->Write(id, chunk, block_kind, absl::MakeConstSpan(pin->data(), pin->size()));
  }
  if (!absl::IsResourceExhausted(pin.status())) return reading(pin.status());
  // No room to bring it in (the pool is full of held and pinned blocks,
  // which nothing the checkpoint can wait for would free): copied out of
  // where it rests instead, without the pool.
  const Swapper::BlockId block = PartitionStore::BlockOf(id, chunk, block_kind);
  absl::MutexLock lock(&staging->mu);
  if (staging->memory.empty()) {
    const uint64_t largest_block = state_chunk_elems_ * sizeof(float);
    ASSIGN_OR_RETURN(staging->memory, HostMemory::Allocate(swapper_->CopyOutBytes(largest_block)));
  }
  absl::StatusOr<uint64_t> bytes =
      swapper_->CopyOut(block, absl::MakeSpan(staging->memory.data(), staging->memory.size()));
  if (!bytes.ok()) return reading(bytes.status());
  return sink->Write(id, chunk, block_kind, absl::MakeConstSpan(staging->memory.data(), *bytes));
}

void PartitionStore::CaptureAll(absl::Span<Partition* const> partitions) {
  std::vector<std::pair<uint64_t, uint64_t>> todo;  // id, chunks
  {
    absl::MutexLock lock(&mu_);
    if (capture_ == nullptr) return;
    for (const Partition* p : partitions) todo.emplace_back(p->info.id, ChunksOf(p->info.numel));
  }
  for (const auto& [id, chunks] : todo) {
    for (uint64_t c = 0; c < chunks; ++c) CaptureChunk(id, c);
  }
}

absl::Status PartitionStore::EndCheckpoint() {
  std::shared_ptr<ChunkCapture> capture;
  {
    absl::MutexLock lock(&mu_);
    capture = capture_;
  }
  if (capture == nullptr) return absl::OkStatus();
  absl::Status status = capture->Finish();  // once no capture runs
  absl::MutexLock lock(&mu_);
  capture_.reset();
  captured_.SignalAll();
  return status;
}

}  // namespace offload
