#include "gpu/emulated_device.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace offload::gpu {
namespace {

constexpr uint64_t kAlignment = 256;  // cudaMalloc's

uint64_t RoundUp(uint64_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

}  // namespace

struct EmulatedDevice::EventState {
  uint64_t recorded = 0;   // recordings issued
  uint64_t completed = 0;  // the latest recording that completed
  absl::Status error;      // of a copy before it, reported once
};

// mu_.Await's condition: the event's recording `target` completed.
struct EmulatedDevice::EventReached {
  const EventState* event;
  uint64_t target;
  bool Done() const { return event->completed >= target; }
};

struct EmulatedDevice::Op {
  enum Type { kCopy, kRecord, kWait, kHost } type = kCopy;
  void* dst = nullptr;
  const void* src = nullptr;
  uint64_t bytes = 0;
  Direction direction = Direction::kHostToDevice;
  absl::Duration delay;
  std::shared_ptr<EventState> event;
  uint64_t generation = 0;
  std::function<void()> fn;
};

struct EmulatedDevice::StreamState {
  bool host = false;
  absl::Mutex mu;
  std::deque<Op> queue ABSL_GUARDED_BY(mu);
  bool stop ABSL_GUARDED_BY(mu) = false;
  // A failed copy's status, until the next event recorded here takes it.
  absl::Status pending_error;  // the stream's own thread (or the caller's, host)
  std::thread thread;
};

EmulatedDevice::EmulatedDevice(EmulatedDeviceOptions options)
    : options_(options),
      host_stream_(std::make_unique<StreamState>()),
      rng_(options.seed * 0x9E3779B97F4A7C15ull + 1) {
  host_stream_->host = true;
}

EmulatedDevice::~EmulatedDevice() = default;

absl::StatusOr<uint64_t> EmulatedDevice::FreeBytes() {
  absl::MutexLock lock(&mu_);
  return options_.memory_bytes - used_;
}

absl::StatusOr<DeviceMemory> EmulatedDevice::Allocate(uint64_t bytes) {
  const uint64_t rounded = RoundUp(std::max<uint64_t>(bytes, 1));
  absl::MutexLock lock(&mu_);
  if (rounded > options_.memory_bytes - used_) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("emulated device: allocating %d bytes: %d of %d bytes free", bytes,
                        options_.memory_bytes - used_, options_.memory_bytes));
  }
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) return absl::ResourceExhaustedError("emulated device: host out of memory");
  used_ += rounded;
  peak_ = std::max(peak_, used_);
  device_[reinterpret_cast<uintptr_t>(p)] = rounded;
  return DeviceMemory(this, p, bytes, /*owned=*/true);
}

absl::StatusOr<PinnedMemory> EmulatedDevice::AllocatePinned(uint64_t bytes) {
  const uint64_t rounded = RoundUp(std::max<uint64_t>(bytes, 1));
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) return absl::ResourceExhaustedError("emulated device: host out of memory");
  absl::MutexLock lock(&mu_);
  pinned_[reinterpret_cast<uintptr_t>(p)] = rounded;
  return PinnedMemory(this, p, bytes, /*owned=*/true);
}

absl::StatusOr<HostRegistration> EmulatedDevice::RegisterHost(void* data, uint64_t bytes) {
  std::function<absl::Status(void*, uint64_t)> fault;
  {
    absl::MutexLock lock(&mu_);
    fault = register_fault_;
  }
  if (fault) {
    if (absl::Status s = fault(data, bytes); !s.ok()) return s;
  }
  if (data == nullptr || bytes == 0) {
    return absl::InvalidArgumentError("emulated device: registering an empty range");
  }
  const auto begin = reinterpret_cast<uintptr_t>(data);
  absl::MutexLock lock(&mu_);
  auto next = registered_.lower_bound(begin);
  const bool overlaps_next = next != registered_.end() && next->first < begin + bytes;
  const bool overlaps_prev =
      next != registered_.begin() && std::prev(next)->first + std::prev(next)->second > begin;
  if (overlaps_next || overlaps_prev) {
    // cudaErrorHostMemoryAlreadyRegistered
    return absl::AlreadyExistsError(
        absl::StrFormat("emulated device: %d bytes at %p overlap a registered range", bytes, data));
  }
  registered_[begin] = bytes;
  registered_bytes_ += bytes;
  return HostRegistration(this, data, bytes, /*owned=*/true);
}

absl::StatusOr<Stream> EmulatedDevice::CreateStream() {
  auto* s = new StreamState;
  s->thread = std::thread([this, s] { Worker(s); });
  absl::MutexLock lock(&mu_);
  streams_.insert(s);
  return Stream(this, s, 0, /*owned=*/true);
}

Stream EmulatedDevice::BorrowStream(void* native) { return Stream(this, native, 0, false); }

absl::StatusOr<Event> EmulatedDevice::CreateEvent() {
  auto* e = new std::shared_ptr<EventState>(std::make_shared<EventState>());
  return Event(this, e, 0, /*owned=*/true);
}

const std::shared_ptr<EmulatedDevice::EventState>& EmulatedDevice::EventOf(const Event& event) {
  return *static_cast<std::shared_ptr<EventState>*>(event.get());
}

EmulatedDevice::StreamState* EmulatedDevice::StateOf(const Stream& stream) {
  if (stream.get() == nullptr) return host_stream_.get();
  auto* s = static_cast<StreamState*>(stream.get());
  absl::MutexLock lock(&mu_);
  return streams_.contains(s) ? s : nullptr;
}

bool EmulatedDevice::InRanges(const std::map<uintptr_t, uint64_t>& ranges, const void* p,
                              uint64_t bytes) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = ranges.upper_bound(a);
  if (it == ranges.begin()) return false;
  --it;
  return a >= it->first && a + bytes <= it->first + it->second;
}

absl::Status EmulatedDevice::CopyAsync(void* dst, const void* src, uint64_t bytes,
                                       Direction direction, const Stream& stream) {
  if (!stream) return absl::InvalidArgumentError("emulated device: copy on no stream");
  Op op;
  op.type = Op::kCopy;
  op.dst = dst;
  op.src = src;
  op.bytes = bytes;
  op.direction = direction;
  {
    absl::MutexLock lock(&mu_);
    const void* device_side = direction == Direction::kHostToDevice ? dst : src;
    if (bytes != 0 && !options_.any_address_is_device && !InRanges(device_, device_side, bytes)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "emulated device: copy of %d bytes %s: %p is not inside device memory", bytes,
          direction == Direction::kHostToDevice ? "to the device" : "from the device",
          device_side));
    }
    ++copies_;
    if (options_.max_copy_delay > absl::ZeroDuration()) {
      rng_ ^= rng_ << 13;
      rng_ ^= rng_ >> 7;
      rng_ ^= rng_ << 17;
      op.delay = options_.max_copy_delay * (static_cast<double>(rng_ % 1000000) / 1000000.0);
    }
  }
  return Enqueue(StateOf(stream), std::move(op));
}

absl::Status EmulatedDevice::Record(const Event& event, const Stream& stream) {
  if (!event || !stream) return absl::InvalidArgumentError("emulated device: record of no event");
  Op op;
  op.type = Op::kRecord;
  op.event = EventOf(event);
  {
    absl::MutexLock lock(&mu_);
    op.generation = ++op.event->recorded;
  }
  return Enqueue(StateOf(stream), std::move(op));
}

absl::Status EmulatedDevice::WaitOn(const Stream& stream, const Event& event) {
  if (!event || !stream) return absl::InvalidArgumentError("emulated device: wait on no event");
  Op op;
  op.type = Op::kWait;
  op.event = EventOf(event);
  std::function<absl::Status(void*, void*)> fault;
  {
    absl::MutexLock lock(&mu_);
    op.generation = op.event->recorded;
    fault = wait_fault_;
  }
  if (fault) {
    if (absl::Status s = fault(stream.get(), event.get()); !s.ok()) return s;
  }
  return Enqueue(StateOf(stream), std::move(op));
}

absl::StatusOr<bool> EmulatedDevice::Query(const Event& event) {
  if (!event) return absl::InvalidArgumentError("emulated device: query of no event");
  EventState& e = *EventOf(event);
  absl::MutexLock lock(&mu_);
  if (e.completed < e.recorded) return false;
  if (!e.error.ok()) return std::exchange(e.error, absl::OkStatus());
  return true;
}

absl::Status EmulatedDevice::Synchronize(const Event& event) {
  if (!event) return absl::InvalidArgumentError("emulated device: synchronize on no event");
  EventState& e = *EventOf(event);
  absl::MutexLock lock(&mu_);
  const uint64_t target = e.recorded;
  const EventReached reached{&e, target};
  mu_.Await(absl::Condition(&reached, &EventReached::Done));
  return std::exchange(e.error, absl::OkStatus());
}

absl::Status EmulatedDevice::Launch(const Stream& stream, std::function<void()> fn) {
  Op op;
  op.type = Op::kHost;
  op.fn = std::move(fn);
  return Enqueue(StateOf(stream), std::move(op));
}

absl::Status EmulatedDevice::Enqueue(StreamState* s, Op op) {
  if (s == nullptr) {
    return absl::InvalidArgumentError(
        "emulated device: a stream it did not make (a borrowed stream must be null, the host "
        "stream: no other handle means anything to it)");
  }
  if (s->host) {
    RunOp(s, op);
    return absl::OkStatus();
  }
  absl::MutexLock lock(&s->mu);
  s->queue.push_back(std::move(op));
  return absl::OkStatus();
}

void EmulatedDevice::RunOp(StreamState* s, Op& op) {
  switch (op.type) {
    case Op::kCopy: {
      CopyFault fault;
      {
        absl::MutexLock lock(&mu_);
        fault = copy_fault_;
      }
      absl::Status status =
          fault ? fault(op.dst, op.src, op.bytes, op.direction) : absl::OkStatus();
      if (!status.ok()) {
        if (s->pending_error.ok()) s->pending_error = std::move(status);
        return;
      }
      if (op.delay > absl::ZeroDuration()) absl::SleepFor(op.delay);
      const uint64_t chunk = std::max<uint64_t>(options_.copy_chunk_bytes, 1);
      for (uint64_t done = 0; done < op.bytes; done += chunk) {
        std::memcpy(static_cast<char*>(op.dst) + done, static_cast<const char*>(op.src) + done,
                    std::min(chunk, op.bytes - done));
        if (!s->host) std::this_thread::yield();
      }
      return;
    }
    case Op::kRecord: {
      absl::MutexLock lock(&mu_);
      op.event->completed = std::max(op.event->completed, op.generation);
      if (!s->pending_error.ok())
        op.event->error = std::exchange(s->pending_error, absl::OkStatus());
      return;
    }
    case Op::kWait: {
      absl::MutexLock lock(&mu_);
      const EventReached reached{op.event.get(), op.generation};
      mu_.Await(absl::Condition(&reached, &EventReached::Done));
      return;
    }
    case Op::kHost:
      op.fn();
      return;
  }
}

void EmulatedDevice::Worker(StreamState* s) {
  for (;;) {
    Op op;
    {
      absl::MutexLock lock(&s->mu);
      s->mu.Await(absl::Condition(
          +[](StreamState* st)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return st->stop || !st->queue.empty(); },
          s));
      if (s->queue.empty()) return;  // stopping, and drained
      op = std::move(s->queue.front());
      s->queue.pop_front();
    }
    RunOp(s, op);
  }
}

void EmulatedDevice::SetWaitFault(std::function<absl::Status(void*, void*)> fault) {
  absl::MutexLock lock(&mu_);
  wait_fault_ = std::move(fault);
}

void EmulatedDevice::SetCopyFault(CopyFault fault) {
  absl::MutexLock lock(&mu_);
  copy_fault_ = std::move(fault);
}

void EmulatedDevice::SetRegisterFault(std::function<absl::Status(void*, uint64_t)> fault) {
  absl::MutexLock lock(&mu_);
  register_fault_ = std::move(fault);
}

uint64_t EmulatedDevice::used_bytes() const {
  absl::MutexLock lock(&mu_);
  return used_;
}
uint64_t EmulatedDevice::peak_bytes() const {
  absl::MutexLock lock(&mu_);
  return peak_;
}
uint64_t EmulatedDevice::registered_bytes() const {
  absl::MutexLock lock(&mu_);
  return registered_bytes_;
}
bool EmulatedDevice::IsRegistered(const void* data, uint64_t bytes) const {
  absl::MutexLock lock(&mu_);
  return InRanges(registered_, data, bytes);
}
uint64_t EmulatedDevice::copies() const {
  absl::MutexLock lock(&mu_);
  return copies_;
}

void EmulatedDevice::Destroy(Kind kind, void* handle, uint64_t bytes) {
  const auto key = reinterpret_cast<uintptr_t>(handle);
  switch (kind) {
    case Kind::kDeviceMemory: {
      absl::MutexLock lock(&mu_);
      auto it = device_.find(key);
      if (it != device_.end()) {
        used_ -= it->second;
        device_.erase(it);
      }
      std::free(handle);
      return;
    }
    case Kind::kPinnedMemory: {
      absl::MutexLock lock(&mu_);
      pinned_.erase(key);
      std::free(handle);
      return;
    }
    case Kind::kHostRegistration: {
      absl::MutexLock lock(&mu_);
      auto it = registered_.find(key);
      if (it != registered_.end()) {
        registered_bytes_ -= it->second;
        registered_.erase(it);
      }
      return;
    }
    case Kind::kStream: {
      auto* s = static_cast<StreamState*>(handle);
      {
        absl::MutexLock lock(&mu_);
        streams_.erase(s);
      }
      {
        absl::MutexLock lock(&s->mu);
        s->stop = true;
      }
      s->thread.join();
      delete s;
      return;
    }
    case Kind::kEvent:
      delete static_cast<std::shared_ptr<EventState>*>(handle);
      return;
  }
}

}  // namespace offload::gpu
