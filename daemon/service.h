// The gRPC layer: converts offload.v1 messages to engine types, calls the
// engine, and converts absl::Status to grpc::Status (the codes map one to
// one). Generated protobuf types stop here.
//
// Thread-safety: the services hold only pointers to thread-safe engine
// objects and are called concurrently by gRPC's thread pool.
#ifndef OFFLOADD_DAEMON_SERVICE_H_
#define OFFLOADD_DAEMON_SERVICE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/config_registry.h"
#include "cpu_adam/optimizer.h"
#include "daemon/access_guard.h"
#include "daemon/call_gate.h"
#include "daemon/snapshot.h"
#include "engine/session_manager.h"
#include "engine/stats.h"
#include "grpcpp/grpcpp.h"
#include "nvme/swap_space.h"
#include "proto/offload.grpc.pb.h"
#include "swapper/swapper.h"

namespace offload {

grpc::Status ToGrpcStatus(const absl::Status& status);

class PartitionServiceImpl final : public v1::PartitionService::Service {
 public:
  // Every call passes `gate`; once it closes, calls fail with UNAVAILABLE.
  // `guard` decides what TCP callers may do.
  // `idle_lease`: the sessions' idle lease, told to clients when they open
  // or resume one (their keepalive's period follows it).
  PartitionServiceImpl(SessionManager* sessions, Stats* stats, CallGate* gate,
                       const AccessGuard* guard, std::string arena_socket,
                       absl::Duration idle_lease = absl::ZeroDuration())
      : sessions_(sessions),
        stats_(stats),
        gate_(gate),
        guard_(guard),
        arena_socket_(std::move(arena_socket)),
        idle_lease_(idle_lease) {}

  // OpenSession is refused (RESOURCE_EXHAUSTED) where fewer than
  // `reserved_descriptors` would be left. Set before the server starts.
  void SetReservedDescriptors(int64_t reserved_descriptors) {
    reserved_descriptors_ = reserved_descriptors;
  }
  // With server.socket_group: each other user's calls in flight at once,
  // at most `max_per_user` (RESOURCE_EXHAUSTED past it). Set before the
  // server starts.
  void LimitCallsPerUser(int max_per_user) {
    per_user_ = std::make_unique<UserCallLimit>(max_per_user);
  }

  grpc::Status OpenSession(grpc::ServerContext*, const v1::OpenSessionRequest*,
                           v1::OpenSessionResponse*) override;
  grpc::Status CloseSession(grpc::ServerContext*, const v1::CloseSessionRequest*,
                            v1::CloseSessionResponse*) override;
  grpc::Status RegisterPartition(grpc::ServerContext*, const v1::RegisterPartitionRequest*,
                                 v1::RegisterPartitionResponse*) override;
  grpc::Status FetchParams(grpc::ServerContext*, const v1::FetchParamsRequest*,
                           v1::FetchParamsResponse*) override;
  grpc::Status ReleasePartitions(grpc::ServerContext*, const v1::ReleasePartitionsRequest*,
                                 v1::ReleasePartitionsResponse*) override;
  grpc::Status GetPendingGradients(grpc::ServerContext*, const v1::GetPendingGradientsRequest*,
                                   v1::GetPendingGradientsResponse*) override;
  grpc::Status WaitStep(grpc::ServerContext*, const v1::WaitStepRequest*,
                        v1::StepResponse*) override;
  grpc::Status SetDelayedUpdate(grpc::ServerContext*, const v1::SetDelayedUpdateRequest*,
                                v1::SetDelayedUpdateResponse*) override;
  grpc::Status GetMoments(grpc::ServerContext*, const v1::GetMomentsRequest*,
                          v1::Moments*) override;
  grpc::Status SetShare(grpc::ServerContext*, const v1::SetShareRequest*,
                        v1::SetShareResponse*) override;
  grpc::Status SetMoments(grpc::ServerContext*, const v1::SetMomentsRequest*,
                          v1::SetMomentsResponse*) override;
  grpc::Status ReportGpuTier(grpc::ServerContext*, const v1::ReportGpuTierRequest*,
                             v1::ReportGpuTierResponse*) override;
  grpc::Status ReturnGradients(grpc::ServerContext*, const v1::ReturnGradientsRequest*,
                               v1::ReturnGradientsResponse*) override;
  grpc::Status Step(grpc::ServerContext*, const v1::StepRequest*, v1::StepResponse*) override;
  grpc::Status ResumeSession(grpc::ServerContext*, const v1::ResumeSessionRequest*,
                             v1::OpenSessionResponse*) override;
  grpc::Status Checkpoint(grpc::ServerContext*, const v1::CheckpointRequest*,
                          v1::CheckpointResponse*) override;
  grpc::Status WaitCheckpoint(grpc::ServerContext*, const v1::WaitCheckpointRequest*,
                              v1::CheckpointResponse*) override;
  grpc::Status SetPlacement(grpc::ServerContext*, const v1::SetPlacementRequest*,
                            v1::SetPlacementResponse*) override;

 private:
  // Every method's prologue and epilogue: enters the call gate (UNAVAILABLE
  // once shutting down), checks the caller may use sessions (AccessGuard),
  // runs `body`, counts a failure, converts the status.
  template <typename Body>
  grpc::Status Serve(const grpc::ServerContext& context, Body&& body);
  // What OpenSession and ResumeSession answer.
  void Answer(const OpenedSession& opened, v1::OpenSessionResponse* resp) const;

  SessionManager* const sessions_;
  Stats* const stats_;
  CallGate* const gate_;
  const AccessGuard* const guard_;
  int64_t reserved_descriptors_ = 0;
  std::unique_ptr<UserCallLimit> per_user_;  // with a socket group
  // RESOURCE_EXHAUSTED where one more session would pass a limit above.
  absl::Status CheckRoomForSession() const;
  // A call naming `session` by id without its token acts as the operator:
  // the guard's CheckOperator for `what`; with the token, OK (the session
  // manager checks it).
  absl::Status CheckByIdAsOperator(const grpc::ServerContext& context,
                                   const v1::SessionRef& session, absl::string_view what) const;
  const std::string arena_socket_;
  const absl::Duration idle_lease_;
};

class ConfigServiceImpl final : public v1::ConfigService::Service {
 public:
  ConfigServiceImpl(ConfigRegistry* registry, const AccessGuard* guard)
      : registry_(registry), guard_(guard) {}

  grpc::Status ListTunables(grpc::ServerContext*, const v1::ListTunablesRequest*,
                            v1::ListTunablesResponse*) override;
  grpc::Status GetTunable(grpc::ServerContext*, const v1::GetTunableRequest*,
                          v1::Tunable*) override;
  grpc::Status SetTunable(grpc::ServerContext*, const v1::SetTunableRequest*,
                          v1::Tunable*) override;

 private:
  ConfigRegistry* const registry_;
  const AccessGuard* const guard_;
};

struct ServerIdentity {
  std::vector<std::string> listening;
  absl::Time started;
};

class StatsServiceImpl final : public v1::StatsService::Service {
 public:
  // `swap` may be null (no NVMe tier).
  // `snapshot` gives the counters, tiers and sessions (Daemon::Snapshot).
  // `guard`: over TCP without the token, session names are left out
  // (every local user may read the status; names are the owner's).
  StatsServiceImpl(SnapshotFn snapshot, const Optimizer* optimizer, ServerIdentity identity,
                   const AccessGuard* guard = nullptr)
      : snapshot_(std::move(snapshot)),
        optimizer_(optimizer),
        guard_(guard),
        identity_(std::move(identity)) {}

  grpc::Status GetStats(grpc::ServerContext* context, const v1::GetStatsRequest*,
                        v1::GetStatsResponse*) override;

  void AddListening(std::string address) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const SnapshotFn snapshot_;
  const Optimizer* const optimizer_;
  const AccessGuard* const guard_;
  absl::Mutex mu_;
  ServerIdentity identity_ ABSL_GUARDED_BY(mu_);
};

}  // namespace offload

#endif  // OFFLOADD_DAEMON_SERVICE_H_
