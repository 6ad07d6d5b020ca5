// ZeRO-3's collectives for a C++ GPU trainer: its units' parameters
// all-gathered from the ranks' slices, its gradients reduce-scattered back
// into them, over a gpu::Communicator the trainer opened (NCCL,
// gpu/nccl_communicator.h, which says how the ranks share its id) and the
// trainer's GpuTier (client/gpu_tier.h), which brings each rank's slices to
// the device ahead of use and takes its gradient slices back to the daemon.
//
// Sharding: a tensor of `numel` elements is cut into size() slices of
// slice_numel = ceil(numel / size()) elements, the last padded with zeros;
// rank r's session holds slice r as one partition (fp32 gradients). On the
// device a tensor is whole: size() * slice_numel elements, the padding at
// its end.
//
//   auto zero3 = Zero3::Create(tier, device, comm, {.bucket_bytes = 64 << 20});
//   int unit = *(*zero3)->AddUnit({{w.id, w.slice_bytes}, {b.id, b.slice_bytes}});
//   each iteration:
//     tier->BeginIteration();
//     (*zero3)->Gather(unit, {w_full, b_full}, compute);   ... forward reads them
//     ... backward writes full gradients, then for each:
//     (*zero3)->ReduceScatter(w.id, w_grad_full, w_full_numel, compute);
//     (*zero3)->FinishBackward(compute);   // every gradient slice in the daemon
//     tier->EndIteration(); session->Step(...); tier->params().Invalidate(compute);
//
// Buckets (DeepSpeed's stage3_prefetch_bucket_size and reduce_bucket_size):
// a unit's tensors are all-gathered in one collective per bucket of at most
// bucket_bytes of gathered output (one NCCL group: one launch, not one per
// tensor); gradients wait in a bucket until bucket_bytes of full gradients
// are there, then go in one reduce-scatter (averaged over the ranks), whose
// slices the tier copies to the daemon on its own stream while backward goes
// on. Every rank must call Gather and ReduceScatter in the same order with
// the same sizes (the communicator's contract).
//
// Memory: the slices a Gather reads are the cache's (they may be evicted
// once the all-gather ran); the gradient slices land in a scratch buffer of
// device memory (Zero3Options::scratch_bytes), reused once the tier's
// copies out of it completed: when it is full, ReduceScatter waits for
// those copies (counted: scratch_waits).
//
// Errors: a wait for a collective that does not complete within
// Zero3Options::collective_timeout aborts the communicator
// (DEADLINE_EXCEEDED), as below. A collective that cannot be issued is
// returned by the call (a
// bucket that cannot be is still queued, its gradients' `full` buffers
// still read: make the call again, or Abandon the iteration); one
// that fails while running breaks the communicator: the gradient slices it
// wrote are released unreturned when FinishBackward (or a full scratch
// buffer) waits for their copies, and that call returns the error. Slices
// returned before the collective that failed are the daemon's (a step then
// finds some partitions' gradients and not others': drop the iteration,
// Step with skip, or end the job).
//
// Padding: the gradient's tail past the tensor's numel (the last rank's
// slice's padding) must be zeros, as the parameters' padding is: the daemon
// counts it in the gradient's norm.
//
// Thread-safety: one thread (the one that issues the compute), as the
// communicator's order requires.
#ifndef OFFLOADD_CLIENT_ZERO3_H_
#define OFFLOADD_CLIENT_ZERO3_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/gpu_tier.h"
#include "gpu/communicator.h"
#include "gpu/device.h"

namespace offload {

struct Zero3Options {
  // Gathered output of one all-gather, full gradients of one
  // reduce-scatter, at most (a tensor larger than this goes alone).
  uint64_t bucket_bytes = 64ull << 20;
  // Device memory for gradient slices on their way to the daemon (grown to
  // one bucket's slices where smaller). 0: twice the largest bucket's
  // slices so far.
  uint64_t scratch_bytes = 0;
  // Gradients are handed over to the daemon's step (see
  // Session::HandOverGradients) rather than returned.
  bool hand_over = true;
  // The longest a wait for a collective's work (the gradient copies behind
  // a reduce-scatter) goes on: past it the communicator is aborted (a peer
  // that died or hangs, or ranks whose calls differ, would hold it for
  // good: NCCL finds neither) and the call returns DEADLINE_EXCEEDED.
  // Waits poll the communicator meanwhile: an error NCCL found ends them
  // at once. (torch's NCCL timeout is 10 minutes too.)
  absl::Duration collective_timeout = absl::Minutes(10);
};

struct Zero3Stats {
  uint64_t all_gathers = 0;  // collectives
  uint64_t gathered_tensors = 0;
  uint64_t gathered_bytes = 0;  // output, on this rank
  uint64_t reduce_scatters = 0;
  uint64_t scattered_tensors = 0;
  uint64_t scattered_bytes = 0;  // full gradients, on this rank
  uint64_t scratch_waits = 0;
  uint64_t gradients_returned = 0;
};

class Zero3 {
 public:
  // `tier`, `device` and `comm` must outlive it; `device` is the tier's.
  static absl::StatusOr<std::unique_ptr<Zero3>> Create(GpuTier* tier, gpu::Device* device,
                                                       gpu::Communicator* comm,
                                                       const Zero3Options& options = {});
  // Waits for the tier's copies out of the scratch buffer.
  // Drops an unfinished iteration's gradients (their copies out of the
  // scratch buffer waited for), waits for the tier's copies in flight (at
  // most collective_timeout each: it may abort the communicator) and gives
  // the tier its own host waits back.
  ~Zero3();

  // The slice numel of a tensor of `numel` elements.
  static uint64_t SliceNumel(uint64_t numel, int ranks) { return (numel + ranks - 1) / ranks; }

  // Declares a unit: its tensors' partitions (this rank's slices) and their
  // bytes (the working dtype's). Returns the tier's unit index.
  absl::StatusOr<int> AddUnit(absl::Span<const std::pair<uint64_t, uint64_t>> slices);

  // Gathers the unit's tensors into `full` (device memory, one per tensor
  // in AddUnit's order, size() times its slice's bytes each), on `compute`:
  // work issued on it afterwards sees them.
  absl::Status Gather(int unit, absl::Span<void* const> full, const gpu::Stream& compute);

  // Queues the full fp32 gradient (`numel` elements, size() times the
  // slice's, written by the work issued so far on `compute`) of the tensor
  // whose slice is `partition_id`; reduce-scatters the bucket once full.
  // `full` must stay unchanged until FinishBackward (or until its bucket
  // went).
  absl::Status ReduceScatter(uint64_t partition_id, const float* full, uint64_t numel,
                             const gpu::Stream& compute);

  // Reduce-scatters what is queued and waits until every gradient slice of
  // the iteration is in the daemon (returned or handed over). Returns the
  // partitions, in the order they went.
  absl::StatusOr<std::vector<uint64_t>> FinishBackward(const gpu::Stream& compute);

  // Gives the iteration up after an error: the gradients still queued are
  // forgotten (their `full` buffers the trainer's again) and those on their
  // way to the daemon waited for and released unreturned.
  absl::Status Abandon();

  Zero3Stats stats() const { return stats_; }

 private:
  struct Pending {
    uint64_t id = 0;
    const float* full = nullptr;
    uint64_t slice_numel = 0;
  };
  Zero3(GpuTier* tier, gpu::Device* device, gpu::Communicator* comm, const Zero3Options& options)
      : tier_(tier), device_(device), comm_(comm), options_(options) {}

  // Reduce-scatters the queued gradients and gives their slices to the tier.
  absl::Status Flush(const gpu::Stream& compute);
  // Waits for every gradient slice given to the tier, and returns them.
  absl::Status Drain();
  // Waits on the host for the work issued so far on `compute`.
  absl::Status WaitFor(const gpu::Stream& compute);
  // Polls `done` until it is true, asking the communicator meanwhile;
  // past collective_timeout aborts it. Returns why it broke, if it did
  // (`what`: the work waited for, in the timeout's message).
  absl::Status Await(absl::string_view what, const std::function<bool()>& done);
  // Await until `event` completed: why the communicator broke, else the
  // device's error asking about the event, if any.
  absl::Status AwaitEvent(absl::string_view what, const gpu::Event& event);

  GpuTier* const tier_;
  gpu::Device* const device_;
  gpu::Communicator* const comm_;
  const Zero3Options options_;
  // Each unit's slice bytes, by the tier's unit index.
  std::vector<std::vector<uint64_t>> units_;
  std::vector<Pending> pending_;
  uint64_t pending_bytes_ = 0;
  gpu::DeviceMemory scratch_;
  uint64_t scratch_head_ = 0;
  std::vector<uint64_t> returned_;  // this iteration's
  Zero3Stats stats_;
};

}  // namespace offload

#endif  // OFFLOADD_CLIENT_ZERO3_H_
