// Conversions between offload.v1 wire types and the project's own types,
// shared by the service layer (daemon/service.cc) and the client library.
#ifndef OFFLOADD_PROTO_CONVERT_H_
#define OFFLOADD_PROTO_CONVERT_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cpu_adam/dtype.h"
#include "cpu_adam/types.h"
#include "proto/offload.pb.h"

namespace offload {

v1::DType ToProto(DType t);
// INVALID_ARGUMENT naming `field` for DTYPE_UNSPECIFIED or an unknown value.
absl::StatusOr<DType> FromProto(v1::DType t, absl::string_view field);

// ToProto sets every field, grad_scale only `with_grad_scale` (a param
// group's is the step's, and setting it there is refused). FromProto: an
// unset grad_scale means 1.
void ToProto(const AdamHyperparams& h, v1::AdamHyperparams* out, bool with_grad_scale = true);
AdamHyperparams FromProto(const v1::AdamHyperparams& p);

}  // namespace offload

#endif  // OFFLOADD_PROTO_CONVERT_H_
