#include "checkpoint/export.h"

#include <sys/stat.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "checkpoint/safetensors.h"
#include "cpu_adam/dtype.h"

namespace offload::checkpoint {

absl::Status ReadWeights(const TensorIndex& index, const std::string& tensor, uint64_t begin,
                         uint64_t elems, float* dst) {
  ASSIGN_OR_RETURN(const TensorIndex::Tensor* t, index.Find(tensor));
  if (begin > t->numel || elems > t->numel - begin) {
    return absl::OutOfRangeError(absl::StrCat("elements [", begin, ", +", elems, ") of tensor '",
                                              tensor, "' are past its ", t->numel));
  }
  const uint64_t end = begin + elems;
  ASSIGN_OR_RETURN(auto slices, index.Covering(tensor, *t, begin, end));
  std::vector<std::byte> working;
  for (const TensorIndex::Slice* s : slices) {
    const uint64_t lo = std::max(begin, s->begin()), hi = std::min(end, s->end());
    float* out = dst + (lo - begin);
    const PartitionRecord& p = *s->partition;
    if (p.master_initialized()) {
      RETURN_IF_ERROR(
          index.Read(*s, ::offload::checkpoint::v1::MASTER, lo, hi - lo, sizeof(float), out));
    } else {
      const auto dtype = static_cast<DType>(p.param_dtype());
      working.resize((hi - lo) * DTypeSize(dtype));
      RETURN_IF_ERROR(index.Read(*s, ::offload::checkpoint::v1::PARAMS, lo, hi - lo,
                                 DTypeSize(dtype), working.data()));
      WidenToFloat(working.data(), dtype, out, hi - lo);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ExportSummary> ExportSafetensors(const TensorIndex& index, const std::string& path) {
  std::vector<SafetensorsEntry> entries;
  ExportSummary summary;
  for (const auto& [name, t] : index.tensors()) {
    SafetensorsEntry e;
    e.name = name;
    e.shape = t.shape.empty() ? std::vector<uint64_t>{t.numel} : t.shape;
    // Every element must be there before anything is written.
    RETURN_IF_ERROR(index.Covering(name, t, 0, t.numel).status());
    e.fill = [&index, name = name](uint64_t begin, uint64_t n, float* dst) {
      return ReadWeights(index, name, begin, n, dst);
    };
    entries.push_back(std::move(e));
    ++summary.tensors;
    summary.elements += t.numel;
  }
  std::map<std::string, std::string> metadata = {{"format", "pt"}, {"producer", "offloadd export"}};
  if (!index.manifests().empty()) {
    metadata["step"] = absl::StrCat(index.manifests().front().second->steps());
  }
  RETURN_IF_ERROR(WriteSafetensors(path, entries, metadata));
  struct stat st;
  if (stat(path.c_str(), &st) == 0) summary.bytes = static_cast<uint64_t>(st.st_size);
  return summary;
}

}  // namespace offload::checkpoint
