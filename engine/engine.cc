#include "engine/engine.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace offload {

Engine::Engine(const EngineOptions& options, Env* env)
    : pool_(env, options.host_budget_bytes, options.lock_pool), optimizer_(options.optimizer) {}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options, Env* env,
                                                       IoBackend* io) {
  std::unique_ptr<Engine> e(new Engine(options, env));
  // The constructor fell back to "auto" for a kernel this CPU lacks; say so.
  RETURN_IF_ERROR(e->optimizer_.SetKernel(options.optimizer.kernel));
  if (!options.pool_dir.empty()) {
    ASSIGN_OR_RETURN(std::unique_ptr<PoolFile> file, PoolFile::Create(options.pool_dir));
    e->pool_.UseFile(std::move(file));
  }
  if (options.nvme.has_value()) {
    if (io == nullptr) {
      return absl::InvalidArgumentError("NVMe tier (nvme.dirs): no I/O backend to write it");
    }
    absl::StatusOr<std::unique_ptr<SwapSpace>> space = SwapSpace::Create(*options.nvme, io);
    if (!space.ok()) {
      return absl::Status(space.status().code(),
                          absl::StrCat("NVMe tier (nvme.dirs): ", space.status().message()));
    }
    e->swap_ = std::move(*space);
  }
  ASSIGN_OR_RETURN(e->swapper_, Swapper::Create(options.swapper, &e->pool_, e->swap_.get()));
  for (int k = 0; k < kDataKinds; ++k) {
    const auto kind = static_cast<DataKind>(k);
    RETURN_IF_ERROR(
        PartitionStoreFactory::CheckPlacement(kind, options.placement[kind], e->swap_ != nullptr));
  }
  e->store_ = std::make_unique<PartitionStoreFactory>(
      env, e->swapper_.get(), &e->stats_, options.session_arena_bytes, options.placement,
      options.state_chunk_elems, options.huge_page_bytes);
  e->steps_ = std::make_unique<StepRunner>(&e->optimizer_, &e->pool_, &e->stats_);
  e->sessions_ =
      std::make_unique<SessionManager>(env, e->store_.get(), e->steps_.get(), &e->stats_);
  return e;
}

}  // namespace offload
