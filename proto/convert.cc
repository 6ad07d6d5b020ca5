#include "proto/convert.h"

#include "absl/strings/str_cat.h"

namespace offload {

v1::DType ToProto(DType t) {
  switch (t) {
    case DType::kFp32:
      return v1::DTYPE_FP32;
    case DType::kBf16:
      return v1::DTYPE_BF16;
    case DType::kFp16:
      return v1::DTYPE_FP16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<DType> FromProto(v1::DType t, absl::string_view field) {
  switch (t) {
    case v1::DTYPE_FP32:
      return DType::kFp32;
    case v1::DTYPE_BF16:
      return DType::kBf16;
    case v1::DTYPE_FP16:
      return DType::kFp16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must be DTYPE_FP32, DTYPE_BF16 or DTYPE_FP16, got ",
                       static_cast<int>(t)));
  }
}

}  // namespace offload
