// The swapper's settings: one light header, bound under "swapper.*".
#ifndef OFFLOADD_SWAPPER_SWAPPER_OPTIONS_H_
#define OFFLOADD_SWAPPER_SWAPPER_OPTIONS_H_

#include <cstdint>

#include "base/config_registry.h"
#include "base/host_memory.h"

namespace offload {

struct SwapperOptions {
  // How far ahead of the current use the learned trace is prefetched: in
  // uses, and in bytes still to be read (blocks already resident do not
  // count). Deeper prefetch hides more I/O latency and holds more of the
  // pool for blocks not yet in use.
  int64_t prefetch_depth = 8;
  int64_t prefetch_bytes = int64_t{256} << 20;

  // Threads that perform swap-ins and write-outs (each blocks in one I/O
  // batch; the NVMe engine's rings bound how many run at once). More threads
  // overlap checksum hashing with other blocks' transfers.
  int64_t io_threads = 4;

  // The pages of the pool memory a block homed on the host lives in: it
  // stays there, and the optimizer streams over it every step. Blocks homed
  // on NVMe are brought in on huge pages whatever this says: each read goes
  // into fresh memory, where 4 KiB pages cost 512 page faults per 2 MiB and
  // split direct reads into more requests (with the optimizer state on NVMe
  // a step took 3.8-4.4x as long on them: benches/RESULTS.md, step_overlap). Not
  // a tunable: the daemon sets it from memory.host_home_pages.
  Pages host_home_pages = Pages::kHuge;

  // A transfer running this long is said in the log (at most once a
  // minute): a stalled disk (a frozen filesystem, a failing device) leaves
  // the fetches and steps that need its blocks waiting, and nothing else
  // would say why. Not a tunable (tests shorten it).
  int64_t stalled_io_seconds = 30;
};

inline constexpr IntRange kPrefetchDepthRange{0, 4096};
inline constexpr IntRange kPrefetchBytesRange{0, INT64_MAX};
inline constexpr IntRange kSwapperIoThreadsRange{1, 64};

// Binds every field under "swapper.*". The prefetch settings are dynamic
// (the daemon hooks them to Swapper::SetPrefetch); io_threads is static.
void BindSwapperTunables(SwapperOptions* options, ConfigRegistry* registry);

}  // namespace offload

#endif  // OFFLOADD_SWAPPER_SWAPPER_OPTIONS_H_
