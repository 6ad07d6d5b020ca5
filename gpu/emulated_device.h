// A device emulated in host memory, for testing the GPU tier on machines
// without a GPU: the same contract as device.h, with
//   - its own memory budget (Allocate beyond it is RESOURCE_EXHAUSTED) and
//     a record of the most it ever had allocated;
//   - streams run by a thread each, which copy in chunks after a random
//     delay: work on one stream runs in order, streams race each other, and
//     a reader that does not wait for a copy sees it half done;
//   - the host stream (BorrowStream(nullptr)): work issued on it runs in
//     the caller, and a wait on an event blocks the caller, as the host code
//     of a CPU "kernel" would;
//   - a copy whose device side is not inside device memory is refused
//     (INVALID_ARGUMENT), where CUDA would fault;
//   - injectable copy, registration and stream-wait failures, and host
//     functions run on a stream (Launch), for ordering tests.
// Thread-safety: as device.h.
#ifndef OFFLOADD_GPU_EMULATED_DEVICE_H_
#define OFFLOADD_GPU_EMULATED_DEVICE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gpu/device.h"

namespace offload::gpu {

struct EmulatedDeviceOptions {
  // Device memory in all.
  uint64_t memory_bytes = 1ull << 30;
  // Each copy waits a random time below this before it runs, so that
  // copies on different streams complete out of order. Zero: none.
  absl::Duration max_copy_delay = absl::Microseconds(200);
  // Copies move this many bytes at a time, yielding in between.
  uint64_t copy_chunk_bytes = 64 << 10;
  uint64_t seed = 1;
  // Copies take any address for device memory, not only Allocate's: for a
  // framework whose CPU tensors play the device's (offloadd.torch's tests).
  bool any_address_is_device = false;
};

class EmulatedDevice final : public Device {
 public:
  explicit EmulatedDevice(EmulatedDeviceOptions options = {});
  ~EmulatedDevice() override;

  std::string name() const override { return "emulated"; }
  absl::StatusOr<uint64_t> FreeBytes() override;
  absl::StatusOr<DeviceMemory> Allocate(uint64_t bytes) override;
  absl::StatusOr<PinnedMemory> AllocatePinned(uint64_t bytes) override;
  absl::StatusOr<HostRegistration> RegisterHost(void* data, uint64_t bytes) override;
  absl::StatusOr<Stream> CreateStream() override;
  Stream BorrowStream(void* native) override;
  absl::StatusOr<Event> CreateEvent() override;
  absl::Status CopyAsync(void* dst, const void* src, uint64_t bytes, Direction direction,
                         const Stream& stream) override;
  absl::Status Record(const Event& event, const Stream& stream) override;
  absl::Status WaitOn(const Stream& stream, const Event& event) override;
  absl::StatusOr<bool> Query(const Event& event) override;
  absl::Status Synchronize(const Event& event) override;

  // --- test hooks ---
  // Decides each copy's fate when it runs: non-OK fails it (nothing is
  // written; the next event on its stream reports the status).
  using CopyFault =
      std::function<absl::Status(void* dst, const void* src, uint64_t bytes, Direction)>;
  void SetCopyFault(CopyFault fault);
  // Decides each RegisterHost: non-OK is returned instead.
  void SetRegisterFault(std::function<absl::Status(void* data, uint64_t bytes)> fault);
  // Decides each WaitOn (the stream's handle, the event's): non-OK is
  // returned and the stream does not wait.
  void SetWaitFault(std::function<absl::Status(void* stream, void* event)> fault);
  // Runs `fn` on `stream` in order with its copies (a "kernel").
  absl::Status Launch(const Stream& stream, std::function<void()> fn);

  // What was allocated (device memory), now and at most.
  uint64_t used_bytes() const;
  uint64_t peak_bytes() const;
  uint64_t registered_bytes() const;
  // Whether [data, data + bytes) lies inside one registered range.
  bool IsRegistered(const void* data, uint64_t bytes) const;
  uint64_t copies() const;

 protected:
  void Destroy(Kind kind, void* handle, uint64_t bytes) override;

 private:
  struct StreamState;
  struct EventState;
  struct EventReached;
  struct Op;

  // The stream behind a handle: the host stream for a null one.
  // Null for a handle this device did not make (a borrowed one must be
  // null: the host stream).
  StreamState* StateOf(const Stream& stream) ABSL_LOCKS_EXCLUDED(mu_);
  // The state behind an event handle (CreateEvent's).
  static const std::shared_ptr<EventState>& EventOf(const Event& event);
  absl::Status Enqueue(StreamState* s, Op op);
  void RunOp(StreamState* s, Op& op);
  void Worker(StreamState* s);
  bool InRanges(const std::map<uintptr_t, uint64_t>& ranges, const void* p, uint64_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const EmulatedDeviceOptions options_;
  std::unique_ptr<StreamState> host_stream_;

  mutable absl::Mutex mu_;
  // Start address -> bytes.
  std::map<uintptr_t, uint64_t> device_ ABSL_GUARDED_BY(mu_);
  std::map<uintptr_t, uint64_t> pinned_ ABSL_GUARDED_BY(mu_);
  std::map<uintptr_t, uint64_t> registered_ ABSL_GUARDED_BY(mu_);
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t peak_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t registered_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t copies_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t rng_ ABSL_GUARDED_BY(mu_);
  CopyFault copy_fault_ ABSL_GUARDED_BY(mu_);
  // The streams CreateStream made and not yet destroyed.
  absl::flat_hash_set<const StreamState*> streams_ ABSL_GUARDED_BY(mu_);
  std::function<absl::Status(void*, uint64_t)> register_fault_ ABSL_GUARDED_BY(mu_);
  std::function<absl::Status(void*, void*)> wait_fault_ ABSL_GUARDED_BY(mu_);
};

}  // namespace offload::gpu

#endif  // OFFLOADD_GPU_EMULATED_DEVICE_H_
