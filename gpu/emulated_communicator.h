// An emulated group of ranks in one process, for testing ZeRO-3 logic on
// machines without GPUs: the contract of communicator.h over
// EmulatedDevices (whose device memory is host memory), with
//   - each rank's collectives run on its stream as a host function
//     (EmulatedDevice::Launch), in issue order with its copies; a rank's
//     collective waits there until every rank's matching one arrived, so a
//     rank that runs ahead waits as it would on NCCL;
//   - ranks that issue different collectives at the same position (kind,
//     reduction, item count or sizes) break the group: every rank's next
//     call returns FAILED_PRECONDITION naming both calls;
//   - a rank that does not arrive within `timeout` breaks it too
//     (DEADLINE_EXCEEDED), instead of hanging the test;
//   - sums in rank order, so results are the same every run.
// Thread-safety: as communicator.h; each rank from a thread of its own.
#ifndef OFFLOADD_GPU_EMULATED_COMMUNICATOR_H_
#define OFFLOADD_GPU_EMULATED_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "gpu/communicator.h"
#include "gpu/emulated_device.h"

namespace offload::gpu {

class EmulatedCommunicator final : public Communicator {
 public:
  struct Group;

  // One communicator per device, rank i on devices[i] (the same device may
  // serve several ranks). The devices must outlive the communicators.
  static std::vector<std::unique_ptr<EmulatedCommunicator>> CreateGroup(
      absl::Span<EmulatedDevice* const> devices, absl::Duration timeout = absl::Seconds(60));

  int rank() const override { return rank_; }
  int size() const override;
  std::string name() const override;
  absl::Status AllGather(absl::Span<const GatherItem> items, const Stream& stream) override;
  absl::Status Check() const override;
  void Abort(absl::Status why) override;
  absl::Status ReduceScatter(absl::Span<const ScatterItem> items, ReduceOp op,
                             const Stream& stream) override;

  // Collectives this rank issued, and the items in them.
  uint64_t collectives() const { return collectives_; }
  uint64_t items() const { return items_; }

 private:
  struct Call;
  EmulatedCommunicator(std::shared_ptr<Group> group, EmulatedDevice* device, int rank)
      : group_(std::move(group)), device_(device), rank_(rank) {}
  absl::Status Issue(Call call, const Stream& stream);

  const std::shared_ptr<Group> group_;
  EmulatedDevice* const device_;
  const int rank_;
  uint64_t next_ = 0;  // this rank's next collective's position
  uint64_t collectives_ = 0;
  uint64_t items_ = 0;
};

}  // namespace offload::gpu

#endif  // OFFLOADD_GPU_EMULATED_COMMUNICATOR_H_
