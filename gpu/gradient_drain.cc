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
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(GradientSink::Span host, sink_->Hold(key));
  auto c = std::make_unique<Copy>();
  c->key = key;
  c->host = host;
  c->bytes = bytes;
  auto issue = [&]() -> absl::Status {
    if (bytes > host.bytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "gradient %d: %d bytes do not fit its host buffer of %d", key, bytes, host.bytes));
    }
    if (spare_events_.empty()) {
      ASSIGN_OR_RETURN(c->done, device_->CreateEvent());
    } else {
      c->done = std::move(spare_events_.back());
      spare_events_.pop_back();
    }
    RETURN_IF_ERROR(device_->Record(producer_done_, producer));
    RETURN_IF_ERROR(device_->WaitOn(stream_, producer_done_));
    if (host.dma) {
      RETURN_IF_ERROR(device_->CopyAsync(host.data, src, bytes, Direction::kDeviceToHost, stream_));
    } else if (bytes <= staging_.bytes()) {
      if (staging_head_ + bytes > staging_.bytes()) {
        // Every earlier staged copy is moved out before the buffer is reused.
        ++stats_.host_waits;
        Collect(/*wait=*/true, &ready_);
        staging_head_ = 0;
      }
      char* stage = static_cast<char*>(staging_.get()) + staging_head_;
      RETURN_IF_ERROR(device_->CopyAsync(stage, src, bytes, Direction::kDeviceToHost, stream_));
      c->staged = stage;
      staging_head_ += (bytes + kAlignment - 1) / kAlignment * kAlignment;
      stats_.staged_bytes += bytes;
    } else {
      // Larger than the staging buffer: chunk by chunk, the host waiting.
      ++stats_.host_waits;
      Collect(/*wait=*/true, &ready_);
      staging_head_ = 0;
      for (uint64_t done = 0; done < bytes;) {
        const uint64_t chunk = std::min<uint64_t>(staging_.bytes(), bytes - done);
        RETURN_IF_ERROR(device_->CopyAsync(staging_.get(), static_cast<const char*>(src) + done,
                                           chunk, Direction::kDeviceToHost, stream_));
        RETURN_IF_ERROR(device_->Record(c->done, stream_));
        RETURN_IF_ERROR(device_->Synchronize(c->done));
        std::memcpy(static_cast<char*>(host.data) + done, staging_.get(), chunk);
        done += chunk;
      }
      stats_.staged_bytes += bytes;
    }
    return device_->Record(c->done, stream_);
  };
  c->failed = issue();
  if (c->failed.ok()) {
    ++stats_.copies;
    stats_.d2h_bytes += bytes;
  }
  in_flight_.push_back(std::move(c));
  return absl::OkStatus();
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
    if (c.failed.ok()) {
      if (wait) {
        status = device_->Synchronize(c.done);
      } else {
        absl::StatusOr<bool> done = device_->Query(c.done);
        if (done.ok() && !*done) break;
        status = done.status();
      }
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

size_t GradientDrain::pending() const {
  absl::MutexLock lock(&mu_);
  return in_flight_.size() + ready_.size();
}

GradientDrainStats GradientDrain::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace offload::gpu
