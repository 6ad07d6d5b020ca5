// A daemon's engine for tests: its pool, swapper over a real NVMe tier (an
// io_uring swap space in a directory, behind a fault-injecting backend),
// partition store, step runner and session manager, built as offloadd
// builds them.
#ifndef OFFLOADD_ENGINE_TEST_ENGINE_H_
#define OFFLOADD_ENGINE_TEST_ENGINE_H_

#include <sys/stat.h>

#include <memory>
#include <string>

#include "base/env.h"
#include "cpu_adam/optimizer.h"
#include "engine/partition_store.h"
#include "engine/session_manager.h"
#include "engine/stats.h"
#include "engine/step_runner.h"
#include "gtest/gtest.h"
#include "nvme/fault_injection.h"
#include "nvme/io_backend_factory.h"
#include "nvme/swap_space.h"
#include "swapper/host_pool.h"
#include "swapper/swapper.h"

namespace offload {

// A daemon's engine: pool, swapper (over an NVMe tier that may fail on
// demand), store, step runner and session manager.
class Engine {
 public:
  // `huge_page_bytes`: the arenas lay large partitions out for huge pages of
  // this size (0: small pages only), as offloadd does with
  // SharedHugePageBytes().
  Engine(const std::string& dir, uint64_t pool_bytes, int64_t prefetch_depth = 8,
         uint64_t chunk_elems = 4096, uint64_t huge_page_bytes = 0) {
    mkdir(dir.c_str(), 0700);
    auto inner = MakeIoBackend(IoOptions{});
    EXPECT_TRUE(inner.ok()) << inner.status();
    auto faulty = std::make_unique<FaultInjectingBackend>(std::move(*inner));
    faults = faulty.get();
    backend_ = std::move(faulty);
    NvmeOptions n;
    n.dirs = dir;
    n.bytes_per_dir = int64_t{64} << 20;
    space_ = *SwapSpace::Create(n, backend_.get());
    pool = std::make_unique<HostPool>(Env::Default(), pool_bytes, false);
    SwapperOptions so;
    so.prefetch_depth = prefetch_depth;
    swapper = *Swapper::Create(so, pool.get(), space_.get());
    store = std::make_unique<PartitionStore>(Env::Default(), swapper.get(), &stats, 64 << 20,
                                              Placement{}, chunk_elems, huge_page_bytes);
    steps = std::make_unique<StepRunner>(&optimizer_, pool.get(), &stats);
    sessions = std::make_unique<SessionManager>(Env::Default(), store.get(), steps.get(), &stats);
  }

  // In the order they are built, so that they are destroyed in reverse: the
  // swapper (and the sessions' blocks) before the swap space it writes to.
 private:
  std::unique_ptr<IoBackend> backend_;
  std::unique_ptr<SwapSpace> space_;
  Optimizer optimizer_{OptimizerOptions{}};

 public:
  FaultInjectingBackend* faults = nullptr;
  Stats stats;
  std::unique_ptr<HostPool> pool;
  std::unique_ptr<Swapper> swapper;
  std::unique_ptr<PartitionStore> store;
  std::unique_ptr<StepRunner> steps;
  std::unique_ptr<SessionManager> sessions;
};

// Every kind of data at `percent` on the host.
inline PlacementChange All(int percent) {
  PlacementChange change;
  for (auto& p : change.host_percent) p = percent;
  return change;
}

}  // namespace offload

#endif  // OFFLOADD_ENGINE_TEST_ENGINE_H_
