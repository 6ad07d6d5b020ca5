// benches/stream_burst: what a burst of calls reset by their client (each
// started and cancelled at once: an RST_STREAM right behind its HEADERS,
// as a rapid-reset flood sends them) leaves in offloadd's resident memory,
// against its baseline measured in the same run.
//
//   bazel build -c opt //benches:stream_burst && bazel-bin/benches/stream_burst
//       [--streams=10000] [--connections=4] [--bursts=3] [--settle_seconds=15]
//       [--socket=PATH --pid=PID] [--tiny]
//
// A fresh offloadd (tests/daemon_process, its defaults), or the running one
// at --socket whose process is --pid; the baseline is its
// VmRSS once a client was served. Then, --bursts times: --streams GetStats
// calls spread over --connections connections to its Unix socket, written
// as raw HTTP/2, each reset (RST_STREAM) right behind its request; its
// VmRSS right after the burst, and --settle_seconds later (offloadd looks
// at its heap every 10 s and gives back what it hoards: the arena
// channel's sweep, TrimHeapIfHoarding). Prints what offloadd sent back (its
// HEADERS frames: each call it answered before the reset reached it sends
// one or two; the streams it reset itself; whether it ended a connection
// with GOAWAY), each VmRSS against the
// baseline, and the growth from the first burst to the last (what keeps
// growing, not what the first burst's threads took once).
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/unique_fd.h"
#include "benches/bench_util.h"
#include "grpcpp/grpcpp.h"
#include "ipc/unix_socket.h"
#include "proto/offload.grpc.pb.h"
#include "tests/daemon_process.h"

namespace offload {
namespace {

struct Flags {
  int64_t streams = 10000;
  int connections = 4;
  int bursts = 3;
  int settle_seconds = 15;  // the arena channel looks at the heap every 10 s
  std::string socket;       // a running offloadd's gRPC socket (with `pid`); empty: start one
  pid_t pid = 0;
};

double ResidentMb(pid_t pid) {
  const std::string line =
      bench::FirstLineWith(("/proc/" + std::to_string(pid) + "/status").c_str(), "VmRSS");
  long kb = 0;
  if (std::sscanf(line.c_str(), "VmRSS: %ld", &kb) != 1) return -1;
  return static_cast<double>(kb) / 1024.0;
}

// HTTP/2 by hand, so that each reset reaches offloadd (a gRPC client that
// cancels a call it just started sends nothing): per stream a HEADERS
// frame of a GetStats call, its request (an empty message, END_STREAM) and
// an RST_STREAM (CANCEL) right behind.
void Frame(std::string* out, uint8_t type, uint8_t flags, uint32_t stream,
           const std::string& payload) {
  const uint32_t n = static_cast<uint32_t>(payload.size());
  const char head[9] = {static_cast<char>(n >> 16),
                        static_cast<char>(n >> 8),
                        static_cast<char>(n),
                        static_cast<char>(type),
                        static_cast<char>(flags),
                        static_cast<char>((stream >> 24) & 0x7f),
                        static_cast<char>(stream >> 16),
                        static_cast<char>(stream >> 8),
                        static_cast<char>(stream)};
  out->append(head, sizeof(head));
  out->append(payload);
}

// HPACK: a literal field without indexing, its name from the static table
// (index < 15) or given.
void Literal(std::string* out, int index, const std::string& name, const std::string& value) {
  out->push_back(static_cast<char>(index));  // 0000xxxx: index, or 0 and a name
  if (index == 0) {
    out->push_back(static_cast<char>(name.size()));
    out->append(name);
  }
  out->push_back(static_cast<char>(value.size()));
  out->append(value);
}

std::string Header() {
  std::string h;
  h.push_back(static_cast<char>(0x83));                     // :method POST (static 3)
  h.push_back(static_cast<char>(0x86));                     // :scheme http (static 6)
  Literal(&h, 4, "", "/offload.v1.StatsService/GetStats");  // :path
  Literal(&h, 1, "", "localhost");                          // :authority
  Literal(&h, 0, "content-type", "application/grpc");
  Literal(&h, 0, "te", "trailers");
  return h;
}

// What offloadd sent back on a connection, by frame type.
struct Answers {
  bool connected = false;
  int64_t headers = 0;  // HEADERS frames: an answer's metadata, its trailers
  int64_t resets = 0;   // streams it reset (RST_STREAM)
  bool goaway = false;  // it ended the connection
  void Add(const Answers& o) {
    connected = connected || o.connected;
    headers += o.headers;
    resets += o.resets;
    goaway = goaway || o.goaway;
  }
};

// `streams` streams on one connection, each reset right behind its request.
Answers Burst(const std::string& socket_path, int64_t streams) {
  Answers answers;
  absl::StatusOr<UniqueFd> c = ConnectUnix(socket_path);
  if (!c.ok()) return answers;
  answers.connected = true;
  const int fd = c->get();
  // What offloadd sends is read (so that its writes never block) and its
  // frames counted; its first SETTINGS is acknowledged before the burst, as
  // a client does (offloadd's bound on streams in flight then holds).
  absl::Notification settings;
  std::thread drain([fd, &answers, &settings] {
    std::string in;
    char buf[1 << 16];
    for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) {
      in.append(buf, static_cast<size_t>(n));
      size_t at = 0;
      while (in.size() - at >= 9) {
        const size_t length = (static_cast<size_t>(static_cast<uint8_t>(in[at])) << 16) |
                              (static_cast<size_t>(static_cast<uint8_t>(in[at + 1])) << 8) |
                              static_cast<uint8_t>(in[at + 2]);
        if (in.size() - at < 9 + length) break;
        switch (in[at + 3]) {
          case 0x4:
            if ((in[at + 4] & 0x1) == 0 && !settings.HasBeenNotified()) settings.Notify();
            break;
          case 0x1:
            ++answers.headers;
            break;
          case 0x3:
            ++answers.resets;
            break;
          case 0x7:
            answers.goaway = true;
            break;
        }
        at += 9 + length;
      }
      in.erase(0, at);
    }
  });
  std::string out = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  Frame(&out, 0x4, 0, 0, "");  // SETTINGS
  bool ok = send(fd, out.data(), out.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(out.size());
  out.clear();
  if (ok && settings.WaitForNotificationWithTimeout(absl::Seconds(5))) {
    Frame(&out, 0x4, 0x1, 0, "");  // SETTINGS ACK
  }
  const std::string header = Header();
  const std::string empty_message(5, '\0');  // uncompressed, 0 bytes
  const std::string cancel("\0\0\0\x08", 4);
  for (int64_t i = 0; i < streams && ok; ++i) {
    const uint32_t id = static_cast<uint32_t>(2 * i + 1);
    Frame(&out, 0x1, 0x4, id, header);         // HEADERS, END_HEADERS
    Frame(&out, 0x0, 0x1, id, empty_message);  // DATA, END_STREAM
    Frame(&out, 0x3, 0, id, cancel);           // RST_STREAM CANCEL
    if (out.size() >= (64 << 10) || i + 1 == streams) {
      for (size_t at = 0; at < out.size();) {
        const ssize_t n = send(fd, out.data() + at, out.size() - at, MSG_NOSIGNAL);
        if (n <= 0) {
          ok = false;  // offloadd hung up
          break;
        }
        at += static_cast<size_t>(n);
      }
      out.clear();
    }
  }
  shutdown(fd, SHUT_WR);
  drain.join();
  return answers;
}

bool Serves(const std::string& address) {
  auto stub =
      v1::StatsService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::GetStatsResponse stats;
  const grpc::Status served = stub->GetStats(&context, v1::GetStatsRequest(), &stats);
  if (!served.ok()) {
    std::fprintf(stderr, "offloadd does not answer: %s\n", served.error_message().c_str());
  }
  return served.ok();
}

int Run(const Flags& f) {
  std::unique_ptr<testing::DaemonProcess> started;
  std::string socket_path = f.socket;
  pid_t pid = f.pid;
  if (socket_path.empty()) {
    auto d = testing::DaemonProcess::Start();
    if (!d.ok()) {
      std::fprintf(stderr, "starting offloadd: %s\n", d.status().ToString().c_str());
      return 1;
    }
    started = *std::move(d);
    socket_path = started->socket_path();
    pid = started->pid();
  }
  const std::string address = "unix:" + socket_path;
  if (!Serves(address)) return 1;  // the baseline has a client's connection
  absl::SleepFor(absl::Seconds(1));
  const double base = ResidentMb(pid);
  std::printf(
      "== stream_burst: %lld streams a burst over %d connections, each reset right behind its "
      "request\n",
      static_cast<long long>(f.streams), f.connections);
  std::printf("offloadd resident before: %.1f MB\n", base);
  std::printf("%-6s %6s %9s %9s %7s %13s %15s %13s\n", "burst", "secs", "HEADERS", "reset",
              "goaway", "RSS after MB", "RSS settled MB", "settled/base");
  double first_settled = 0, last_settled = 0;
  for (int b = 0; b < f.bursts; ++b) {
    const absl::Time start = absl::Now();
    std::vector<std::thread> threads;
    std::vector<Answers> answers(f.connections);
    for (int c = 0; c < f.connections; ++c) {
      // (The remainder goes to the first connections.)
      const int64_t mine = f.streams / f.connections + (c < f.streams % f.connections ? 1 : 0);
      threads.emplace_back([&, c, mine] { answers[c] = Burst(socket_path, mine); });
    }
    for (auto& t : threads) t.join();
    Answers all;
    for (const Answers& a : answers) {
      if (!a.connected) {
        std::fprintf(stderr, "could not connect to %s\n", socket_path.c_str());
        return 1;
      }
      all.Add(a);
    }
    const double secs = absl::ToDoubleSeconds(absl::Now() - start);
    const double after = ResidentMb(pid);
    absl::SleepFor(absl::Seconds(f.settle_seconds));
    const double settled = ResidentMb(pid);
    if (b == 0) first_settled = settled;
    last_settled = settled;
    std::printf("%-6d %6.2f %9lld %9lld %7s %13.1f %15.1f %12.2fx\n", b + 1, secs,
                static_cast<long long>(all.headers), static_cast<long long>(all.resets),
                all.goaway ? "yes" : "no", after, settled, settled / base);
  }
  std::printf(
      "settled resident memory: %.2fx the baseline after the last burst; %+.1f MB from "
      "the first burst to the last\n",
      last_settled / base, last_settled - first_settled);
  // Still serving.
  if (!Serves(address)) return 1;
  return 0;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) {
  offload::Flags f;
  for (int i = 1; i < argc; ++i) {
    const char* v = nullptr;
    if (std::string(argv[i]) == "--tiny") {
      f.streams = 200;
      f.bursts = 1;
      f.connections = 2;
      f.settle_seconds = 1;
    } else if ((v = offload::bench::FlagValue(argv[i], "streams"))) {
      f.streams = static_cast<int64_t>(offload::bench::CountOrExit(v));
    } else if ((v = offload::bench::FlagValue(argv[i], "connections"))) {
      f.connections = static_cast<int>(offload::bench::CountOrExit(v));
    } else if ((v = offload::bench::FlagValue(argv[i], "socket"))) {
      f.socket = v;
    } else if ((v = offload::bench::FlagValue(argv[i], "pid"))) {
      f.pid = static_cast<pid_t>(offload::bench::CountOrExit(v));
    } else if ((v = offload::bench::FlagValue(argv[i], "settle_seconds"))) {
      f.settle_seconds = static_cast<int>(offload::bench::CountOrExit(v));
    } else if ((v = offload::bench::FlagValue(argv[i], "bursts"))) {
      f.bursts = static_cast<int>(offload::bench::CountOrExit(v));
    } else {
      std::fprintf(stderr, "unknown flag %s (see the header of benches/stream_burst_bench.cc)\n",
                   argv[i]);
      return 2;
    }
  }
  offload::bench::PrintMachine("/tmp");
  return offload::Run(f);
}
