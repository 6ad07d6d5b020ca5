// The GPU tier's gradient side: gradients copied from the device into
// their host buffers (the partitions' gradient buffers in the daemon's
// arena) on a copy stream of their own while the rest of backward runs.
//
//   1. Add(key, src, bytes, producer): the key's host buffer is held
//      (GradientSink::HoldBuffers, one call for the keys of one Add); a copy of `src` into it is
//      issued on the drain's stream after the work issued so far on `producer` (the backward pass
//      that wrote `src`), straight into DMA-registered memory or through a
//      pinned staging buffer.
//   2. Completed(wait): the keys whose copies are done, in the order added;
//      their host buffers hold the bytes, and the caller hands them on (and
//      may free `src`). A copy that failed is reported here with its key
//      (its buffer is released unreturned by the caller): nothing half
//      written is ever handed on.
// `src` must stay valid until its key is reported.
//
// Thread-safety: all methods are safe from any thread (one lock).
#ifndef OFFLOADD_GPU_GRADIENT_DRAIN_H_
#define OFFLOADD_GPU_GRADIENT_DRAIN_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "gpu/device.h"

namespace offload::gpu {

// Where gradients go on the host.
class GradientSink {
 public:
  struct Span {
    void* data = nullptr;
    uint64_t bytes = 0;
    bool dma = false;  // registered for DMA: copied into directly
  };
  virtual ~GradientSink() = default;
  // Holds the keys' host buffers for writing until the caller hands each
  // on; all of them or (an error) none.
  virtual absl::StatusOr<std::vector<Span>> HoldBuffers(absl::Span<const uint64_t> keys) = 0;
};

struct GradientDrainStats {
  uint64_t copies = 0;
  uint64_t d2h_bytes = 0;
  uint64_t staged_bytes = 0;
  uint64_t host_waits = 0;  // Completed(wait) or staging reuse blocked the host
  uint64_t copy_failures = 0;
};

class GradientDrain {
 public:
  struct Done {
    uint64_t key = 0;
    absl::Status status;  // OK: the host buffer holds the bytes
  };

  static absl::StatusOr<std::unique_ptr<GradientDrain>> Create(Device* device, GradientSink* sink,
                                                               uint64_t staging_bytes = 16 << 20);
  // Waits for the copies in flight.
  ~GradientDrain();

  // One gradient to copy: its key, where it is on the device, its bytes.
  struct Item {
    uint64_t key = 0;
    const void* src = nullptr;
    uint64_t bytes = 0;
  };
  absl::Status Add(uint64_t key, const void* src, uint64_t bytes, const Stream& producer);
  // Several, in order, after the work issued so far on `producer`: one
  // wait on it and one completion event for all of them (a gradient hook
  // that batches costs the driver a third of the calls), and one hold of
  // their buffers. An error holding them adds none.
  absl::Status Add(absl::Span<const Item> items, const Stream& producer);
  // Completed copies, oldest first; with `wait`, every copy added so far.
  std::vector<Done> Completed(bool wait);
  // Copies added and not yet reported.
  size_t pending() const;
  // Copies added and not complete yet (those complete wait to be
  // reported); never blocks.
  size_t InFlight();
  GradientDrainStats stats() const;
  // How the host waits for copies (see HostWait); null: the device's
  // Synchronize.
  void SetHostWait(HostWait wait);

 private:
  struct Copy {
    uint64_t key = 0;
    GradientSink::Span host;
    uint64_t bytes = 0;
    // Staged: the device copy lands here; moved to `host` once done.
    const char* staged = nullptr;
    Event done;  // set on the last copy of each Add
    // The event that says this copy is done: `done` of its Add's last copy
    // (which stays in in_flight_ until this one is collected).
    const Event* finished = nullptr;
    absl::Status failed;  // could not be issued
    // What that event said, once asked: the same for every copy of the Add
    // (a device reports a failed copy once, at the first event after it:
    // asked per copy, the first would take the blame and the failed one
    // pass as good).
    std::shared_ptr<std::optional<absl::Status>> outcome;
  };

  GradientDrain(Device* device, GradientSink* sink, Stream stream, Event producer_done,
                PinnedMemory staging);
  // Finishes the front copy (its event complete, or waited for).
  Done Finish(Copy& c, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Collect(bool wait, std::vector<Done>* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Issues `c`'s copy of `src` on the drain's stream.
  absl::Status Issue(Copy& c, const void* src) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Event> TakeEvent() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records one event after the copies issued since the last Seal, which
  // each then wait on (Collect needs every copy in flight sealed).
  void Seal() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Device* const device_;
  GradientSink* const sink_;
  Stream stream_;
  Event producer_done_;
  PinnedMemory staging_;

  mutable absl::Mutex mu_;
  HostWait host_wait_ ABSL_GUARDED_BY(mu_);
  // The host's wait for `event`: host_wait_, else the device's Synchronize.
  absl::Status WaitOnHost(const Event& event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::deque<std::unique_ptr<Copy>> in_flight_ ABSL_GUARDED_BY(mu_);
  std::vector<Copy*> open_ ABSL_GUARDED_BY(mu_);  // in in_flight_, not yet sealed
  std::vector<Done> ready_ ABSL_GUARDED_BY(mu_);  // collected, not yet reported
  // Events of finished copies, reused (not one driver call per gradient).
  std::vector<Event> spare_events_ ABSL_GUARDED_BY(mu_);
  uint64_t staging_head_ ABSL_GUARDED_BY(mu_) = 0;
  GradientDrainStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace offload::gpu

#endif  // OFFLOADD_GPU_GRADIENT_DRAIN_H_
