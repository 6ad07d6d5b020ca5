// The NCCL implementation of gpu::Communicator, for C++ trainers whose
// ranks are processes, one GPU each (one node or many).
//
// The ranks share a unique id that one of them creates (NewNcclId) before
// any opens its communicator; how it travels is the trainer's: rank 0 writes
// it to a file on a filesystem every rank sees and the others wait for the
// file (what offload_gpu_demo does: --nccl_id_file), an environment variable
// the launcher sets (hex), MPI_Bcast, or torch.distributed's TCPStore. Every
// rank then calls OpenNcclCommunicator with the same id and size, and its
// own rank; the call blocks until all have joined.
//
// Where offloadd was built without NCCL (bazel/cuda.bzl found no nccl.h and
// libnccl.so.2 in the toolkit), nccl_communicator_none.cc stands in: both
// functions fail with FAILED_PRECONDITION saying how to rebuild.
//
// Errors: NCCL's become a Status naming the call and NCCL's text (invalid
// arguments INVALID_ARGUMENT, a peer or network gone UNAVAILABLE, anything
// else INTERNAL). A communicator whose collective failed while it ran is
// broken (ncclCommGetAsyncError), or a group that failed part way (the
// ranks' sequences no longer match), is aborted by the call or Check that
// finds it (ncclCommAbort), and every later call returns that error; the
// trainer's job is then over, as with NCCL in torch. A collective whose
// peer died without a network error NCCL sees waits for good: a wait for it
// polls (Check) and, past a timeout of its own, Aborts the communicator,
// which ends its kernels (client/zero3.h does so for its waits,
// Zero3Options::collective_timeout; a trainer's own waits on the stream
// should do the same, as torch's NCCL watchdog does).
#ifndef OFFLOADD_GPU_NCCL_COMMUNICATOR_H_
#define OFFLOADD_GPU_NCCL_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gpu/communicator.h"

namespace offload::gpu {

// Whether this binary was built with NCCL.
bool BuiltWithNccl();

// A new unique id (128 bytes), for every rank of one communicator.
absl::StatusOr<std::string> NewNcclId();

// Joins the communicator `id` as `rank` of `size` on CUDA device `ordinal`
// (the one the trainer's gpu::Device is; its streams carry the collectives).
// Blocks until every rank joined.
absl::StatusOr<std::unique_ptr<Communicator>> OpenNcclCommunicator(int ordinal,
                                                                   absl::string_view id, int rank,
                                                                   int size);

}  // namespace offload::gpu

#endif  // OFFLOADD_GPU_NCCL_COMMUNICATOR_H_
