#include "gpu/gradient_drain.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "base/status_macros.h"

namespace offload::gpu {
namespace {
constexpr uint64_t kAlignment = 256;
}  // namespace

absl::StatusOr<std::unique_ptr<GradientDrain>> GradientDrain::Create(Device* device,
                                                                     GradientSink* sink,
                                                                     uint64_t staging_bytes) {
  if (device == nullptr || sink == nullptr) {
    return absl::InvalidArgumentError("GradientDrain needs a device and a sink");
  }
  ASSIGN_OR_RETURN(Stream stream, device->CreateStream());
  ASSIGN_OR_RETURN(Event producer_done, device->CreateEvent());
  ASSIGN_OR_RETURN(PinnedMemory staging,
                   device->AllocatePinned(std::max<uint64_t>(staging_bytes, 1 << 20)));
  return std::unique_ptr<GradientDrain>(new GradientDrain(
      device, sink, std::move(stream), std::move(producer_done), std::move(staging)));
}

GradientDrain::GradientDrain(Device* device, GradientSink* sink, Stream stream, Event producer_done,
                             PinnedMemory staging)
    : device_(device),
      sink_(sink),
      stream_(std::move(stream)),
      producer_done_(std::move(producer_done)),
      staging_(std::move(staging)) {}

GradientDrain::~GradientDrain() {
  absl::MutexLock lock(&mu_);
  Collect(/*wait=*/true, &ready_);
}

absl::Status GradientDrain::Add(uint64_t key, const void* src, uint64_t bytes,
                                const Stream& producer) {
  const Item item{key, src, bytes};
  return Add(absl::MakeConstSpan(&item, 1), producer);
}

absl::StatusOr<Event> GradientDrain::TakeEvent() {
  if (spare_events_.empty()) return device_->CreateEvent();
  Event e = std::move(spare_events_.back());
  spare_events_.pop_back();
  return e;
}

absl::Status GradientDrain::Issue(Copy& c, const void* src) {
  const uint64_t bytes = c.bytes;
  if (bytes > c.host.bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "gradient %d: %d bytes do not fit its host buffer of %d", c.key, bytes, c.host.bytes));
  }
  if (c.host.dma) {
    return device_->CopyAsync(c.host.data, src, bytes, Direction::kDeviceToHost, stream_);
  }
  if (bytes <= staging_.bytes()) {
    if (staging_head_ + bytes > staging_.bytes()) {
      // Every earlier staged copy is moved out before the buffer is reused.
      ++stats_.host_waits;
      Seal();
      Collect(/*wait=*/true, &ready_);
      staging_head_ = 0;
    }
    char* stage = static_cast<char*>(staging_.get()) + staging_head_;
    RETURN_IF_ERROR(device_->CopyAsync(stage, src, bytes, Direction::kDeviceToHost, stream_));
    c.staged = stage;
    staging_head_ += (bytes + kAlignment - 1) / kAlignment * kAlignment;
    stats_.staged_bytes += bytes;
    return absl::OkStatus();
  }
  // Larger than the staging buffer: chunk by chunk, the host waiting.
  ++stats_.host_waits;
  Seal();
  Collect(/*wait=*/true, &ready_);
  staging_head_ = 0;
  ASSIGN_OR_RETURN(Event chunk_done, TakeEvent());
  for (uint64_t done = 0; done < bytes;) {
    const uint64_t chunk = std::min<uint64_t>(staging_.bytes(), bytes - done);
    RETURN_IF_ERROR(device_->CopyAsync(staging_.get(), static_cast<const char*>(src) + done, chunk,
                                       Direction::kDeviceToHost, stream_));
    RETURN_IF_ERROR(device_->Record(chunk_done, stream_));
    RETURN_IF_ERROR(WaitOnHost(chunk_done));
    std::memcpy(static_cast<char*>(c.host.data) + done, staging_.get(), chunk);
    done += chunk;
  }
  spare_events_.push_back(std::move(chunk_done));
  stats_.staged_bytes += bytes;
  return absl::OkStatus();
}

absl::Status GradientDrain::Add(absl::Span<const Item> items, const Stream& producer) {
  absl::MutexLock lock(&mu_);
  if (items.empty()) return absl::OkStatus();
  // The copies start after the work that wrote their sources.
  std::vector<uint64_t> keys;
  keys.reserve(items.size());
  for (const Item& item : items) keys.push_back(item.key);
  ASSIGN_OR_RETURN(std::vector<GradientSink::Span> hosts, sink_->HoldBuffers(keys));
  if (hosts.size() != items.size()) {
    return absl::InternalError(absl::StrFormat("the gradient sink held %d buffers for %d keys",
                                               hosts.size(), items.size()));
  }
  absl::Status ordered = device_->Record(producer_done_, producer);
  if (ordered.ok()) ordered = device_->WaitOn(stream_, producer_done_);
  for (size_t k = 0; k < items.size(); ++k) {
    const Item& item = items[k];
    auto c = std::make_unique<Copy>();
    c->key = item.key;
    c->host = hosts[k];
    c->bytes = item.bytes;
    c->failed = ordered.ok() ? Issue(*c, item.src) : ordered;
    if (c->failed.ok()) {
      ++stats_.copies;
      stats_.d2h_bytes += item.bytes;
    }
    open_.push_back(c.get());
    in_flight_.push_back(std::move(c));
  }
  Seal();
  return absl::OkStatus();
}

void GradientDrain::Seal() {
  if (open_.empty()) return;
  // One event after all of them, on their stream: each is done once it is.
  Copy& last = *open_.back();
  absl::StatusOr<Event> done = TakeEvent();
  absl::Status recorded = done.ok() ? device_->Record(*done, stream_) : done.status();
  if (recorded.ok()) last.done = *std::move(done);
  auto outcome = std::make_shared<std::optional<absl::Status>>();
  for (Copy* c : open_) {
    if (!recorded.ok() && c->failed.ok()) c->failed = recorded;
    c->finished = &last.done;
    c->outcome = outcome;
  }
  open_.clear();
}

GradientDrain::Done GradientDrain::Finish(Copy& c, absl::Status status) {
  if (!c.failed.ok()) status = c.failed;
  if (status.ok() && c.staged != nullptr) std::memcpy(c.host.data, c.staged, c.bytes);
  if (!status.ok()) {
    ++stats_.copy_failures;
    status = absl::Status(
        status.code(), absl::StrFormat("copy of gradient %d (%d bytes) from %s failed: %s", c.key,
                                       c.bytes, device_->name(), status.message()));
  }
  return Done{c.key, std::move(status)};
}

void GradientDrain::Collect(bool wait, std::vector<Done>* out) {
  while (!in_flight_.empty()) {
    Copy& c = *in_flight_.front();
    absl::Status status;
    if (c.failed.ok() && c.outcome->has_value()) {
      status = **c.outcome;  // its Add's event answered for an earlier copy
    } else if (c.failed.ok()) {
      if (wait) {
        status = WaitOnHost(*c.finished);
      } else {
        absl::StatusOr<bool> done = device_->Query(*c.finished);
        if (done.ok() && !*done) break;
        status = done.status();
      }
      *c.outcome = status;
    }
    out->push_back(Finish(c, std::move(status)));
    if (c.done) spare_events_.push_back(std::move(c.done));  // complete: for a later copy
    in_flight_.pop_front();
  }
}

std::vector<GradientDrain::Done> GradientDrain::Completed(bool wait) {
  absl::MutexLock lock(&mu_);
  if (wait && !in_flight_.empty()) ++stats_.host_waits;
  Collect(wait, &ready_);
  return std::exchange(ready_, {});
}

absl::Status GradientDrain::WaitOnHost(const Event& event) {
  return host_wait_ ? host_wait_(event) : device_->Synchronize(event);
}

void GradientDrain::SetHostWait(HostWait wait) {
  absl::MutexLock lock(&mu_);
  host_wait_ = std::move(wait);
}

size_t GradientDrain::InFlight() {
  absl::MutexLock lock(&mu_);
  Collect(/*wait=*/false, &ready_);
  return in_flight_.size();
}

size_t GradientDrain::pending() const {
  absl::MutexLock lock(&mu_);
  return in_flight_.size() + ready_.size();
}

GradientDrainStats GradientDrain::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace offload::gpu
