// gpu/: the device a trainer's GPU tier moves data to and from, behind one
// interface with two implementations: CUDA (cuda_device.h, built where the
// toolkit is) and a host-emulated device (emulated_device.h) with its own
// memory budget, copy engines as threads, events and injectable failures,
// so that the tier's logic is tested on every machine. Used by the client
// library and the Python binding; never by engine/ or the daemon, which
// hold no device memory.
//
// The model is CUDA's, reduced to what the tier needs:
//   - device memory (Allocate) and pinned host memory (AllocatePinned);
//   - host memory registered for DMA (RegisterHost): copies from and to it
//     run at the link's speed and do not block the host;
//   - streams: work on one stream runs in the order it was issued; work on
//     different streams runs concurrently and completes in any order;
//   - events: recorded on a stream, complete once the work before them on
//     that stream did; a stream can wait on an event (no host block).
// A copy that fails makes the next event recorded after it on the same
// stream complete with that error (Query and Synchronize return it once);
// the bytes it was to write are undefined, its source is untouched.
//
// Every resource has one owner, Handle<Kind>, which gives it back to its
// device on destruction; a Handle must not outlive its Device. Borrowed
// streams (a framework's, such as torch's current stream) are Handles that
// own nothing.
//
// Thread-safety: a Device's methods may be called from any thread. One
// stream's work is ordered by the order of the calls that issue it.
#ifndef OFFLOADD_GPU_DEVICE_H_
#define OFFLOADD_GPU_DEVICE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace offload::gpu {

enum class Kind {
  kDeviceMemory,      // device bytes
  kPinnedMemory,      // page-locked host bytes, allocated by the device
  kHostRegistration,  // caller's host bytes, registered for DMA
  kStream,
  kEvent,
};

class Device;

// The one owner of a device resource: move-only, gives it back to its
// device when destroyed (unless borrowed). `get()` is the native handle or
// address: a cudaStream_t / cudaEvent_t / pointer on CUDA.
template <Kind K>
class Handle {
 public:
  Handle() = default;
  Handle(Device* device, void* handle, uint64_t bytes, bool owned)
      : device_(device), handle_(handle), bytes_(bytes), owned_(owned) {}
  ~Handle() { Reset(); }
  Handle(Handle&& o) noexcept { *this = std::move(o); }
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      Reset();
      device_ = std::exchange(o.device_, nullptr);
      handle_ = std::exchange(o.handle_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
      owned_ = std::exchange(o.owned_, false);
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  void* get() const { return handle_; }
  uint64_t bytes() const { return bytes_; }
  Device* device() const { return device_; }
  explicit operator bool() const { return device_ != nullptr; }
  void Reset();

 private:
  Device* device_ = nullptr;
  void* handle_ = nullptr;
  uint64_t bytes_ = 0;
  bool owned_ = false;
};

using DeviceMemory = Handle<Kind::kDeviceMemory>;
using PinnedMemory = Handle<Kind::kPinnedMemory>;
using HostRegistration = Handle<Kind::kHostRegistration>;
using Stream = Handle<Kind::kStream>;
using Event = Handle<Kind::kEvent>;

// Which way a copy goes (the device may use different engines for each).
enum class Direction { kHostToDevice, kDeviceToHost };

class Device {
 public:
  virtual ~Device() = default;

  // "cuda:0 (NVIDIA H200)", "emulated".
  virtual std::string name() const = 0;
  // Device memory this process may still allocate, and in all.
  virtual absl::StatusOr<uint64_t> FreeBytes() = 0;

  // RESOURCE_EXHAUSTED when the device has not `bytes` free.
  virtual absl::StatusOr<DeviceMemory> Allocate(uint64_t bytes) = 0;
  virtual absl::StatusOr<PinnedMemory> AllocatePinned(uint64_t bytes) = 0;
  // Registers [data, data + bytes) for DMA until the handle goes. The
  // memory must stay mapped (and its pages in place: not removed or
  // remapped) for the registration's life. Costs about as much as touching
  // the pages once; the kernel may refuse it (RLIMIT_MEMLOCK): callers keep
  // a path that works without it.
  virtual absl::StatusOr<HostRegistration> RegisterHost(void* data, uint64_t bytes) = 0;

  virtual absl::StatusOr<Stream> CreateStream() = 0;
  // A stream this device does not own (a framework's): `native` is a
  // cudaStream_t on CUDA, 0 the legacy default stream; on the emulated
  // device 0 is the host stream (work issued on it runs in the caller, and
  // waiting on an event blocks the caller until it completes).
  virtual Stream BorrowStream(void* native) = 0;
  virtual absl::StatusOr<Event> CreateEvent() = 0;

  // Issues a copy of `bytes` from `src` to `dst` on `stream`. Returns an
  // error only when it cannot be issued (bad arguments); a copy that fails
  // while running is reported by the next event recorded on the stream.
  virtual absl::Status CopyAsync(void* dst, const void* src, uint64_t bytes, Direction direction,
                                 const Stream& stream) = 0;
  // Re-records `event` at the current end of `stream`.
  virtual absl::Status Record(const Event& event, const Stream& stream) = 0;
  // Work issued on `stream` from now on runs after `event` completed.
  virtual absl::Status WaitOn(const Stream& stream, const Event& event) = 0;
  // True once `event` completed; the error of a copy before it if one
  // failed. An event never recorded counts as complete.
  virtual absl::StatusOr<bool> Query(const Event& event) = 0;
  // Blocks until `event` completed; its error as Query.
  virtual absl::Status Synchronize(const Event& event) = 0;

 protected:
  template <Kind K>
  friend class Handle;
  // Gives back what a Handle owned. Must not fail; logs if the device does.
  virtual void Destroy(Kind kind, void* handle, uint64_t bytes) = 0;
};

// How a component waits on the host for an event its copies need (behind
// them, on another stream, may be a collective a peer never joins): the
// device's Synchronize by default; client/zero3 gives one that polls its
// communicator and gives up after a timeout (aborting it).
using HostWait = std::function<absl::Status(const Event&)>;

template <Kind K>
void Handle<K>::Reset() {
  if (device_ != nullptr && owned_) device_->Destroy(K, handle_, bytes_);
  device_ = nullptr;
  handle_ = nullptr;
  bytes_ = 0;
  owned_ = false;
}

}  // namespace offload::gpu

#endif  // OFFLOADD_GPU_DEVICE_H_
