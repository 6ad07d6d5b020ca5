#include "daemon/grpc_server.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/descriptors.h"
#include "base/log.h"
#include "base/posix_error.h"
#include "base/status_macros.h"
#include "grpc/support/log.h"
#include "grpcpp/server_posix.h"
#include "ipc/unix_socket.h"

namespace offload {
namespace {

// Set by gRPC's log when a listener stopped accepting; taken by the keeper.
std::atomic<bool> g_accept_failed{false};

void OnGrpcLog(gpr_log_func_args* args) {
  if (absl::StrContains(args->message, "Failed accept4")) {
    g_accept_failed.store(true, std::memory_order_release);
  }
  if (args->severity != GPR_LOG_SEVERITY_ERROR) return;
  // One limiter per place in gRPC that logs, so that one error repeating
  // does not hide another (a few dozen places at most; leaked on purpose,
  // as gRPC may log while the process exits).
  static absl::Mutex mu;
  static auto* limiters = new absl::flat_hash_map<std::string, std::unique_ptr<LogLimiter>>();
  LogLimiter* limiter;
  {
    absl::MutexLock lock(&mu);
    std::unique_ptr<LogLimiter>& l = (*limiters)[absl::StrCat(args->file, ":", args->line)];
    if (l == nullptr) l = std::make_unique<LogLimiter>(absl::Seconds(10));
    limiter = l.get();
  }
  if (int64_t held = limiter->Admit(absl::Now()); held >= 0) {
    LogError("gRPC: %s (%s:%d)%s", args->message, args->file, args->line, LogLimiter::Held(held));
  }
}

}  // namespace

GrpcServer::GrpcServer(GrpcServerOptions options, std::vector<grpc::Service*> services)
    : options_(std::move(options)), services_(std::move(services)) {}

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(
    GrpcServerOptions options, std::vector<grpc::Service*> services) {
  gpr_set_log_function(&OnGrpcLog);
  std::unique_ptr<GrpcServer> s(new GrpcServer(std::move(options), std::move(services)));
  // The unix socket's calls on a server of their own, never rebuilt: TCP's
  // troubles do not cut them.
  ASSIGN_OR_RETURN(s->unix_server_, s->Build(/*tcp=*/false));
  if (s->options_.tcp_port >= 0) {
    absl::MutexLock lock(&s->mu_);
    ASSIGN_OR_RETURN(s->server_, s->Build(/*tcp=*/true));
  }
  g_accept_failed.store(false);
  UnixAcceptorOptions accept;
  accept.path = s->options_.unix_path;
  accept.group = s->options_.group;
  accept.handshake_timeout = s->options_.handshake_timeout;
  accept.max_connections_per_user = s->options_.max_connections_per_user;
  accept.reserved_descriptors = s->options_.reserved_descriptors;
  accept.counters = s->options_.counters;
  ASSIGN_OR_RETURN(s->acceptor_,
                   UnixAcceptor::Start(std::move(accept), [raw = s.get()](UniqueFd connection) {
                     raw->Adopt(std::move(connection));
                   }));
  if (s->options_.tcp_port >= 0) s->keeper_ = std::thread([raw = s.get()] { raw->Keep(); });
  return s;
}

void GrpcServer::Adopt(UniqueFd connection) {
  // (unix_server_ stands from before the acceptor starts until after it
  // stopped.)
  grpc::AddInsecureChannelFromFd(unix_server_.get(), connection.release());
}

absl::StatusOr<std::unique_ptr<grpc::Server>> GrpcServer::Build(bool tcp) {
  grpc::ServerBuilder builder;
  // Each server its own threads (a server that cannot reserve one at start
  // aborts the process: a rebuilt TCP server must not find the Unix
  // socket's calls holding them all). TCP's is read-only status, or the
  // token holder's: an eighth.
  grpc::ResourceQuota quota(tcp ? "offloadd-tcp" : "offloadd");
  quota.SetMaxThreads(tcp ? std::max(2, options_.max_threads / 8) : options_.max_threads);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options_.max_streams_per_connection);
  // A port another process listens on is taken (gRPC sets SO_REUSEPORT by
  // default: a second offloadd given the same port shared it, the kernel
  // dealing each connection to either).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(
      GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
      static_cast<int>(absl::ToInt64Milliseconds(options_.handshake_timeout)));
  if (options_.idle_timeout > absl::ZeroDuration()) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                               static_cast<int>(absl::ToInt64Milliseconds(options_.idle_timeout)));
  }
  // (The unix socket's connections come from the acceptor: Adopt.)
  int selected_port = -1;
  const int chosen = tcp_port_.load();
  const int port = chosen >= 0 ? chosen : options_.tcp_port;  // the same one on a rebuild
  if (tcp) {
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), grpc::InsecureServerCredentials(),
                             &selected_port);
  }
  // (Synchronous services may serve several servers.)
  for (grpc::Service* service : services_) builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    return absl::UnavailableError(absl::StrCat("gRPC server failed to start",
                                               tcp ? absl::StrCat(" on 127.0.0.1:", port) : ""));
  }
  if (tcp && tcp_port_ < 0) tcp_port_ = selected_port;  // chosen once, then kept
  return server;
}

void GrpcServer::Keep() {
  const auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
  absl::MutexLock lock(&mu_);
  for (;;) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping), absl::Milliseconds(200));
    if (stopping_) return;
    if (!g_accept_failed.exchange(false, std::memory_order_acq_rel)) continue;
    const absl::Time failed = absl::Now();
    LogWarning(
        "gRPC stopped accepting connections (accept4 failed; at EMFILE gRPC 1.51 gives a "
        "listener up): rebuilding the listeners once %d descriptors are free",
        options_.reserved_descriptors);
    DescriptorUse use = CountDescriptors();
    while (use.free() < options_.reserved_descriptors) {
      mu_.AwaitWithTimeout(absl::Condition(&stopping), absl::Milliseconds(200));
      if (stopping_) return;
      use = CountDescriptors();
    }
    // Calls on the old server get a second to finish; then they are
    // cancelled (UNAVAILABLE) and their clients reconnect.
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      server_->Wait();
      server_.reset();
    }
    g_accept_failed.store(false, std::memory_order_release);  // the old listeners' last words
    absl::StatusOr<std::unique_ptr<grpc::Server>> built;
    while (!(built = Build(/*tcp=*/true)).ok()) {
      // (A port taken meanwhile, descriptors gone again.)
      LogError("rebuilding the gRPC listeners failed (retrying in a second): %s",
               built.status().ToString());
      mu_.AwaitWithTimeout(absl::Condition(&stopping), absl::Seconds(1));
      if (stopping_) return;
    }
    server_ = *std::move(built);
    if (options_.counters != nullptr) {
      options_.counters->listener_rebuilds.fetch_add(1, std::memory_order_relaxed);
    }
    LogInfo("gRPC listeners rebuilt %d ms after they stopped accepting (%d of %d descriptors open)",
            absl::ToInt64Milliseconds(absl::Now() - failed), use.open, use.limit);
  }
}

void GrpcServer::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  acceptor_.reset();  // no new connection
  if (keeper_.joinable()) keeper_.join();
  absl::MutexLock lock(&mu_);
  for (grpc::Server* server : {server_.get(), unix_server_.get()}) {
    if (server != nullptr) server->Shutdown(std::chrono::system_clock::now());
  }
  for (grpc::Server* server : {server_.get(), unix_server_.get()}) {
    if (server != nullptr) server->Wait();
  }
}

GrpcServer::~GrpcServer() { Shutdown(); }

}  // namespace offload
