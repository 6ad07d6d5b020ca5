// A partition as the engine describes it to the daemon's services: where
// its buffers are in the session's arena, and what it is.
#ifndef OFFLOADD_ENGINE_PARTITION_INFO_H_
#define OFFLOADD_ENGINE_PARTITION_INFO_H_

#include <cstdint>
#include <string>

#include "cpu_adam/dtype.h"

namespace offload {

struct ArenaRegion {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct PartitionInfo {
  uint64_t id = 0;
  std::string name;
  uint64_t numel = 0;
  DType param_dtype = DType::kFp32;
  DType grad_dtype = DType::kFp32;
  ArenaRegion params;
  ArenaRegion grads;
  // Registered with fp32_master and not released yet: where the trainer
  // writes the fp32 initial values (numel floats). Otherwise empty.
  ArenaRegion master_init;
  // Everything the partition may place in the arena (its working copy's
  // second buffer included): what a client maps once.
  ArenaRegion span;
  // The span is laid out for huge pages (each region starts on one and
  // fills whole ones): a client maps it asking for huge pages; otherwise it
  // asks for small pages only (a huge page there would hold more than the
  // pool counts).
  bool huge_pages = false;
  uint64_t step = 0;
  // Its state came from the checkpoint its session restores: the
  // parameters are in place (nothing to write before releasing).
  bool restored = false;
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_PARTITION_INFO_H_
