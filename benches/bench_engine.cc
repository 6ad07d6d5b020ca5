#include "benches/bench_engine.h"

#include <utility>

#include "base/env.h"
#include "base/status_macros.h"
#include "nvme/io_backend_factory.h"

namespace offload::bench {

absl::StatusOr<std::unique_ptr<BenchEngine>> MakeBenchEngine(const BenchEngineOptions& o) {
  auto e = std::make_unique<BenchEngine>();
  if (!o.nvme.dirs.empty()) {
    ASSIGN_OR_RETURN(e->backend, MakeIoBackend(o.nvme.io));
    ASSIGN_OR_RETURN(e->space, SwapSpace::Create(o.nvme, e->backend.get()));
  }
  e->pool = std::make_unique<HostPool>(Env::Default(), o.pool_bytes, /*lock_memory=*/false);
  e->optimizer = std::make_unique<Optimizer>(o.optimizer);
  ASSIGN_OR_RETURN(e->swapper, Swapper::Create(o.swapper, e->pool.get(), e->space.get()));
  e->store = std::make_unique<PartitionStore>(Env::Default(), e->swapper.get(), &e->stats,
                                              o.arena_bytes, Placement{}, o.chunk_elems,
                                              o.huge_page_bytes);
  e->steps = std::make_unique<StepRunner>(e->optimizer.get(), e->pool.get(), &e->stats);
  e->sessions = std::make_unique<SessionManager>(Env::Default(), e->store.get(), e->steps.get(),
                                                 &e->stats);
  return e;
}

}  // namespace offload::bench
