#include "client/client.h"

#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/algorithm/container.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/host_memory.h"
#include "base/log.h"
#include "base/posix_error.h"
#include "base/span_maps.h"
#include "base/status_macros.h"
#include "base/unique_fd.h"
#include "grpcpp/grpcpp.h"
#include "ipc/arena_protocol.h"
#include "ipc/paths.h"
#include "ipc/request_ring.h"
#include "proto/convert.h"
#include "proto/offload.grpc.pb.h"

namespace offload {
namespace {

// Why nothing answered at `address` within `waited`, as far as a plain
// connection to a Unix socket tells: "is it running?" misleads where it is
// (a stopped or refusing offloadd, a socket this user may not use).
absl::Status NoAnswer(const std::string& address, absl::Duration waited) {
  if (!absl::StartsWith(address, "unix:")) {
    return absl::UnavailableError(absl::StrCat("no offloadd answers at ", address,
                                               " (is it running? start it with `offloadd`)"));
  }
  const std::string path = address.substr(5);
  // Not blocking: a full listen queue (offloadd stopped, with clients
  // still knocking) answers EAGAIN at once, where connect() would wait.
  UniqueFd probe(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  int err = EINVAL;
  if (probe.valid() && path.size() < sizeof(addr.sun_path)) {
    std::memcpy(addr.sun_path, path.data(), path.size());
    err = connect(probe.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0 ? 0
                                                                                            : errno;
  }
  const auto why = [&] {
    return std::string(PosixError(absl::StrCat("connect ", path), err).message());
  };
  if (err == 0 || err == EAGAIN) {
    return absl::UnavailableError(absl::StrCat(
        "offloadd's socket ", path,
        err == 0 ? " takes connections" : " has its queue of connections full",
        " but nothing answered within ", absl::FormatDuration(waited),
        ": offloadd serves only its owner and its server.socket_group's members (its log names "
        "a uid it refused), or it is stopped or too busy to answer"));
  }
  if (err == EACCES || err == EPERM) {
    return absl::PermissionDeniedError(
        absl::StrCat("offloadd's socket ", path, " is not this user's to connect to (", why(),
                     "): offloadd serves its owner and the members of its server.socket_group"));
  }
  return absl::UnavailableError(
      absl::StrCat("no offloadd listens on ", path, " (", why(), "): start it with `offloadd`"));
}

// The arena connections of this process's sessions: offloadd's sign that
// the trainer lives. A child forked from it (a data loader's worker)
// closes its copies at once (pthread_atfork), so that the connection
// closes when the trainer dies, not when the last child does. A slot is -1
// when free; lock-free, as the child's handler may take no lock.
constexpr int kForkSlots = 4096;
std::atomic<int> g_connections[kForkSlots];
std::once_flag g_connections_once;

void CloseConnectionsInChild() {
  for (std::atomic<int>& slot : g_connections) {
    const int fd = slot.exchange(-1, std::memory_order_relaxed);  // (none for a grandchild)
    if (fd >= 0) close(fd);
  }
}

// Its slot, or -1 where all are taken (that connection then stays open in
// children, as before).
int RegisterConnection(int fd) {
  std::call_once(g_connections_once, [] {
    for (std::atomic<int>& slot : g_connections) slot.store(-1);
    pthread_atfork(nullptr, nullptr, &CloseConnectionsInChild);
  });
  for (int i = 0; i < kForkSlots; ++i) {
    int free = -1;
    if (g_connections[i].compare_exchange_strong(free, fd)) return i;
  }
  return -1;
}

// Before the connection closes (its number may be another file's then).
void UnregisterConnection(int* slot) {
  if (*slot >= 0) g_connections[*slot].store(-1);
  *slot = -1;
}

absl::Status FromGrpc(const grpc::Status& s, absl::string_view call) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(call, ": ", s.error_message()));
}

// A region of the session's arena.
struct ArenaSpan {
  uint64_t offset = 0, bytes = 0;
};

// A gRPC answer's location as the request ring carries one (Session::Impl::
// View reads only that); its name travels beside it.
ring::Location FromWire(const v1::PartitionLocation& loc) {
  ring::Location l{};
  l.id = loc.partition_id();
  l.numel = loc.numel();
  l.step = loc.step();
  l.params_offset = loc.params().offset();
  l.params_bytes = loc.params().bytes();
  l.grads_offset = loc.grads().offset();
  l.grads_bytes = loc.grads().bytes();
  l.span_offset = loc.span().offset();
  l.span_bytes = loc.span().bytes();
  l.master_init_offset = loc.master_init().offset();
  l.master_init_bytes = loc.master_init().bytes();
  l.param_dtype = static_cast<uint32_t>(loc.param_dtype());
  l.grad_dtype = static_cast<uint32_t>(loc.grad_dtype());
  l.restored = loc.restored() ? 1 : 0;
  l.huge_pages = loc.huge_pages() ? 1 : 0;
  return l;
}

Tunable FromProto(const v1::Tunable& t) {
  return Tunable{t.name(), t.type(),        t.value(),  t.default_value(),
                 t.unit(), t.description(), t.dynamic()};
}

// `timeout` from now as gRPC takes deadlines: an infinite one is none (a
// sum of milliseconds would overflow and lie in the past).
std::chrono::system_clock::time_point DeadlineAfter(absl::Duration timeout) {
  return absl::ToChronoTime(absl::Now() + timeout);
}

struct Rpc {
  Rpc(absl::Duration timeout, const std::string& token) {
    context.set_deadline(DeadlineAfter(timeout));
    if (!token.empty()) context.AddMetadata(kTokenMetadataKey, token);
  }
  grpc::ClientContext context;
};

// INVALID_ARGUMENT, naming the field, outside [0, 100].
absl::Status ToProto(const Placement& p, v1::Placement* out) {
  const struct {
    const char* name;
    const std::optional<int>& value;
    void (v1::Placement::*set)(uint32_t);
  } fields[] = {
      {"params_host_percent", p.params_host_percent, &v1::Placement::set_params_host_percent},
      {"grads_host_percent", p.grads_host_percent, &v1::Placement::set_grads_host_percent},
      {"optimizer_state_host_percent", p.optimizer_state_host_percent,
       &v1::Placement::set_optimizer_state_host_percent},
  };
  for (const auto& f : fields) {
    if (!f.value.has_value()) continue;
    if (*f.value < 0 || *f.value > 100) {
      return absl::InvalidArgumentError(
          absl::StrCat("placement ", f.name, " must be 0 to 100, got ", *f.value));
    }
    (out->*f.set)(static_cast<uint32_t>(*f.value));
  }
  return absl::OkStatus();
}

std::vector<ring::Item> RingItems(absl::Span<const uint64_t> ids) {
  std::vector<ring::Item> items(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) items[i] = ring::Item{ids[i], 0, 0, 0};
  return items;
}

StepResult FromProto(const v1::StepResponse& r) {
  StepResult out;
  out.partitions_updated = r.partitions_updated();
  out.params_updated = r.params_updated();
  out.skipped = r.skipped();
  out.nonfinite_gradients = r.nonfinite_gradients();
  out.wall_us = r.wall_us();
  out.state_wait_us = r.state_wait_us();
  out.compute_us = r.compute_us();
  out.loss_scale = r.loss_scale();
  out.running = r.running();
  out.delayed_update = r.delayed_update();
  return out;
}

}  // namespace

struct Client::Impl {
  std::string address;
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::shared_ptr<v1::PartitionService::Stub> partitions;
  std::unique_ptr<v1::ConfigService::Stub> config;
  std::unique_ptr<v1::StatsService::Stub> stats;
};

struct Session::Impl {
  std::shared_ptr<v1::PartitionService::Stub> stub;
  absl::Duration timeout;
  std::string token;
  v1::SessionRef ref;
  UniqueFd arena;  // the session arena's memfd
  // Maps spans of `arena` (set with it).
  std::unique_ptr<SpanMaps> spans;
  uint64_t arena_capacity = 0;
  std::string auto_checkpoint_dir;
  std::string restored_from;
  std::vector<uint64_t> restorable_steps;
  UniqueFd connection;  // the arena channel; closing it abandons the session
  // The request ring (fetch, release, return without gRPC; with
  // ring_step_calls, the step, its pending gradients and waiting for it
  // too), if the daemon offers one and the client wants it.
  HostMemory ring_memory;
  std::unique_ptr<ring::Client> ring;
  bool ring_step_calls = false;
  bool ring_fetch_if_ready = false;  // its fetch takes kIfReady
  // The offloadd this session's shared memory came from went away (the
  // arena channel hung up) or closed the ring as it stopped. Its calls then
  // get a definite answer instead of UNAVAILABLE for ever (Orphaned): a
  // restarted offloadd's NOT_FOUND (the session is from before its
  // restart, naming its automatic checkpoint), or, where it kept the
  // session, FAILED_PRECONDITION saying to resume it (this object's
  // mappings are the previous offloadd's: views over them would be stale).
  std::atomic<bool> orphaned{false};
  // GpuTiers of this session alive (Session::Close refuses while any is);
  // shared with them, as one may outlive the Session.
  std::shared_ptr<std::atomic<int>> tiers = std::make_shared<std::atomic<int>>(0);

  // The process that opened the session: a child forked since (a data
  // loader's worker) neither closes it nor touches the keepalive thread,
  // which does not exist there.
  const pid_t owner = getpid();
  bool InOwner() const { return getpid() == owner; }

  // The keepalive (ClientOptions::keepalive): a thread that calls offloadd
  // every `period` until stopped (Close, the destructor: the call in flight
  // is cancelled), its offloadd is gone, or the session is (closed, expired,
  // or from before offloadd restarted: the trainer's own next call says so).
  std::unique_ptr<std::thread> keepalive;
  absl::Mutex keepalive_mu;
  bool keepalive_stop ABSL_GUARDED_BY(keepalive_mu) = false;
  grpc::ClientContext* keepalive_call ABSL_GUARDED_BY(keepalive_mu) = nullptr;
  ~Impl() {
    StopKeepalive();
    UnregisterConnection(&connection_slot);
  }
  int connection_slot = -1;  // RegisterConnection's
  void StartKeepalive(absl::Duration period) {
    keepalive = std::make_unique<std::thread>([this, period] {
      keepalive_mu.Lock();
      for (;;) {
        keepalive_mu.AwaitWithTimeout(absl::Condition(&keepalive_stop), period);
        if (keepalive_stop || ConnectionHungUp()) break;
        // Any call that names the session shows it alive; this one reads
        // nothing the daemon must lock for long.
        v1::GetPendingGradientsRequest req;
        *req.mutable_session() = ref;
        v1::GetPendingGradientsResponse resp;
        Rpc rpc(std::min(timeout, period), token);
        keepalive_call = &rpc.context;
        keepalive_mu.Unlock();
        const grpc::StatusCode code =
            stub->GetPendingGradients(&rpc.context, req, &resp).error_code();
        keepalive_mu.Lock();
        keepalive_call = nullptr;
        if (code == grpc::StatusCode::NOT_FOUND || code == grpc::StatusCode::FAILED_PRECONDITION ||
            code == grpc::StatusCode::PERMISSION_DENIED) {
          break;  // the session is gone: nothing left to keep alive
        }
      }
      keepalive_mu.Unlock();
    });
  }
  // Safe from several threads at once, and from a forked child (which
  // leaves the thread object alone).
  void StopKeepalive() {
    if (!InOwner()) {
      // (Not even its lock: the parent's thread may have held it at the fork.)
      (void)keepalive.release();  // the child has no such thread: never joined
      return;
    }
    std::unique_ptr<std::thread> thread;
    {
      absl::MutexLock lock(&keepalive_mu);
      keepalive_stop = true;
      if (keepalive_call != nullptr) keepalive_call->TryCancel();
      thread = std::move(keepalive);
    }
    if (thread != nullptr && thread->joinable()) thread->join();
  }

  bool UseRing(size_t items) const { return ring != nullptr && items <= ring::kMaxItems; }
  ring::Client::Answer RingCall(ring::Op op, uint32_t flags, absl::Span<const ring::Item> items,
                                absl::Duration timeout) {
    return Orphaning(ring->Call(op, flags, items, timeout));
  }
  // A call whose request is a message's bytes (ring::kStep).
  ring::Client::Answer RingCall(ring::Op op, absl::string_view request, absl::Duration timeout) {
    return Orphaning(ring->Call(op, request, timeout));
  }
  // A call's answer, the session marked orphaned where it says the daemon
  // went.
  ring::Client::Answer Orphaning(ring::Client::Answer answer) {
    if (absl::IsUnavailable(answer.status) && (ConnectionHungUp() || RingClosed())) {
      orphaned.store(true);
    }
    return answer;
  }
  // Whether the step's calls go through the mailbox (the daemon serves them).
  bool UseRingForStep() const { return ring != nullptr && ring_step_calls; }
  // A step call through the mailbox: `request` a message's bytes (none for
  // ring::kPendingGradients and ring::kWaitStep), its answer a response
  // message.
  absl::Status RingMessage(ring::Op op, absl::string_view request,
                           google::protobuf::MessageLite* out) {
    ring::Client::Answer answer = RingCall(op, request, timeout);
    RETURN_IF_ERROR(answer.status);
    if (!out->ParseFromString(answer.payload)) {
      return absl::InternalError(absl::StrCat("the daemon's answer to request ring op ", op,
                                              " is not its message (", answer.payload.size(),
                                              " bytes)"));
    }
    return absl::OkStatus();
  }
  bool ConnectionHungUp() const {
    pollfd p{connection.get(), POLLRDHUP, 0};
    return poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0;
  }
  bool RingClosed() const {
    const auto* layout = reinterpret_cast<const ring::Layout*>(ring_memory.data());
    return layout != nullptr && layout->state.load() == ring::kClosed;
  }
  // Orphaned, before a call over gRPC: a connection the daemon hung up
  // makes this Session orphaned first. (The ring's calls find that out
  // from their answer; gRPC's would be served by the next offloadd, which
  // kept the session, while this object maps its memory through the
  // previous one's.)
  absl::Status OrphanedBeforeGrpc() {
    if (!orphaned.load() && ConnectionHungUp()) orphaned.store(true);
    return Orphaned();
  }
  // OK while this session is served by the offloadd it came from; else the
  // definite answer (see orphaned).
  absl::Status Orphaned() {
    if (!orphaned.load()) return absl::OkStatus();
    v1::GetPendingGradientsRequest req;
    *req.mutable_session() = ref;
    v1::GetPendingGradientsResponse resp;
    Rpc rpc(timeout, token);
    absl::Status probe =
        FromGrpc(stub->GetPendingGradients(&rpc.context, req, &resp), "GetPendingGradients");
    if (!probe.ok()) return probe;
    return absl::FailedPreconditionError(absl::StrCat(
        "offloadd restarted and kept session ", ref.session_id(),
        ", but this Session object's shared memory is the previous offloadd's: take the session "
        "back with Client::ResumeSession(id, token) and use the Session it returns"));
  }

  absl::Mutex mu;
  // Partition names (the ring's answers carry none).
  absl::flat_hash_map<uint64_t, std::string> names ABSL_GUARDED_BY(mu);
  bool closed ABSL_GUARDED_BY(mu) = false;
  bool closing ABSL_GUARDED_BY(mu) = false;  // a Close's call under way
  // Each partition's span (params, grads, the second working-copy buffer),
  // mapped the first time the daemon names it: address space only for what
  // the session holds, small spans as views of their arena window's
  // mapping (SpanMaps: mappings per window, not per partition, as in the
  // daemon). A partition's span never moves (its params may move inside
  // it), so its mapping stays valid as long as the Session. Kept with the
  // arena offset it starts at.
  struct Mapped {
    uint64_t begin = 0;
    MappedSpan memory;
    // After `memory`: unregistered before it is unmapped. The regions
    // registered for DMA, by arena offset: the working copy the daemon
    // named (each of the delayed update's two buffers once it is named)
    // and the gradient buffer. Never the whole span: a registration pins
    // pages, and the daemon discards the second buffer's pages when the
    // delayed update switches on (Swapper::Add), which would leave the
    // device reading the pinned, orphaned ones.
    struct Registered {
      uint64_t offset = 0;
      bool params = false;  // a working-copy buffer (dropped by SetDelayedUpdate)
      gpu::HostRegistration registration;
    };
    std::vector<Registered> dma;
    // Offsets of regions the device refused: not asked again (each ask a
    // driver call under the session's lock, on every fetch naming it).
    std::vector<uint64_t> refused;
  };
  absl::flat_hash_map<uint64_t, Mapped> regions ABSL_GUARDED_BY(mu);
  // Set by EnableDma: regions are registered with it as they are named.
  gpu::Device* dma_device ABSL_GUARDED_BY(mu) = nullptr;
  Session::DmaStats dma_stats ABSL_GUARDED_BY(mu);

  // Registers `r` (a region of `m`) with dma_device, once; a refusal is
  // counted, warned of once, and leaves it unregistered. Whether it is
  // registered.
  bool RegisterForDma(Mapped& m, const ArenaSpan& r, bool params)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (dma_device == nullptr || r.bytes == 0) return false;
    for (const Mapped::Registered& x : m.dma) {
      if (x.offset == r.offset) return true;
    }
    if (absl::c_linear_search(m.refused, r.offset)) return false;
    const absl::Time start = absl::Now();
    absl::StatusOr<gpu::HostRegistration> reg =
        dma_device->RegisterHost(m.memory.data() + (r.offset - m.begin), r.bytes);
    dma_stats.register_us += absl::ToInt64Microseconds(absl::Now() - start);
    if (reg.ok()) {
      m.dma.push_back({r.offset, params, *std::move(reg)});
      ++dma_stats.regions;
      dma_stats.bytes += r.bytes;
      return true;
    }
    m.refused.push_back(r.offset);
    if (dma_stats.failed_regions++ == 0) {
      LogWarning(
          "registering the session's arena with %s for DMA failed (%s); its copies go "
          "through a staging buffer instead, slower (counted in "
          "dma_stats().failed_regions)",
          dma_device->name(), reg.status().ToString());
    }
    return false;
  }

  // A partition's view from where the daemon placed it (a request ring's
  // answer as it is; a gRPC one through FromWire): the one location type on
  // this side of the process boundary. `name` empty: the one it had.
  absl::StatusOr<PartitionView> View(const ring::Location& l, absl::string_view name) {
    const ArenaSpan params{l.params_offset, l.params_bytes}, grads{l.grads_offset, l.grads_bytes},
        master_init{l.master_init_offset, l.master_init_bytes}, span{l.span_offset, l.span_bytes};
    for (const ArenaSpan& r : {params, grads, master_init, span}) {
      if (r.offset > arena_capacity || r.bytes > arena_capacity - r.offset) {
        return absl::InternalError(
            absl::StrCat("daemon placed partition ", l.id, " outside its arena"));
      }
    }
    // The partition's whole span (its params may move inside it).
    const uint64_t page = PageSize();
    const uint64_t begin = span.offset / page * page;
    const uint64_t end = span.offset + span.bytes;
    if (span.bytes == 0) {
      return absl::InternalError(absl::StrCat("daemon named no span for partition ", l.id));
    }
    PartitionView v;
    v.id = l.id;
    v.numel = l.numel;
    ASSIGN_OR_RETURN(v.param_dtype, FromProto(static_cast<v1::DType>(l.param_dtype),
                                              "param_dtype from the daemon"));
    ASSIGN_OR_RETURN(v.grad_dtype,
                     FromProto(static_cast<v1::DType>(l.grad_dtype), "grad_dtype from the daemon"));
    v.step = l.step;
    v.restored = l.restored != 0;
    std::byte* base;
    {
      absl::MutexLock lock(&mu);
      auto it = regions.find(l.id);
      if (it == regions.end()) {
        absl::StatusOr<MappedSpan> region =
            spans->Map(begin, end - begin, l.huge_pages != 0 ? Pages::kHuge : Pages::kSmall);
        if (!region.ok()) {
          return absl::Status(region.status().code(), absl::StrCat("mapping partition ", l.id, ": ",
                                                                   region.status().message()));
        }
        it = regions.emplace(l.id, Mapped{begin, *std::move(region), {}, {}}).first;
      }
      Mapped& m = it->second;
      for (const ArenaSpan& r : {params, grads, master_init}) {
        if (r.bytes != 0 &&
            (r.offset < m.begin || r.offset + r.bytes > m.begin + m.memory.size())) {
          return absl::InternalError(
              absl::StrCat("daemon placed partition ", l.id, " outside its mapped span"));
        }
      }
      // Both, so that neither is left half registered by a refusal.
      const bool params_dma = RegisterForDma(m, params, /*params=*/true);
      const bool grads_dma = RegisterForDma(m, grads, /*params=*/false);
      v.dma = params_dma && (grads_dma || grads.bytes == 0);
      base = m.memory.data() - m.begin;
      v.memory = m.memory.mapping();
      if (!name.empty()) {
        names.try_emplace(l.id, std::string(name));
        v.name = std::string(name);
      } else if (auto known = names.find(l.id); known != names.end()) {
        v.name = known->second;
      }
    }
    v.params = base + params.offset;
    v.grads = base + grads.offset;
    if (master_init.bytes != 0) v.master_init = reinterpret_cast<float*>(base + master_init.offset);
    return v;
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

const std::string& Client::address() const { return impl_->address; }

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->address = options.address.empty() ? DefaultClientAddress() : options.address;
  if (impl->options.token.empty()) {
    if (const char* token = std::getenv("OFFLOADD_TOKEN")) impl->options.token = token;
  }
  if (absl::StartsWith(impl->address, "unix:")) {
    const std::string path = impl->address.substr(5);
    if (access(path.c_str(), F_OK) != 0) {
      if (errno == EACCES) {
        // Its directory is not this user's to search: a service's socket
        // is its group's (server.socket_group).
        return absl::PermissionDeniedError(absl::StrCat(
            "offloadd's socket ", path,
            " is not reachable by this user (permission denied on its directory): offloadd "
            "serves the owner and the members of its server.socket_group (the packaged "
            "service: group offloadd; `sudo usermod -aG offloadd $USER`, then log in again)"));
      }
      return absl::UnavailableError(absl::StrCat("no offloadd socket at ", path,
                                                 " (is it running? start it with `offloadd`)"));
    }
  }
  grpc::ChannelArguments args;
  // A connection of its own: channels to one address otherwise share the
  // process's, and a Client made after offloadd restarted would inherit the
  // dead daemon's (its first call failing UNAVAILABLE, "Broken pipe").
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // A fetch of every partition of a session with tens of thousands of them
  // answers more than gRPC's default 4 MiB.
  args.SetMaxReceiveMessageSize(256 << 20);
  impl->channel =
      grpc::CreateCustomChannel(impl->address, grpc::InsecureChannelCredentials(), args);
  if (!impl->channel->WaitForConnected(DeadlineAfter(options.connect_timeout))) {
    return NoAnswer(impl->address, options.connect_timeout);
  }
  impl->partitions = v1::PartitionService::NewStub(impl->channel);
  impl->config = v1::ConfigService::NewStub(impl->channel);
  impl->stats = v1::StatsService::NewStub(impl->channel);
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<Session>> Client::OpenSession(const std::string& name,
                                                             const SessionOptions& options) {
  v1::OpenSessionRequest req;
  req.set_name(name);
  RETURN_IF_ERROR(ToProto(options.placement, req.mutable_placement()));
  if (options.loss_scaling.has_value()) {
    const LossScaling& l = *options.loss_scaling;
    v1::LossScaling* out = req.mutable_loss_scaling();
    if (l.initial_scale) out->set_initial_scale(*l.initial_scale);
    if (l.growth_interval) out->set_growth_interval(*l.growth_interval);
    if (l.growth_factor) out->set_growth_factor(*l.growth_factor);
    if (l.backoff_factor) out->set_backoff_factor(*l.backoff_factor);
    if (l.hysteresis) out->set_hysteresis(*l.hysteresis);
    if (l.min_scale) out->set_min_scale(*l.min_scale);
  }
  req.set_restore_from(options.restore_from);
  req.set_resume_lost(options.resume_lost);
  if (options.restore_steps.has_value()) req.set_restore_steps(*options.restore_steps);
  req.set_keep_for_resume(options.keep_for_resume);
  req.set_share_weight(options.share_weight);
  if (options.delayed_update_after_steps.has_value()) {
    req.set_delayed_update_after_steps(*options.delayed_update_after_steps);
  }
  v1::OpenSessionResponse resp;
  Rpc rpc(impl_->options.call_timeout, impl_->options.token);
  RETURN_IF_ERROR(
      FromGrpc(impl_->partitions->OpenSession(&rpc.context, req, &resp), "OpenSession"));
  return Attach(resp, /*close_on_failure=*/true);
}

absl::StatusOr<std::unique_ptr<Session>> Client::ResumeSession(uint64_t session_id,
                                                               const std::string& token) {
  v1::ResumeSessionRequest req;
  req.mutable_session()->set_session_id(session_id);
  req.mutable_session()->set_token(token);
  v1::OpenSessionResponse resp;
  Rpc rpc(impl_->options.call_timeout, impl_->options.token);
  RETURN_IF_ERROR(
      FromGrpc(impl_->partitions->ResumeSession(&rpc.context, req, &resp), "ResumeSession"));
  return Attach(resp, /*close_on_failure=*/false);
}

absl::StatusOr<std::unique_ptr<Session>> Client::Attach(const v1::OpenSessionResponse& resp,
                                                        bool close_on_failure) {
  auto session = std::make_unique<Session::Impl>();
  session->stub = impl_->partitions;
  session->timeout = impl_->options.call_timeout;
  session->token = impl_->options.token;
  session->ref = resp.session();
  // Wrap now, so that a failure below closes a new session on the daemon
  // (a resumed one stays for the caller to try again).
  std::unique_ptr<Session> out(new Session(std::move(session)));
  Session::Impl& s = *out->impl_;
  absl::StatusOr<Attachment> attachment = AttachArena(
      resp.arena_socket(), AttachRequest{resp.session().session_id(), resp.session().token()});
  if (!attachment.ok()) {
    if (!close_on_failure) {
      absl::MutexLock lock(&s.mu);
      s.closed = true;  // nothing to close from here
    }
    return attachment.status();
  }
  Attachment attached = *std::move(attachment);
  // Held open for the session's life: if this process dies, the daemon
  // sees the connection close and frees the session.
  s.connection = std::move(attached.connection);
  s.connection_slot = RegisterConnection(s.connection.get());
  s.arena = std::move(attached.arena);
  s.spans = std::make_unique<SpanMaps>(
      [fd = s.arena.get()](uint64_t offset, uint64_t bytes, Pages pages) {
        return HostMemory::MapShared(fd, offset, bytes, pages);
      });
  s.arena_capacity = resp.arena_capacity();
  s.auto_checkpoint_dir = resp.auto_checkpoint_dir();
  s.restored_from = resp.restored_from();
  s.restorable_steps.assign(resp.restorable_steps().begin(), resp.restorable_steps().end());
  const v1::Region& r = resp.request_ring();
  if (impl_->options.request_ring && r.bytes() == ring::RingBytes() &&
      r.offset() <= s.arena_capacity - r.bytes()) {
    absl::StatusOr<HostMemory> mapped =
        HostMemory::MapShared(s.arena.get(), r.offset(), r.bytes(), Pages::kSmall);
    if (mapped.ok()) {
      auto* layout = reinterpret_cast<ring::Layout*>(mapped->data());
      if (layout->magic == ring::kMagic && layout->version == ring::kVersion) {
        s.ring_memory = *std::move(mapped);
        s.ring = std::make_unique<ring::Client>(layout, s.connection.get(),
                                                impl_->options.request_ring_spin);
        s.ring_step_calls = (layout->features & ring::kStepCalls) != 0;
        s.ring_fetch_if_ready = (layout->features & ring::kFetchIfReady) != 0;
      }
    }
  }
  if (impl_->options.keepalive && resp.idle_lease_seconds() > 0) {
    s.StartKeepalive(
        std::max(absl::Seconds(resp.idle_lease_seconds()) / 4, absl::Milliseconds(100)));
  }
  return out;
}

absl::StatusOr<std::vector<Tunable>> Client::ListTunables() {
  v1::ListTunablesResponse resp;
  Rpc rpc(impl_->options.call_timeout, impl_->options.token);
  RETURN_IF_ERROR(FromGrpc(impl_->config->ListTunables(&rpc.context, {}, &resp), "ListTunables"));
  std::vector<Tunable> out;
  for (const v1::Tunable& t : resp.tunables()) out.push_back(FromProto(t));
  return out;
}

absl::StatusOr<Tunable> Client::GetTunable(const std::string& name) {
  v1::GetTunableRequest req;
  req.set_name(name);
  v1::Tunable resp;
  Rpc rpc(impl_->options.call_timeout, impl_->options.token);
  RETURN_IF_ERROR(FromGrpc(impl_->config->GetTunable(&rpc.context, req, &resp), "GetTunable"));
  return FromProto(resp);
}

absl::StatusOr<Tunable> Client::SetTunable(const std::string& name, const std::string& value) {
  v1::SetTunableRequest req;
  req.set_name(name);
  req.set_value(value);
  v1::Tunable resp;
  Rpc rpc(impl_->options.call_timeout, impl_->options.token);
  RETURN_IF_ERROR(FromGrpc(impl_->config->SetTunable(&rpc.context, req, &resp), "SetTunable"));
  return FromProto(resp);
}

absl::StatusOr<DaemonStats> Client::GetStats() {
  v1::GetStatsResponse resp;
  Rpc rpc(impl_->options.call_timeout, impl_->options.token);
  RETURN_IF_ERROR(FromGrpc(impl_->stats->GetStats(&rpc.context, {}, &resp), "GetStats"));
  DaemonStats out;
  out.version = resp.version();
  out.pid = resp.pid();
  out.uptime_ms = resp.uptime_ms();
  out.listening.assign(resp.listening().begin(), resp.listening().end());
  out.optimizer = resp.optimizer_kernel();
  for (const auto& t : resp.tiers())
    out.tiers.push_back({t.name(), t.used_bytes(), t.budget_bytes()});
  for (const auto& c : resp.counters()) out.counters.push_back({c.name(), c.value(), c.unit()});
  for (const auto& s : resp.sessions()) {
    out.sessions.push_back({s.session_id(), s.name(), s.partitions(), s.arena_bytes(), s.steps(),
                            s.held(), s.params_host_bytes(), s.params_nvme_bytes(),
                            s.grads_host_bytes(), s.grads_nvme_bytes(), s.state_host_bytes(),
                            s.state_nvme_bytes(), std::nullopt});
    out.sessions.back().step_wall_nanos = s.step_wall_nanos();
    out.sessions.back().step_wait_nanos = s.step_wait_nanos();
    out.sessions.back().step_compute_nanos = s.step_compute_nanos();
    out.sessions.back().share_weight = s.share_weight();
    out.sessions.back().optimizer_params = s.optimizer_params();
    out.sessions.back().optimizer_queued_nanos = s.optimizer_queued_nanos();
    out.sessions.back().nvme_read_bytes = s.nvme_read_bytes();
    out.sessions.back().nvme_write_bytes = s.nvme_write_bytes();
    out.sessions.back().io_queued_nanos = s.io_queued_nanos();
    out.sessions.back().pool_room_bytes = s.pool_room_bytes();
    out.sessions.back().pool_evictions = s.pool_evictions();
    out.sessions.back().detached_seconds = s.has_detached_seconds() ? s.detached_seconds() : -1;
    if (s.has_gpu()) {
      const v1::GpuTierCounters& g = s.gpu();
      out.sessions.back().gpu = GpuTierCounters{
          g.h2d_bytes(),      g.h2d_staged_bytes(), g.d2h_bytes(),  g.tensor_uses(),
          g.resident_hits(),  g.prefetch_hits(),    g.host_waits(), g.evictions(),
          g.resident_bytes(), g.budget_bytes(),     g.dma_bytes(),  g.prefetch_depth(),
          g.prefetch_bytes()};
    }
  }
  return out;
}

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Session::~Session() {
  if (!impl_->InOwner()) {
    // A forked child's copy: the session, its threads, its gRPC channel and
    // DMA registrations are its parent's; left alone, not even destroyed.
    (void)impl_.release();
    return;
  }
  impl_->StopKeepalive();
  // Closed, best effort, unless the offloadd it attached to is gone (its
  // arena connection hung up): whatever listens at the address now may be a
  // restarted offloadd keeping this session for a trainer to resume, maybe
  // through another Session object.
  if (impl_->connection.valid()) {
    if (impl_->ConnectionHungUp()) return;
  }
  // Not Close(): a Session destroyed without it did not finish its job (an
  // exception unwinding, a process on its way out after a failure), and one
  // kept for a resume leaves its automatic checkpoints.
  Close(/*finished=*/false).IgnoreError();
}

uint64_t Session::id() const { return impl_->ref.session_id(); }

absl::Status Session::EnableDma(gpu::Device* device) {
  if (device == nullptr) return absl::InvalidArgumentError("EnableDma: no device");
  absl::MutexLock lock(&impl_->mu);
  if (impl_->dma_device != nullptr && impl_->dma_device != device) {
    return absl::FailedPreconditionError("EnableDma: already enabled with another device");
  }
  impl_->dma_device = device;  // regions register as the daemon next names them
  return absl::OkStatus();
}

Session::DmaStats Session::dma_stats() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->dma_stats;
}

const std::string& Session::token() const { return impl_->ref.token(); }
const std::string& Session::auto_checkpoint_dir() const { return impl_->auto_checkpoint_dir; }
const std::string& Session::restored_from() const { return impl_->restored_from; }
const std::vector<uint64_t>& Session::restorable_steps() const { return impl_->restorable_steps; }

bool Session::FetchesIfReady(size_t partitions) const {
  return impl_->UseRing(partitions) && impl_->ring_fetch_if_ready;
}

bool IsNotReady(const absl::Status& s) { return ring::IsNotReady(s); }

absl::StatusOr<PartitionView> Session::Register(const std::string& name, uint64_t numel,
                                                DType param_dtype, DType grad_dtype,
                                                bool fp32_master,
                                                const std::optional<TensorSlice>& slice) {
  RETURN_IF_ERROR(impl_->OrphanedBeforeGrpc());
  v1::RegisterPartitionRequest req;
  *req.mutable_session() = impl_->ref;
  req.set_name(name);
  req.set_numel(numel);
  req.set_param_dtype(ToProto(param_dtype));
  req.set_grad_dtype(ToProto(grad_dtype));
  req.set_fp32_master(fp32_master);
  if (slice.has_value()) {
    req.mutable_slice()->set_tensor(slice->tensor);
    for (uint64_t d : slice->shape) req.mutable_slice()->add_shape(d);
    req.mutable_slice()->set_offset(slice->offset);
  }
  v1::RegisterPartitionResponse resp;
  Rpc rpc(impl_->timeout, impl_->token);
  RETURN_IF_ERROR(
      FromGrpc(impl_->stub->RegisterPartition(&rpc.context, req, &resp), "RegisterPartition"));
  return impl_->View(FromWire(resp.location()), resp.location().name());
}

absl::StatusOr<std::vector<PartitionView>> Session::Fetch(absl::Span<const uint64_t> ids,
                                                          const FetchOptions& options) {
  RETURN_IF_ERROR(impl_->Orphaned());
  if (impl_->UseRing(ids.size()) && !ids.empty() && !options.load) {
    const uint32_t flags = (options.grads ? ring::kGrads : 0u) |
                           (options.writable ? ring::kWritable : 0u) |
                           (options.if_ready ? ring::kIfReady : 0u);
    ring::Client::Answer answer =
        impl_->RingCall(ring::kFetch, flags, RingItems(ids), impl_->timeout);
    RETURN_IF_ERROR(answer.status);
    std::vector<PartitionView> out;
    out.reserve(answer.locations.size());
    for (const ring::Location& l : answer.locations) {
      ASSIGN_OR_RETURN(PartitionView v, impl_->View(l, ""));
      out.push_back(std::move(v));
    }
    return out;
  }
  RETURN_IF_ERROR(impl_->OrphanedBeforeGrpc());
  v1::FetchParamsRequest req;
  *req.mutable_session() = impl_->ref;
  for (uint64_t id : ids) req.add_partition_ids(id);
  req.set_grads(options.grads);
  req.set_writable(options.writable);
  req.set_load(options.load);
  req.set_if_ready(options.if_ready);
  v1::FetchParamsResponse resp;
  Rpc rpc(impl_->timeout, impl_->token);
  RETURN_IF_ERROR(FromGrpc(impl_->stub->FetchParams(&rpc.context, req, &resp), "FetchParams"));
  std::vector<PartitionView> out;
  for (const v1::PartitionLocation& loc : resp.locations()) {
    ASSIGN_OR_RETURN(PartitionView v, impl_->View(FromWire(loc), loc.name()));
    out.push_back(std::move(v));
  }
  return out;
}

absl::StatusOr<PartitionView> Session::Fetch(uint64_t partition_id, const FetchOptions& options) {
  ASSIGN_OR_RETURN(std::vector<PartitionView> views,
                   Fetch(absl::MakeConstSpan(&partition_id, 1), options));
  if (views.size() != 1) return absl::InternalError("FetchParams returned no location");
  return std::move(views[0]);
}

absl::Status Session::Release(const PartitionView& p) {
  return Release(absl::MakeConstSpan(&p.id, 1));
}

absl::Status Session::Release(absl::Span<const uint64_t> ids) {
  RETURN_IF_ERROR(impl_->Orphaned());
  if (impl_->UseRing(ids.size())) {
    return impl_->RingCall(ring::kRelease, 0, RingItems(ids), impl_->timeout).status;
  }
  RETURN_IF_ERROR(impl_->OrphanedBeforeGrpc());
  v1::ReleasePartitionsRequest req;
  *req.mutable_session() = impl_->ref;
  for (uint64_t id : ids) req.add_partition_ids(id);
  v1::ReleasePartitionsResponse resp;
  Rpc rpc(impl_->timeout, impl_->token);
  return FromGrpc(impl_->stub->ReleasePartitions(&rpc.context, req, &resp), "ReleasePartitions");
}

absl::Status Session::ReturnGradients(const PartitionView& p) {
  return ReturnGradients(absl::MakeConstSpan(&p, 1));
}

absl::Status Session::ReturnGradients(absl::Span<const PartitionView> parts, bool release,
                                      bool hand_over) {
  return ReturnGradients(parts, release, hand_over, {});
}

absl::Status Session::HandOverGradients(absl::Span<const PartitionView> parts,
                                        absl::Span<const GradientStats> stats, bool release) {
  if (stats.size() != parts.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "HandOverGradients: ", stats.size(), " statistics for ", parts.size(), " partitions"));
  }
  return ReturnGradients(parts, release, /*hand_over=*/true, stats);
}

absl::Status Session::ReturnGradients(absl::Span<const PartitionView> parts, bool release,
                                      bool hand_over, absl::Span<const GradientStats> stats) {
  RETURN_IF_ERROR(impl_->Orphaned());
  if (impl_->UseRing(parts.size())) {
    std::vector<ring::Item> items(parts.size());
    for (size_t i = 0; i < parts.size(); ++i) {
      items[i] =
          ring::Item{parts[i].id, parts[i].numel, static_cast<uint32_t>(parts[i].grad_dtype), 0};
      if (!stats.empty()) {
        items[i].flags = ring::kItemStats;
        items[i].sq_norm = stats[i].sq_norm;
        items[i].nonfinite = stats[i].nonfinite;
      }
    }
    return impl_
        ->RingCall(ring::kReturnGradients,
                   (release ? ring::kThenRelease : 0u) | (hand_over ? ring::kHandOver : 0u), items,
                   impl_->timeout)
        .status;
  }
  RETURN_IF_ERROR(impl_->OrphanedBeforeGrpc());
  v1::ReturnGradientsRequest req;
  *req.mutable_session() = impl_->ref;
  for (size_t i = 0; i < parts.size(); ++i) {
    v1::GradientBuffer* item = req.add_partitions();
    item->set_partition_id(parts[i].id);
    item->set_numel(parts[i].numel);
    item->set_grad_dtype(ToProto(parts[i].grad_dtype));
    if (!stats.empty()) {
      item->mutable_stats()->set_sq_norm(stats[i].sq_norm);
      item->mutable_stats()->set_nonfinite(stats[i].nonfinite);
    }
  }
  req.set_release(release);
  req.set_hand_over(hand_over);
  v1::ReturnGradientsResponse resp;
  Rpc rpc(impl_->timeout, impl_->token);
  return FromGrpc(impl_->stub->ReturnGradients(&rpc.context, req, &resp), "ReturnGradients");
}

absl::StatusOr<PendingGradients> Session::GetPendingGradients() {
  // (A stale Session object is told so, as its partition calls are: the
  // GPU tier's guard asks this when one of its calls finds offloadd gone.)
  RETURN_IF_ERROR(impl_->Orphaned());
  v1::GetPendingGradientsResponse resp;
  if (impl_->UseRingForStep()) {
    // A call a step: through the mailbox, the same message as gRPC's.
    RETURN_IF_ERROR(impl_->RingMessage(ring::kPendingGradients, {}, &resp));
  } else {
    RETURN_IF_ERROR(impl_->OrphanedBeforeGrpc());
    v1::GetPendingGradientsRequest req;
    *req.mutable_session() = impl_->ref;
    Rpc rpc(impl_->timeout, impl_->token);
    RETURN_IF_ERROR(FromGrpc(impl_->stub->GetPendingGradients(&rpc.context, req, &resp),
                             "GetPendingGradients"));
  }
  return PendingGradients{
      resp.sq_norm(),    resp.nonfinite(),      resp.partitions(),         resp.micro_batches(),
      resp.loss_scale(), resp.delayed_update(), resp.auto_checkpoint_due()};
}

absl::StatusOr<StepResult> Session::Step(const AdamHyperparams& h, const StepOptions& options) {
  v1::StepRequest req;
  *req.mutable_session() = impl_->ref;
  req.set_skip(options.skip);
  req.set_overflow(options.overflow);
  req.set_overlap(options.overlap);
  if (options.auto_checkpoint.has_value()) req.set_auto_checkpoint(*options.auto_checkpoint);
  ToProto(h, req.mutable_hyperparams());
  for (const StepOptions::Group& g : options.groups) {
    v1::ParamGroup* out = req.add_groups();
    for (uint64_t id : g.partition_ids) out->add_partition_ids(id);
    ToProto(g.hyperparams, out->mutable_hyperparams(), /*with_grad_scale=*/false);  // the step's
  }
  v1::StepResponse resp;
  if (impl_->UseRingForStep() && req.ByteSizeLong() <= ring::kMaxRequestBytes) {
    RETURN_IF_ERROR(impl_->Orphaned());
    req.clear_session();  // (the mailbox is the session's)
    RETURN_IF_ERROR(impl_->RingMessage(ring::kStep, req.SerializeAsString(), &resp));
    return FromProto(resp);
  }
  RETURN_IF_ERROR(impl_->OrphanedBeforeGrpc());
  Rpc rpc(impl_->timeout, impl_->token);
  RETURN_IF_ERROR(FromGrpc(impl_->stub->Step(&rpc.context, req, &resp), "Step"));
  return FromProto(resp);
}

namespace {
// Elements of each moment one GetMoments carries (the daemon's limit), and
// one SetMoments (under the daemon's 4 MiB limit on what it receives).
constexpr uint64_t kMomentsPerCall = uint64_t{4} << 20;
constexpr uint64_t kMomentsPerWrite = uint64_t{384} << 10;
}  // namespace

absl::StatusOr<Session::Moments> Session::ReadMoments(uint64_t id, uint64_t begin, uint64_t count,
                                                      bool with_master) {
  Moments out;
  // Grown as the answers come (the daemon checks `count` against the
  // partition first: an absurd one allocates nothing).
  // (With the master, three arrays in the bytes of two.)
  const uint64_t per_call = with_master ? kMomentsPerCall * 2 / 3 : kMomentsPerCall;
  // At least one call (for no elements, the step count alone).
  uint64_t done = 0;
  do {
    const uint64_t n = std::min(count - done, per_call);
    v1::GetMomentsRequest req;
    *req.mutable_session() = impl_->ref;
    req.set_partition_id(id);
    req.set_begin(begin + done);
    req.set_count(n);
    req.set_with_master(with_master);
    v1::Moments resp;
    RETURN_IF_ERROR(impl_->OrphanedBeforeGrpc());  // (see Orphaned)
    Rpc rpc(impl_->timeout, impl_->token);
    RETURN_IF_ERROR(FromGrpc(impl_->stub->GetMoments(&rpc.context, req, &resp), "GetMoments"));
    if (resp.exp_avg().size() != n * sizeof(float) ||
        resp.exp_avg_sq().size() != n * sizeof(float)) {
      return absl::InternalError(absl::StrCat("GetMoments answered ", resp.exp_avg().size(),
                                              " and ", resp.exp_avg_sq().size(), " bytes for ", n,
                                              " elements"));
    }
    if (with_master && resp.master().size() != n * sizeof(float)) {
      return absl::InternalError(absl::StrCat("GetMoments answered ", resp.master().size(),
                                              " bytes of master weights for ", n,
                                              " elements (an older offloadd does not send them)"));
    }
    auto append = [n](std::vector<float>& to, const std::string& bytes) {
      const size_t at = to.size();
      to.resize(at + n);
      std::memcpy(to.data() + at, bytes.data(), n * sizeof(float));
    };
    append(out.exp_avg, resp.exp_avg());
    append(out.exp_avg_sq, resp.exp_avg_sq());
    if (with_master) append(out.master, resp.master());
    out.step = resp.step();
    done += n;
  } while (done < count);
  return out;
}

absl::Status Session::WriteMoments(uint64_t id, uint64_t step, uint64_t begin,
                                   absl::Span<const float> exp_avg,
                                   absl::Span<const float> exp_avg_sq) {
  if (exp_avg.size() != exp_avg_sq.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("exp_avg has ", exp_avg.size(), " elements, exp_avg_sq ", exp_avg_sq.size()));
  }
  // At least one call (for no elements, the step count alone).
  uint64_t done = 0;
  do {
    const uint64_t n = std::min<uint64_t>(exp_avg.size() - done, kMomentsPerWrite);
    v1::SetMomentsRequest req;
    *req.mutable_session() = impl_->ref;
    req.set_partition_id(id);
    req.set_begin(begin + done);
    v1::Moments* m = req.mutable_moments();
    m->set_step(step);
    m->set_exp_avg(exp_avg.data() + done, n * sizeof(float));
    m->set_exp_avg_sq(exp_avg_sq.data() + done, n * sizeof(float));
    v1::SetMomentsResponse resp;
    RETURN_IF_ERROR(impl_->OrphanedBeforeGrpc());  // (see Orphaned)
    Rpc rpc(impl_->timeout, impl_->token);
    RETURN_IF_ERROR(FromGrpc(impl_->stub->SetMoments(&rpc.context, req, &resp), "SetMoments"));
    done += n;
  } while (done < exp_avg.size());
  return absl::OkStatus();
}

absl::Status Session::SetDelayedUpdate(bool enabled) {
  v1::SetDelayedUpdateRequest req;
  *req.mutable_session() = impl_->ref;
  req.set_enabled(enabled);
  v1::SetDelayedUpdateResponse resp;
  RETURN_IF_ERROR(impl_->OrphanedBeforeGrpc());  // (see Orphaned)
  Rpc rpc(impl_->timeout, impl_->token);
  RETURN_IF_ERROR(
      FromGrpc(impl_->stub->SetDelayedUpdate(&rpc.context, req, &resp), "SetDelayedUpdate"));
  // The daemon added or removed second buffers, discarding their pages:
  // registrations of working copies may pin orphaned ones. They register
  // again when next named.
  absl::MutexLock lock(&impl_->mu);
  for (auto& [id, m] : impl_->regions) {
    // Kept first, dropped after (partition, not remove_if: the dropped ones
    // are still whole when counted).
    auto stale = std::partition(m.dma.begin(), m.dma.end(),
                                [](const Impl::Mapped::Registered& r) { return !r.params; });
    for (auto it = stale; it != m.dma.end(); ++it) {
      --impl_->dma_stats.regions;
      impl_->dma_stats.bytes -= it->registration.bytes();
    }
    m.dma.erase(stale, m.dma.end());
  }
  return absl::OkStatus();
}

absl::StatusOr<GpuTierNodeSettings> Session::ReportGpuTier(const GpuTierCounters& c) {
  v1::ReportGpuTierRequest req;
  *req.mutable_session() = impl_->ref;
  v1::GpuTierCounters* out = req.mutable_counters();
  out->set_h2d_bytes(c.h2d_bytes);
  out->set_h2d_staged_bytes(c.h2d_staged_bytes);
  out->set_d2h_bytes(c.d2h_bytes);
  out->set_tensor_uses(c.tensor_uses);
  out->set_resident_hits(c.resident_hits);
  out->set_prefetch_hits(c.prefetch_hits);
  out->set_host_waits(c.host_waits);
  out->set_evictions(c.evictions);
  out->set_resident_bytes(c.resident_bytes);
  out->set_budget_bytes(c.budget_bytes);
  out->set_dma_bytes(c.dma_bytes);
  out->set_prefetch_depth(c.prefetch_depth);
  out->set_prefetch_bytes(c.prefetch_bytes);
  v1::ReportGpuTierResponse resp;
  RETURN_IF_ERROR(impl_->OrphanedBeforeGrpc());  // (see Orphaned)
  // Short: the trainer's thread waits for it, and a report is never worth
  // more than a moment of training.
  Rpc rpc(std::min(impl_->timeout, absl::Seconds(1)), impl_->token);
  RETURN_IF_ERROR(FromGrpc(impl_->stub->ReportGpuTier(&rpc.context, req, &resp), "ReportGpuTier"));
  return GpuTierNodeSettings{resp.prefetch_depth(), resp.prefetch_bytes()};
}

absl::StatusOr<StepResult> Session::WaitStep() {
  RETURN_IF_ERROR(impl_->Orphaned());
  v1::StepResponse resp;
  if (impl_->UseRingForStep()) {
    RETURN_IF_ERROR(impl_->RingMessage(ring::kWaitStep, {}, &resp));
    return FromProto(resp);
  }
  v1::WaitStepRequest req;
  *req.mutable_session() = impl_->ref;
  RETURN_IF_ERROR(impl_->OrphanedBeforeGrpc());  // (see Orphaned)
  Rpc rpc(impl_->timeout, impl_->token);
  RETURN_IF_ERROR(FromGrpc(impl_->stub->WaitStep(&rpc.context, req, &resp), "WaitStep"));
  return FromProto(resp);
}

absl::Status Session::SetPlacement(const Placement& placement) {
  {
    absl::MutexLock lock(&impl_->mu);
    if (impl_->dma_device != nullptr && (placement.params_host_percent.value_or(100) < 100 ||
                                         placement.grads_host_percent.value_or(100) < 100)) {
      return absl::FailedPreconditionError(
          "SetPlacement: this session's arena is registered for DMA (EnableDma), which needs its "
          "params and grads wholly on the host; below 100% the daemon would remove pages the "
          "device copies from");
    }
  }
  v1::SetPlacementRequest req;
  *req.mutable_session() = impl_->ref;
  RETURN_IF_ERROR(ToProto(placement, req.mutable_placement()));
  v1::SetPlacementResponse resp;
  RETURN_IF_ERROR(impl_->OrphanedBeforeGrpc());  // (see Orphaned)
  Rpc rpc(impl_->timeout, impl_->token);
  return FromGrpc(impl_->stub->SetPlacement(&rpc.context, req, &resp), "SetPlacement");
}

namespace {

CheckpointResult FromProto(const v1::CheckpointResponse& r) {
  CheckpointResult out;
  out.manifest = r.manifest();
  out.partitions = r.partitions();
  out.bytes = r.bytes();
  out.steps = r.steps();
  out.pause_us = r.pause_us();
  out.wall_us = r.wall_us();
  out.running = r.running();
  return out;
}

}  // namespace

absl::StatusOr<CheckpointResult> Session::Checkpoint(const std::string& directory,
                                                     bool background) {
  v1::CheckpointRequest req;
  *req.mutable_session() = impl_->ref;
  req.set_directory(directory);
  req.set_background(background);
  v1::CheckpointResponse resp;
  RETURN_IF_ERROR(impl_->OrphanedBeforeGrpc());  // (see Orphaned)
  Rpc rpc(impl_->timeout, impl_->token);
  RETURN_IF_ERROR(FromGrpc(impl_->stub->Checkpoint(&rpc.context, req, &resp), "Checkpoint"));
  return FromProto(resp);
}

absl::StatusOr<CheckpointResult> Session::WaitCheckpoint() {
  v1::WaitCheckpointRequest req;
  *req.mutable_session() = impl_->ref;
  v1::CheckpointResponse resp;
  RETURN_IF_ERROR(impl_->OrphanedBeforeGrpc());  // (see Orphaned)
  Rpc rpc(impl_->timeout, impl_->token);
  RETURN_IF_ERROR(
      FromGrpc(impl_->stub->WaitCheckpoint(&rpc.context, req, &resp), "WaitCheckpoint"));
  return FromProto(resp);
}

absl::Status Session::Close(bool finished) {
  if (!impl_->InOwner()) {
    return absl::FailedPreconditionError(
        "this session belongs to the process that opened it, not to a child forked from it: "
        "close it there");
  }
  if (const int tiers = impl_->tiers->load(); tiers > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", impl_->ref.session_id(), " has ", tiers,
        " GpuTier(s) attached: destroy them first (their copies read and write its memory)"));
  }
  {
    // One close at a time: another waits for its outcome (closed, or not:
    // then it asks again itself).
    absl::MutexLock lock(&impl_->mu);
    impl_->mu.Await(absl::Condition(
        +[](Impl* i) ABSL_NO_THREAD_SAFETY_ANALYSIS { return !i->closing; }, impl_.get()));
    if (impl_->closed) return absl::OkStatus();
    impl_->closing = true;
  }
  v1::CloseSessionRequest req;
  *req.mutable_session() = impl_->ref;
  req.set_finished(finished);
  v1::CloseSessionResponse resp;
  Rpc rpc(absl::Seconds(10), impl_->token);
  absl::Status closed =
      FromGrpc(impl_->stub->CloseSession(&rpc.context, req, &resp), "CloseSession");
  if (absl::IsUnavailable(closed) || absl::IsDeadlineExceeded(closed) ||
      absl::IsResourceExhausted(closed)) {
    // Not closed (offloadd stopping, or too busy to answer): a retry asks
    // again, and the keepalive goes on meanwhile. Dropping the connection
    // now would tell offloadd the trainer went away, and a finished job's
    // session would be kept as unfinished.
    absl::MutexLock lock(&impl_->mu);
    impl_->closing = false;
    return closed;
  }
  impl_->StopKeepalive();
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->closed = true;
    impl_->closing = false;
  }
  UnregisterConnection(&impl_->connection_slot);
  impl_->connection.reset();
  // The partitions went with the session: their mappings go now, each
  // registration for DMA before its mapping, even while this object lives
  // on (a trainer's lingering references): pinned pages would otherwise
  // stay allocated after the daemon freed them, outside its pool.
  absl::MutexLock lock(&impl_->mu);
  impl_->regions.clear();
  impl_->dma_stats.regions = impl_->dma_stats.bytes = 0;
  return closed;
}

std::shared_ptr<std::atomic<int>> Session::TierCount() const { return impl_->tiers; }

absl::Status Client::SetShare(uint64_t session_id, uint32_t weight) {
  v1::SetShareRequest req;
  req.mutable_session()->set_session_id(session_id);  // no token: as the operator
  req.set_weight(weight);
  v1::SetShareResponse resp;
  Rpc rpc(impl_->options.call_timeout, impl_->options.token);
  return FromGrpc(impl_->partitions->SetShare(&rpc.context, req, &resp), "SetShare");
}

absl::Status Client::CloseUnattachedSession(uint64_t session_id) {
  v1::CloseSessionRequest req;
  req.mutable_session()->set_session_id(session_id);  // no token: as the operator
  v1::CloseSessionResponse resp;
  Rpc rpc(impl_->options.call_timeout, impl_->options.token);
  return FromGrpc(impl_->partitions->CloseSession(&rpc.context, req, &resp), "CloseSession");
}

absl::StatusOr<CheckpointResult> Client::CheckpointSession(uint64_t session_id,
                                                           const std::string& directory) {
  v1::CheckpointRequest req;
  req.mutable_session()->set_session_id(session_id);  // no token: as the operator
  req.set_directory(directory);
  v1::CheckpointResponse resp;
  Rpc rpc(impl_->options.call_timeout, impl_->options.token);
  RETURN_IF_ERROR(FromGrpc(impl_->partitions->Checkpoint(&rpc.context, req, &resp), "Checkpoint"));
  return FromProto(resp);
}

}  // namespace offload
