// What the partition store gives a checkpoint (a set's image as the
// checkpoint began, and each chunk's bytes through a ChunkSink) and takes
// back from one when a session restores it (RestoredState). The format on
// disk is checkpoint/'s; engine/checkpoint.h joins the two.
#ifndef OFFLOADD_ENGINE_CHECKPOINT_IMAGE_H_
#define OFFLOADD_ENGINE_CHECKPOINT_IMAGE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "cpu_adam/types.h"
#include "engine/partition_info.h"
#include "engine/placement.h"

namespace offload {

// A registering partition's state, from a checkpoint its session restores
// (engine/checkpoint.h).
struct RestoredState {
  uint64_t step = 0;
  bool master_initialized = false;  // master weights and moments saved
  bool grads_ready = false;         // accumulated gradients saved
  uint64_t micro_batches = 0;
  GradStats grad_stats;
  bool next_params_pending = false;  // a newer working copy saved (the delayed update)
  // Elements [begin, begin + elems) of one block kind (PartitionStore::
  // BlockKind: kMaster, kExpAvg, kExpAvgSq, kAccumBlock, kParamsBlock for the
  // current working copy, kShadowBlock for the newer one) into `dst`.
  std::function<absl::Status(int block_kind, uint64_t begin, uint64_t elems, std::byte* dst)> read;
  // Where one record holds exactly those elements in a memory file (a
  // session kept across a restart in its pool's file, memory.pool_dir): the
  // file, the offset and the bytes. Null or nullopt: read.
  struct InMemory {
    std::string file;
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  std::function<std::optional<InMemory>(int block_kind, uint64_t begin, uint64_t elems)> in_memory;
  // Whether `bytes` (taken where in_memory said) match that record's
  // checksum: DATA_LOSS naming it otherwise.
  std::function<absl::Status(int block_kind, uint64_t begin, uint64_t elems,
                             absl::Span<const std::byte> bytes)>
      check_in_memory;
};

// Receives a checkpoint's bytes (PartitionStore::BeginCheckpoint): one block
// kind of one chunk of a partition, as it was when the checkpoint began.
// Called from several threads (the writer's, and those of calls about to
// change a chunk not written yet).
class ChunkSink {
 public:
  virtual ~ChunkSink() = default;
  virtual absl::Status Write(uint64_t id, uint64_t chunk, int block_kind,
                             absl::Span<const std::byte> bytes) = 0;
};

// A partition as a checkpoint began.
struct CheckpointedPartition {
  PartitionInfo info;
  std::string tensor;  // never empty here
  std::vector<uint64_t> shape{};
  uint64_t tensor_offset = 0;
  bool master_initialized = false;
  bool grads_ready = false;
  uint64_t micro_batches = 0;
  GradStats grad_stats;
  // The block kinds saved, per chunk: the master weights and moments if
  // initialised, the accumulator if gradients are ready, the working copy
  // read now (`current_kind`), and the newer one if pending (`next_kind`,
  // else -1).
  std::vector<int> block_kinds;
  int current_kind = 0, next_kind = -1;
  uint64_t chunks = 0;
};

// A set as a checkpoint began.
struct SetImage {
  uint64_t steps = 0;
  bool delayed = false;
  Placement placement;
  uint64_t chunk_elems = 0;
  std::vector<CheckpointedPartition> partitions;  // by id
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_CHECKPOINT_IMAGE_H_
