// The optimizer's settings: one light header (no oneTBB), so that the
// daemon's configuration can name them without pulling in the pool. Every
// range is defined once, here, and used by the registry binding and by
// Optimizer's own setters alike.
#ifndef OFFLOADD_CPU_ADAM_OPTIMIZER_OPTIONS_H_
#define OFFLOADD_CPU_ADAM_OPTIMIZER_OPTIONS_H_

#include <cstdint>
#include <string>

#include "base/config_registry.h"

namespace offload {

struct OptimizerOptions {
  // Threads in the optimizer's arena; 0 means one per online CPU. More
  // threads help until memory bandwidth saturates (usually at a fraction of
  // the cores); fewer leave cores to the trainers.
  int64_t threads = 0;

  // Elements per parallel task. Smaller tiles balance load across threads;
  // larger ones spend less on scheduling. Rounded down to a multiple of 32,
  // so that a tile of an aligned array starts on a cache line (the kernels
  // write whole lines of a working copy around the cache only there).
  int64_t tile_elems = 1 << 16;

  // Instruction set: "auto" (widest the CPU has), "avx512", "avx2" or
  // "scalar". All give bit-identical results.
  std::string kernel = "auto";

  // Scan the gradients for NaN/Inf before updating anything; a step that
  // finds some changes no state and reports itself skipped (loss-scale
  // overflow). In the daemon it costs nothing (the count comes with the
  // gradients' accumulation or hand-over); Optimizer::Step alone reads the
  // gradients once more for it (2 or 4 bytes per parameter; see
  // benches/RESULTS.md).
  bool check_finite = true;
};

inline constexpr IntRange kOptimizerThreadsRange{0, 1024};
inline constexpr IntRange kOptimizerTileElemsRange{1024, int64_t{1} << 30};

// Binds every field under "optimizer.*". All are dynamic: the daemon hooks
// them to its Optimizer's setters. `options` must outlive `registry`.
void BindOptimizerTunables(OptimizerOptions* options, ConfigRegistry* registry);

}  // namespace offload

#endif  // OFFLOADD_CPU_ADAM_OPTIMIZER_OPTIONS_H_
