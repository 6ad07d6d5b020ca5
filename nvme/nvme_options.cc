#include "nvme/nvme_options.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"

namespace offload {

std::vector<std::string> NvmeOptions::DirList() const {
  std::vector<std::string> out;
  for (absl::string_view dir : absl::StrSplit(dirs, ',', absl::SkipWhitespace())) {
    out.emplace_back(absl::StripAsciiWhitespace(dir));
  }
  return out;
}

absl::Status ValidateRequestBytes(int64_t bytes) {
  if (!kRequestBytesRange.Contains(bytes) || bytes % kIoGranule != 0) {
    return absl::InvalidArgumentError(absl::StrCat("request_bytes must be a multiple of ",
                                                   kIoGranule, " in [", kRequestBytesRange.min,
                                                   ", ", kRequestBytesRange.max, "], got ", bytes));
  }
  return absl::OkStatus();
}

absl::Status ValidateIoOptions(const IoOptions& o) {
  if (o.backend != "auto" && o.backend != "io_uring" && o.backend != "posix") {
    return absl::InvalidArgumentError(
        absl::StrCat("I/O backend must be auto, io_uring or posix, got '", o.backend, "'"));
  }
  RETURN_IF_ERROR(kQueueDepthRange.Check("queue_depth", o.queue_depth));
  RETURN_IF_ERROR(kSubmitBatchRange.Check("submit_batch", o.submit_batch));
  RETURN_IF_ERROR(kRingsRange.Check("rings", o.rings));
  RETURN_IF_ERROR(kPosixThreadsRange.Check("posix_threads", o.posix_threads));
  return ValidateRequestBytes(o.request_bytes);
}

void BindNvmeTunables(NvmeOptions* o, ConfigRegistry* r) {
  r->Bind("nvme.dirs", &o->dirs,
          {"paths", "comma-separated swap directories, one per NVMe device; empty = no NVMe tier",
           false});
  r->Bind("nvme.bytes_per_dir", &o->bytes_per_dir,
          {"bytes", "space preallocated in each swap directory", false, kBytesPerDirRange});
  r->Bind("nvme.stripe_bytes", &o->stripe_bytes,
          {"bytes", "striping unit across swap directories", false, kStripeBytesRange});
  r->Bind("nvme.checksum", &o->checksum,
          {"bool", "XXH3 checksum per stripe, verified on swap-in", true});
  r->Bind("nvme.direct_io", &o->direct_io,
          {"bool", "O_DIRECT where the filesystem supports it", false});
  r->Bind("nvme.backend", &o->io.backend,
          {"name",
           "auto (io_uring, else posix), io_uring or posix",
           false,
           {},
           {"auto", "io_uring", "posix"}});
  r->Bind("nvme.queue_depth", &o->io.queue_depth,
          {"requests", "I/O requests in flight per ring", true, kQueueDepthRange});
  r->Bind("nvme.request_bytes", &o->io.request_bytes,
          {"bytes", "largest single read or write (multiple of 4KiB)", true, kRequestBytesRange});
  r->Bind("nvme.rings", &o->io.rings,
          {"rings", "io_uring instances (concurrent transfers)", false, kRingsRange});
  r->Bind("nvme.submit_batch", &o->io.submit_batch,
          {"requests", "requests queued per io_uring_submit", true, kSubmitBatchRange});
  r->Bind("nvme.sqpoll", &o->io.sqpoll,
          {"bool", "kernel thread polls the submission queue (spins a core)", false});
  r->Bind("nvme.posix_threads", &o->io.posix_threads,
          {"threads", "workers of the pread/pwrite fallback", false, kPosixThreadsRange});
}

}  // namespace offload
