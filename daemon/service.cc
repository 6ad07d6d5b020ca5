#include "daemon/service.h"

#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/descriptors.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "daemon/step_wire.h"
#include "engine/version.h"
#include "ipc/request_ring.h"
#include "proto/convert.h"

namespace offload {
namespace {

SessionKey KeyOf(const v1::SessionRef& ref) { return SessionKey{ref.session_id(), ref.token()}; }

void ToProto(const PartitionInfo& p, v1::PartitionLocation* out) {
  out->set_partition_id(p.id);
  out->set_name(p.name);
  out->set_numel(p.numel);
  out->set_param_dtype(ToProto(p.param_dtype));
  out->set_grad_dtype(ToProto(p.grad_dtype));
  out->mutable_params()->set_offset(p.params.offset);
  out->mutable_params()->set_bytes(p.params.bytes);
  out->mutable_grads()->set_offset(p.grads.offset);
  out->mutable_grads()->set_bytes(p.grads.bytes);
  out->mutable_span()->set_offset(p.span.offset);
  out->mutable_span()->set_bytes(p.span.bytes);
  if (p.master_init.bytes != 0) {
    out->mutable_master_init()->set_offset(p.master_init.offset);
    out->mutable_master_init()->set_bytes(p.master_init.bytes);
  }
  out->set_step(p.step);
  out->set_restored(p.restored);
  out->set_huge_pages(p.huge_pages);
}

// A path from the wire: absolute-or-empty is the callee's to check; here,
// text of sane length.
absl::Status CheckPath(absl::string_view path, absl::string_view what) {
  if (path.size() > 4096 || path.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be a path of at most 4096 bytes without NUL"));
  }
  if (const std::optional<size_t> bad = FirstInvalidUtf8(path); bad.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not UTF-8 (byte ", *bad, " of ", path.size(), ")"));
  }
  return absl::OkStatus();
}

void ToProto(const SessionManager::CheckpointOutcome& o, v1::CheckpointResponse* out) {
  out->set_manifest(o.summary.manifest);
  out->set_partitions(o.summary.partitions);
  out->set_bytes(o.summary.bytes);
  out->set_steps(o.summary.steps);
  out->set_pause_us(o.summary.pause_us);
  out->set_wall_us(o.summary.wall_us);
  out->set_running(o.running);
}

void ToProto(const TunableInfo& t, v1::Tunable* out) {
  out->set_name(t.name);
  out->set_type(t.type);
  out->set_value(t.value);
  out->set_default_value(t.default_value);
  out->set_unit(t.unit);
  out->set_dynamic(t.dynamic);
  out->set_description(t.description);
}

// Percentages above 100 are refused here, before they become ints.
absl::StatusOr<PlacementChange> FromProto(const v1::Placement& p) {
  PlacementChange change;
  const struct {
    DataKind kind;
    const char* name;
    bool set;
    uint32_t value;
  } fields[] = {
      {DataKind::kParams, "params_host_percent", p.has_params_host_percent(),
       p.params_host_percent()},
      {DataKind::kGrads, "grads_host_percent", p.has_grads_host_percent(), p.grads_host_percent()},
      {DataKind::kOptimizerState, "optimizer_state_host_percent",
       p.has_optimizer_state_host_percent(), p.optimizer_state_host_percent()},
  };
  for (const auto& f : fields) {
    if (!f.set) continue;
    if (f.value > 100) {
      return absl::InvalidArgumentError(
          absl::StrCat("placement.", f.name, " must be 0 to 100, got ", f.value));
    }
    change[f.kind] = static_cast<int>(f.value);
  }
  return change;
}

absl::Status ShuttingDown() {
  return absl::UnavailableError("offloadd is shutting down; retry against its successor");
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

template <typename Body>
grpc::Status PartitionServiceImpl::Serve(const grpc::ServerContext& context, Body&& body) {
  CallScope scope(gate_);
  absl::Status status =
      !scope.entered() ? ShuttingDown() : guard_->CheckMayChange(context, "using sessions");
  // Another user's (a socket group's member): at most its share of calls in
  // flight at once.
  std::optional<uid_t> counted;
  if (status.ok() && per_user_ != nullptr && guard_->group_shared()) {
    absl::StatusOr<std::optional<uid_t>> user = guard_->OtherUser(context);
    if (!user.ok()) {
      status = user.status();
    } else if (user->has_value() && !per_user_->Enter(**user)) {
      status = absl::ResourceExhaustedError(
          absl::StrCat("user ", **user, " has ", per_user_->max_per_user(),
                       " calls in flight at offloadd, the most one user of its socket group may "
                       "(server.max_threads / 4): retry when one ends"));
    } else {
      counted = *user;
    }
  }
  if (status.ok()) status = body();
  if (counted.has_value()) per_user_->Exit(*counted);
  // (A fetch asked if ready and refused did what was asked.)
  if (!status.ok() && !ring::IsNotReady(status)) {
    stats_->requests_failed.fetch_add(1, std::memory_order_relaxed);
  }
  return ToGrpcStatus(status);
}

grpc::Status PartitionServiceImpl::OpenSession(grpc::ServerContext* context,
                                               const v1::OpenSessionRequest* req,
                                               v1::OpenSessionResponse* resp) {
  return Serve(*context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(PlacementChange placement, FromProto(req->placement()));
    std::optional<LossScalingOptions> scaling;
    if (req->has_loss_scaling()) {
      const v1::LossScaling& l = req->loss_scaling();
      LossScalingOptions o;
      if (l.has_initial_scale()) o.initial_scale = l.initial_scale();
      if (l.has_growth_interval()) o.growth_interval = l.growth_interval();
      if (l.has_growth_factor()) o.growth_factor = l.growth_factor();
      if (l.has_backoff_factor()) o.backoff_factor = l.backoff_factor();
      if (l.has_hysteresis()) o.hysteresis = l.hysteresis();
      if (l.has_min_scale()) o.min_scale = l.min_scale();
      scaling = o;
    }
    std::optional<uint64_t> dpu_after;
    if (req->has_delayed_update_after_steps()) dpu_after = req->delayed_update_after_steps();
    RETURN_IF_ERROR(CheckPath(req->restore_from(), "restore_from"));
    RETURN_IF_ERROR(CheckRoomForSession());
    // (Before the session is made: one refused leaves nothing behind.)
    if (req->share_weight() > 0) {
      RETURN_IF_ERROR(SessionManager::CheckShareWeight(req->share_weight()));
    }
    RestoreFrom restore(req->restore_from());
    restore.lost = req->resume_lost();
    restore.keep_for_resume = req->keep_for_resume();
    if (req->has_restore_steps()) restore.steps = req->restore_steps();
    ASSIGN_OR_RETURN(std::optional<uid_t> user, guard_->OtherUser(*context));
    ASSIGN_OR_RETURN(OpenedSession opened,
                     sessions_->Open(req->name(), placement, scaling, dpu_after, restore, user));
    if (req->share_weight() > 0) {
      absl::Status shared = sessions_->SetShare(opened.key, req->share_weight());
      if (!shared.ok()) {
        sessions_->Close(opened.key).IgnoreError();
        return shared;
      }
    }
    Answer(opened, resp);
    return absl::OkStatus();
  });
}

absl::Status PartitionServiceImpl::CheckByIdAsOperator(const grpc::ServerContext& context,
                                                       const v1::SessionRef& session,
                                                       absl::string_view what) const {
  return session.token().empty() ? guard_->CheckOperator(context, what) : absl::OkStatus();
}

absl::Status PartitionServiceImpl::CheckRoomForSession() const {
  // (server.max_sessions is the session manager's, checked where it counts.)
  // A session takes a few descriptors (its arena, its request ring's
  // wake-ups) and its trainer's connections a few more.
  constexpr int64_t kPerSession = 4;
  const DescriptorUse use = CountDescriptors();
  if (use.free() < reserved_descriptors_ + kPerSession) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "offloadd has ", use.open, " of its ", use.limit, " file descriptors open and keeps ",
        reserved_descriptors_,
        " for its listeners, checkpoints and control calls (server.reserved_descriptors): "
        "close sessions, or raise its limit (LimitNOFILE= in its unit, ulimit -n)"));
  }
  return absl::OkStatus();
}

void PartitionServiceImpl::Answer(const OpenedSession& opened,
                                  v1::OpenSessionResponse* resp) const {
  resp->mutable_session()->set_session_id(opened.key.id);
  resp->mutable_session()->set_token(opened.key.token);
  resp->set_arena_socket(arena_socket_);
  resp->set_arena_capacity(opened.arena_capacity);
  resp->mutable_request_ring()->set_offset(opened.ring.offset);
  resp->mutable_request_ring()->set_bytes(opened.ring.bytes);
  resp->set_auto_checkpoint_dir(sessions_->AutoCheckpointDir(opened.key.id));
  resp->set_idle_lease_seconds(static_cast<uint32_t>(absl::ToInt64Seconds(idle_lease_)));
  resp->set_restored_from(opened.restored_from);
  for (uint64_t steps : opened.restorable_steps) resp->add_restorable_steps(steps);
}

grpc::Status PartitionServiceImpl::ResumeSession(grpc::ServerContext* context,
                                                 const v1::ResumeSessionRequest* req,
                                                 v1::OpenSessionResponse* resp) {
  return Serve(*context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(OpenedSession opened, sessions_->Resume(KeyOf(req->session())));
    Answer(opened, resp);
    return absl::OkStatus();
  });
}

grpc::Status PartitionServiceImpl::CloseSession(grpc::ServerContext* context,
                                                const v1::CloseSessionRequest* req,
                                                v1::CloseSessionResponse*) {
  return Serve(*context, [&]() -> absl::Status {
    if (req->session().token().empty()) {
      // The operator's close by id: only a session no trainer is attached to.
      RETURN_IF_ERROR(guard_->CheckOperator(*context, "closing a session by id"));
      const uint64_t id = req->session().session_id();
      ASSIGN_OR_RETURN(SessionManager::ClosedByOperator closed, sessions_->CloseUnattached(id));
      LogInfo("session %d ('%s') closed by the operator (%s)", static_cast<int64_t>(id),
              closed.name,
              closed.detached_seconds < 0
                  ? std::string("no trainer had attached to it")
                  : absl::StrCat("its trainer went away ", closed.detached_seconds, " s before"));
      return absl::OkStatus();
    }
    return sessions_->Close(KeyOf(req->session()), !req->has_finished() || req->finished());
  });
}

grpc::Status PartitionServiceImpl::RegisterPartition(grpc::ServerContext* context,
                                                     const v1::RegisterPartitionRequest* req,
                                                     v1::RegisterPartitionResponse* resp) {
  return Serve(*context, [&]() -> absl::Status {
    PartitionSpec spec;
    spec.name = req->name();
    spec.numel = req->numel();
    ASSIGN_OR_RETURN(spec.param_dtype, FromProto(req->param_dtype(), "param_dtype"));
    ASSIGN_OR_RETURN(spec.grad_dtype, FromProto(req->grad_dtype(), "grad_dtype"));
    spec.fp32_master = req->fp32_master();
    if (req->has_slice()) {
      const v1::TensorSlice& slice = req->slice();
      RETURN_IF_ERROR(CheckName(slice.tensor(), "slice.tensor", /*may_be_empty=*/false));
      if (slice.shape_size() > 16) {
        return absl::InvalidArgumentError(
            absl::StrCat("slice.shape has ", slice.shape_size(), " dimensions; at most 16"));
      }
      spec.tensor = slice.tensor();
      spec.shape.assign(slice.shape().begin(), slice.shape().end());
      spec.tensor_offset = slice.offset();
    }
    ASSIGN_OR_RETURN(PartitionInfo info, sessions_->Register(KeyOf(req->session()), spec));
    ToProto(info, resp->mutable_location());
    return absl::OkStatus();
  });
}

grpc::Status PartitionServiceImpl::FetchParams(grpc::ServerContext* context,
                                               const v1::FetchParamsRequest* req,
                                               v1::FetchParamsResponse* resp) {
  return Serve(*context, [&]() -> absl::Status {
    std::vector<uint64_t> ids(req->partition_ids().begin(), req->partition_ids().end());
    FetchMode mode;
    mode.grads = req->grads();
    mode.writable = req->writable();
    mode.load = req->load();
    mode.if_ready = req->if_ready();
    ASSIGN_OR_RETURN(std::vector<PartitionInfo> infos,
                     sessions_->Fetch(KeyOf(req->session()), ids, mode));
    for (const PartitionInfo& p : infos) ToProto(p, resp->add_locations());
    return absl::OkStatus();
  });
}

grpc::Status PartitionServiceImpl::ReleasePartitions(grpc::ServerContext* context,
                                                     const v1::ReleasePartitionsRequest* req,
                                                     v1::ReleasePartitionsResponse*) {
  return Serve(*context, [&]() -> absl::Status {
    std::vector<uint64_t> ids(req->partition_ids().begin(), req->partition_ids().end());
    return sessions_->Release(KeyOf(req->session()), ids);
  });
}

grpc::Status PartitionServiceImpl::ReturnGradients(grpc::ServerContext* context,
                                                   const v1::ReturnGradientsRequest* req,
                                                   v1::ReturnGradientsResponse*) {
  return Serve(*context, [&]() -> absl::Status {
    const SessionKey key = KeyOf(req->session());
    std::vector<v1::GradientBuffer> items;
    if (req->partitions_size() == 0) {
      v1::GradientBuffer& one = items.emplace_back();
      one.set_partition_id(req->partition_id());
      one.set_numel(req->numel());
      one.set_grad_dtype(req->grad_dtype());
      if (req->has_stats()) *one.mutable_stats() = req->stats();
    } else {
      if (req->has_stats()) {
        return absl::InvalidArgumentError(
            "ReturnGradients with partitions gives each one's statistics in it, not in stats");
      }
      if (req->partition_id() != 0 || req->numel() != 0) {
        return absl::InvalidArgumentError(
            "ReturnGradients names partitions either in partition_id or in partitions, not both");
      }
      if (static_cast<size_t>(req->partitions_size()) > SessionManager::kMaxFetchIds) {
        return absl::InvalidArgumentError(
            absl::StrCat("a gradient return may name at most ", SessionManager::kMaxFetchIds,
                         " partitions, got ", req->partitions_size()));
      }
      items.assign(req->partitions().begin(), req->partitions().end());
    }
    std::vector<GradientReturn> returns;
    returns.reserve(items.size());
    for (const v1::GradientBuffer& item : items) {
      GradientReturn& r = returns.emplace_back();
      r.partition_id = item.partition_id();
      r.numel = item.numel();
      r.grad_dtype = FromProto(item.grad_dtype(), "grad_dtype");
      if (item.has_stats()) r.stats = GradStats{item.stats().sq_norm(), item.stats().nonfinite()};
    }
    return sessions_->ReturnGradients(key, returns, req->release(), req->hand_over());
  });
}

grpc::Status PartitionServiceImpl::Step(grpc::ServerContext* context, const v1::StepRequest* req,
                                        v1::StepResponse* resp) {
  return Serve(*context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(StepCall call, FromProto(*req));
    ASSIGN_OR_RETURN(StepSummary summary,
                     sessions_->Step(KeyOf(req->session()), call.hyperparams, call.control));
    ToProto(summary, resp);
    return absl::OkStatus();
  });
}

grpc::Status PartitionServiceImpl::WaitStep(grpc::ServerContext* context,
                                            const v1::WaitStepRequest* req,
                                            v1::StepResponse* resp) {
  return Serve(*context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(StepSummary summary, sessions_->WaitStep(KeyOf(req->session())));
    ToProto(summary, resp);
    return absl::OkStatus();
  });
}

namespace {
// The most moment elements one GetMoments or SetMoments carries (two
// moments of 16 MiB each: 128 calls at once hold at most 4 GiB).
constexpr uint64_t kMaxMomentElements = uint64_t{4} << 20;
}  // namespace

grpc::Status PartitionServiceImpl::GetMoments(grpc::ServerContext* context,
                                              const v1::GetMomentsRequest* req, v1::Moments* resp) {
  return Serve(*context, [&]() -> absl::Status {
    // (With the master, three arrays in the bytes of two.)
    const uint64_t most = req->with_master() ? kMaxMomentElements * 2 / 3 : kMaxMomentElements;
    if (req->count() > most) {
      return absl::InvalidArgumentError(absl::StrCat("count ", req->count(), " is over ", most,
                                                     " elements a call",
                                                     req->with_master() ? " with the master" : ""));
    }
    std::string* exp_avg = resp->mutable_exp_avg();
    std::string* exp_avg_sq = resp->mutable_exp_avg_sq();
    exp_avg->resize(req->count() * sizeof(float));
    exp_avg_sq->resize(req->count() * sizeof(float));
    float* master = nullptr;
    if (req->with_master()) {
      resp->mutable_master()->resize(req->count() * sizeof(float));
      master = reinterpret_cast<float*>(resp->mutable_master()->data());
    }
    ASSIGN_OR_RETURN(uint64_t step, sessions_->ReadMoments(
                                        KeyOf(req->session()), req->partition_id(), req->begin(),
                                        req->count(), reinterpret_cast<float*>(exp_avg->data()),
                                        reinterpret_cast<float*>(exp_avg_sq->data()), master));
    resp->set_step(step);
    return absl::OkStatus();
  });
}

grpc::Status PartitionServiceImpl::SetShare(grpc::ServerContext* context,
                                            const v1::SetShareRequest* req, v1::SetShareResponse*) {
  return Serve(*context, [&]() -> absl::Status {
    RETURN_IF_ERROR(
        CheckByIdAsOperator(*context, req->session(), "setting another session's share by id"));
    return sessions_->SetShare(KeyOf(req->session()), req->weight());
  });
}

grpc::Status PartitionServiceImpl::SetMoments(grpc::ServerContext* context,
                                              const v1::SetMomentsRequest* req,
                                              v1::SetMomentsResponse*) {
  return Serve(*context, [&]() -> absl::Status {
    const v1::Moments& m = req->moments();
    if (m.exp_avg().size() != m.exp_avg_sq().size() || m.exp_avg().size() % sizeof(float) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("moments.exp_avg (", m.exp_avg().size(), " bytes) and moments.exp_avg_sq (",
                       m.exp_avg_sq().size(), " bytes) must be the same whole number of floats"));
    }
    const uint64_t count = m.exp_avg().size() / sizeof(float);
    if (count > kMaxMomentElements) {
      return absl::InvalidArgumentError(
          absl::StrCat(count, " elements is over ", kMaxMomentElements, " a call"));
    }
    // (Copied: protobuf's strings need not be aligned for floats.)
    std::vector<float> exp_avg(count), exp_avg_sq(count);
    std::memcpy(exp_avg.data(), m.exp_avg().data(), count * sizeof(float));
    std::memcpy(exp_avg_sq.data(), m.exp_avg_sq().data(), count * sizeof(float));
    return sessions_->WriteMoments(KeyOf(req->session()), req->partition_id(), m.step(),
                                   req->begin(), count, exp_avg.data(), exp_avg_sq.data());
  });
}

grpc::Status PartitionServiceImpl::SetDelayedUpdate(grpc::ServerContext* context,
                                                    const v1::SetDelayedUpdateRequest* req,
                                                    v1::SetDelayedUpdateResponse*) {
  return Serve(*context,
               [&] { return sessions_->SetDelayedUpdate(KeyOf(req->session()), req->enabled()); });
}

grpc::Status PartitionServiceImpl::ReportGpuTier(grpc::ServerContext* context,
                                                 const v1::ReportGpuTierRequest* req,
                                                 v1::ReportGpuTierResponse* resp) {
  return Serve(*context, [&]() -> absl::Status {
    const v1::GpuTierCounters& c = req->counters();
    GpuTierReport r;
    r.h2d_bytes = c.h2d_bytes();
    r.h2d_staged_bytes = c.h2d_staged_bytes();
    r.d2h_bytes = c.d2h_bytes();
    r.tensor_uses = c.tensor_uses();
    r.resident_hits = c.resident_hits();
    r.prefetch_hits = c.prefetch_hits();
    r.host_waits = c.host_waits();
    r.evictions = c.evictions();
    r.resident_bytes = c.resident_bytes();
    r.budget_bytes = c.budget_bytes();
    r.dma_bytes = c.dma_bytes();
    r.prefetch_depth = c.prefetch_depth();
    r.prefetch_bytes = c.prefetch_bytes();
    for (uint64_t v : {r.h2d_bytes, r.d2h_bytes, r.tensor_uses, r.host_waits, r.evictions}) {
      if (v > static_cast<uint64_t>(INT64_MAX)) {
        return absl::InvalidArgumentError(
            absl::StrCat("a counter of ", v, " is past what the node's totals hold"));
      }
    }
    if (r.h2d_staged_bytes > r.h2d_bytes || r.resident_hits > r.tensor_uses ||
        r.prefetch_hits > r.tensor_uses - r.resident_hits) {
      return absl::InvalidArgumentError(
          absl::StrCat("counters that cannot be (staged ", r.h2d_staged_bytes, " of ", r.h2d_bytes,
                       " bytes; of ", r.tensor_uses, " uses ", r.resident_hits, " resident and ",
                       r.prefetch_hits, " prefetched)"));
    }
    ASSIGN_OR_RETURN(GpuTierSettings settings, sessions_->ReportGpuTier(KeyOf(req->session()), r));
    resp->set_prefetch_depth(settings.prefetch_depth);
    resp->set_prefetch_bytes(settings.prefetch_bytes);
    return absl::OkStatus();
  });
}

grpc::Status PartitionServiceImpl::GetPendingGradients(grpc::ServerContext* context,
                                                       const v1::GetPendingGradientsRequest* req,
                                                       v1::GetPendingGradientsResponse* resp) {
  return Serve(*context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(PendingGradients p, sessions_->Pending(KeyOf(req->session())));
    ToProto(p, resp);
    return absl::OkStatus();
  });
}

grpc::Status PartitionServiceImpl::SetPlacement(grpc::ServerContext* context,
                                                const v1::SetPlacementRequest* req,
                                                v1::SetPlacementResponse*) {
  return Serve(*context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(PlacementChange change, FromProto(req->placement()));
    return sessions_->SetPlacement(KeyOf(req->session()), change);
  });
}

grpc::Status PartitionServiceImpl::Checkpoint(grpc::ServerContext* context,
                                              const v1::CheckpointRequest* req,
                                              v1::CheckpointResponse* resp) {
  return Serve(*context, [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckByIdAsOperator(*context, req->session(), "checkpointing a session by id"));
    RETURN_IF_ERROR(CheckPath(req->directory(), "directory"));
    ASSIGN_OR_RETURN(
        SessionManager::CheckpointOutcome outcome,
        sessions_->Checkpoint(KeyOf(req->session()), req->directory(), req->background()));
    ToProto(outcome, resp);
    return absl::OkStatus();
  });
}

grpc::Status PartitionServiceImpl::WaitCheckpoint(grpc::ServerContext* context,
                                                  const v1::WaitCheckpointRequest* req,
                                                  v1::CheckpointResponse* resp) {
  return Serve(*context, [&]() -> absl::Status {
    RETURN_IF_ERROR(
        CheckByIdAsOperator(*context, req->session(), "waiting for a session's checkpoint by id"));
    ASSIGN_OR_RETURN(SessionManager::CheckpointOutcome outcome,
                     sessions_->WaitCheckpoint(KeyOf(req->session())));
    ToProto(outcome, resp);
    return absl::OkStatus();
  });
}

grpc::Status ConfigServiceImpl::ListTunables(grpc::ServerContext*, const v1::ListTunablesRequest*,
                                             v1::ListTunablesResponse* resp) {
  for (const TunableInfo& t : registry_->List()) ToProto(t, resp->add_tunables());
  return grpc::Status::OK;
}

namespace {

// Tunable names and values arrive as bytes: text, and short, before the
// registry sees (and echoes) them.
absl::Status CheckTunableText(absl::string_view text, absl::string_view what) {
  if (text.size() > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("tunable ", what, " is over 4096 bytes (", text.size(), ")"));
  }
  if (const std::optional<size_t> bad = FirstInvalidUtf8(text); bad.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tunable ", what, " is not UTF-8 (byte ", *bad, " of ", text.size(), ")"));
  }
  return absl::OkStatus();
}

}  // namespace

grpc::Status ConfigServiceImpl::GetTunable(grpc::ServerContext*, const v1::GetTunableRequest* req,
                                           v1::Tunable* resp) {
  if (absl::Status s = CheckTunableText(req->name(), "name"); !s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<TunableInfo> t = registry_->Get(req->name());
  if (!t.ok()) return ToGrpcStatus(t.status());
  ToProto(*t, resp);
  return grpc::Status::OK;
}

grpc::Status ConfigServiceImpl::SetTunable(grpc::ServerContext* context,
                                           const v1::SetTunableRequest* req, v1::Tunable* resp) {
  if (absl::Status may = guard_->CheckOperator(*context, "changing tunables"); !may.ok()) {
    return ToGrpcStatus(may);
  }
  for (const auto& [text, what] : {std::pair{&req->name(), "name"}, {&req->value(), "value"}}) {
    if (absl::Status s = CheckTunableText(*text, what); !s.ok()) return ToGrpcStatus(s);
  }
  absl::StatusOr<TunableInfo> t = registry_->Set(req->name(), req->value());
  if (!t.ok()) return ToGrpcStatus(t.status());
  ToProto(*t, resp);
  return grpc::Status::OK;
}

void StatsServiceImpl::AddListening(std::string address) {
  absl::MutexLock lock(&mu_);
  identity_.listening.push_back(std::move(address));
}

grpc::Status StatsServiceImpl::GetStats(grpc::ServerContext* context, const v1::GetStatsRequest*,
                                        v1::GetStatsResponse* resp) {
  const bool names = guard_ == nullptr || guard_->CheckMayChange(*context, "").ok();
  resp->set_version(kOffloaddVersion);
  resp->set_pid(static_cast<uint32_t>(getpid()));
  {
    absl::MutexLock lock(&mu_);
    resp->set_uptime_ms(absl::ToInt64Milliseconds(absl::Now() - identity_.started));
    for (const std::string& l : identity_.listening) resp->add_listening(l);
  }
  const DaemonSnapshot snapshot = snapshot_();
  for (const TierValue& t : snapshot.tiers) {
    v1::TierSummary* tier = resp->add_tiers();
    tier->set_name(t.name);
    tier->set_used_bytes(t.used_bytes);
    tier->set_budget_bytes(t.budget_bytes);
  }
  for (const CounterValue& c : snapshot.counters) {
    v1::Counter* out = resp->add_counters();
    out->set_name(c.name);
    out->set_value(c.value);
    out->set_unit(c.unit);
  }
  for (const SessionSummary& s : snapshot.sessions) {
    v1::SessionSummary* out = resp->add_sessions();
    out->set_session_id(s.id);
    if (names) out->set_name(s.name);
    out->set_partitions(s.partitions);
    out->set_arena_bytes(s.arena_bytes);
    out->set_steps(s.steps);
    constexpr int kState = static_cast<int>(DataKind::kOptimizerState);
    constexpr int kParams = static_cast<int>(DataKind::kParams);
    constexpr int kGrads = static_cast<int>(DataKind::kGrads);
    out->set_state_host_bytes(s.host_bytes[kState]);
    out->set_state_nvme_bytes(s.nvme_bytes[kState]);
    out->set_params_host_bytes(s.host_bytes[kParams]);
    out->set_params_nvme_bytes(s.nvme_bytes[kParams]);
    out->set_grads_host_bytes(s.host_bytes[kGrads]);
    out->set_grads_nvme_bytes(s.nvme_bytes[kGrads]);
    out->set_held(s.held);
    out->set_step_wall_nanos(s.step_wall_nanos);
    out->set_step_wait_nanos(s.step_wait_nanos);
    out->set_step_compute_nanos(s.step_compute_nanos);
    out->set_share_weight(s.share_weight);
    out->set_optimizer_params(s.optimizer_params);
    out->set_optimizer_queued_nanos(s.optimizer_queued_nanos);
    out->set_nvme_read_bytes(s.nvme_read_bytes);
    out->set_nvme_write_bytes(s.nvme_write_bytes);
    out->set_io_queued_nanos(s.io_queued_nanos);
    out->set_pool_room_bytes(s.pool_room_bytes);
    out->set_pool_evictions(s.pool_evictions);
    if (s.detached_seconds >= 0) out->set_detached_seconds(s.detached_seconds);
    if (s.gpu.has_value()) {
      const GpuTierReport& g = *s.gpu;
      v1::GpuTierCounters* c = out->mutable_gpu();
      c->set_h2d_bytes(g.h2d_bytes);
      c->set_h2d_staged_bytes(g.h2d_staged_bytes);
      c->set_d2h_bytes(g.d2h_bytes);
      c->set_tensor_uses(g.tensor_uses);
      c->set_resident_hits(g.resident_hits);
      c->set_prefetch_hits(g.prefetch_hits);
      c->set_host_waits(g.host_waits);
      c->set_evictions(g.evictions);
      c->set_resident_bytes(g.resident_bytes);
      c->set_budget_bytes(g.budget_bytes);
      c->set_dma_bytes(g.dma_bytes);
      c->set_prefetch_depth(g.prefetch_depth);
      c->set_prefetch_bytes(g.prefetch_bytes);
    }
  }
  resp->set_optimizer_kernel(
      absl::StrCat(optimizer_->kernel_name(), ", ", optimizer_->threads(), " threads"));
  return grpc::Status::OK;
}

}  // namespace offload
