// The daemon's gRPC server on its unix socket (and 127.0.0.1:port), kept
// listening.
//
// The unix socket is accepted by offloadd (daemon/unix_acceptor), which
// knows each connection's user before gRPC gets it
// (grpc::AddInsecureChannelFromFd): another user's connections are bounded
// (`max_connections_per_user`), descriptors running short are kept for
// offloadd's own user, and accepting never stops for good.
// On TCP, gRPC 1.51 accepts itself and stops for good once accept4 fails
// with anything but EAGAIN, EINTR or ECONNABORTED (EMFILE: grpc#20418): the
// daemon runs on, deaf. GrpcServer watches gRPC's own log for that failure
// ("Failed accept4") and, once the process has `reserved_descriptors` free
// again, builds the server anew with the same services: calls still
// running on the old one end with UNAVAILABLE and clients reconnect by
// themselves. Connections that never start HTTP/2 are closed after
// `handshake_timeout`, those with no call after `idle_timeout`, so that
// silent ones give their descriptors back.
//
// gRPC's log goes through offloadd's (errors only, a repeated one once
// every 10 seconds with its count). One GrpcServer per process (gRPC's log
// hook is global). Thread-safe.
#ifndef OFFLOADD_DAEMON_GRPC_SERVER_H_
#define OFFLOADD_DAEMON_GRPC_SERVER_H_

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/unique_fd.h"
#include "daemon/unix_acceptor.h"
#include "grpcpp/grpcpp.h"

namespace offload {

struct GrpcServerOptions {
  std::string unix_path;  // created owner-only (0600)
  int tcp_port = -1;      // on 127.0.0.1; -1: none; 0: any free one
  int max_threads = 128;
  int max_streams_per_connection = 64;
  absl::Duration handshake_timeout = absl::Seconds(10);
  absl::Duration idle_timeout = absl::ZeroDuration();  // zero: kept
  int64_t reserved_descriptors = 64;
  // Members of this group may connect too (the socket is 0660, its group).
  std::optional<gid_t> group;
  // Connections one such member may hold at once on the unix socket; 0: no
  // bound.
  int64_t max_connections_per_user = 0;
  // Where the listeners count what they did with connections; outlives the
  // server; null: not counted.
  ConnectionCounters* counters = nullptr;
};

class GrpcServer {
 public:
  // `services` must outlive the server.
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(GrpcServerOptions options,
                                                           std::vector<grpc::Service*> services);
  ~GrpcServer();
  GrpcServer(const GrpcServer&) = delete;
  GrpcServer& operator=(const GrpcServer&) = delete;

  // The TCP port it listens on (chosen at start where options asked for
  // 0), or -1.
  int tcp_port() const { return tcp_port_.load(std::memory_order_relaxed); }
  // Stops accepting, cancels calls in flight, waits for them. Idempotent.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  GrpcServer(GrpcServerOptions options, std::vector<grpc::Service*> services);
  // A server of the services: on the TCP port (`tcp`), or on no port, for
  // the unix socket's connections (Adopt).
  absl::StatusOr<std::unique_ptr<grpc::Server>> Build(bool tcp);
  // The keeper thread: rebuilds after gRPC logged a failed accept.
  void Keep() ABSL_LOCKS_EXCLUDED(mu_);
  // A connection the acceptor took: the server's from now on.
  void Adopt(UniqueFd connection) ABSL_LOCKS_EXCLUDED(mu_);

  GrpcServerOptions options_;
  const std::vector<grpc::Service*> services_;
  std::atomic<int> tcp_port_{-1};
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<grpc::Server> server_ ABSL_GUARDED_BY(mu_);  // TCP's, rebuilt
  std::unique_ptr<grpc::Server> unix_server_;                  // set at Start, never rebuilt
  std::thread keeper_;
  std::unique_ptr<UnixAcceptor> acceptor_;  // set at Start, reset at Shutdown
};

}  // namespace offload

#endif  // OFFLOADD_DAEMON_GRPC_SERVER_H_
