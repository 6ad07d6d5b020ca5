#include "daemon/ring_service.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cpu_adam/dtype.h"
#include "daemon/step_wire.h"
#include "ipc/request_ring.h"

namespace offload {

namespace {

ring::Location ToRing(const PartitionInfo& p) {
  ring::Location l{};
  l.id = p.id;
  l.numel = p.numel;
  l.step = p.step;
  l.params_offset = p.params.offset;
  l.params_bytes = p.params.bytes;
  l.grads_offset = p.grads.offset;
  l.grads_bytes = p.grads.bytes;
  l.span_offset = p.span.offset;
  l.span_bytes = p.span.bytes;
  l.master_init_offset = p.master_init.offset;
  l.master_init_bytes = p.master_init.bytes;
  l.param_dtype = static_cast<uint32_t>(p.param_dtype);
  l.grad_dtype = static_cast<uint32_t>(p.grad_dtype);
  l.restored = p.restored ? 1 : 0;
  l.huge_pages = p.huge_pages ? 1 : 0;
  return l;
}

// `result`'s status and, on success, its wire message as the answer's
// payload.
template <typename Message, typename Result>
void Reply(const absl::StatusOr<Result>& result, RingAnswer* answer) {
  answer->status = result.status();
  if (!result.ok()) return;
  Message message;
  ToProto(*result, &message);
  message.SerializeToString(&answer->payload);
}

}  // namespace

RingAnswer RingService::Serve(const SessionKey& key, const RingRequest& r) {
  RingAnswer answer;
  CallScope scope(gate_);
  if (!scope.entered()) {
    answer.status =
        absl::UnavailableError("offloadd is shutting down; retry against its successor");
    return answer;
  }
  // The flags each op knows: another (a newer client's) is refused, not
  // dropped (ring_service.h).
  const uint32_t known = r.op == ring::kFetch ? ring::kGrads | ring::kWritable | ring::kIfReady
                         : r.op == ring::kReturnGradients ? ring::kThenRelease | ring::kHandOver
                                                          : 0;
  if ((r.op == ring::kFetch || r.op == ring::kRelease || r.op == ring::kReturnGradients) &&
      (r.flags & ~known) != 0) {
    answer.status = absl::InvalidArgumentError(
        absl::StrCat("request ring: op ", r.op, " takes no flags ", r.flags & ~known));
    stats_->requests_failed.fetch_add(1, std::memory_order_relaxed);
    return answer;
  }
  std::vector<uint64_t> ids;
  ids.reserve(r.items.size());
  for (const ring::Item& item : r.items) ids.push_back(item.id);
  switch (r.op) {
    case ring::kFetch: {
      if (ids.empty()) {
        answer.status = absl::InvalidArgumentError(
            "a fetch through the request ring names its partitions (fetch-all is gRPC's)");
        break;
      }
      FetchMode mode;
      mode.grads = (r.flags & ring::kGrads) != 0;
      mode.writable = (r.flags & ring::kWritable) != 0;
      mode.if_ready = (r.flags & ring::kIfReady) != 0;
      absl::StatusOr<std::vector<PartitionInfo>> held = sessions_->Fetch(key, ids, mode);
      answer.status = held.status();
      if (held.ok()) {
        for (const PartitionInfo& p : *held) answer.locations.push_back(ToRing(p));
      }
      break;
    }
    case ring::kRelease:
      answer.status = sessions_->Release(key, ids);
      break;
    case ring::kReturnGradients: {
      std::vector<GradientReturn> items;
      items.reserve(r.items.size());
      for (const ring::Item& item : r.items) {
        GradientReturn g;
        g.partition_id = item.id;
        g.numel = item.numel;
        if (item.dtype >= 1 && item.dtype <= 3) {
          g.grad_dtype = static_cast<DType>(item.dtype);
        } else {
          g.grad_dtype = absl::InvalidArgumentError(
              absl::StrCat("grad_dtype ", item.dtype, " is not fp32 (1), bf16 (2) or fp16 (3)"));
        }
        if ((item.flags & ~ring::kItemStats) != 0) {
          g.grad_dtype = absl::InvalidArgumentError(
              absl::StrCat("unknown item flags ", item.flags, " for partition ", item.id));
        }
        if (item.flags & ring::kItemStats) g.stats = GradStats{item.sq_norm, item.nonfinite};
        items.push_back(std::move(g));
      }
      answer.status = sessions_->ReturnGradients(key, items, (r.flags & ring::kThenRelease) != 0,
                                                 (r.flags & ring::kHandOver) != 0);
      break;
    }
    case ring::kStep: {
      v1::StepRequest req;
      if (r.flags != 0) {
        answer.status = absl::InvalidArgumentError(
            absl::StrCat("request ring: a step takes no flags, got ", r.flags));
        break;
      }
      if (!req.ParseFromString(r.payload)) {
        answer.status = absl::InvalidArgumentError(absl::StrCat(
            "request ring: a step's request of ", r.payload.size(), " bytes is not a StepRequest"));
        break;
      }
      absl::StatusOr<StepCall> call = FromProto(req);
      Reply<v1::StepResponse>(call.ok() ? sessions_->Step(key, call->hyperparams, call->control)
                                        : absl::StatusOr<StepSummary>(call.status()),
                              &answer);
      break;
    }
    case ring::kPendingGradients:
    case ring::kWaitStep: {
      if (!r.items.empty() || r.flags != 0) {
        answer.status = absl::InvalidArgumentError(
            absl::StrCat("request ring: op ", r.op, " takes no items and no flags, got ",
                         r.items.size(), " items and flags ", r.flags));
        break;
      }
      if (r.op == ring::kPendingGradients) {
        Reply<v1::GetPendingGradientsResponse>(sessions_->Pending(key), &answer);
      } else {
        Reply<v1::StepResponse>(sessions_->WaitStep(key), &answer);
      }
      break;  // (tens of bytes; RingServer refuses one past the mailbox)
    }
  }
  // (A fetch asked if ready and refused did what was asked.)
  if (!answer.status.ok() && !ring::IsNotReady(answer.status)) {
    stats_->requests_failed.fetch_add(1, std::memory_order_relaxed);
  }
  return answer;
}

}  // namespace offload
