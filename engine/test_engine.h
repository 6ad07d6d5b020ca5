// A daemon's engine for tests (engine/engine.h): its pool, swapper over a
// real NVMe tier (an io_uring swap space in a directory, behind a
// fault-injecting backend), partition store, step runner and session
// manager.
#ifndef OFFLOADD_ENGINE_TEST_ENGINE_H_
#define OFFLOADD_ENGINE_TEST_ENGINE_H_

#include <sys/stat.h>

#include <memory>
#include <string>

#include "base/env.h"
#include "engine/engine.h"
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

// A daemon's engine (Engine::Create, as offloadd builds it) over an NVMe
// tier that may fail on demand; its parts as the tests reach them.
class TestEngine {
 public:
  // `huge_page_bytes`: the arenas lay large partitions out for huge pages of
  // this size (0: small pages only), as offloadd does with
  // SharedHugePageBytes().
  // `pool_dir`: the pool's memory is a file there (EngineOptions::pool_dir).
  TestEngine(const std::string& dir, uint64_t pool_bytes, int64_t prefetch_depth = 8,
             uint64_t chunk_elems = 4096, uint64_t huge_page_bytes = 0,
             const std::string& pool_dir = "")
      : engine_(Make(dir, pool_bytes, prefetch_depth, chunk_elems, huge_page_bytes, pool_dir)),
        faults(backend_.get()),
        stats(engine_->stats()),
        pool(&engine_->pool()),
        swapper(&engine_->swapper()),
        store(&engine_->store()),
        steps(&engine_->steps()),
        sessions(&engine_->sessions()) {}

 private:
  std::unique_ptr<Engine> Make(const std::string& dir, uint64_t pool_bytes, int64_t prefetch_depth,
                               uint64_t chunk_elems, uint64_t huge_page_bytes,
                               const std::string& pool_dir) {
    mkdir(dir.c_str(), 0700);
    auto inner = MakeIoBackend(IoOptions{});
    EXPECT_TRUE(inner.ok()) << inner.status();
    backend_ = std::make_unique<FaultInjectingBackend>(std::move(*inner));
    EngineOptions o;
    o.host_budget_bytes = pool_bytes;
    o.swapper.prefetch_depth = prefetch_depth;
    o.state_chunk_elems = chunk_elems;
    o.session_arena_bytes = 64 << 20;
    o.huge_page_bytes = huge_page_bytes;
    o.pool_dir = pool_dir;
    o.nvme.emplace();
    o.nvme->dirs = dir;
    o.nvme->bytes_per_dir = int64_t{64} << 20;
    auto engine = Engine::Create(o, Env::Default(), backend_.get());
    EXPECT_TRUE(engine.ok()) << engine.status();
    return std::move(*engine);
  }

  // The backend outlives the engine, whose swap space writes through it.
  std::unique_ptr<FaultInjectingBackend> backend_;
  std::unique_ptr<Engine> engine_;

 public:
  FaultInjectingBackend* const faults;
  Stats& stats;
  HostPool* const pool;
  Swapper* const swapper;
  PartitionStoreFactory* const store;
  StepRunner* const steps;
  SessionManager* const sessions;
};

// Every kind of data at `percent` on the host.
inline PlacementChange All(int percent) {
  PlacementChange change;
  for (auto& p : change.host_percent) p = percent;
  return change;
}

}  // namespace offload

#endif  // OFFLOADD_ENGINE_TEST_ENGINE_H_
