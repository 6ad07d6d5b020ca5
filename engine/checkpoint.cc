#include "engine/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/host_memory.h"
#include "base/status_macros.h"
#include "engine/version.h"

namespace offload {
namespace {

using checkpoint::RecordKind;
namespace ckv1 = ::offload::checkpoint::v1;

// The record kind of a block kind as a restored partition lays them out
// (version 0: kParamsBlock is the working copy read now).
RecordKind RecordKindToRestore(int block_kind) {
  switch (block_kind) {
    case PartitionStore::kParamsBlock:
      return ckv1::PARAMS;
    case PartitionStore::kShadowBlock:
      return ckv1::PARAMS_NEXT;
    case PartitionStore::kMaster:
      return ckv1::MASTER;
    case PartitionStore::kExpAvg:
      return ckv1::EXP_AVG;
    case PartitionStore::kExpAvgSq:
      return ckv1::EXP_AVG_SQ;
    case PartitionStore::kAccumBlock:
      return ckv1::ACCUM;
  }
  return ckv1::RECORD_KIND_UNSPECIFIED;
}

// The record kind of one of a checkpointed partition's block kinds: its
// working-copy buffers by which one is current, not by name.
RecordKind RecordKindOf(const CheckpointedPartition& p, int block_kind) {
  if (block_kind == p.current_kind) return ckv1::PARAMS;
  if (block_kind == p.next_kind) return ckv1::PARAMS_NEXT;
  return RecordKindToRestore(block_kind);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CheckpointWriter>> CheckpointWriter::Begin(
    PartitionStore* set, const SessionCheckpointState& state, checkpoint::Directory dir) {
  const int64_t began = absl::GetCurrentTimeNanos();
  const std::string stem = checkpoint::StemFor(state.name);
  ASSIGN_OR_RETURN(checkpoint::DataFileWriter file, checkpoint::DataFileWriter::Create(dir, stem));
  std::unique_ptr<CheckpointWriter> w(new CheckpointWriter(set, dir, stem, std::move(file), state));
  w->began_ns_ = began;
  absl::StatusOr<SetImage> image = set->BeginCheckpoint(w.get());
  if (!image.ok()) {
    w->ended_ = true;  // never began
    w->laid_out_.Notify();
    w->file_.Remove();
    return image.status();
  }
  w->image_ = *std::move(image);
  w->summary_.pause_us = static_cast<uint64_t>(absl::GetCurrentTimeNanos() - began) / 1000;

  absl::MutexLock lock(&w->mu_);
  checkpoint::Manifest& m = w->manifest_;
  m.set_format_version(checkpoint::kFormatVersion);
  m.set_session_name(state.name);
  m.set_offloadd_version(kOffloaddVersion);
  m.set_created_unix_ms(absl::ToUnixMillis(absl::Now()));
  m.set_steps(w->image_.steps);
  m.set_delayed_update(w->image_.delayed);
  m.set_delayed_update_after(state.delayed_update_after);
  for (int k = 0; k < kDataKinds; ++k) m.add_host_percent(w->image_.placement.host_percent[k]);
  if (state.scaler != nullptr) {
    const LossScalingOptions& o = state.scaler->options();
    const LossScaler::State s = state.scaler->state();
    ckv1::LossScalerState* ls = m.mutable_loss_scaler();
    ls->set_initial_scale(o.initial_scale);
    ls->set_growth_interval(o.growth_interval);
    ls->set_growth_factor(o.growth_factor);
    ls->set_backoff_factor(o.backoff_factor);
    ls->set_hysteresis(o.hysteresis);
    ls->set_min_scale(o.min_scale);
    ls->set_scale(s.scale);
    ls->set_hysteresis_left(s.hysteresis_left);
    ls->set_clean_steps(s.clean_steps);
  }
  m.set_data_file(w->file_.name());
  if (state.by_reference != nullptr) m.set_memory_file(state.memory_file);
  if (state.user.has_value()) m.set_opened_by(static_cast<uint32_t>(*state.user));
  // The layout: per partition, per chunk, each saved block kind, each
  // record on an aligned offset, so that it is written around the page
  // cache (checkpoint/format.h; its blocks' memory is page-aligned), and
  // shares no page of the page cache with the next (larger pages than
  // 4 KiB: arm64, ppc64le).
  const uint64_t record_alignment = std::max<uint64_t>(checkpoint::kDirectAlignment, PageSize());
  uint64_t offset = 0;
  const uint64_t chunk_elems = w->image_.chunk_elems;
  for (size_t i = 0; i < w->image_.partitions.size(); ++i) {
    const CheckpointedPartition& p = w->image_.partitions[i];
    w->index_[p.info.id] = i;
    ckv1::Partition* out = m.add_partitions();
    out->set_name(p.info.name);
    out->set_tensor(p.tensor);
    for (uint64_t d : p.shape) out->add_shape(d);
    out->set_offset(p.tensor_offset);
    out->set_numel(p.info.numel);
    out->set_param_dtype(static_cast<uint32_t>(p.info.param_dtype));
    out->set_grad_dtype(static_cast<uint32_t>(p.info.grad_dtype));
    out->set_step(p.info.step);
    out->set_master_initialized(p.master_initialized);
    out->set_grads_ready(p.grads_ready);
    out->set_micro_batches(p.micro_batches);
    out->set_grad_sq_norm(p.grad_stats.sq_norm);
    out->set_grad_nonfinite(p.grad_stats.nonfinite);
    out->set_next_params_pending(p.next_kind >= 0);
    for (uint64_t c = 0; c < p.chunks; ++c) {
      const uint64_t begin = c * chunk_elems;
      const uint64_t elems = std::min(chunk_elems, p.info.numel - begin);
      for (int kind : p.block_kinds) {
        const bool params = kind == p.current_kind || kind == p.next_kind;
        const uint64_t bytes = elems * (params ? DTypeSize(p.info.param_dtype) : sizeof(float));
        offset = RoundUp(offset, record_alignment);
        ckv1::Record* r = out->add_records();
        r->set_kind(RecordKindOf(p, kind));
        r->set_begin(begin);
        r->set_elems(elems);
        r->set_offset(offset);
        r->set_bytes(bytes);
        offset += bytes;
      }
    }
  }
  m.set_data_bytes(offset);
  w->summary_.partitions = w->image_.partitions.size();
  w->summary_.bytes = offset;
  w->summary_.steps = w->image_.steps;
  w->laid_out_.Notify();
  return w;
}

CheckpointWriter::~CheckpointWriter() {
  if (ended_) return;
  // Begun, never finished: the image ends, and the data file goes.
  set_->EndCheckpoint().IgnoreError();
  file_.Remove();
}

absl::Status CheckpointWriter::Write(uint64_t id, uint64_t chunk, int block_kind,
                                     absl::Span<const std::byte> bytes) {
  // Copy-on-write starts inside Begin, before the layout exists.
  laid_out_.WaitForNotification();
  auto it = index_.find(id);
  if (it == index_.end()) return absl::InternalError(absl::StrCat("no partition ", id));
  const CheckpointedPartition& p = image_.partitions[it->second];
  const auto pos = std::find(p.block_kinds.begin(), p.block_kinds.end(), block_kind);
  if (pos == p.block_kinds.end() || chunk >= p.chunks) {
    return absl::InternalError(
        absl::StrCat("partition ", id, " saves no block kind ", block_kind, " of chunk ", chunk));
  }
  const size_t r = chunk * p.block_kinds.size() + static_cast<size_t>(pos - p.block_kinds.begin());
  uint64_t offset, want;
  {
    absl::MutexLock lock(&mu_);
    const ckv1::Record& rec =
        manifest_.partitions(static_cast<int>(it->second)).records(static_cast<int>(r));
    offset = rec.offset();
    want = rec.bytes();
  }
  if (bytes.size() != want) {
    return absl::InternalError(absl::StrCat("chunk ", chunk, " of partition ", id, " has ",
                                            bytes.size(), " bytes, its record ", want));
  }
  const uint64_t hash = checkpoint::Hash(bytes.data(), bytes.size());
  // Kept by reference: the bytes stay where they are, in the pool's file.
  std::optional<uint64_t> in_memory;
  if (by_reference_ != nullptr) in_memory = by_reference_->OffsetOf(bytes.data(), bytes.size());
  if (in_memory.has_value()) {
    by_reference_->Retain(*in_memory, bytes.size());
    referenced_bytes_.fetch_add(bytes.size(), std::memory_order_relaxed);
  } else {
    RETURN_IF_ERROR(file_.Write(offset, bytes));
  }
  absl::MutexLock lock(&mu_);
  ckv1::Record* rec = manifest_.mutable_partitions(static_cast<int>(it->second))
                          ->mutable_records(static_cast<int>(r));
  rec->set_xxh3(hash);
  if (in_memory.has_value()) rec->set_memory_offset(*in_memory);
  return absl::OkStatus();
}

absl::StatusOr<CheckpointSummary> CheckpointWriter::Finish(const std::atomic<bool>* cancelled) {
  // The whole file first: a disk without the room fails the checkpoint
  // before any capture writes to it. (Not when keeping by reference: most
  // of it stays a hole.)
  absl::Status status = by_reference_ != nullptr ? absl::OkStatus() : file_.Reserve(summary_.bytes);
  if (status.ok()) {
    // Every chunk, in the data file's order, taken from one cursor by this
    // thread and capture_threads_ - 1 helpers: as many writes (and, with
    // state on NVMe, swap-ins) in flight.
    std::vector<std::pair<uint64_t, uint64_t>> chunks;  // partition id, chunk
    for (const CheckpointedPartition& p : image_.partitions) {
      for (uint64_t c = 0; c < p.chunks; ++c) chunks.emplace_back(p.info.id, c);
    }
    std::atomic<size_t> next{0};
    std::atomic<bool> stopped{false};
    auto capture = [&] {
      for (size_t i; (i = next.fetch_add(1)) < chunks.size();) {
        if (cancelled != nullptr && cancelled->load()) {
          stopped = true;
          return;
        }
        set_->CaptureChunk(chunks[i].first, chunks[i].second);
      }
    };
    std::vector<std::thread> helpers;
    const size_t threads = std::min<size_t>(capture_threads_, chunks.size());
    for (size_t t = 1; t < threads; ++t) {
      try {
        helpers.emplace_back(capture);
      } catch (const std::system_error&) {
        break;  // no thread to be had: fewer capture
      }
    }
    capture();
    for (std::thread& t : helpers) t.join();
    if (stopped)
      status = absl::CancelledError("the session closed while its checkpoint was written");
  }
  absl::Status captured = set_->EndCheckpoint();
  ended_ = true;
  if (status.ok()) status = captured;
  if (status.ok()) status = file_.Sync();
  if (status.ok()) {
    absl::MutexLock lock(&mu_);
    status = checkpoint::CommitManifest(dir_, stem_, manifest_, keep_previous_);
  }
  if (!status.ok()) {
    // The previous checkpoint stays, unless the rename committed this one
    // (and only the directory's fsync failed): then its data stays too.
    absl::StatusOr<checkpoint::Manifest> on_disk =
        checkpoint::ReadManifest(dir_, absl::StrCat(stem_, ".manifest"));
    if (!on_disk.ok() || on_disk->data_file() != file_.name()) file_.Remove();
    absl::MutexLock lock(&mu_);
    return absl::Status(status.code(),
                        absl::StrCat("checkpoint of session '", manifest_.session_name(), "' into ",
                                     dir_.path(), " failed: ", status.message()));
  }
  summary_.manifest = dir_.PathOf(absl::StrCat(stem_, ".manifest"));
  summary_.referenced_bytes = referenced_bytes_.load();
  summary_.wall_us = static_cast<uint64_t>(absl::GetCurrentTimeNanos() - began_ns_) / 1000;
  return summary_;
}

absl::StatusOr<std::unique_ptr<CheckpointRestore>> CheckpointRestore::Open(
    const std::string& dir, const std::string& session_name, std::optional<uint64_t> steps) {
  if (dir.empty() || dir[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("restore_from must be an absolute path, got '", dir, "'"));
  }
  auto r = std::unique_ptr<CheckpointRestore>(new CheckpointRestore());
  ASSIGN_OR_RETURN(r->index_, checkpoint::TensorIndex::Load(dir, steps));
  for (const auto& [path, m] : r->index_->manifests()) {
    if (m->session_name() == session_name) r->session_ = m.get();
  }
  if (r->session_ == nullptr) r->session_ = r->index_->manifests().front().second.get();
  const auto& m = *r->session_;
  if (m.host_percent_size() != kDataKinds) {
    return absl::DataLossError(absl::StrCat("checkpoint in ", dir, ": a manifest with ",
                                            m.host_percent_size(), " placement percentages"));
  }
  return r;
}

std::optional<std::pair<LossScalingOptions, LossScaler::State>> CheckpointRestore::loss_scaler()
    const {
  if (!session_->has_loss_scaler()) return std::nullopt;
  const ckv1::LossScalerState& ls = session_->loss_scaler();
  LossScalingOptions o;
  o.initial_scale = ls.initial_scale();
  o.growth_interval = ls.growth_interval();
  o.growth_factor = ls.growth_factor();
  o.backoff_factor = ls.backoff_factor();
  o.hysteresis = ls.hysteresis();
  o.min_scale = ls.min_scale();
  return std::make_pair(o, LossScaler::State{ls.scale(), ls.hysteresis_left(), ls.clean_steps()});
}

absl::StatusOr<RestoredState> CheckpointRestore::StateFor(const PartitionSpec& spec) const {
  const std::string tensor = spec.tensor.empty() ? spec.name : spec.tensor;
  ASSIGN_OR_RETURN(const checkpoint::TensorIndex::Tensor* t, index_->Find(tensor));
  const uint64_t begin = spec.tensor_offset, end = begin + spec.numel;
  ASSIGN_OR_RETURN(std::vector<const checkpoint::TensorIndex::Slice*> slices,
                   index_->Covering(tensor, *t, begin, end));
  const std::string what = absl::StrCat("partition '", spec.name, "' (elements [", begin, ", ", end,
                                        ") of tensor '", tensor, "')");
  if (!spec.shape.empty() && !t->shape.empty() && spec.shape != t->shape) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": its tensor is registered with another shape than the checkpoint's"));
  }
  // Without a shape on either side the tensor is what the checkpoint's
  // slices cover: a partition that is its own tensor must be of the
  // checkpointed size (not cut, nor filled with zeros). (A slice's elements
  // past them cannot be told from padding, which more ranks have more of:
  // zeros; a tensor registered with its shape has its gaps refused.)
  if (t->shape.empty() && spec.shape.empty() && spec.tensor.empty() && spec.numel != t->numel) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": the checkpoint holds ", t->numel,
                                                      " elements of it, not ", spec.numel));
  }
  // Agreed by every slice it takes elements from (a slice wholly of
  // padding takes them from the tensor's first).
  const checkpoint::PartitionRecord& first =
      slices.empty() ? *t->slices.front().partition : *slices.front()->partition;
  RestoredState state;
  state.step = first.step();
  state.master_initialized = first.master_initialized();
  state.next_params_pending = first.next_params_pending();
  for (const auto* s : slices) {
    const checkpoint::PartitionRecord& p = *s->partition;
    if (p.step() != state.step || p.master_initialized() != state.master_initialized ||
        p.next_params_pending() != state.next_params_pending) {
      return absl::FailedPreconditionError(absl::StrCat(what, ": the checkpoint's slices '",
                                                        first.name(), "' and '", p.name(),
                                                        "' are at different steps"));
    }
    if (p.param_dtype() != static_cast<uint32_t>(spec.param_dtype)) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, " is registered as ", DTypeName(spec.param_dtype),
                       "; the checkpoint holds ", DTypeName(static_cast<DType>(p.param_dtype()))));
    }
    if (p.grads_ready()) {
      if (slices.size() != 1 || p.offset() != begin || p.numel() != spec.numel) {
        return absl::FailedPreconditionError(absl::StrCat(
            what,
            ": the checkpoint holds gradients accumulated for its next step, sliced "
            "otherwise; restore with the same slicing, or checkpoint right after a step"));
      }
      state.grads_ready = true;
      state.micro_batches = p.micro_batches();
      state.grad_stats.sq_norm = p.grad_sq_norm();
      state.grad_stats.nonfinite = p.grad_nonfinite();
    }
  }
  const checkpoint::TensorIndex* index = index_.get();
  const uint64_t tensor_numel = t->numel;
  const DType dtype = spec.param_dtype;
  state.read = [index, slices, begin, tensor_numel, dtype](int block_kind, uint64_t from,
                                                           uint64_t elems, std::byte* dst) {
    const RecordKind kind = RecordKindToRestore(block_kind);
    const bool params = kind == ckv1::PARAMS || kind == ckv1::PARAMS_NEXT;
    const size_t size = params ? DTypeSize(dtype) : sizeof(float);
    // In the tensor's indices; past its end: padding, zeros.
    const uint64_t lo = begin + from, hi = lo + elems;
    std::memset(dst, 0, elems * size);
    for (const auto* s : slices) {
      const uint64_t a = std::max(lo, s->begin()), b = std::min({hi, s->end(), tensor_numel});
      if (a >= b) continue;
      RETURN_IF_ERROR(index->Read(*s, kind, a, b - a, size, dst + (a - lo) * size));
    }
    return absl::OkStatus();
  };
  // Kept in memory: one slice, as the partition was, each record whole.
  if (slices.size() == 1 && slices.front()->begin() == begin &&
      slices.front()->partition->numel() == spec.numel &&
      !slices.front()->manifest->memory_file().empty()) {
    const checkpoint::TensorIndex::Slice* slice = slices.front();
    auto find = [slice](int block_kind, uint64_t from,
                        uint64_t elems) -> const checkpoint::Record* {
      const RecordKind kind = RecordKindToRestore(block_kind);
      for (const checkpoint::Record& r : slice->partition->records()) {
        if (r.kind() == kind && r.begin() == from && r.elems() == elems && r.has_memory_offset()) {
          return &r;
        }
      }
      return nullptr;
    };
    state.in_memory = [slice, find](int block_kind, uint64_t from,
                                    uint64_t elems) -> std::optional<RestoredState::InMemory> {
      const checkpoint::Record* r = find(block_kind, from, elems);
      if (r == nullptr) return std::nullopt;
      return RestoredState::InMemory{slice->manifest->memory_file(), r->memory_offset(),
                                     r->bytes()};
    };
    state.check_in_memory = [slice, find](int block_kind, uint64_t from, uint64_t elems,
                                          absl::Span<const std::byte> bytes) -> absl::Status {
      const checkpoint::Record* r = find(block_kind, from, elems);
      if (r == nullptr || r->bytes() != bytes.size() ||
          checkpoint::Hash(bytes.data(), bytes.size()) != r->xxh3()) {
        return absl::DataLossError(absl::StrCat(
            slice->manifest->memory_file(), ": the ", bytes.size(), " bytes kept at offset ",
            r == nullptr ? 0 : r->memory_offset(), " do not match their checksum"));
      }
      return absl::OkStatus();
    };
  }
  return state;
}

}  // namespace offload
