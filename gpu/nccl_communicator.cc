// gpu::Communicator over NCCL. Built only where bazel/cuda.bzl found NCCL in
// the toolkit; nccl_communicator_none.cc stands in for it elsewhere.
#include "gpu/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"

#if NCCL_VERSION_CODE < 21400
#error "offloadd needs NCCL 2.14 or later (ncclAvg, ncclRemoteError, ncclInProgress)"
#endif

namespace offload::gpu {
namespace {

absl::Status NcclError(absl::string_view what, ncclResult_t r) {
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (r) {
    case ncclSuccess:
      return absl::OkStatus();
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      code = absl::StatusCode::kInvalidArgument;
      break;
    case ncclRemoteError:
    case ncclSystemError:
      code = absl::StatusCode::kUnavailable;
      break;
    default:
      break;
  }
  return absl::Status(
      code, absl::StrCat(what, ": ", ncclGetErrorString(r), " (NCCL ", static_cast<int>(r), ")"));
}

absl::Status SetDevice(int ordinal) {
  if (cudaError_t err = cudaSetDevice(ordinal); err != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("cudaSetDevice(", ordinal, "): ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int ordinal, int rank, int size)
      : comm_(comm), ordinal_(ordinal), rank_(rank), size_(size) {}
  ~NcclCommunicator() override {
    if (!broken_.ok()) return;  // aborted when found broken (ncclCommAbort freed it)
    (void)SetDevice(ordinal_);
    // A broken communicator cannot finish its work: abort it instead.
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &async) != ncclSuccess || async != ncclSuccess) {
      ncclCommAbort(comm_);
      return;
    }
    if (ncclResult_t r = ncclCommDestroy(comm_); r != ncclSuccess) {
      LogWarning("%s: ncclCommDestroy: %s", name(), ncclGetErrorString(r));
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return absl::StrCat("nccl rank ", rank_, " of ", size_); }

  absl::Status AllGather(absl::Span<const GatherItem> items, const Stream& stream) override {
    // Every item checked before the group starts: one refused inside it
    // would leave the others issued and the peers waiting in them.
    for (const GatherItem& g : items) {
      if (g.bytes != 0 && (g.send == nullptr || g.recv == nullptr)) {
        return absl::InvalidArgumentError(
            absl::StrCat(name(), ": all-gather of ", g.bytes, " bytes with a null buffer"));
      }
    }
    return Group("all-gather", items.size(), [&](size_t i) {
      const GatherItem& g = items[i];
      return ncclAllGather(g.send, g.recv, g.bytes, ncclUint8, comm_, Native(stream));
    });
  }

  absl::Status Check() const override { return Broken(name()); }
  void Abort(absl::Status why) override { (void)AbortOnce(std::move(why)); }

  absl::Status ReduceScatter(absl::Span<const ScatterItem> items, ReduceOp op,
                             const Stream& stream) override {
    for (const ScatterItem& s : items) {
      if (s.count != 0 && (s.send == nullptr || s.recv == nullptr)) {
        return absl::InvalidArgumentError(
            absl::StrCat(name(), ": reduce-scatter of ", s.count, " floats with a null buffer"));
      }
    }
    const ncclRedOp_t nccl_op = op == ReduceOp::kAvg ? ncclAvg : ncclSum;
    return Group("reduce-scatter", items.size(), [&](size_t i) {
      const ScatterItem& s = items[i];
      return ncclReduceScatter(s.send, s.recv, s.count, ncclFloat32, nccl_op, comm_,
                               Native(stream));
    });
  }

 private:
  static cudaStream_t Native(const Stream& stream) {
    return static_cast<cudaStream_t>(stream.get());
  }

  // Issues items [0, n) as one NCCL group, after checking that no earlier
  // collective broke the communicator.
  template <typename IssueOne>
  absl::Status Group(absl::string_view what, size_t n, IssueOne issue) {
    const std::string context = absl::StrCat(name(), ": ", what, " of ", n, " items");
    if (absl::Status broken = Broken(context); !broken.ok()) return broken;
    if (n == 0) return absl::OkStatus();
    if (absl::Status s = SetDevice(ordinal_); !s.ok()) return s;
    if (ncclResult_t r = ncclGroupStart(); r != ncclSuccess) {
      return NcclError(absl::StrCat(context, ": ncclGroupStart"), r);
    }
    ncclResult_t first = ncclSuccess;
    for (size_t i = 0; i < n && first == ncclSuccess; ++i) first = issue(i);
    const ncclResult_t end = ncclGroupEnd();
    // A group that failed part way may be issued on the peers and not here:
    // the ranks' sequences no longer match, so nothing after it can be
    // trusted: aborted, as a communicator found broken.
    if (first != ncclSuccess) return AbortOnce(NcclError(context, first));
    if (end != ncclSuccess) {
      return AbortOnce(NcclError(absl::StrCat(context, ": ncclGroupEnd"), end));
    }
    return absl::OkStatus();
  }

  // OK unless NCCL reports the communicator broken; then, once, it is
  // aborted (its kernels still queued on the trainer's streams end, rather
  // than spin until the job is killed: a wait for them, a copy after a
  // failed collective, would never return) and the error kept for every
  // later call. (One thread calls, as the contract says.)
  absl::Status Broken(absl::string_view context) const {
    if (!broken_.ok()) {
      return absl::Status(broken_.code(), absl::StrCat(context, ": the communicator was aborted (",
                                                       broken_.message(), ")"));
    }
    ncclResult_t async = ncclSuccess;
    if (ncclResult_t r = ncclCommGetAsyncError(comm_, &async); r != ncclSuccess) {
      return NcclError(absl::StrCat(context, ": ncclCommGetAsyncError"), r);
    }
    if (async == ncclSuccess || async == ncclInProgress) return absl::OkStatus();
    return AbortOnce(NcclError(absl::StrCat(context, ": the communicator is broken"), async));
  }

  // Aborts the communicator (once) for `why`, which every later call
  // reports.
  absl::Status AbortOnce(absl::Status why) const {
    if (broken_.ok()) {
      broken_ = std::move(why);
      (void)SetDevice(ordinal_);
      ncclCommAbort(comm_);
    }
    return broken_;
  }

  const ncclComm_t comm_;
  mutable absl::Status broken_;  // set once aborted
  const int ordinal_;
  const int rank_;
  const int size_;
};

}  // namespace

bool BuiltWithNccl() { return true; }

absl::StatusOr<std::string> NewNcclId() {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return NcclError("ncclGetUniqueId", r);
  }
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<Communicator>> OpenNcclCommunicator(int ordinal,
                                                                   absl::string_view id, int rank,
                                                                   int size) {
  if (id.size() != NCCL_UNIQUE_ID_BYTES) {
    return absl::InvalidArgumentError(
        absl::StrCat("an NCCL id has ", NCCL_UNIQUE_ID_BYTES, " bytes, not ", id.size()));
  }
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " of ", size));
  }
  if (absl::Status s = SetDevice(ordinal); !s.ok()) return s;
  ncclUniqueId unique;
  std::memcpy(unique.internal, id.data(), id.size());
  ncclComm_t comm = nullptr;
  if (ncclResult_t r = ncclCommInitRank(&comm, size, unique, rank); r != ncclSuccess) {
    return NcclError(
        absl::StrCat("ncclCommInitRank (rank ", rank, " of ", size, ", device ", ordinal, ")"), r);
  }
  return std::unique_ptr<Communicator>(new NcclCommunicator(comm, ordinal, rank, size));
}

}  // namespace offload::gpu
