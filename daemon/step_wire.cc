#include "daemon/step_wire.h"

#include <cstdint>
#include <utility>

#include "proto/convert.h"

namespace offload {

absl::StatusOr<StepCall> FromProto(const v1::StepRequest& req) {
  if (!req.has_hyperparams()) return absl::InvalidArgumentError("Step needs hyperparams");
  StepCall call;
  call.hyperparams = FromProto(req.hyperparams());
  call.control.skip = req.skip();
  call.control.overflow = req.overflow();
  call.control.overlap = req.overlap();
  if (req.has_auto_checkpoint()) call.control.auto_checkpoint = req.auto_checkpoint();
  for (const v1::ParamGroup& g : req.groups()) {
    if (g.hyperparams().has_grad_scale()) {
      return absl::InvalidArgumentError(
          "a param group sets grad_scale; it is the step's (the global clip coefficient)");
    }
    ParamGroup group;
    group.partition_ids.assign(g.partition_ids().begin(), g.partition_ids().end());
    group.hyperparams = FromProto(g.hyperparams());
    call.control.groups.push_back(std::move(group));
  }
  return call;
}

void ToProto(const StepSummary& s, v1::StepResponse* out) {
  out->set_loss_scale(s.loss_scale);
  out->set_partitions_updated(s.partitions_updated);
  out->set_params_updated(s.params_updated);
  out->set_skipped(s.skipped);
  out->set_nonfinite_gradients(s.nonfinite);
  out->set_wall_us(static_cast<uint64_t>(s.wall_nanos / 1000));
  out->set_state_wait_us(static_cast<uint64_t>(s.state_wait_nanos / 1000));
  out->set_compute_us(static_cast<uint64_t>(s.compute_nanos / 1000));
  out->set_running(s.running);
  out->set_delayed_update(s.delayed_update);
}

void ToProto(const PendingGradients& p, v1::GetPendingGradientsResponse* out) {
  out->set_sq_norm(p.stats.sq_norm);
  out->set_nonfinite(p.stats.nonfinite);
  out->set_partitions(p.partitions);
  out->set_micro_batches(p.micro_batches);
  out->set_loss_scale(p.loss_scale);
  out->set_delayed_update(p.delayed_update);
  out->set_auto_checkpoint_due(p.auto_checkpoint_due);
}

}  // namespace offload
