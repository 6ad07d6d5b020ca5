// libFuzzer target over offloadd's request decoding and validation.
//
// Each input is one call to the PartitionService: the first byte picks the
// method, the rest are the request's bytes exactly as they would arrive on
// the wire. They go through a real gRPC server (in-process channel) into
// the real service over a real engine (host pool, swapper, partition store,
// step runner, session manager), so gRPC's decoding, the proto conversion
// and every validation run. With the first byte's high bit set, the request
// is decoded, pointed at a live session (so that calls reach past the
// session check), and encoded again.
//
// What must hold for every input: offloadd does not crash, answers the call
// with a status (gRPC's deadline bounds a hang: DEADLINE_EXCEEDED aborts),
// and keeps serving: every 64 inputs a well-formed call on the live session
// must succeed. Sessions an input opens are closed after it.
//
// Built with clang's -fsanitize=fuzzer by tools/fuzz.sh (see there); seeds
// in fuzz/corpus/ (written by FUZZ_WRITE_SEEDS=dir ./request_fuzzer).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "base/env.h"
#include "cpu_adam/optimizer.h"
#include "daemon/access_guard.h"
#include "daemon/call_gate.h"
#include "daemon/service.h"
#include "engine/engine.h"
#include "engine/partition_store.h"
#include "engine/session_manager.h"
#include "engine/stats.h"
#include "engine/step_runner.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "ipc/paths.h"
#include "proto/offload.grpc.pb.h"
#include "swapper/host_pool.h"
#include "swapper/swapper.h"

namespace offload {
namespace {

constexpr char kToken[] = "fuzz-token";

enum Method {
  kOpenSession,
  kCloseSession,
  kRegisterPartition,
  kFetchParams,
  kReleasePartitions,
  kReturnGradients,
  kGetPendingGradients,
  kStep,
  kWaitStep,
  kSetDelayedUpdate,
  kSetPlacement,
  kCheckpoint,
  kWaitCheckpoint,
  kResumeSession,
  kMethods
};
const char* const kNames[kMethods] = {
    "OpenSession",       "CloseSession",     "RegisterPartition",   "FetchParams",
    "ReleasePartitions", "ReturnGradients",  "GetPendingGradients", "Step",
    "WaitStep",          "SetDelayedUpdate", "SetPlacement",        "Checkpoint",
    "WaitCheckpoint",    "ResumeSession"};

// Decodes `body` as M, points it at `session`, encodes it again; unchanged
// if it does not decode.
template <typename M>
std::string WithSession(const std::string& body, const v1::SessionRef& session) {
  M m;
  if (!m.ParseFromString(body)) return body;
  *m.mutable_session() = session;
  return m.SerializeAsString();
}

class Harness {
 public:
  Harness() { Build(); }

  void Build() {
    EngineOptions o;
    o.host_budget_bytes = uint64_t{64} << 20;
    o.session_arena_bytes = uint64_t{16} << 20;
    o.state_chunk_elems = 1 << 16;
    engine_ = *Engine::Create(o, Env::Default());
    guard_ = std::make_unique<AccessGuard>(kToken, "<fuzz>");
    service_ = std::make_unique<PartitionServiceImpl>(&engine_->sessions(), &engine_->stats(),
                                                      &gate_, guard_.get(), "<fuzz>.arena");
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    stub_ = std::make_unique<grpc::GenericStub>(server_->InProcessChannel({}));
    RenewLiveSession();
  }

  // (Re)opens the live session, with one partition registered and released.
  void RenewLiveSession() {
    std::string reply;
    if (live_.session_id() != 0) {
      v1::CloseSessionRequest close;
      *close.mutable_session() = live_;
      Call(kCloseSession, close.SerializeAsString(), nullptr);
    }
    if (!Call(kOpenSession, v1::OpenSessionRequest().SerializeAsString(), &reply).ok()) Die("open");
    v1::OpenSessionResponse opened;
    opened.ParseFromString(reply);
    live_ = opened.session();
    v1::RegisterPartitionRequest reg;
    *reg.mutable_session() = live_;
    reg.set_name("w");
    reg.set_numel(4096);
    reg.set_param_dtype(v1::DTYPE_FP32);
    reg.set_grad_dtype(v1::DTYPE_FP32);
    if (!Call(kRegisterPartition, reg.SerializeAsString(), &reply).ok()) Die("register");
    v1::RegisterPartitionResponse registered;
    registered.ParseFromString(reply);
    v1::ReleasePartitionsRequest release;
    *release.mutable_session() = live_;
    if (!Call(kReleasePartitions, release.SerializeAsString(), &reply).ok()) Die("release");
    partition_ = registered.location().partition_id();
  }

  grpc::Status Call(Method m, const std::string& body, std::string* reply) {
    grpc::ClientContext ctx;
    ctx.AddMetadata(kTokenMetadataKey, kToken);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    grpc::Slice slice(body);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::CompletionQueue cq;
    auto rpc = stub_->PrepareUnaryCall(
        &ctx, std::string("/offload.v1.PartitionService/") + kNames[m], request, &cq);
    rpc->StartCall();
    grpc::Status status;
    rpc->Finish(&response, &status, reinterpret_cast<void*>(1));
    void* tag;
    bool ok;
    cq.Next(&tag, &ok);
    if (status.ok() && reply != nullptr) {
      std::vector<grpc::Slice> slices;
      (void)response.Dump(&slices);
      reply->clear();
      for (const grpc::Slice& s : slices) {
        reply->append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
    return status;
  }

  void One(const uint8_t* data, size_t size) {
    if (size == 0) return;
    const Method m = static_cast<Method>((data[0] & 0x7f) % kMethods);
    std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
    if (data[0] & 0x80) body = PointAtLive(m, body);
    if (m == kCheckpoint) {
      // Checkpoints write files: only ever into the harness's directory
      // (an input that does not decode fails in the server the same way).
      v1::CheckpointRequest c;
      if (c.ParseFromString(body)) {
        c.set_directory(checkpoint_dir_);
        body = c.SerializeAsString();
      }
    }
    std::string reply;
    const grpc::Status s = Call(m, body, &reply);
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) Die("a call hung");
    if (m == kOpenSession && s.ok()) {  // close what the input opened
      v1::OpenSessionResponse opened;
      opened.ParseFromString(reply);
      v1::CloseSessionRequest close;
      *close.mutable_session() = opened.session();
      Call(kCloseSession, close.SerializeAsString(), nullptr);
    }
    // Every input while there are few (a seed run checks each), then every
    // 64th; every 4096th starts a fresh live session, so that what earlier
    // inputs registered or held does not fill its arena for good.
    ++calls_;
    if (calls_ <= 64 || calls_ % 64 == 0) CheckStillServing();
    if (calls_ % 4096 == 0) RenewLiveSession();
  }

  void RemoveCheckpoints() {
    std::error_code ignored;
    std::filesystem::remove_all(checkpoint_dir_, ignored);
  }

  // Writes one valid request per method (two for ReturnGradients), pointed
  // at the live session, as seed inputs, each in a file named after its
  // method (or `name`).
  void WriteSeeds(const std::string& dir) {
    auto write = [&](Method m, const google::protobuf::Message& req, const char* name = nullptr) {
      std::ofstream f(dir + "/" + (name != nullptr ? name : kNames[m]), std::ios::binary);
      f.put(static_cast<char>(m | 0x80));
      f << req.SerializeAsString();
    };
    v1::OpenSessionRequest open;
    open.set_name("seed");
    write(kOpenSession, open);
    v1::RegisterPartitionRequest reg;
    reg.set_name("seed");
    reg.set_numel(1000);
    reg.set_param_dtype(v1::DTYPE_BF16);
    reg.set_grad_dtype(v1::DTYPE_FP32);
    write(kRegisterPartition, reg);
    v1::FetchParamsRequest fetch;
    fetch.add_partition_ids(partition_);
    fetch.set_grads(true);
    write(kFetchParams, fetch);
    v1::ReleasePartitionsRequest release;
    release.add_partition_ids(partition_);
    write(kReleasePartitions, release);
    v1::ReturnGradientsRequest ret;
    ret.set_partition_id(partition_);
    ret.set_numel(4096);
    ret.set_grad_dtype(v1::DTYPE_FP32);
    write(kReturnGradients, ret);
    v1::ReturnGradientsRequest handed = ret;  // with the trainer's statistics
    handed.set_hand_over(true);
    handed.mutable_stats()->set_sq_norm(1.0);
    write(kReturnGradients, handed, "ReturnGradientsHandedOver");
    write(kGetPendingGradients, v1::GetPendingGradientsRequest());
    v1::StepRequest step;
    step.mutable_hyperparams()->set_lr(1e-3);
    step.set_overlap(true);
    v1::ParamGroup* g = step.add_groups();
    g->add_partition_ids(partition_);
    g->mutable_hyperparams()->set_weight_decay(0.1);
    write(kStep, step);
    write(kWaitStep, v1::WaitStepRequest());
    v1::SetDelayedUpdateRequest dpu;
    dpu.set_enabled(true);
    write(kSetDelayedUpdate, dpu);
    v1::SetPlacementRequest placement;
    placement.mutable_placement()->set_optimizer_state_host_percent(50);
    write(kSetPlacement, placement);
    write(kCloseSession, v1::CloseSessionRequest());
    v1::CheckpointRequest checkpoint;
    checkpoint.set_directory(checkpoint_dir_);
    checkpoint.set_background(true);
    write(kCheckpoint, checkpoint);
    write(kWaitCheckpoint, v1::WaitCheckpointRequest());
    write(kResumeSession, v1::ResumeSessionRequest());
  }

 private:
  [[noreturn]] static void Die(const char* what) {
    std::fprintf(stderr, "request_fuzzer: %s\n", what);
    std::abort();
  }

  std::string PointAtLive(Method m, const std::string& body) {
    switch (m) {
      case kOpenSession:
        return body;  // no session to point at
      case kCloseSession:
        return body;  // closing the live session would end the run's reach
      case kRegisterPartition:
        return WithSession<v1::RegisterPartitionRequest>(body, live_);
      case kFetchParams:
        return WithSession<v1::FetchParamsRequest>(body, live_);
      case kReleasePartitions:
        return WithSession<v1::ReleasePartitionsRequest>(body, live_);
      case kReturnGradients:
        return WithSession<v1::ReturnGradientsRequest>(body, live_);
      case kGetPendingGradients:
        return WithSession<v1::GetPendingGradientsRequest>(body, live_);
      case kStep:
        return WithSession<v1::StepRequest>(body, live_);
      case kWaitStep:
        return WithSession<v1::WaitStepRequest>(body, live_);
      case kSetDelayedUpdate:
        return WithSession<v1::SetDelayedUpdateRequest>(body, live_);
      case kSetPlacement:
        return WithSession<v1::SetPlacementRequest>(body, live_);
      case kCheckpoint:
        return WithSession<v1::CheckpointRequest>(body, live_);
      case kWaitCheckpoint:
        return WithSession<v1::WaitCheckpointRequest>(body, live_);
      case kResumeSession:
        return WithSession<v1::ResumeSessionRequest>(body, live_);
      case kMethods:
        break;
    }
    return body;
  }

  // A well-formed call on the live session: it must succeed whatever came
  // before.
  void CheckStillServing() {
    v1::GetPendingGradientsRequest req;
    *req.mutable_session() = live_;
    if (!Call(kGetPendingGradients, req.SerializeAsString(), nullptr).ok()) {
      Die("the live session stopped answering");
    }
  }

  CallGate gate_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<AccessGuard> guard_;
  std::unique_ptr<PartitionServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::GenericStub> stub_;
  v1::SessionRef live_;
  uint64_t partition_ = 0;
  uint64_t calls_ = 0;
  // Where every Checkpoint writes, whatever directory the input named.
  // (Under $TMPDIR where set: tools/fuzz.sh points it at a directory it
  // removes, as libFuzzer may end the process without running atexit.)
  std::string checkpoint_dir_ = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string t = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
                    "/offloadd-fuzz-checkpoints.XXXXXX";
    return std::string(mkdtemp(t.data()) ? t : "/tmp");
  }();
};

Harness* harness = nullptr;

}  // namespace
}  // namespace offload

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  offload::harness = new offload::Harness();
  std::atexit([] { offload::harness->RemoveCheckpoints(); });
  if (const char* dir = std::getenv("FUZZ_WRITE_SEEDS")) {
    offload::harness->WriteSeeds(dir);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  offload::harness->One(data, size);
  return 0;
}
