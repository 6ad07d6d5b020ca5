#include "cpu_adam/optimizer_options.h"

namespace offload {

void BindOptimizerTunables(OptimizerOptions* o, ConfigRegistry* r) {
  r->Bind(
      "optimizer.threads", &o->threads,
      {"threads", "threads in the optimizer arena; 0 = one per CPU", true, kOptimizerThreadsRange});
  r->Bind("optimizer.tile_elems", &o->tile_elems,
          {"elements", "parameters per optimizer task", true, kOptimizerTileElemsRange});
  r->Bind("optimizer.kernel", &o->kernel,
          {"isa",
           "Adam kernel: auto, avx512, avx2 or scalar (all bit-identical)",
           true,
           {},
           {"auto", "avx512", "avx2", "scalar"}});
  r->Bind("optimizer.check_finite", &o->check_finite,
          {"bool", "skip a step whose gradients hold NaN/Inf, changing nothing", true});
}

}  // namespace offload
