// The daemon's engine (engine/engine.h) for the benchmarks that drive it
// without gRPC (step_overlap, out_of_core_step, checkpoint), with its NVMe
// tier's I/O backend, and its parts as they reach them.
#ifndef OFFLOADD_BENCHES_BENCH_ENGINE_H_
#define OFFLOADD_BENCHES_BENCH_ENGINE_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "cpu_adam/optimizer.h"
#include "engine/engine.h"
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
  BenchEngine(std::unique_ptr<IoBackend> io, std::unique_ptr<Engine> e)
      : backend(std::move(io)),
        engine(std::move(e)),
        stats(engine->stats()),
        pool(&engine->pool()),
        optimizer(&engine->optimizer()),
        space(engine->swap_space()),
        swapper(&engine->swapper()),
        store(&engine->store()),
        steps(&engine->steps()),
        sessions(&engine->sessions()) {}

  std::unique_ptr<IoBackend> backend;  // outlives the engine's swap space
  std::unique_ptr<Engine> engine;
  Stats& stats;
  HostPool* const pool;
  Optimizer* const optimizer;
  SwapSpace* const space;  // null without an NVMe tier
  Swapper* const swapper;
  PartitionStoreFactory* const store;
  StepRunner* const steps;
  SessionManager* const sessions;
};

absl::StatusOr<std::unique_ptr<BenchEngine>> MakeBenchEngine(const BenchEngineOptions& options);

// The swapper's and the NVMe tier's settings a run used, for its header:
// "prefetch depth 8 / 256MiB; io_threads 4; checksum on; io_uring requests
// of 1MiB, queue depth 32, 2 rings; stripe 1MiB".
std::string DescribeSwapSettings(const NvmeOptions& nvme, const SwapperOptions& swapper);

}  // namespace offload::bench

#endif  // OFFLOADD_BENCHES_BENCH_ENGINE_H_
