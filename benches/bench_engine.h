// The daemon's engine assembled in-process for the benchmarks that drive it
// without gRPC (step_overlap, out_of_core_step, checkpoint): I/O backend,
// swap space, host pool, optimizer, swapper, partition store, step runner
// and session manager, built as offloadd builds them (engine/daemon.cc) and
// destroyed in reverse (the sessions and their blocks before the swapper,
// the swapper before the pool and the swap space it writes to).
#ifndef OFFLOADD_BENCHES_BENCH_ENGINE_H_
#define OFFLOADD_BENCHES_BENCH_ENGINE_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "cpu_adam/optimizer.h"
#include "engine/partition_store.h"
#include "engine/session_manager.h"
#include "engine/stats.h"
#include "engine/step_runner.h"
#include "nvme/io_backend.h"
#include "nvme/nvme_options.h"
#include "nvme/swap_space.h"
#include "swapper/host_pool.h"
#include "swapper/swapper.h"
#include "swapper/swapper_options.h"

namespace offload::bench {

struct BenchEngineOptions {
  // The NVMe tier: none when `nvme.dirs` is empty. Its I/O backend is made
  // from `nvme.io`.
  NvmeOptions nvme;
  uint64_t pool_bytes = uint64_t{1} << 40;
  OptimizerOptions optimizer;
  SwapperOptions swapper;
  // The partition store's: the arenas' total budget, the state chunk, and
  // the huge page size large partitions are laid out for (0: none).
  uint64_t arena_bytes = uint64_t{1} << 40;
  uint64_t chunk_elems = (16 << 20) / sizeof(float);
  uint64_t huge_page_bytes = 0;
};

struct BenchEngine {
  std::unique_ptr<IoBackend> backend;
  std::unique_ptr<SwapSpace> space;
  Stats stats;
  std::unique_ptr<HostPool> pool;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<Swapper> swapper;
  std::unique_ptr<PartitionStore> store;
  std::unique_ptr<StepRunner> steps;
  std::unique_ptr<SessionManager> sessions;
};

absl::StatusOr<std::unique_ptr<BenchEngine>> MakeBenchEngine(const BenchEngineOptions& options);

}  // namespace offload::bench

#endif  // OFFLOADD_BENCHES_BENCH_ENGINE_H_
