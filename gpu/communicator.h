// gpu/: the collectives a ZeRO-3 trainer needs across its ranks, over
// device memory and ordered on a device stream, behind one interface with
// two implementations: NCCL (nccl_communicator.h, built where the toolkit
// has it) and an emulated group of ranks in one process
// (emulated_communicator.h), so that the ZeRO-3 logic above it
// (client/zero3.h) is tested on every machine.
//
// The model is NCCL's, reduced to what ZeRO-3 needs:
//   - every rank issues the same collectives in the same order, each on a
//     stream of its own device; a collective runs after the work issued
//     before it on that stream, and work issued after it waits for it;
//   - one call with several items is one collective (NCCL: one group), so
//     that a bucket of tensors costs one launch, not one per tensor;
//   - a call returns an error only when it cannot be issued (bad arguments,
//     or a communicator already broken); a collective that fails while it
//     runs (a peer gone, ranks that disagree) breaks the communicator: every
//     later call returns that error, naming the collective. What it was to
//     write is then undefined; what it reads is untouched. (NCCL reports
//     what it detects, ncclCommGetAsyncError; a peer that dies without a
//     network error may leave the collective waiting for good: whoever
//     waits for it gives up after a timeout of its own and Aborts, as
//     torch's NCCL watchdog does; client/zero3.h does for its waits.)
//
// Thread-safety: one thread issues a communicator's collectives (their
// order is the contract between ranks).
#ifndef OFFLOADD_GPU_COMMUNICATOR_H_
#define OFFLOADD_GPU_COMMUNICATOR_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "gpu/device.h"

namespace offload::gpu {

enum class ReduceOp { kSum, kAvg };

class Communicator {
 public:
  // Rank r's `bytes` at `send` land at recv + r * bytes on every rank;
  // `recv` holds size() * bytes. `send` may be recv + rank() * bytes (in
  // place).
  struct GatherItem {
    const void* send = nullptr;
    void* recv = nullptr;
    uint64_t bytes = 0;
  };
  // `send` holds size() * count floats; rank r receives the reduction over
  // the ranks of their send[r * count, (r + 1) * count).
  struct ScatterItem {
    const float* send = nullptr;
    float* recv = nullptr;
    uint64_t count = 0;
  };

  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "nccl rank 1 of 4", "emulated rank 0 of 2".
  virtual std::string name() const = 0;

  virtual absl::Status AllGather(absl::Span<const GatherItem> items, const Stream& stream) = 0;
  virtual absl::Status ReduceScatter(absl::Span<const ScatterItem> items, ReduceOp op,
                                     const Stream& stream) = 0;
  // OK unless a collective broke the communicator (then the error that
  // did, naming the collective): asked after a collective's results were
  // waited for, before they are used (a failed collective leaves what it
  // was to write undefined).
  virtual absl::Status Check() const = 0;
  // Breaks the communicator for `why` (a wait for one of its collectives
  // gave up): its collectives in flight end (what they were to write
  // undefined: a wait for them then returns), and Check and every later
  // call return `why`. Nothing if it is broken already. From the thread
  // that issues.
  virtual void Abort(absl::Status why) = 0;
};

}  // namespace offload::gpu

#endif  // OFFLOADD_GPU_COMMUNICATOR_H_
