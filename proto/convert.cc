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
      return absl::InvalidArgumentError(absl::StrCat(
          field, " must be DTYPE_FP32, DTYPE_BF16 or DTYPE_FP16, got ", static_cast<int>(t)));
  }
}

void ToProto(const AdamHyperparams& h, v1::AdamHyperparams* p, bool with_grad_scale) {
  p->set_lr(h.lr);
  p->set_beta1(h.beta1);
  p->set_beta2(h.beta2);
  p->set_eps(h.eps);
  p->set_weight_decay(h.weight_decay);
  p->set_decoupled_weight_decay(h.decoupled_weight_decay);
  p->set_bias_correction(h.bias_correction);
  if (with_grad_scale) p->set_grad_scale(h.grad_scale);
}

AdamHyperparams FromProto(const v1::AdamHyperparams& p) {
  AdamHyperparams h;
  h.lr = p.lr();
  h.beta1 = p.beta1();
  h.beta2 = p.beta2();
  h.eps = p.eps();
  h.weight_decay = p.weight_decay();
  h.decoupled_weight_decay = p.decoupled_weight_decay();
  h.bias_correction = p.bias_correction();
  if (p.has_grad_scale()) h.grad_scale = p.grad_scale();
  return h;
}

}  // namespace offload
