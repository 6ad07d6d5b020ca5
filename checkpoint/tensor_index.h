// Which partitions of a checkpoint hold which elements of which tensor,
// over every manifest in a checkpoint directory: what restoring (into any
// number of sessions, however the tensors are sliced now) and exporting
// read from.
//
// A partition is a slice of a tensor (proto/checkpoint.proto's Partition:
// tensor, offset, numel); slices of one tensor from all manifests must not
// overlap (FAILED_PRECONDITION naming both: two checkpoints of the same
// partitions in one directory). Adam is elementwise, so any element range of
// a tensor can be rebuilt from the slices that cover it, bit for bit.
//
// Thread-safety: const methods may be called from several threads at once.
#ifndef OFFLOADD_CHECKPOINT_TENSOR_INDEX_H_
#define OFFLOADD_CHECKPOINT_TENSOR_INDEX_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/format.h"

namespace offload::checkpoint {

class TensorIndex {
 public:
  struct Slice {
    const Manifest* manifest;
    const PartitionRecord* partition;
    const DataFileReader* reader;
    uint64_t begin() const { return partition->offset(); }
    uint64_t end() const { return partition->offset() + partition->numel(); }
  };
  struct Tensor {
    std::vector<uint64_t> shape;  // as registered (may be empty)
    uint64_t numel = 0;           // the product of shape, else the slices' end
    std::vector<Slice> slices;    // by offset
  };

  // Reads and verifies every manifest in `dir` (each of `steps`, if given:
  // ReadManifests) and opens their data files. Without `steps`,
  // FAILED_PRECONDITION where the manifests are of different steps (a
  // rank's last checkpoint did not complete: restoring all would mix two
  // moments of training), naming each session's and the latest all hold.
  static absl::StatusOr<std::unique_ptr<TensorIndex>> Load(
      const std::string& dir, std::optional<uint64_t> steps = std::nullopt);

  const std::string& directory() const { return dir_; }
  // path, manifest
  const std::vector<std::pair<std::string, std::unique_ptr<Manifest>>>& manifests() const {
    return manifests_;
  }
  const std::map<std::string, Tensor>& tensors() const { return tensors_; }
  // NOT_FOUND naming the tensor and the directory.
  absl::StatusOr<const Tensor*> Find(const std::string& tensor) const;

  // The slices of `t` holding elements [begin, end) (clamped to the
  // tensor's numel). FAILED_PRECONDITION if some element is in none.
  absl::StatusOr<std::vector<const Slice*>> Covering(const std::string& name, const Tensor& t,
                                                     uint64_t begin, uint64_t end) const;

  // Elements [begin, begin + elems) of the tensor (indices in the tensor)
  // of `kind`, `elem_size` bytes each, from `slice`'s records into `dst`
  // (which holds elems * elem_size bytes), verified (after a DATA_LOSS,
  // `dst` may hold the bytes that failed). FAILED_PRECONDITION if the slice
  // has no such records or they hold another element size.
  absl::Status Read(const Slice& slice, RecordKind kind, uint64_t begin, uint64_t elems,
                    size_t elem_size, void* dst) const;

 private:
  std::string dir_;
  std::vector<std::pair<std::string, std::unique_ptr<Manifest>>> manifests_;
  std::vector<std::unique_ptr<DataFileReader>> readers_;
  std::map<std::string, Tensor> tensors_;
};

const char* RecordKindName(RecordKind kind);

}  // namespace offload::checkpoint

#endif  // OFFLOADD_CHECKPOINT_TENSOR_INDEX_H_
