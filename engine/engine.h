// The core's front door: the host pool, the optimizer, the NVMe tier's swap
// space, the swapper, the partition store, the step runner and the session
// manager, built in that order by one call and destroyed in reverse (the
// sessions and their blocks before the swapper, the swapper before the pool
// and the swap space it writes to). The daemon, the tests, the benchmarks
// and the fuzzer all start an engine here; what serves it (gRPC, the arena
// channel, metrics) lives around it.
//
//   EngineOptions o;
//   o.host_budget_bytes = 8ull << 30;
//   ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(o, Env::Default()));
//   engine->sessions().Open(...);
//
// Thread-safety: the accessors are constant after Create; each component is
// thread-safe as its header says.
#ifndef OFFLOADD_ENGINE_ENGINE_H_
#define OFFLOADD_ENGINE_ENGINE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "base/env.h"
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

namespace offload {

struct EngineOptions {
  // The host pool: every byte of partition state in host memory is charged
  // to it; mlocked where permitted with `lock_pool`.
  uint64_t host_budget_bytes = uint64_t{8} << 30;
  bool lock_pool = false;
  // The pool's memory as a file in this directory on a memory file system
  // (swapper/pool_file.h); empty: private memory.
  std::string pool_dir;
  OptimizerOptions optimizer;
  SwapperOptions swapper;
  // New sessions' placement (PartitionStoreFactory::CheckPlacement'd against
  // whether there is an NVMe tier).
  Placement placement;
  // Partitions move and are updated in chunks of this many elements.
  uint64_t state_chunk_elems = (uint64_t{16} << 20) / sizeof(float);
  uint64_t session_arena_bytes = uint64_t{256} << 30;
  // Arenas lay large partitions out for huge pages of this size (0: small
  // pages only; offloadd passes SharedHugePageBytes()).
  uint64_t huge_page_bytes = 0;
  // The NVMe tier, if any: swap files in `nvme->dirs`, written through the
  // I/O backend given to Create.
  std::optional<NvmeOptions> nvme;
};

class Engine {
 public:
  // `io`: the NVMe tier's I/O backend, required with options.nvme (and
  // ignored without); it must outlive the engine. Errors: the pool file's
  // (PoolFile::Create), the NVMe tier's
  // (prefixed "NVMe tier (nvme.dirs)"), a placement the tiers cannot hold,
  // the optimizer's kernel.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options, Env* env,
                                                        IoBackend* io = nullptr);
  // Sessions first (their blocks), then the step runner, the store, the
  // swapper, the swap space and the pool: the reverse of Create.
  ~Engine() = default;

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  Stats& stats() { return stats_; }
  HostPool& pool() { return pool_; }
  Optimizer& optimizer() { return optimizer_; }
  SwapSpace* swap_space() { return swap_.get(); }  // null without an NVMe tier
  Swapper& swapper() { return *swapper_; }
  PartitionStoreFactory& store() { return *store_; }
  StepRunner& steps() { return *steps_; }
  SessionManager& sessions() { return *sessions_; }

 private:
  Engine(const EngineOptions& options, Env* env);

  // In the order they are built; destroyed in reverse.
  Stats stats_;
  HostPool pool_;
  Optimizer optimizer_;
  std::unique_ptr<SwapSpace> swap_;
  std::unique_ptr<Swapper> swapper_;
  std::unique_ptr<PartitionStoreFactory> store_;
  std::unique_ptr<StepRunner> steps_;
  std::unique_ptr<SessionManager> sessions_;
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_ENGINE_H_
