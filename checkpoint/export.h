// Consolidated fp32 weights of a checkpoint, however many sessions (ranks)
// wrote it: each tensor whole, from the fp32 master weights of its slices
// (or, for a slice never stepped, its working copy widened to fp32),
// padding past the tensor's end dropped. (A tensor registered without a
// shape ends where its last slice does: its padding, which nothing tells
// apart, stays.)
#ifndef OFFLOADD_CHECKPOINT_EXPORT_H_
#define OFFLOADD_CHECKPOINT_EXPORT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "checkpoint/tensor_index.h"

namespace offload::checkpoint {

struct ExportSummary {
  uint64_t tensors = 0;
  uint64_t elements = 0;
  uint64_t bytes = 0;  // of the file
};

// Writes `index`'s tensors to `path` in safetensors format (F32, shaped as
// registered, 1-D otherwise). FAILED_PRECONDITION if a tensor is not
// wholly covered by the checkpoint's slices.
absl::StatusOr<ExportSummary> ExportSafetensors(const TensorIndex& index, const std::string& path);

// Elements [begin, begin + elems) of `tensor`'s consolidated fp32 weights;
// OUT_OF_RANGE past the tensor's end.
absl::Status ReadWeights(const TensorIndex& index, const std::string& tensor, uint64_t begin,
                         uint64_t elems, float* dst);

}  // namespace offload::checkpoint

#endif  // OFFLOADD_CHECKPOINT_EXPORT_H_
