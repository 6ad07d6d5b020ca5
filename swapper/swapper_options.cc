#include "swapper/swapper_options.h"

namespace offload {

void BindSwapperTunables(SwapperOptions* o, ConfigRegistry* r) {
  r->Bind("swapper.prefetch_depth", &o->prefetch_depth,
          {"uses", "prefetch this many uses ahead along the learned access order", true,
           kPrefetchDepthRange});
  r->Bind("swapper.prefetch_bytes", &o->prefetch_bytes,
          {"bytes", "prefetch at most this many bytes ahead", true, kPrefetchBytesRange});
  r->Bind("swapper.io_threads", &o->io_threads,
          {"threads", "threads performing swap-ins and write-outs", false, kSwapperIoThreadsRange});
}

}  // namespace offload
