// Conversions between offload.v1 wire types and the project's own types,
// shared by the service layer (engine/service.cc) and the client library.
#ifndef OFFLOADD_PROTO_CONVERT_H_
#define OFFLOADD_PROTO_CONVERT_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cpu_adam/dtype.h"
#include "proto/offload.pb.h"

namespace offload {

v1::DType ToProto(DType t);
// INVALID_ARGUMENT naming `field` for DTYPE_UNSPECIFIED or an unknown value.
absl::StatusOr<DType> FromProto(v1::DType t, absl::string_view field);

}  // namespace offload

#endif  // OFFLOADD_PROTO_CONVERT_H_
