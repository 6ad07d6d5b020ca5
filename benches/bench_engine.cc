#include "benches/bench_engine.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "base/config_registry.h"
#include "base/env.h"
#include "base/status_macros.h"
#include "nvme/io_backend_factory.h"

namespace offload::bench {

absl::StatusOr<std::unique_ptr<BenchEngine>> MakeBenchEngine(const BenchEngineOptions& o) {
  std::unique_ptr<IoBackend> io;
  EngineOptions e;
  if (!o.nvme.dirs.empty()) {
    ASSIGN_OR_RETURN(io, MakeIoBackend(o.nvme.io));
    e.nvme = o.nvme;
  }
  e.host_budget_bytes = o.pool_bytes;
  e.optimizer = o.optimizer;
  e.swapper = o.swapper;
  e.session_arena_bytes = o.arena_bytes;
  e.state_chunk_elems = o.chunk_elems;
  e.huge_page_bytes = o.huge_page_bytes;
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(e, Env::Default(), io.get()));
  return std::make_unique<BenchEngine>(std::move(io), std::move(engine));
}

std::string DescribeSwapSettings(const NvmeOptions& nvme, const SwapperOptions& swapper) {
  return absl::StrFormat(
      "prefetch depth %lld / %s; io_threads %lld; checksum %s; io_uring requests of %s, "
      "queue depth %lld, %lld rings; stripe %s",
      static_cast<long long>(swapper.prefetch_depth), FormatByteSize(swapper.prefetch_bytes),
      static_cast<long long>(swapper.io_threads), nvme.checksum ? "on" : "off",
      FormatByteSize(nvme.io.request_bytes), static_cast<long long>(nvme.io.queue_depth),
      static_cast<long long>(nvme.io.rings), FormatByteSize(nvme.stripe_bytes));
}

}  // namespace offload::bench
