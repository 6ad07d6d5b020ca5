#include "client/zero3.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace offload {
namespace {

// Scratch slices start at this alignment (NCCL's and CUDA's copies are
// fastest from aligned addresses).
constexpr uint64_t kAlign = 256;

uint64_t AlignUp(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

}  // namespace

absl::StatusOr<std::unique_ptr<Zero3>> Zero3::Create(GpuTier* tier, gpu::Device* device,
                                                     gpu::Communicator* comm,
                                                     const Zero3Options& options) {
  if (tier == nullptr || device == nullptr || comm == nullptr) {
    return absl::InvalidArgumentError("Zero3 needs a GPU tier, its device and a communicator");
  }
  if (options.bucket_bytes == 0) {
    return absl::InvalidArgumentError("Zero3: bucket_bytes must be positive");
  }
  std::unique_ptr<Zero3> zero3(new Zero3(tier, device, comm, options));
  // The tier's host waits, too, may sit behind a collective (its copies
  // behind the reduce-scatter that wrote them, or the all-gather that read
  // a unit's slices): they poll the communicator and time out as Zero3's.
  tier->SetHostWait(
      [z = zero3.get()](const gpu::Event& event) {
        return z->AwaitEvent("a copy behind a collective", event);
      },
      zero3.get());
  return zero3;
}

Zero3::~Zero3() {
  // The tier's copies may still read the scratch buffer.
  if (tier_->gradients_pending() > 0) {
    if (absl::Status s = tier_->DropGradients(); !s.ok()) {
      LogWarning("Zero3: dropping the unfinished iteration's gradients: %s", s.ToString());
    }
  }
  // Copies in flight (a prefetch behind an all-gather a peer never joins)
  // waited for while the wait still times out, not in the tier's
  // destructor, which would wait for good (a copy that failed after its
  // use stays for the tier's EndIteration to report).
  tier_->params().AwaitCopies();
  tier_->ClearHostWait(this);
}

absl::StatusOr<int> Zero3::AddUnit(absl::Span<const std::pair<uint64_t, uint64_t>> slices) {
  ASSIGN_OR_RETURN(int unit, tier_->params().AddUnit(slices));
  if (static_cast<size_t>(unit) >= units_.size()) units_.resize(unit + 1);
  units_[unit].clear();
  for (const auto& [id, bytes] : slices) units_[unit].push_back(bytes);
  return unit;
}

absl::Status Zero3::Gather(int unit, absl::Span<void* const> full, const gpu::Stream& compute) {
  if (unit < 0 || static_cast<size_t>(unit) >= units_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Zero3: no unit ", unit, " (", units_.size(), " declared)"));
  }
  const std::vector<uint64_t>& sizes = units_[unit];
  if (full.size() != sizes.size()) {
    return absl::InvalidArgumentError(absl::StrCat("Zero3: unit ", unit, " has ", sizes.size(),
                                                   " tensors, Gather was given ", full.size()));
  }
  // Checked before anything is issued: a collective one rank cannot issue
  // midway leaves its peers waiting in it.
  for (size_t i = 0; i < full.size(); ++i) {
    if (full[i] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("Zero3: unit ", unit, ": tensor ", i, "'s gathered buffer is null"));
    }
  }
  ASSIGN_OR_RETURN(std::vector<uint64_t> offsets, tier_->params().Use(unit, compute));
  char* slab = static_cast<char*>(tier_->params().slab());
  const uint64_t ranks = comm_->size();
  absl::Status gathered;
  std::vector<gpu::Communicator::GatherItem> bucket;
  uint64_t bucket_out = 0;
  auto issue = [&]() {
    if (bucket.empty() || !gathered.ok()) return;
    gathered = comm_->AllGather(bucket, compute);
    if (gathered.ok()) {
      ++stats_.all_gathers;
      stats_.gathered_tensors += bucket.size();
      stats_.gathered_bytes += bucket_out;
    }
    bucket.clear();
    bucket_out = 0;
  };
  for (size_t i = 0; i < sizes.size(); ++i) {
    const uint64_t out = sizes[i] * ranks;
    if (!bucket.empty() && bucket_out + out > options_.bucket_bytes) issue();
    bucket.push_back({slab + offsets[i], full[i], sizes[i]});
    bucket_out += out;
  }
  issue();
  // The slices were read by the all-gathers, issued on `compute`: they may
  // go once those ran (and on an error the unit must not stay pinned).
  absl::Status done = tier_->params().Done(unit, compute);
  RETURN_IF_ERROR(gathered);
  return done;
}

absl::Status Zero3::ReduceScatter(uint64_t partition_id, const float* full, uint64_t numel,
                                  const gpu::Stream& compute) {
  const uint64_t ranks = comm_->size();
  if (full == nullptr || numel == 0 || numel % ranks != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Zero3: the gradient of partition ", partition_id, " has ", numel,
                     " elements; it must be the whole padded tensor, a positive multiple of the ",
                     ranks, " ranks"));
  }
  const uint64_t bytes = numel * sizeof(float);
  // Called again after its bucket could not be issued (this gradient is
  // queued, last): the bucket is issued, the gradient not queued twice.
  if (pending_bytes_ >= options_.bucket_bytes && !pending_.empty() &&
      pending_.back().id == partition_id && pending_.back().full == full) {
    return Flush(compute);
  }
  if (!pending_.empty() && pending_bytes_ + bytes > options_.bucket_bytes) {
    RETURN_IF_ERROR(Flush(compute));
  }
  pending_.push_back({partition_id, full, numel / ranks});
  pending_bytes_ += bytes;
  if (pending_bytes_ >= options_.bucket_bytes) return Flush(compute);
  return absl::OkStatus();
}

absl::Status Zero3::Flush(const gpu::Stream& compute) {
  if (pending_.empty()) return absl::OkStatus();
  // The bucket stays queued until its collective is issued: what can fail
  // before (room in the scratch buffer) leaves it as it was, and this rank
  // in step with its peers.
  const std::vector<Pending>& bucket = pending_;
  uint64_t need = 0;
  for (const Pending& p : bucket) need += AlignUp(p.slice_numel * sizeof(float));
  // A Drain that fails (a broken communicator, a failed copy) leaves no
  // iteration to go on with: the bucket goes with it.
  auto drained = [this]() {
    absl::Status s = Drain();
    if (!s.ok()) {
      pending_.clear();
      pending_bytes_ = 0;
    }
    return s;
  };
  if (!scratch_ || scratch_.bytes() < need) {
    // A first or larger buffer: the old one's copies must be done first.
    RETURN_IF_ERROR(drained());
    scratch_.Reset();
    const uint64_t want = options_.scratch_bytes != 0 ? options_.scratch_bytes : 2 * need;
    ASSIGN_OR_RETURN(scratch_, device_->Allocate(std::max(want, need)));
  } else if (scratch_head_ + need > scratch_.bytes()) {
    ++stats_.scratch_waits;
    RETURN_IF_ERROR(drained());
  }
  char* at = static_cast<char*>(scratch_.get()) + scratch_head_;
  std::vector<gpu::Communicator::ScatterItem> items;
  for (const Pending& p : bucket) {
    items.push_back({p.full, reinterpret_cast<float*>(at), p.slice_numel});
    at += AlignUp(p.slice_numel * sizeof(float));
  }
  RETURN_IF_ERROR(comm_->ReduceScatter(items, gpu::ReduceOp::kAvg, compute));
  scratch_head_ += need;
  ++stats_.reduce_scatters;
  stats_.scattered_tensors += bucket.size();
  stats_.scattered_bytes += pending_bytes_;
  std::vector<gpu::GradientDrain::Item> copies;
  for (size_t i = 0; i < bucket.size(); ++i) {
    copies.push_back({bucket[i].id, items[i].recv, bucket[i].slice_numel * sizeof(float)});
  }
  pending_.clear();
  pending_bytes_ = 0;
  // All or none (one hold of their buffers). None: the collective still
  // writes the scratch buffer, which must not go before it ran.
  absl::Status added = tier_->AddGradients(copies, compute);
  if (!added.ok()) {
    absl::Status waited = WaitFor(compute);
    if (!waited.ok()) LogWarning("Zero3: waiting for the reduce-scatter: %s", waited.ToString());
  }
  return added;
}

absl::Status Zero3::Await(absl::string_view what, const std::function<bool()>& done) {
  const absl::Time deadline = absl::Now() + options_.collective_timeout;
  absl::Duration nap = absl::Microseconds(10);
  absl::Status broken;
  while (!done()) {
    // Once broken (by NCCL's error or the timeout) the communicator is
    // aborted: its kernels end, and so does this wait.
    if (broken.ok()) broken = comm_->Check();
    if (broken.ok() && absl::Now() > deadline) {
      broken = absl::DeadlineExceededError(absl::StrCat(
          comm_->name(), ": ", what, " did not complete within ",
          absl::FormatDuration(options_.collective_timeout),
          " (Zero3Options::collective_timeout): a rank died or hangs, or the ranks' calls "
          "differ; the communicator is aborted"));
      comm_->Abort(broken);
    }
    absl::SleepFor(nap);
    nap = std::min(2 * nap, absl::Milliseconds(1));
  }
  return broken;
}

absl::Status Zero3::WaitFor(const gpu::Stream& compute) {
  ASSIGN_OR_RETURN(gpu::Event ran, device_->CreateEvent());
  RETURN_IF_ERROR(device_->Record(ran, compute));
  return AwaitEvent("the reduce-scatter", ran);
}

absl::Status Zero3::AwaitEvent(absl::string_view what, const gpu::Event& event) {
  absl::Status queried;
  RETURN_IF_ERROR(Await(what, [&] {
    absl::StatusOr<bool> done = device_->Query(event);
    if (!done.ok()) queried = done.status();
    return !done.ok() || *done;
  }));
  return queried;
}

absl::Status Zero3::Drain() {
  absl::Status drained;
  if (tier_->gradients_pending() > 0) {
    // Waited for here, not in the tier: a reduce-scatter a peer never
    // joins would hold the copies behind it for good.
    const absl::Status waited = Await("the gradients' reduce-scatters and copies",
                                      [this] { return tier_->gradients_in_flight() == 0; });
    // The slices were written by reduce-scatters: a communicator one of
    // them broke makes every copy of them garbage, handed to no step.
    absl::StatusOr<std::vector<uint64_t>> ids =
        tier_->ReturnGradients(/*wait=*/true, options_.hand_over, {}, [&]() -> absl::Status {
          RETURN_IF_ERROR(waited);
          return comm_->Check();
        });
    if (ids.ok()) {
      stats_.gradients_returned += ids->size();
      returned_.insert(returned_.end(), ids->begin(), ids->end());
    }
    drained = ids.status();
  }
  scratch_head_ = 0;  // (its copies are done, returned or not)
  return drained;
}

absl::Status Zero3::Abandon() {
  pending_.clear();
  pending_bytes_ = 0;
  returned_.clear();
  scratch_head_ = 0;
  return tier_->gradients_pending() > 0 ? tier_->DropGradients() : absl::OkStatus();
}

absl::StatusOr<std::vector<uint64_t>> Zero3::FinishBackward(const gpu::Stream& compute) {
  RETURN_IF_ERROR(Flush(compute));
  RETURN_IF_ERROR(Drain());
  return std::exchange(returned_, {});
}

}  // namespace offload
