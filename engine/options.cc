#include "engine/options.h"

#include <unistd.h>

#include "ipc/paths.h"

namespace offload {

DaemonOptions::DaemonOptions() {
  server.data_dir = DefaultDataDir();
  const int64_t pages = sysconf(_SC_PHYS_PAGES);
  const int64_t page_size = sysconf(_SC_PAGESIZE);
  memory.host_budget_bytes =
      pages > 0 && page_size > 0 ? pages * page_size / 2 >> 20 << 20 : int64_t{8} << 30;
}

void BindTunables(DaemonOptions* o, ConfigRegistry* r) {
  r->Bind("server.data_dir", &o->server.data_dir,
          {"path", "directory for the socket and state (created 0700)", false});
  r->Bind("server.socket", &o->server.socket,
          {"path", "gRPC Unix socket; empty means <data_dir>/offloadd.sock", false});
  r->Bind("server.tcp_port", &o->server.tcp_port,
          {"port", "also serve gRPC on 127.0.0.1:<port>; -1 off, 0 any free port", false, -1,
           65535});
  r->Bind("memory.host_budget_bytes", &o->memory.host_budget_bytes,
          {"bytes", "host memory for all sessions (arenas, master weights, moments)", true, 4096,
           9.2e18});
  r->Bind("memory.session_arena_bytes", &o->memory.session_arena_bytes,
          {"bytes", "address space reserved per session arena (new sessions)", true, 1 << 20,
           double(int64_t{1} << 44)});
  r->Bind("optimizer.threads", &o->optimizer.threads,
          {"threads", "threads in the optimizer arena; 0 = one per CPU", true, 0, 1024});
  r->Bind("optimizer.tile_elems", &o->optimizer.tile_elems,
          {"elements", "parameters per optimizer task", true, 1024, double(int64_t{1} << 30)});
  r->Bind("optimizer.kernel", &o->optimizer.kernel,
          {"isa", "Adam kernel: auto, avx512, avx2 or scalar (all bit-identical)", true});
  r->Bind("optimizer.check_finite", &o->optimizer.check_finite,
          {"bool", "skip a step whose gradients hold NaN/Inf, changing nothing", true});
  r->Bind("nvme.dirs", &o->nvme.dirs,
          {"paths", "comma-separated swap directories, one per NVMe device; empty = no NVMe tier",
           false});
  r->Bind("nvme.bytes_per_dir", &o->nvme.bytes_per_dir,
          {"bytes", "space preallocated in each swap directory", false, 1 << 20, 9.2e18});
  r->Bind("nvme.stripe_bytes", &o->nvme.stripe_bytes,
          {"bytes", "striping unit across swap directories", false, 4096, double(int64_t{1} << 30)});
  r->Bind("nvme.checksum", &o->nvme.checksum,
          {"bool", "XXH3 checksum per extent, verified on swap-in", true});
  r->Bind("nvme.direct_io", &o->nvme.direct_io,
          {"bool", "O_DIRECT where the filesystem supports it", false});
  r->Bind("nvme.backend", &o->nvme.io.backend,
          {"name", "auto (io_uring, else posix), io_uring or posix", false});
  r->Bind("nvme.queue_depth", &o->nvme.io.queue_depth,
          {"requests", "I/O requests in flight per ring", true, 1, 256});
  r->Bind("nvme.request_bytes", &o->nvme.io.request_bytes,
          {"bytes", "largest single read or write (multiple of 4KiB)", true, 4096,
           double(int64_t{1} << 30)});
  r->Bind("nvme.rings", &o->nvme.io.rings,
          {"rings", "io_uring instances (concurrent transfers)", false, 1, 64});
  r->Bind("nvme.submit_batch", &o->nvme.io.submit_batch,
          {"requests", "requests queued per io_uring_submit", true, 1, 256});
  r->Bind("nvme.sqpoll", &o->nvme.io.sqpoll,
          {"bool", "kernel thread polls the submission queue (spins a core)", false});
  r->Bind("nvme.posix_threads", &o->nvme.io.posix_threads,
          {"threads", "workers of the pread/pwrite fallback", false, 1, 256});
}

}  // namespace offload
