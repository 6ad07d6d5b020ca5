// The step protocol's answers as the wire says them (offload.v1's
// StepResponse and GetPendingGradientsResponse), shared by the gRPC service
// and the request ring's, which carries the same messages serialized.
#ifndef OFFLOADD_DAEMON_STEP_WIRE_H_
#define OFFLOADD_DAEMON_STEP_WIRE_H_

#include "absl/status/statusor.h"
#include "cpu_adam/types.h"
#include "engine/session_manager.h"
#include "engine/step_protocol.h"
#include "engine/step_runner.h"
#include "proto/offload.pb.h"

namespace offload {

// A StepRequest's hyperparameters and control (its session aside), with the
// checks both services make: INVALID_ARGUMENT without hyperparams, or for a
// param group that sets grad_scale (the step's).
struct StepCall {
  AdamHyperparams hyperparams;
  StepControl control;
};
absl::StatusOr<StepCall> FromProto(const v1::StepRequest& req);

void ToProto(const StepSummary& s, v1::StepResponse* out);
void ToProto(const PendingGradients& p, v1::GetPendingGradientsResponse* out);

}  // namespace offload

#endif  // OFFLOADD_DAEMON_STEP_WIRE_H_
