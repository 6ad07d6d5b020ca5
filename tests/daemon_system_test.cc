// System tests: a real offloadd process, driven from this (separate) process
// through the client library, raw gRPC stubs and the arena channel.
#include <arpa/inet.h>
#include <dirent.h>
#include <grp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "absl/algorithm/container.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/host_memory.h"
#include "base/smaps_testing.h"
#include "checkpoint/format.h"
#include "client/client.h"
#include "client/demo/mlp.h"
#include "client/gpu_tier.h"
#include "gpu/emulated_device.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "ipc/arena_protocol.h"
#include "ipc/unix_socket.h"
#include "proto/offload.grpc.pb.h"
#include "tests/daemon_process.h"

namespace offload {
namespace {

using ::offload::testing::DaemonProcess;
using ::offload::testing::RemoveOnExit;

// In a forked child: becomes nobody (uid and gid 65534), in the group users
// (gid 100) or in no group. False if the kernel refused.
bool BecomeNobody(bool in_users) {
  const gid_t users = 100;
  return setgroups(in_users ? 1 : 0, &users) == 0 && setgid(65534) == 0 && setuid(65534) == 0;
}

// Starts offloadd with its sockets shared with group users
// (server.socket_group, 0660) in a new directory under /tmp that others may
// enter (`*dir`, its socket `*dir`/offloadd.sock, removed when `*remove`
// goes), with `flags` besides.
absl::StatusOr<std::unique_ptr<DaemonProcess>> StartGroupShared(
    const std::vector<std::string>& flags, std::string* dir,
    std::unique_ptr<RemoveOnExit>* remove) {
  char made[] = "/tmp/offloadd_group.XXXXXX";
  if (mkdtemp(made) == nullptr) return absl::InternalError("mkdtemp failed");
  *remove = std::make_unique<RemoveOnExit>(made);
  if (chmod(made, 0755) != 0) return absl::InternalError("chmod failed");
  *dir = made;
  std::vector<std::string> all = {"--server.socket=" + *dir + "/offloadd.sock",
                                  "--server.socket_group=users"};
  all.insert(all.end(), flags.begin(), flags.end());
  return DaemonProcess::Start(all);
}

// Runs `binary` (a path in the test's runfiles) as nobody in group users,
// with `args`, from a copy in `dir` (the runfiles are under root's home,
// which nobody may not read). Its exit status (-1 if it did not exit; 8: it
// could not become nobody) and what it printed: stdout, and stderr too
// where `with_stderr` (else stderr stays the test's: gRPC's own log lines).
struct RanAsNobody {
  int status = -1;
  std::string output;
};
RanAsNobody RunAsNobody(const std::string& dir, const std::string& binary,
                        const std::vector<std::string>& args, bool with_stderr) {
  const std::string copy = dir + "/" + std::filesystem::path(binary).filename().string();
  if (!std::filesystem::exists(copy)) std::filesystem::copy_file(binary, copy);
  EXPECT_EQ(chmod(copy.c_str(), 0755), 0);
  std::vector<char*> argv{const_cast<char*>(copy.c_str())};
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  int out[2];
  EXPECT_EQ(pipe(out), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], 1);
    if (with_stderr) dup2(out[1], 2);
    if (!BecomeNobody(/*in_users=*/true)) _exit(8);
    execv(copy.c_str(), argv.data());
    _exit(9);
  }
  close(out[1]);
  RanAsNobody ran;
  char buf[512];
  for (ssize_t got; (got = read(out[0], buf, sizeof(buf))) > 0;) ran.output.append(buf, got);
  close(out[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  ran.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return ran;
}

// The counter `name` of the daemon `client` talks to; -1 if there is none.
int64_t CounterOf(Client& client, const std::string& name) {
  auto stats = client.GetStats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (!stats.ok()) return -1;
  for (const auto& c : stats->counters) {
    if (c.name == name) return c.value;
  }
  ADD_FAILURE() << "no counter " << name;
  return -1;
}

class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override { StartDaemon({}); }

  void StartDaemon(const std::vector<std::string>& flags) {
    auto d = DaemonProcess::Start(flags);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d);
    auto c = Client::Connect({daemon_->address()});
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
  }

  // A demo trainer killed while it steps; `lease`: the daemon's reconnect
  // lease is on.
  void KillATrainer(bool lease);
  // Starts the demo trainer (its session "offload_demo") and waits until it
  // steps; `pid`: its process.
  void StartSteppingTrainer(pid_t* pid);
  // SIGKILLs the demo trainer `pid` and waits until offloadd saw it go.
  void KillSteppingTrainer(pid_t pid);
  // A session "survivor" holding one partition beside the trainer's;
  // `bytes`: the host tier's use with it alone.
  std::unique_ptr<Session> OpenSurvivor(uint64_t* bytes) {
    auto survivor = Open("survivor");
    if (survivor == nullptr || !survivor->Register("w", 1000, DType::kFp32, DType::kFp32).ok()) {
      return nullptr;
    }
    *bytes = Stats().tiers[0].used_bytes;
    return survivor;
  }

  std::unique_ptr<Session> Open(const std::string& name) {
    auto s = client_->OpenSession(name);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }

  DaemonStats Stats() {
    auto stats = client_->GetStats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? *std::move(stats) : DaemonStats{};
  }

  int64_t Counter(const std::string& name) { return CounterOf(*client_, name); }

  // A second client of the daemon whose calls all go through gRPC (no
  // request ring), for tests of both ways; null (a failure recorded) if it
  // does not connect.
  std::unique_ptr<Client> GrpcOnlyClient() {
    ClientOptions no_ring{daemon_->address()};
    no_ring.request_ring = false;
    auto c = Client::Connect(no_ring);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<Client> client_;
};

// Holds `p`'s gradient buffer, to write gradients into (the residency
// contract: written only while held).
void HoldGrads(Session* s, const PartitionView& p) {
  FetchOptions grads;
  grads.grads = true;
  ASSERT_TRUE(s->Fetch(p.id, grads).ok());
}

void ExpectDemoMatchesInProcess(Client* client, DType dtype) {
  demo::MlpConfig config;
  config.steps = 60;
  config.param_dtype = dtype;
  auto session = client->OpenSession("demo");
  ASSERT_TRUE(session.ok()) << session.status();
  auto remote_store = demo::MakeDaemonStore(config, session->get());
  auto remote = demo::Train(config, remote_store.get());
  ASSERT_TRUE(remote.ok()) << remote.status();
  auto local_store = demo::MakeInProcessStore(config);
  auto local = demo::Train(config, local_store.get());
  ASSERT_TRUE(local.ok()) << local.status();
  ASSERT_EQ(remote->size(), 60u);
  for (size_t i = 0; i < remote->size(); ++i) {
    EXPECT_NEAR((*remote)[i], (*local)[i], 1e-5 * std::fabs((*local)[i])) << "step " << i;
  }
  // And it actually learns.
  EXPECT_LT(remote->back(), 0.5 * remote->front());
}

TEST_F(DaemonTest, DemoTrainsThroughDaemonExactlyLikeInProcess) {
  ExpectDemoMatchesInProcess(client_.get(), DType::kFp32);
  ExpectDemoMatchesInProcess(client_.get(), DType::kBf16);
  ExpectDemoMatchesInProcess(client_.get(), DType::kFp16);
  EXPECT_EQ(Counter("steps"), 180);
  // Its state all on the host: its pins go without the swapper's lock.
  const int64_t unlocked = Counter("swap_unlocked_pins");
  EXPECT_GT(unlocked, Counter("swap_acquires") / 2);
  EXPECT_LE(unlocked, Counter("swap_acquires"));
}

TEST_F(DaemonTest, BadRequestsGetClearErrorsAndTheDaemonKeepsServing) {
  auto a = Open("a");
  auto b = Open("b");
  ASSERT_TRUE(a && b);
  auto pa = a->Register("w", 100, DType::kBf16, DType::kFp32);
  ASSERT_TRUE(pa.ok()) << pa.status();

  auto zero = a->Register("z", 0, DType::kFp32, DType::kFp32);
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(zero.status().message(), "numel"));

  // Fetch before register.
  auto unknown = a->Fetch(987654);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(unknown.status().message(), "987654"));

  // Wrong size and dtype mismatch on return.
  PartitionView wrong_size = *pa;
  wrong_size.numel = 99;
  auto size_status = a->ReturnGradients(wrong_size);
  EXPECT_EQ(size_status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(size_status.message(), "registered with 100"));
  PartitionView wrong_dtype = *pa;
  wrong_dtype.grad_dtype = DType::kFp16;
  auto dtype_status = a->ReturnGradients(wrong_dtype);
  EXPECT_EQ(dtype_status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(dtype_status.message(), "fp16"));

  // A second session touching the first one's partition.
  EXPECT_EQ(b->Fetch(pa->id).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(b->ReturnGradients(*pa).code(), absl::StatusCode::kPermissionDenied);

  // Step before any gradients.
  EXPECT_EQ(a->Step(AdamHyperparams{}).status().code(), absl::StatusCode::kFailedPrecondition);
  AdamHyperparams bad;
  bad.lr = -1;
  HoldGrads(a.get(), *pa);
  ASSERT_TRUE(a->ReturnGradients(*pa).ok());
  EXPECT_EQ(a->Step(bad).status().code(), absl::StatusCode::kInvalidArgument);

  // Double close.
  ASSERT_TRUE(b->Close().ok());
  EXPECT_TRUE(b->Close().ok());  // the library makes a second Close a no-op

  // The daemon and the first session are fine.
  auto step = a->Step(AdamHyperparams{});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->partitions_updated, 1u);
  auto c = Open("c");
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->Register("w", 10, DType::kFp32, DType::kFp32).ok());
  EXPECT_EQ(Counter("requests_failed"), 8);
}

TEST_F(DaemonTest, NonFiniteGradientsSkipTheStepAndChangeNothing) {
  auto s = Open("overflow");
  ASSERT_TRUE(s);
  auto w = s->Register("w", 1000, DType::kBf16, DType::kBf16);
  ASSERT_TRUE(w.ok());
  for (uint16_t& x : w->params_as<uint16_t>()) x = FloatToBf16(0.5f);
  HoldGrads(s.get(), *w);
  for (uint16_t& x : w->grads_as<uint16_t>()) x = FloatToBf16(0.1f);
  w->grads_as<uint16_t>()[777] = FloatToBf16(INFINITY);
  ASSERT_TRUE(s->ReturnGradients(*w).ok());
  auto skipped = s->Step(AdamHyperparams{});
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_TRUE(skipped->skipped);
  EXPECT_EQ(skipped->nonfinite_gradients, 1u);
  EXPECT_EQ(skipped->partitions_updated, 0u);
  auto after = s->Fetch(w->id);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->step, 0u);
  for (uint16_t x : after->params_as<uint16_t>()) ASSERT_EQ(x, FloatToBf16(0.5f));
  // The skipped step consumed the gradients: fresh ones are needed.
  EXPECT_EQ(s->Step(AdamHyperparams{}).status().code(), absl::StatusCode::kFailedPrecondition);
  HoldGrads(s.get(), *w);
  for (uint16_t& x : w->grads_as<uint16_t>()) x = FloatToBf16(0.1f);
  ASSERT_TRUE(s->ReturnGradients(*w).ok());
  auto ok = s->Step(AdamHyperparams{});
  ASSERT_TRUE(ok.ok());
  EXPECT_FALSE(ok->skipped);
  EXPECT_EQ(s->Fetch(w->id)->step, 1u);
  EXPECT_EQ(Counter("steps_skipped_nonfinite"), 1);
  // Finite gradients dropped by the trainer (skip: zero_grad after a
  // return) are not counted as non-finite; another rank's overflow is.
  for (bool overflow : {false, true}) {
    HoldGrads(s.get(), *w);
    for (uint16_t& x : w->grads_as<uint16_t>()) x = FloatToBf16(0.1f);
    ASSERT_TRUE(s->ReturnGradients(*w).ok());
    StepOptions o;
    (overflow ? o.overflow : o.skip) = true;
    auto skip = s->Step(AdamHyperparams{}, o);
    ASSERT_TRUE(skip.ok()) << skip.status();
    EXPECT_TRUE(skip->skipped);
  }
  EXPECT_EQ(Counter("steps_skipped_nonfinite"), 2);
  EXPECT_EQ(Counter("steps_dropped"), 1);
}

// Several partitions' gradients in one ReturnGradients, with the holds let
// go after; an error stops at the partition it names and says how many
// went before, and the daemon keeps what those returned.
TEST_F(DaemonTest, GradientsOfSeveralPartitionsReturnInOneCall) {
  auto s = Open("batched");
  ASSERT_TRUE(s);
  std::vector<PartitionView> parts;
  for (int i = 0; i < 3; ++i) {
    auto p = s->Register(absl::StrCat("p", i), 64, DType::kFp32, DType::kFp32);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(s->Release(*p).ok());
    parts.push_back(*p);
  }
  const std::vector<uint64_t> ids = {parts[0].id, parts[1].id, parts[2].id};
  FetchOptions grads;
  grads.grads = true;
  auto held = s->Fetch(ids, grads);
  ASSERT_TRUE(held.ok()) << held.status();
  for (int i = 0; i < 3; ++i) {
    for (float& g : (*held)[i].grads_as<float>()) g = 0.5f * (i + 1);
  }
  ASSERT_TRUE(s->ReturnGradients(*held, /*release=*/true).ok());
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  for (const DaemonStats::Session& x : stats->sessions) {
    if (x.name == "batched") {
      EXPECT_EQ(x.held, 0u);
    }
  }
  auto pending = s->GetPendingGradients();
  ASSERT_TRUE(pending.ok());
  EXPECT_EQ(pending->partitions, 3u);
  EXPECT_DOUBLE_EQ(pending->sq_norm, 64 * (0.25 + 1.0 + 2.25));

  // The second partition's buffer is not held: the first is returned, the
  // error names the second and the count, nothing is released.
  ASSERT_TRUE(s->Fetch(parts[0].id, grads).ok());
  ASSERT_TRUE(s->Fetch(parts[1].id).ok());
  auto partial = s->ReturnGradients(std::vector<PartitionView>{(*held)[0], (*held)[1]}, true);
  EXPECT_EQ(partial.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(partial.message(), "returned 1 of 2")) << partial.message();
  // Still held: nothing was released.
  EXPECT_TRUE(s->Release(absl::MakeConstSpan(&ids[1], 1)).ok());
  EXPECT_TRUE(s->Release(absl::MakeConstSpan(&ids[0], 1)).ok());
  // The first partition's second micro-batch was added; the second's not.
  EXPECT_DOUBLE_EQ(s->GetPendingGradients()->sq_norm, 64 * (1.0 + 1.0 + 2.25));
  auto step = s->Step(AdamHyperparams{});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->partitions_updated, 3u);
}

// optimizer.state_dict()'s calls over the wire: a partition larger than one
// call carries (4M elements) read and written in several, and refused
// calls that name what is wrong.
TEST_F(DaemonTest, MomentsTravelInSeveralCallsAndComeBackAsWritten) {
  auto s = Open("moments");
  ASSERT_TRUE(s);
  constexpr uint64_t kN = (uint64_t{4} << 20) + 3;
  auto p = s->Register("big", kN, DType::kFp32, DType::kFp32);
  ASSERT_TRUE(p.ok()) << p.status();
  std::vector<float> initial(kN);
  for (uint64_t j = 0; j < kN; ++j) initial[j] = static_cast<float>(j % 4099) * 0.25f;
  std::memcpy(p->params, initial.data(), kN * sizeof(float));
  ASSERT_TRUE(s->Release(*p).ok());
  std::vector<float> m(kN), v(kN);
  for (uint64_t j = 0; j < kN; ++j) {
    m[j] = static_cast<float>(j % 1000) * 1e-3f;
    v[j] = static_cast<float>(j % 77) * 1e-5f;
  }
  absl::Status written = s->WriteMoments(p->id, 5, 0, m, v);
  ASSERT_TRUE(written.ok()) << written;
  auto read = s->ReadMoments(p->id, 0, kN);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->step, 5u);
  EXPECT_EQ(read->exp_avg, m);
  EXPECT_EQ(read->exp_avg_sq, v);
  auto tail = s->ReadMoments(p->id, kN - 2, 2);
  ASSERT_TRUE(tail.ok()) << tail.status();
  EXPECT_EQ(tail->exp_avg, std::vector<float>(m.end() - 2, m.end()));
  EXPECT_TRUE(tail->master.empty());
  // With the fp32 master weights (fewer elements a call): before any step,
  // the values registered.
  auto with_master = s->ReadMoments(p->id, 0, kN, /*with_master=*/true);
  ASSERT_TRUE(with_master.ok()) << with_master.status();
  EXPECT_EQ(with_master->exp_avg, m);
  EXPECT_EQ(with_master->master, initial);
  auto past = s->ReadMoments(p->id, kN - 2, 3);
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument) << past.status();
  const float one = 1.0f;
  auto uneven = s->WriteMoments(p->id, 1, 0, absl::MakeConstSpan(&one, 1), {});
  EXPECT_EQ(uneven.code(), absl::StatusCode::kInvalidArgument) << uneven;
  auto other = Open("another");
  ASSERT_TRUE(other);
  auto theirs = other->ReadMoments(p->id, 0, 1);
  EXPECT_EQ(theirs.status().code(), absl::StatusCode::kPermissionDenied) << theirs.status();
}

// Gradients handed over (ReturnGradients with hand_over), through the
// request ring and through gRPC: the step reads them in the buffer and
// trains bit for bit like gradients returned the usual way; a fetch of the
// buffer before the step takes it back, changing nothing. Handed over with
// the trainer's statistics (HandOverGradients; made up here, to show that
// they are what GetPendingGradients adds up), the same.
TEST_F(DaemonTest, HandedOverGradientsTrainLikeReturnedOnesOverRingAndGrpc) {
  std::unique_ptr<Client> grpc_client = GrpcOnlyClient();
  ASSERT_NE(grpc_client, nullptr);
  for (const auto& [c, via] : {std::pair<Client*, std::string>{client_.get(), "ring"},
                               std::pair<Client*, std::string>{grpc_client.get(), "grpc"}}) {
    auto handed = c->OpenSession("handed-" + via), kept = c->OpenSession("kept-" + via),
         given = c->OpenSession("given-" + via);
    ASSERT_TRUE(handed.ok() && kept.ok() && given.ok());
    std::vector<PartitionView> w;
    for (Session* s : {handed->get(), kept->get(), given->get()}) {
      auto p = s->Register("w", 3000, DType::kBf16, DType::kBf16);
      ASSERT_TRUE(p.ok()) << p.status();
      for (uint16_t& x : p->params_as<uint16_t>()) x = FloatToBf16(0.5f);
      ASSERT_TRUE(s->Release(*p).ok());
      w.push_back(*p);
    }
    for (int step = 1; step <= 3; ++step) {
      const GradientStats made_up{42.0 * step, 0};
      for (int i = 0; i < 3; ++i) {
        Session* s = i == 0 ? handed->get() : i == 1 ? kept->get() : given->get();
        HoldGrads(s, w[i]);
        auto g = w[i].grads_as<uint16_t>();
        for (size_t j = 0; j < g.size(); ++j) g[j] = FloatToBf16(0.01f * step * (j % 7));
        const std::vector<PartitionView> one{w[i]};
        if (i == 2) {
          // (Refused by the client: one statistic per partition.)
          EXPECT_EQ(s->HandOverGradients(one, {}).code(), absl::StatusCode::kInvalidArgument);
          const absl::Status nan = s->HandOverGradients(one, {{std::nan(""), 0}});
          EXPECT_EQ(nan.code(), absl::StatusCode::kInvalidArgument) << via << ": " << nan;
          ASSERT_TRUE(s->HandOverGradients(one, {made_up}, /*release=*/true).ok()) << via;
        } else {
          ASSERT_TRUE(s->ReturnGradients(one, /*release=*/true, /*hand_over=*/i == 0).ok()) << via;
        }
      }
      auto ph = (*handed)->GetPendingGradients(), pk = (*kept)->GetPendingGradients(),
           pg = (*given)->GetPendingGradients();
      ASSERT_TRUE(ph.ok() && pk.ok() && pg.ok());
      EXPECT_EQ(ph->sq_norm, pk->sq_norm);
      EXPECT_EQ(pg->sq_norm, made_up.sq_norm) << via;
      EXPECT_EQ(pg->partitions, 1u);
      if (step == 2) {
        FetchOptions grads;
        grads.grads = true;
        auto back = (*handed)->Fetch(w[0].id, grads);
        ASSERT_TRUE(back.ok()) << via << ": " << back.status();
        ASSERT_TRUE((*handed)->Release(*back).ok());
        auto again = (*handed)->GetPendingGradients();
        ASSERT_TRUE(again.ok());
        EXPECT_EQ(again->sq_norm, pk->sq_norm);
      }
      ASSERT_TRUE((*handed)->Step(AdamHyperparams{}).ok());
      ASSERT_TRUE((*kept)->Step(AdamHyperparams{}).ok());
      // (Overlapped, and waited for: WaitStep both ways too.)
      StepOptions overlapped;
      overlapped.overlap = true;
      ASSERT_TRUE((*given)->Step(AdamHyperparams{}, overlapped).ok());
      auto waited = (*given)->WaitStep();
      ASSERT_TRUE(waited.ok()) << via << ": " << waited.status();
      EXPECT_EQ(waited->partitions_updated, 1u) << via;
      EXPECT_FALSE(waited->running) << via;
      auto a = (*handed)->Fetch(w[0].id);
      auto b = (*kept)->Fetch(w[1].id);
      auto d = (*given)->Fetch(w[2].id);
      ASSERT_TRUE(a.ok() && b.ok() && d.ok());
      EXPECT_EQ(a->step, static_cast<uint64_t>(step));
      const auto pa = a->params_as<uint16_t>(), pb = b->params_as<uint16_t>(),
                 pd = d->params_as<uint16_t>();
      EXPECT_TRUE(std::equal(pa.begin(), pa.end(), pb.begin(), pb.end())) << via << " " << step;
      EXPECT_TRUE(std::equal(pd.begin(), pd.end(), pb.begin(), pb.end())) << via << " " << step;
      EXPECT_NE(pa[1], FloatToBf16(0.5f));
      ASSERT_TRUE((*handed)->Release(*a).ok());
      ASSERT_TRUE((*kept)->Release(*b).ok());
      ASSERT_TRUE((*given)->Release(*d).ok());
    }
  }
}

// The step protocol over the wire: micro-batches accumulate; two ranks
// combine their pending norms and commit with clip_grad_norm_'s
// coefficient; an fp16 session's overflow skips and lowers its loss scale.
TEST_F(DaemonTest, AccumulationGlobalClippingAndLossScalingOverTheWire) {
  auto r0 = Open("rank0");
  auto r1 = Open("rank1");
  ASSERT_TRUE(r0 && r1);
  std::vector<PartitionView> parts;
  for (Session* s : {r0.get(), r1.get()}) {
    auto p = s->Register("w", 1000, DType::kFp32, DType::kFp32);
    ASSERT_TRUE(p.ok());
    for (float& x : p->params_as<float>()) x = 1.0f;
    ASSERT_TRUE(s->Release(*p).ok());
    parts.push_back(*p);
  }
  // Two micro-batches of 0.5 each on rank 0, one of 1.0 on rank 1.
  auto put = [&](Session* s, const PartitionView& p, float g) {
    HoldGrads(s, p);
    for (float& x : p.grads_as<float>()) x = g;
    ASSERT_TRUE(s->ReturnGradients(p).ok());
    ASSERT_TRUE(s->Release(p).ok());
  };
  put(r0.get(), parts[0], 0.5f);
  put(r0.get(), parts[0], 0.5f);
  put(r1.get(), parts[1], 1.0f);
  auto p0 = r0->GetPendingGradients();
  auto p1 = r1->GetPendingGradients();
  ASSERT_TRUE(p0.ok() && p1.ok());
  EXPECT_EQ(p0->micro_batches, 2u);
  EXPECT_EQ(p0->sq_norm, 1000.0);  // 1000 values of 1.0
  EXPECT_EQ(p1->sq_norm, 1000.0);
  EXPECT_EQ(p0->loss_scale, 1.0);
  const double total = std::sqrt(p0->sq_norm + p1->sq_norm);
  const double coef = std::min(1.0, 1.0 / (total + 1e-6));
  AdamHyperparams h;
  h.grad_scale = coef;
  auto s0 = r0->Step(h);
  auto s1 = r1->Step(h);
  ASSERT_TRUE(s0.ok() && s1.ok());
  EXPECT_EQ(s0->partitions_updated, 1u);
  auto w0 = r0->Fetch(parts[0].id);
  auto w1 = r1->Fetch(parts[1].id);
  ASSERT_TRUE(w0.ok() && w1.ok());
  EXPECT_EQ(w0->params_as<float>()[7], w1->params_as<float>()[7]);  // the same update
  EXPECT_LT(w0->params_as<float>()[7], 1.0f);
  // A param group over the wire: rank 1's partition with lr 0 does not move.
  ASSERT_TRUE(r0->Release(*w0).ok());
  ASSERT_TRUE(r1->Release(*w1).ok());
  put(r1.get(), parts[1], 1.0f);
  const float before = w1->params_as<float>()[7];
  StepOptions frozen;
  AdamHyperparams zero_lr;
  zero_lr.lr = 0;
  frozen.groups.push_back({{parts[1].id}, zero_lr});
  ASSERT_TRUE(r1->Step(h, frozen).ok());
  auto w1b = r1->Fetch(parts[1].id);
  ASSERT_TRUE(w1b.ok());
  EXPECT_EQ(w1b->params_as<float>()[7], before);

  // fp16 with loss scaling: an overflow on another rank skips the step.
  SessionOptions fp16;
  fp16.loss_scaling = LossScaling{};
  fp16.loss_scaling->initial_scale = 4096;
  fp16.loss_scaling->hysteresis = 1;
  auto opened = client_->OpenSession("fp16", fp16);
  ASSERT_TRUE(opened.ok()) << opened.status();
  Session* s = opened->get();
  auto w = s->Register("w", 100, DType::kFp16, DType::kFp16);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(s->Release(*w).ok());
  HoldGrads(s, *w);
  for (uint16_t& x : w->grads_as<uint16_t>()) x = FloatToFp16(0.25f * 4096);
  ASSERT_TRUE(s->ReturnGradients(*w).ok());
  auto pending = s->GetPendingGradients();
  ASSERT_TRUE(pending.ok());
  EXPECT_EQ(pending->loss_scale, 4096.0);
  EXPECT_DOUBLE_EQ(pending->sq_norm, 100 * 0.0625);  // unscaled
  StepOptions overflow;
  overflow.overflow = true;
  auto skipped = s->Step(AdamHyperparams{}, overflow);
  ASSERT_TRUE(skipped.ok());
  EXPECT_TRUE(skipped->skipped);
  EXPECT_EQ(skipped->loss_scale, 2048.0);
  SessionOptions bad;
  bad.loss_scaling = LossScaling{};
  bad.loss_scaling->backoff_factor = 3;
  auto refused = client_->OpenSession("bad", bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "backoff_factor"));
}

// The delayed parameter update over the wire, switched on by itself after
// 5 steps: the demo's first losses are those of the plain run, later ones
// differ (one step stale), and it still learns.
TEST_F(DaemonTest, DelayedUpdateSwitchesOnAfterItsWarmUpAndStillTrains) {
  demo::MlpConfig config;
  config.steps = 40;
  auto plain = client_->OpenSession("plain");
  ASSERT_TRUE(plain.ok());
  auto plain_store = demo::MakeDaemonStore(config, plain->get());
  auto want = demo::Train(config, plain_store.get());
  ASSERT_TRUE(want.ok()) << want.status();
  SessionOptions options;
  options.delayed_update_after_steps = 5;
  auto dpu = client_->OpenSession("dpu", options);
  ASSERT_TRUE(dpu.ok());
  auto dpu_store = demo::MakeDaemonStore(config, dpu->get());
  auto got = demo::Train(config, dpu_store.get());
  ASSERT_TRUE(got.ok()) << got.status();
  for (int i = 0; i <= 5; ++i) EXPECT_EQ((*got)[i], (*want)[i]) << "step " << i;
  EXPECT_NE((*got)[10], (*want)[10]);
  EXPECT_LT(got->back(), 0.5 * got->front());
  // Off drains: afterwards steps are plain again.
  EXPECT_TRUE((*dpu)->SetDelayedUpdate(false).ok());
}

// DMA registers each partition's working copy and gradient buffer as the
// daemon names them, never its whole span: the delayed update's second
// buffer is registered only once it is named as the working copy, after
// the daemon made it (discarding whatever pages were there, which a
// registration made earlier would have pinned, leaving the device
// reading orphaned pages). Switching the delayed update off drops the
// working copies' registrations; the next fetch registers again.
TEST_F(DaemonTest, DmaRegistersWorkingCopiesOnlyOnceTheDaemonNamesThem) {
  gpu::EmulatedDevice device;  // outlives the session
  SessionOptions options;
  options.delayed_update_after_steps = 0;
  auto opened = client_->OpenSession("dma", options);
  ASSERT_TRUE(opened.ok()) << opened.status();
  Session* s = opened->get();
  ASSERT_TRUE(s->EnableDma(&device).ok());
  constexpr uint64_t kNumel = 4096;
  constexpr uint64_t kBytes = kNumel * sizeof(float);
  auto p = s->Register("w", kNumel, DType::kFp32, DType::kFp32);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(p->dma);
  EXPECT_TRUE(device.IsRegistered(p->params, kBytes));
  EXPECT_TRUE(device.IsRegistered(p->grads, kBytes));
  EXPECT_EQ(device.registered_bytes(), 2 * kBytes);  // not the span's third buffer
  for (float& x : p->params_as<float>()) x = 1.0f;
  ASSERT_TRUE(s->Release(*p).ok());
  std::vector<void*> working;
  for (int step = 0; step < 4; ++step) {
    FetchOptions grads;
    grads.grads = true;
    auto v = s->Fetch(p->id, grads);
    ASSERT_TRUE(v.ok()) << v.status();
    ASSERT_TRUE(v->dma) << "step " << step;
    EXPECT_TRUE(device.IsRegistered(v->params, kBytes)) << "step " << step;
    if (absl::c_find(working, v->params) == working.end()) working.push_back(v->params);
    for (float& g : v->grads_as<float>()) g = 0.25f;
    ASSERT_TRUE(s->ReturnGradients(absl::MakeConstSpan(&*v, 1), /*release=*/true).ok());
    // Before the step that first writes the second buffer, nothing of it
    // is registered: only the buffers named so far are.
    EXPECT_EQ(device.registered_bytes(), (1 + working.size()) * kBytes) << "step " << step;
    auto r = s->Step(AdamHyperparams{});
    ASSERT_TRUE(r.ok()) << r.status();
  }
  ASSERT_EQ(working.size(), 2u);  // the delayed update's two buffers took turns
  EXPECT_EQ(s->dma_stats().regions, 3u);
  ASSERT_TRUE(s->SetDelayedUpdate(false).ok());
  EXPECT_EQ(device.registered_bytes(), kBytes);  // the gradient buffer's
  EXPECT_EQ(s->dma_stats().regions, 1u);
  EXPECT_EQ(s->dma_stats().bytes, kBytes);
  auto v = s->Fetch(p->id);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_TRUE(v->dma);
  EXPECT_EQ(device.registered_bytes(), 2 * kBytes);
  ASSERT_TRUE(s->Release(*v).ok());
  // Closing gives every registration back (and unmaps), though the
  // Session object lives on: nothing stays pinned after the daemon freed
  // the session's memory.
  ASSERT_TRUE(s->Close().ok());
  EXPECT_EQ(device.registered_bytes(), 0u);
  EXPECT_EQ(s->dma_stats().regions, 0u);
}

// A session is not closed under its GpuTier (whose copies read and write
// its memory): Close refuses until the tier is gone.
TEST_F(DaemonTest, ASessionIsNotClosedUnderItsGpuTier) {
  gpu::EmulatedDevice device;
  auto opened = client_->OpenSession("tiered");
  ASSERT_TRUE(opened.ok()) << opened.status();
  Session* s = opened->get();
  GpuTierOptions options;
  options.params.budget_bytes = 1 << 20;
  auto tier = GpuTier::Create(s, &device, options);
  ASSERT_TRUE(tier.ok()) << tier.status();
  const absl::Status refused = s->Close();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "GpuTier")) << refused;
  EXPECT_TRUE(s->GetPendingGradients().ok());  // still open
  tier->reset();
  EXPECT_TRUE(s->Close().ok());
}

// A parameter copy that fails after its use was issued makes the
// iteration's end ABORTED (its compute read undefined bytes), also when a
// first EndIteration was refused for gradients still on their way: the
// failure is reported to the call that ends the iteration, not lost.
TEST_F(DaemonTest, ACopyFailedAfterItsUseAbortsTheIterationsEnd) {
  gpu::EmulatedDevice device;  // outlives the session
  auto opened = client_->OpenSession("aborted");
  ASSERT_TRUE(opened.ok()) << opened.status();
  Session* s = opened->get();
  auto p = s->Register("w", 4096, DType::kFp32, DType::kFp32);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(s->Release(*p).ok());
  GpuTierOptions options;
  options.params.budget_bytes = 1 << 20;
  options.params.prefetch_depth = 0;
  auto tier = GpuTier::Create(s, &device, options);
  ASSERT_TRUE(tier.ok()) << tier.status();
  auto unit = (*tier)->params().AddUnit({{p->id, 4096 * sizeof(float)}});
  ASSERT_TRUE(unit.ok()) << unit.status();
  auto grads = device.Allocate(4096 * sizeof(float));
  ASSERT_TRUE(grads.ok()) << grads.status();
  std::memset(grads->get(), 0, 4096 * sizeof(float));
  gpu::Stream compute = device.BorrowStream(nullptr);
  device.SetCopyFault([](void*, const void*, uint64_t, gpu::Direction direction) {
    return direction == gpu::Direction::kHostToDevice ? absl::DataLossError("injected")
                                                      : absl::OkStatus();
  });
  ASSERT_TRUE((*tier)->BeginIteration().ok());
  ASSERT_TRUE((*tier)->params().Use(*unit, compute).ok());  // its copy fails afterwards
  ASSERT_TRUE((*tier)->params().Done(*unit, compute).ok());
  ASSERT_TRUE((*tier)->AddGradient(p->id, grads->get(), 4096 * sizeof(float), compute).ok());
  EXPECT_EQ((*tier)->EndIteration().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*tier)->DropGradients().ok());
  const absl::Status ended = (*tier)->EndIteration();
  EXPECT_EQ(ended.code(), absl::StatusCode::kAborted) << ended;
  device.SetCopyFault(nullptr);
  tier->reset();
}

// A region the device refuses to register is asked once: later fetches
// naming it go to the staging path without another driver call, and
// failed_regions counts regions, not fetches.
TEST_F(DaemonTest, ARegionTheDeviceRefusesIsAskedOnce) {
  gpu::EmulatedDevice device;  // outlives the session
  std::atomic<int> asked{0};
  device.SetRegisterFault([&asked](void*, uint64_t) {
    ++asked;
    return absl::ResourceExhaustedError("injected: RLIMIT_MEMLOCK");
  });
  auto opened = client_->OpenSession("refused");
  ASSERT_TRUE(opened.ok()) << opened.status();
  Session* s = opened->get();
  ASSERT_TRUE(s->EnableDma(&device).ok());
  auto p = s->Register("w", 4096, DType::kFp32, DType::kFp32);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->dma);
  ASSERT_TRUE(s->Release(*p).ok());
  for (int i = 0; i < 3; ++i) {
    FetchOptions grads;
    grads.grads = true;
    auto v = s->Fetch(p->id, grads);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_FALSE(v->dma);
    ASSERT_TRUE(s->Release(*v).ok());
  }
  EXPECT_EQ(asked.load(), 2);  // the working copy and the gradient buffer
  EXPECT_EQ(s->dma_stats().failed_regions, 2u);
}

// With the delayed update the step after an iteration runs while the next
// one computes, and reads the gradient buffers that iteration's backward
// writes again. Held a batch at a time (SetGradientsPerBatch, what
// offloadd.torch sets while a step runs), the first batch waits only for
// its own partitions' updates, which the step does first (in the order
// their gradients came), not for the whole step. (Timed, as the daemon is
// another process: the hold against the step, in the same round. On a
// loaded machine the test's thread may lose the race in a round, so one
// round of five must show it; held all at once, the hold lasts as long as
// the large partition's update, most of the step, in every round. The
// steps counter is no witness: it moves just after the large partition
// leaves the step, and a hold of it may return in between.)
TEST_F(DaemonTest, WithTheDelayedUpdateAGradientBatchWaitsOnlyForItsOwnPartitions) {
  gpu::EmulatedDevice device({.memory_bytes = 512 << 20});  // outlives the session
  std::unique_ptr<Session> s = Open("dpu");
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(s->SetDelayedUpdate(true).ok());
  // A partition whose gradients come first, updated in a run of the
  // optimizer of its own (1M parameters: StepRunner's shortest), and a
  // large one whose update takes most of the step's time.
  const uint64_t numel[] = {1 << 20, 24 << 20};
  std::vector<uint64_t> ids;
  for (int i = 0; i < 2; ++i) {
    auto p = s->Register(absl::StrCat("w", i), numel[i], DType::kFp32, DType::kFp32);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(s->Release(*p).ok());
    ids.push_back(p->id);
  }
  GpuTierOptions options;
  options.params.budget_bytes = (numel[0] + numel[1]) * sizeof(float);
  options.hold_per_iteration = true;
  auto tier = GpuTier::Create(s.get(), &device, options);
  ASSERT_TRUE(tier.ok()) << tier.status();
  // (The tier holds what its units name; the parameters are not used here.)
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE((*tier)->params().AddUnit({{ids[i], numel[i] * sizeof(float)}}).ok());
  }
  auto grads = device.Allocate(numel[1] * sizeof(float));
  ASSERT_TRUE(grads.ok()) << grads.status();
  std::memset(grads->get(), 0, numel[1] * sizeof(float));
  gpu::Stream host = device.BorrowStream(nullptr);
  // Backward: the small partition's gradient, then the large one's,
  // handed over with their statistics.
  auto backward = [&] {
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE((*tier)->AddGradient(ids[i], grads->get(), numel[i] * sizeof(float), host).ok());
    }
    absl::flat_hash_map<uint64_t, GradientStats> stats = {{ids[0], {}}, {ids[1], {}}};
    auto returned = (*tier)->ReturnGradients(/*wait=*/true, /*hand_over=*/true, stats);
    ASSERT_TRUE(returned.ok()) << returned.status();
    ASSERT_EQ(returned->size(), 2u);
    ASSERT_TRUE((*tier)->EndIteration().ok());
  };
  StepOptions kOverlap;
  kOverlap.overlap = true;
  ASSERT_TRUE((*tier)->BeginIteration().ok());
  backward();
  ASSERT_TRUE(s->Step(AdamHyperparams{}, kOverlap).ok());
  ASSERT_TRUE(s->WaitStep().ok());
  int early = 0;  // rounds whose first batch was held in under half the step
  std::string rounds;
  const int64_t refused = Counter("grad_holds_not_ready");
  for (int round = 0; round < 5; ++round) {
    ASSERT_TRUE((*tier)->BeginIteration().ok());
    backward();
    const int64_t steps = Counter("steps");
    const absl::Time step_start = absl::Now();
    ASSERT_TRUE(s->Step(AdamHyperparams{}, kOverlap).ok());
    (*tier)->SetGradientsPerBatch(true);
    ASSERT_TRUE((*tier)->BeginIteration().ok());
    const absl::Time hold_start = absl::Now();
    ASSERT_TRUE((*tier)->AddGradient(ids[0], grads->get(), numel[0] * sizeof(float), host).ok());
    // Held while the step still updates the large partition (24M
    // parameters: tens of milliseconds here).
    const absl::Duration hold = absl::Now() - hold_start;
    ASSERT_TRUE((*tier)->AddGradient(ids[1], grads->get(), numel[1] * sizeof(float), host).ok());
    ASSERT_TRUE(s->WaitStep().ok());
    const absl::Duration step = absl::Now() - step_start;
    if (2 * hold < step) ++early;
    absl::StrAppend(&rounds, " ", absl::FormatDuration(hold), "/", absl::FormatDuration(step));
    EXPECT_EQ(Counter("steps"), steps + 1);
    auto returned = (*tier)->ReturnGradients(/*wait=*/true, /*hand_over=*/false);
    ASSERT_TRUE(returned.ok()) << returned.status();
    ASSERT_TRUE((*tier)->EndIteration().ok());
    ASSERT_TRUE(s->Step(AdamHyperparams{}, kOverlap).ok());
    ASSERT_TRUE(s->WaitStep().ok());
    (*tier)->SetGradientsPerBatch(false);
  }
  EXPECT_GE(early, 1) << "the first batch's hold / the step, by round:" << rounds;
  // (Its first batch asked for every buffer at once if ready, and was
  // refused while the step ran.)
  EXPECT_GE(Counter("grad_holds_not_ready") - refused, 1);
}

// Held a batch at a time (a step may still be running), the iteration's
// first batch still holds every gradient buffer in one call when the step
// has read them all by then (a fetch asked if ready: the daemon refuses at
// once otherwise, and each batch holds its own, asking no more this
// iteration). On a node with cores to spare the delayed update's step is
// over before the next backward's first gradient: one call, not one a
// batch (13 on the H200's 25M model).
TEST_F(DaemonTest, WithTheDelayedUpdateTheFirstBatchHoldsEveryBufferOnceTheStepHasReadThem) {
  gpu::EmulatedDevice device({.memory_bytes = 64 << 20});  // outlives the session
  std::unique_ptr<Session> s = Open("dpu_ready");
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(s->SetDelayedUpdate(true).ok());
  constexpr int kParts = 6;
  constexpr uint64_t kNumel = 4096;
  std::vector<uint64_t> ids;
  for (int i = 0; i < kParts; ++i) {
    auto p = s->Register(absl::StrCat("w", i), kNumel, DType::kFp32, DType::kFp32);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(s->Release(*p).ok());
    ids.push_back(p->id);
  }
  GpuTierOptions options;
  options.params.budget_bytes = kParts * kNumel * sizeof(float);
  options.hold_per_iteration = true;
  auto tier = GpuTier::Create(s.get(), &device, options);
  ASSERT_TRUE(tier.ok()) << tier.status();
  for (uint64_t id : ids) {
    ASSERT_TRUE((*tier)->params().AddUnit({{id, kNumel * sizeof(float)}}).ok());
  }
  auto grads = device.Allocate(kNumel * sizeof(float));
  ASSERT_TRUE(grads.ok()) << grads.status();
  std::memset(grads->get(), 0, kNumel * sizeof(float));
  gpu::Stream host = device.BorrowStream(nullptr);
  StepOptions overlap;
  overlap.overlap = true;
  // An iteration whose gradients come a partition a batch; the daemon calls
  // each batch made.
  auto backward = [&](std::vector<uint64_t>* calls) {
    for (uint64_t id : ids) {
      const uint64_t before = (*tier)->stats().daemon_calls;
      ASSERT_TRUE((*tier)->AddGradient(id, grads->get(), kNumel * sizeof(float), host).ok());
      calls->push_back((*tier)->stats().daemon_calls - before);
    }
    absl::flat_hash_map<uint64_t, GradientStats> stats;
    for (uint64_t id : ids) stats[id] = {};
    auto returned = (*tier)->ReturnGradients(/*wait=*/true, /*hand_over=*/true, stats);
    ASSERT_TRUE(returned.ok()) << returned.status();
    ASSERT_EQ(returned->size(), ids.size());
    ASSERT_TRUE((*tier)->EndIteration().ok());
  };
  std::vector<uint64_t> calls;
  ASSERT_TRUE((*tier)->BeginIteration().ok());
  backward(&calls);
  ASSERT_TRUE(s->Step(AdamHyperparams{}, overlap).ok());
  // The step over before the next backward: its first batch holds all.
  ASSERT_TRUE(s->WaitStep().ok());
  (*tier)->SetGradientsPerBatch(true);
  const int64_t refused = Counter("grad_holds_not_ready");
  ASSERT_TRUE((*tier)->BeginIteration().ok());
  calls.clear();
  backward(&calls);
  EXPECT_EQ(calls, std::vector<uint64_t>({1, 0, 0, 0, 0, 0}));
  EXPECT_EQ(Counter("grad_holds_not_ready"), refused);
  // Stepped and trained on as held a batch at a time: the step reads them.
  ASSERT_TRUE(s->Step(AdamHyperparams{}, overlap).ok());
  ASSERT_TRUE(s->WaitStep().ok());
  EXPECT_EQ(Counter("steps"), 2);
}

// A fetch of gradient buffers asked if ready, while the step reads them
// (handed over, an overlapped step of 24M parameters just started), is
// refused at once with the words IsNotReady knows, holding nothing and
// not counted as a failed request; through the request ring and through
// gRPC. (The step may win the race in a round: five rounds, one refusal
// each way needed.)
TEST_F(DaemonTest, AFetchAskedIfReadyIsRefusedAtOnceWhileTheStepReadsTheBuffers) {
  std::unique_ptr<Client> grpc_client = GrpcOnlyClient();
  ASSERT_NE(grpc_client, nullptr);
  for (const auto& [c, via] : {std::pair<Client*, std::string>{client_.get(), "ring"},
                               std::pair<Client*, std::string>{grpc_client.get(), "grpc"}}) {
    auto opened = c->OpenSession("if-ready-" + via);
    ASSERT_TRUE(opened.ok()) << opened.status();
    Session* s = opened->get();
    EXPECT_EQ(s->FetchesIfReady(1), via == "ring");
    auto p = s->Register("w", 24 << 20, DType::kFp32, DType::kFp32);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(s->Release(*p).ok());
    StepOptions overlap;
    overlap.overlap = true;
    FetchOptions if_ready;
    if_ready.grads = if_ready.if_ready = true;
    int refused = 0;
    for (int i = 0; i < 5 && refused == 0; ++i) {
      HoldGrads(s, *p);
      ASSERT_TRUE(s->HandOverGradients({*p}, {{1.0, 0}}, /*release=*/true).ok());
      ASSERT_TRUE(s->Step(AdamHyperparams{}, overlap).ok());
      const int64_t failed = Counter("requests_failed");
      auto got = s->Fetch(p->id, if_ready);
      if (got.ok()) {
        ASSERT_TRUE(s->Release(*got).ok());  // (the step was over: held as without it)
      } else {
        EXPECT_TRUE(IsNotReady(got.status())) << via << ": " << got.status();
        EXPECT_EQ(Counter("requests_failed"), failed) << via;
        DaemonStats stats = Stats();
        for (const auto& session : stats.sessions) {
          if (session.name == "if-ready-" + via) {
            EXPECT_EQ(session.held, 0u) << via;
          }
        }
        ++refused;
      }
      ASSERT_TRUE(s->WaitStep().ok());
    }
    EXPECT_EQ(refused, 1) << via << ": the step was over before every fetch";
    // Once the step has read it: held.
    auto held = s->Fetch(p->id, if_ready);
    ASSERT_TRUE(held.ok()) << via << ": " << held.status();
    ASSERT_TRUE(s->Release(*held).ok());
  }
}

// A trainer's GPU tier reports what it did (the session's stats and the
// node's gpu_* counters show it) and takes the node's prefetch settings
// from the answer: offloadctl set gpu.prefetch_depth reaches it at its next
// report, and -1 gives it its own back.
TEST_F(DaemonTest, GpuTiersReportToTheDaemonAndTakeItsPrefetchSettings) {
  gpu::EmulatedDevice device;  // outlives the session
  auto opened = client_->OpenSession("gpu");
  ASSERT_TRUE(opened.ok()) << opened.status();
  Session* s = opened->get();
  constexpr uint64_t kNumel = 2048;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 4; ++i) {
    auto p = s->Register(absl::StrCat("w", i), kNumel, DType::kFp32, DType::kFp32);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(s->Release(*p).ok());
    ids.push_back(p->id);
  }
  GpuTierOptions options;
  options.params.budget_bytes = 4 * kNumel * sizeof(float);
  options.params.prefetch_depth = 2;
  options.hold_per_iteration = true;
  options.report_interval = absl::ZeroDuration();  // every iteration
  auto tier = GpuTier::Create(s, &device, options);
  ASSERT_TRUE(tier.ok()) << tier.status();
  std::vector<int> units;
  for (uint64_t id : ids) {
    auto u = (*tier)->params().AddUnit({{id, kNumel * sizeof(float)}});
    ASSERT_TRUE(u.ok()) << u.status();
    units.push_back(*u);
  }
  auto stream = device.CreateStream();
  ASSERT_TRUE(stream.ok());
  // Forward and backward, each unit used twice; the prefetches issued at
  // the iteration's start are complete before their use (Synchronize), so
  // that a use counts as exactly one of resident and prefetched.
  auto iteration = [&] {
    ASSERT_TRUE((*tier)->BeginIteration().ok());
    ASSERT_TRUE((*tier)->params().Synchronize().ok());
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t i = 0; i < units.size(); ++i) {
        const int u = units[pass == 0 ? i : units.size() - 1 - i];
        ASSERT_TRUE((*tier)->params().Use(u, *stream).ok());
        ASSERT_TRUE((*tier)->params().Done(u, *stream).ok());
      }
    }
    ASSERT_TRUE((*tier)->params().Invalidate(*stream).ok());
    ASSERT_TRUE((*tier)->EndIteration().ok());
  };
  iteration();
  iteration();
  auto find = [&](const DaemonStats& stats) -> std::optional<GpuTierCounters> {
    for (const DaemonStats::Session& x : stats.sessions) {
      if (x.id == s->id()) return x.gpu;
    }
    return std::nullopt;
  };
  std::optional<GpuTierCounters> reported = find(Stats());
  ASSERT_TRUE(reported.has_value());
  const GpuTierStats mine = (*tier)->stats();
  EXPECT_EQ(mine.reports, 2u);
  EXPECT_EQ(reported->h2d_bytes, mine.params.h2d_bytes);
  EXPECT_EQ(reported->h2d_bytes, 2 * 4 * kNumel * sizeof(float));  // every step's values
  EXPECT_EQ(reported->tensor_uses, 16u);
  EXPECT_GT(reported->prefetch_hits, 0u);
  EXPECT_GT(reported->resident_hits, 0u);  // backward's
  EXPECT_LE(reported->resident_hits + reported->prefetch_hits, reported->tensor_uses);
  EXPECT_EQ(reported->prefetch_depth, 2u);
  EXPECT_EQ(Counter("gpu_h2d_bytes"), static_cast<int64_t>(reported->h2d_bytes));

  // The node's setting reaches the tier at its next report.
  ASSERT_TRUE(client_->SetTunable("gpu.prefetch_depth", "0").ok());
  iteration();
  EXPECT_EQ((*tier)->stats().prefetch_depth, 0);
  const uint64_t prefetched = (*tier)->stats().params.prefetched_units;
  iteration();
  EXPECT_EQ((*tier)->stats().params.prefetched_units, prefetched);  // none with depth 0
  EXPECT_EQ(find(Stats())->prefetch_depth, 0u);
  ASSERT_TRUE(client_->SetTunable("gpu.prefetch_depth", "-1").ok());
  iteration();
  EXPECT_EQ((*tier)->stats().prefetch_depth, 2);  // its own again
  EXPECT_EQ((*tier)->stats().reports, 5u);        // every iteration's, none refused
  EXPECT_EQ(client_->SetTunable("gpu.prefetch_depth", "-2").status().code(),
            absl::StatusCode::kInvalidArgument);

  // Counters that cannot be are refused, and change nothing.
  GpuTierCounters bad;
  bad.h2d_bytes = 10;
  bad.h2d_staged_bytes = 20;
  auto refused = s->ReportGpuTier(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "staged 20 of 10")) << refused.status();
  EXPECT_EQ(find(Stats())->h2d_bytes, (*tier)->stats().params.h2d_bytes);
}

// The lines of /proc/<pid>/maps (this process's by default): its mappings
// as the kernel counts them against vm.max_map_count.
int ProcessMappings(const std::string& pid = "self") {
  std::ifstream maps("/proc/" + pid + "/maps");
  int lines = 0;
  for (std::string line; std::getline(maps, line);) ++lines;
  return lines;
}

// Small partitions' spans share one mapping per window of the arena, in the
// daemon and in the trainer: a session of thousands of them (a
// mixture-of-experts rank) takes a few mappings, not one or two per
// partition (about 32,500 partitions used to reach vm.max_map_count and
// abort the daemon). Partitions next to each other in one window keep their
// own bytes: each trains from its own initial values.
TEST_F(DaemonTest, SmallPartitionsShareMappingsOnBothSidesOfTheArena) {
  auto s = Open("experts");
  ASSERT_TRUE(s);
  const std::string daemon_pid = std::to_string(daemon_->pid());
  const int daemon_before = ProcessMappings(daemon_pid);
  const int64_t gauge_before = Counter("memory_mappings");
  const int trainer_before = ProcessMappings();
  constexpr int kPartitions = 6000;
  std::vector<PartitionView> parts;
  for (int i = 0; i < kPartitions; ++i) {
    auto p = s->Register(absl::StrCat("expert", i), 64, DType::kFp32, DType::kFp32);
    ASSERT_TRUE(p.ok()) << i << ": " << p.status();
    for (float& x : p->params_as<float>()) x = static_cast<float>(i);
    ASSERT_TRUE(s->Release(*p).ok());
    parts.push_back(*p);
  }
  const int daemon_grew = ProcessMappings(daemon_pid) - daemon_before;
  const int trainer_grew = ProcessMappings() - trainer_before;
  // A window per 64 MiB of 12 KiB spans (2 here), a slab per 16 or more
  // partitions' state: 20 in the daemon and 10 in this process (threads,
  // heaps and all) when this was written; 6,000 or more each before windows.
  EXPECT_LT(daemon_grew, kPartitions / 64) << daemon_grew;
  EXPECT_LT(trainer_grew, kPartitions / 64) << trainer_grew;
  // The daemon's own count (its mappings, not threads' stacks or heaps)
  // grew as little.
  EXPECT_LT(Counter("memory_mappings") - gauge_before, kPartitions / 64);
  EXPECT_GT(Counter("memory_mapping_budget"), 0);
  std::vector<uint64_t> ids;
  for (const PartitionView& p : parts) ids.push_back(p.id);
  FetchOptions grads;
  grads.grads = true;
  // In batches: a fetch names at most 4,096 partitions.
  constexpr size_t kBatch = 2000;
  for (size_t at = 0; at < ids.size(); at += kBatch) {
    auto held = s->Fetch(absl::MakeConstSpan(ids).subspan(at, kBatch), grads);
    ASSERT_TRUE(held.ok()) << held.status();
    for (const PartitionView& v : *held) {
      for (float& g : v.grads_as<float>()) g = 1.0f;
    }
    ASSERT_TRUE(s->ReturnGradients(*held, /*release=*/true).ok());
  }
  AdamHyperparams adam;
  adam.lr = 0.5f;
  adam.weight_decay = 0.0f;
  auto step = s->Step(adam);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->partitions_updated, static_cast<uint64_t>(kPartitions));
  for (size_t at = 0; at < ids.size(); at += kBatch) {
    const auto batch = absl::MakeConstSpan(ids).subspan(at, kBatch);
    auto after = s->Fetch(batch, {});
    ASSERT_TRUE(after.ok()) << after.status();
    for (size_t i = 0; i < after->size(); ++i) {
      // Adam's first step moves each value by lr against its gradient.
      for (float x : (*after)[i].params_as<float>()) {
        ASSERT_NEAR(x, static_cast<float>(at + i) - 0.5f, 1e-3f) << "partition " << at + i;
      }
    }
    ASSERT_TRUE(s->Release(batch).ok());
  }
}

// Memory mappings are a budget checked when a partition is registered:
// past it, Register is RESOURCE_EXHAUSTED naming the budget and the session
// with the most partitions, and the daemon serves everyone else (it used to
// run into vm.max_map_count and abort). The budget changes live. Small
// partitions reserve a mapping per 16 (their state's slab); their spans
// count as they are mapped (a window per 64 MiB of them).
TEST_F(DaemonTest, MappingsAreABudgetCheckedAtRegistration) {
  StartDaemon({"--memory.max_mappings=400"});
  auto hog = Open("hog");
  ASSERT_TRUE(hog);
  absl::Status refused;
  int registered = 0;
  for (int i = 0; i < 20000 && refused.ok(); ++i) {
    auto p = hog->Register(absl::StrCat("t", i), 64, DType::kFp32, DType::kFp32);
    if (!p.ok()) {
      refused = p.status();
      break;
    }
    ASSERT_TRUE(hog->Release(*p).ok());
    ++registered;
  }
  ASSERT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_GT(registered, 1000);  // before windows: 1 each reserved for its span (about 350)
  EXPECT_TRUE(absl::StrContains(refused.message(), "memory.max_mappings")) << refused;
  // Asked again, refused again: a refusal takes no share of a mapping.
  for (int retry = 0; retry < 20; ++retry) {
    EXPECT_EQ(hog->Register(absl::StrCat("t", registered), 64, DType::kFp32, DType::kFp32)
                  .status()
                  .code(),
              absl::StatusCode::kResourceExhausted)
        << retry;
  }
  EXPECT_TRUE(absl::StrContains(refused.message(), "('hog') with " + std::to_string(registered)))
      << refused;
  // Everyone else is served: another session opens, trains what it has,
  // and the daemon answers stats.
  // Its small partitions reserve a mapping every 16 of them, and each
  // needs room for its span: within a few, one is refused.
  auto other = Open("other");
  ASSERT_TRUE(other);
  absl::Status other_refused;
  for (int i = 0; i < 20 && other_refused.ok(); ++i) {
    auto p = other->Register(absl::StrCat("v", i), 64, DType::kFp32, DType::kFp32);
    other_refused = p.status();
    if (p.ok()) {
      ASSERT_TRUE(other->Release(*p).ok());
    }
  }
  EXPECT_EQ(other_refused.code(), absl::StatusCode::kResourceExhausted) << other_refused;
  EXPECT_EQ(Stats().sessions.size(), 2u);
  // Closing the hog gives its mappings back.
  ASSERT_TRUE(hog->Close().ok());
  auto w = other->Register("w", 64, DType::kFp32, DType::kFp32);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(other->Release(*w).ok());
  // And the budget is live: 0 lifts it.
  ASSERT_TRUE(client_->SetTunable("memory.max_mappings", "0").ok());
  for (int i = 0; i < registered + 10; ++i) {
    auto p = other->Register(absl::StrCat("u", i), 64, DType::kFp32, DType::kFp32);
    ASSERT_TRUE(p.ok()) << i << ": " << p.status();
    ASSERT_TRUE(other->Release(*p).ok());
  }
}

// State homed on NVMe maps nothing when it is registered, only when the
// swapper brings it in (a step): the budget reserves what each partition
// may map, so the same number of partitions is refused as with the state
// on the host, and stepping them all stays within it. Blocks larger than
// the pool's shared slots (64 KiB) each map on their own; smaller ones share
// slabs, as small spans share their arena window's mapping.
void MappingBudgetCase(uint64_t numel);

TEST(DaemonStartup, TheMappingBudgetReservesWhatNvmeHomedStateMapsLater) {
  for (const uint64_t numel : {uint64_t{1} << 15, uint64_t{64}}) {
    SCOPED_TRACE(numel);
    MappingBudgetCase(numel);
  }
}

void MappingBudgetCase(uint64_t numel) {
  char dir[] = "/tmp/offloadd_maps.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  RemoveOnExit remove(dir);
  // Small partitions reserve a mapping per 16: a lower budget, refused
  // before their state fills the tier.
  const bool large = numel * sizeof(float) > (64 << 10);
  auto d =
      DaemonProcess::Start({std::string("--nvme.dirs=") + dir, "--nvme.bytes_per_dir=64MiB",
                            "--placement.optimizer_state_host_percent=0",
                            large ? "--memory.max_mappings=400" : "--memory.max_mappings=200"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto c = Client::Connect({(*d)->address()});
  ASSERT_TRUE(c.ok()) << c.status();
  auto s = (*c)->OpenSession("nvme");
  ASSERT_TRUE(s.ok()) << s.status();
  std::vector<PartitionView> parts;
  absl::Status refused;
  while (parts.size() < 20000) {
    auto p = (*s)->Register(absl::StrCat("t", parts.size()), numel, DType::kFp32, DType::kFp32);
    if (!p.ok()) {
      refused = p.status();
      break;
    }
    ASSERT_TRUE((*s)->Release(*p).ok());
    parts.push_back(*p);
  }
  ASSERT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  if (large) {
    // 4 mappings reserved each for its state (none mapped now), the spans
    // counted as mapped (512 KiB each: one window).
    EXPECT_LE(parts.size(), 100u);
    EXPECT_GT(parts.size(), 80u);  // 5 each, before windows
  } else {
    EXPECT_GT(parts.size(), 1000u);  // a slab per 16, a window for all
  }
  EXPECT_TRUE(absl::StrContains(refused.message(), "reserved for registered partitions"))
      << refused;
  // Every one of them stepped: their state brought in, within the budget.
  std::vector<uint64_t> ids;
  for (const PartitionView& p : parts) ids.push_back(p.id);
  FetchOptions grads;
  grads.grads = true;
  auto held = (*s)->Fetch(ids, grads);
  ASSERT_TRUE(held.ok()) << held.status();
  for (const PartitionView& v : *held) {
    for (float& g : v.grads_as<float>()) g = 0.5f;
  }
  ASSERT_TRUE((*s)->ReturnGradients(*held, /*release=*/true).ok());
  auto step = (*s)->Step(AdamHyperparams{});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->partitions_updated, parts.size());
  EXPECT_LE(CounterOf(**c, "memory_mappings"), large ? 400 : 200);
}

TEST_F(DaemonTest, GradScaleAndEveryKernelGiveTheSameUpdate) {
  // Partition a gets gradients g with grad_scale 0.25; partition b gets g/4
  // with grad_scale 1 in another session. Both must end bit-identical, under
  // each kernel the CPU has, switched while the daemon runs.
  std::vector<float> first;
  for (const char* kernel : {"scalar", "avx2", "avx512"}) {
    auto set = client_->SetTunable("optimizer.kernel", kernel);
    if (!set.ok()) {
      EXPECT_EQ(set.status().code(), absl::StatusCode::kFailedPrecondition);
      continue;
    }
    auto sa = Open("a");
    auto sb = Open("b");
    ASSERT_TRUE(sa && sb);
    auto a = sa->Register("w", 4099, DType::kFp32, DType::kFp32);
    auto b = sb->Register("w", 4099, DType::kFp32, DType::kFp32);
    ASSERT_TRUE(a.ok() && b.ok());
    HoldGrads(sa.get(), *a);
    HoldGrads(sb.get(), *b);
    for (size_t i = 0; i < 4099; ++i) {
      const float g = std::sin(static_cast<float>(i));
      a->params_as<float>()[i] = b->params_as<float>()[i] = std::cos(static_cast<float>(i));
      a->grads_as<float>()[i] = g;
      b->grads_as<float>()[i] = g * 0.25f;
    }
    AdamHyperparams h;
    h.grad_scale = 0.25f;
    ASSERT_TRUE(sa->ReturnGradients(*a).ok());
    ASSERT_TRUE(sa->Step(h).ok());
    h.grad_scale = 1.0f;
    ASSERT_TRUE(sb->ReturnGradients(*b).ok());
    ASSERT_TRUE(sb->Step(h).ok());
    std::vector<float> pa(a->params_as<float>().begin(), a->params_as<float>().end());
    std::vector<float> pb(b->params_as<float>().begin(), b->params_as<float>().end());
    EXPECT_EQ(pa, pb) << kernel;
    if (first.empty()) first = pa;
    EXPECT_EQ(pa, first) << kernel << " differs from scalar";
  }
  EXPECT_EQ(client_->SetTunable("optimizer.kernel", "sse9").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Without a reconnect lease, a killed trainer's session is closed at once;
// with one (on by default), it waits for its trainer, holding its memory,
// until the lease is over.
TEST_F(DaemonTest, AKilledTrainersSessionIsClosedAndItsMemoryFreed) {
  for (const bool lease : {false, true}) {
    SCOPED_TRACE(lease ? "with a reconnect lease" : "without a reconnect lease");
    daemon_.reset();
    StartDaemon({absl::StrCat("--server.reconnect_lease_seconds=", lease ? 2 : 0)});
    ASSERT_NO_FATAL_FAILURE(KillATrainer(lease));
  }
}

void DaemonTest::StartSteppingTrainer(pid_t* started) {
  auto pid = ::offload::testing::SpawnProcess(
      {"client/demo/offload_demo", "--address=" + daemon_->address(), "--mode=daemon",
       "--steps=1000000"},
      daemon_->data_dir() + "/trainer.log");
  ASSERT_TRUE(pid.ok()) << pid.status();
  auto trainer = ::offload::testing::OpenPidFd(*pid);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  // Wait until the trainer is stepping. Only polling can tell: offloadd logs
  // no steps and GetStats is a unary call, and the demo prints its losses
  // only when it finishes. The backoff waits on the trainer's pidfd, so a
  // trainer that fails is reported when it exits, with its output.
  auto stepping = [&] {
    for (const auto& s : Stats().sessions) {
      if (s.name == "offload_demo" && s.steps > 0) return true;
    }
    return false;
  };
  absl::Status stepped = ::offload::testing::PollWithBackoff(stepping, trainer->get());
  if (!stepped.ok()) {
    kill(*pid, SIGKILL);
    waitpid(*pid, nullptr, 0);
    std::ifstream log(daemon_->data_dir() + "/trainer.log");
    std::stringstream output;
    output << log.rdbuf();
    FAIL() << "the trainer never stepped: " << stepped << "; its output:\n" << output.str();
  }
  ASSERT_TRUE(stepping()) << "the trainer never stepped";
  *started = *pid;
}

void DaemonTest::KillSteppingTrainer(pid_t pid) {
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  ASSERT_EQ(waitpid(pid, nullptr, 0), pid);
  // The daemon notices the dropped connection: its arena channel sees the
  // hangup, closes or detaches the session, then logs this line.
  absl::Status noticed =
      daemon_->WaitForLog(absl::StrCat("(pid ", pid, ") went away without closing it"));
  ASSERT_TRUE(noticed.ok()) << noticed;
}

void DaemonTest::KillATrainer(bool lease) {
  uint64_t survivor_bytes = 0;
  auto survivor = OpenSurvivor(&survivor_bytes);
  ASSERT_TRUE(survivor);

  pid_t trainer = -1;
  ASSERT_NO_FATAL_FAILURE(StartSteppingTrainer(&trainer));
  EXPECT_GT(Stats().tiers[0].used_bytes, survivor_bytes);

  ASSERT_NO_FATAL_FAILURE(KillSteppingTrainer(trainer));
  if (lease) {
    // Kept for its trainer, holding its memory, until the lease is over;
    // its stats say its trainer went away (the survivor's is here).
    EXPECT_EQ(Stats().sessions.size(), 2u);
    for (const auto& s : Stats().sessions) {
      if (s.name == "offload_demo") {
        EXPECT_GE(s.detached_seconds, 0);
      } else {
        EXPECT_EQ(s.detached_seconds, -1) << s.name;
      }
    }
    EXPECT_GT(Stats().tiers[0].used_bytes, survivor_bytes);
    EXPECT_EQ(Counter("sessions_abandoned"), 0);
    ASSERT_TRUE(daemon_->WaitForLog("none resumed it within 2s").ok()) << daemon_->ReadLog();
  }
  auto gone = [&] { return Stats().sessions.size() == 1; };
  ASSERT_TRUE(gone());
  EXPECT_EQ(Stats().sessions[0].name, "survivor");
  EXPECT_EQ(Stats().tiers[0].used_bytes, survivor_bytes);
  EXPECT_EQ(Counter("sessions_abandoned"), 1);
  EXPECT_TRUE(absl::StrContains(daemon_->ReadLog(), "went away without closing it"));
  // An orderly close is not counted as abandoned, and the survivor still works.
  ASSERT_TRUE(survivor->Close().ok());
  EXPECT_EQ(Counter("sessions_abandoned"), 1);
  auto again = Open("again");
  ASSERT_TRUE(again);
  EXPECT_TRUE(again->Register("w", 10, DType::kFp32, DType::kFp32).ok());
}

// The operator ends a session its trainer left (kept for the reconnect
// lease) at once, with its memory; one whose trainer is attached is
// refused. (Another user on a shared socket may not: SocketGroup's test.)
TEST_F(DaemonTest, TheOperatorClosesASessionItsTrainerLeft) {
  daemon_.reset();
  StartDaemon({"--server.reconnect_lease_seconds=600"});
  uint64_t survivor_bytes = 0;
  auto survivor = OpenSurvivor(&survivor_bytes);
  ASSERT_TRUE(survivor);
  pid_t trainer = -1;
  ASSERT_NO_FATAL_FAILURE(StartSteppingTrainer(&trainer));
  uint64_t id = 0;
  for (const auto& s : Stats().sessions) {
    if (s.name == "offload_demo") id = s.id;
  }
  ASSERT_NE(id, 0u);
  const absl::Status attached = client_->CloseUnattachedSession(id);
  EXPECT_EQ(attached.code(), absl::StatusCode::kFailedPrecondition) << attached;
  EXPECT_TRUE(absl::StrContains(attached.message(), "has its trainer attached")) << attached;
  EXPECT_EQ(Stats().sessions.size(), 2u);
  // Nor one no trainer attached to yet (one may be on its way).
  {
    auto stub = v1::PartitionService::NewStub(
        grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials()));
    v1::OpenSessionRequest open;
    open.set_name("raw");
    v1::OpenSessionResponse opened;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->OpenSession(&ctx, open, &opened).ok());
    const absl::Status unattached = client_->CloseUnattachedSession(opened.session().session_id());
    EXPECT_EQ(unattached.code(), absl::StatusCode::kFailedPrecondition) << unattached;
    EXPECT_TRUE(absl::StrContains(unattached.message(), "no trainer attached yet")) << unattached;
    grpc::ClientContext close_ctx;
    v1::CloseSessionRequest close;
    *close.mutable_session() = opened.session();
    v1::CloseSessionResponse closed;
    ASSERT_TRUE(stub->CloseSession(&close_ctx, close, &closed).ok());
  }

  ASSERT_NO_FATAL_FAILURE(KillSteppingTrainer(trainer));
  EXPECT_EQ(Stats().sessions.size(), 2u);  // kept for the lease, with its memory
  EXPECT_GT(Stats().tiers[0].used_bytes, survivor_bytes);

  const absl::Status closed = client_->CloseUnattachedSession(id);
  ASSERT_TRUE(closed.ok()) << closed;
  EXPECT_TRUE(
      daemon_
          ->WaitForLog(absl::StrCat(
              "session ", id, " ('offload_demo') closed by the operator (its trainer went away"))
          .ok())
      << daemon_->ReadLog();
  ASSERT_EQ(Stats().sessions.size(), 1u);
  EXPECT_EQ(Stats().sessions[0].name, "survivor");
  EXPECT_EQ(Stats().tiers[0].used_bytes, survivor_bytes);
  const absl::Status again = client_->CloseUnattachedSession(id);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  EXPECT_TRUE(absl::StrContains(again.message(), "is closed")) << again;
  EXPECT_EQ(client_->CloseUnattachedSession(id + 1000).code(), absl::StatusCode::kNotFound);
  // The survivor is served as before.
  EXPECT_TRUE(survivor->Register("w2", 10, DType::kFp32, DType::kFp32).ok());
}

// A session opened over raw gRPC that no trainer attaches to is closed
// after the lease; one a trainer attached to stays.
// No deadline at all is a timeout a user may ask for: calls then wait as
// long as they take (they failed at once: the deadline overflowed into the
// past).
TEST_F(DaemonTest, InfiniteTimeoutsMeanNoDeadline) {
  ClientOptions o{daemon_->address()};
  o.connect_timeout = absl::InfiniteDuration();
  o.call_timeout = absl::InfiniteDuration();
  o.request_ring = false;  // every call over gRPC, with its deadline
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  auto s = (*c)->OpenSession("no_deadline");
  ASSERT_TRUE(s.ok()) << s.status();
  auto stats = (*c)->GetStats();
  EXPECT_TRUE(stats.ok()) << stats.status();
}

TEST_F(DaemonTest, ASessionNobodyAttachesToExpires) {
  daemon_.reset();
  StartDaemon({"--server.attach_lease_seconds=1"});
  auto kept = Open("attached");
  ASSERT_TRUE(kept);
  auto channel = grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::PartitionService::NewStub(channel);
  v1::OpenSessionRequest open;
  open.set_name("raw");
  v1::OpenSessionResponse opened;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->OpenSession(&ctx, open, &opened).ok());
  }
  v1::RegisterPartitionRequest reg;
  *reg.mutable_session() = opened.session();
  reg.set_name("w");
  reg.set_numel(1 << 20);
  reg.set_param_dtype(v1::DTYPE_FP32);
  reg.set_grad_dtype(v1::DTYPE_FP32);
  v1::RegisterPartitionResponse reg_resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->RegisterPartition(&ctx, reg, &reg_resp).ok());
  }
  absl::Status expired = daemon_->WaitForLog(
      absl::StrCat("session ", opened.session().session_id(), " closed: no trainer attached"));
  ASSERT_TRUE(expired.ok()) << expired;
  const DaemonStats stats = Stats();
  ASSERT_EQ(stats.sessions.size(), 1u);
  EXPECT_EQ(stats.sessions[0].name, "attached");
  EXPECT_EQ(Counter("sessions_expired"), 1);
  v1::FetchParamsRequest fetch;
  *fetch.mutable_session() = opened.session();
  v1::FetchParamsResponse fetched;
  grpc::ClientContext ctx;
  grpc::Status gone = stub->FetchParams(&ctx, fetch, &fetched);
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(gone.error_message(), "is closed")) << gone.error_message();
  EXPECT_TRUE(kept->Register("w", 16, DType::kFp32, DType::kFp32).ok());
}

// An attached trainer that stops calling (frozen: no keepalive either) loses
// its session after the idle lease; one that keeps calling keeps its own.
TEST_F(DaemonTest, ASessionNoCallReachesExpires) {
  daemon_.reset();
  StartDaemon({"--server.idle_lease_seconds=1"});
  ClientOptions frozen_options{daemon_->address()};
  frozen_options.keepalive = false;
  auto frozen = Client::Connect(frozen_options);
  ASSERT_TRUE(frozen.ok()) << frozen.status();
  auto opened = (*frozen)->OpenSession("hung");
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::unique_ptr<Session> hung = *std::move(opened);
  auto busy = Open("busy");
  ASSERT_TRUE(hung && busy);
  ASSERT_TRUE(hung->Register("w", 1024, DType::kFp32, DType::kFp32).ok());
  const std::string closed = absl::StrCat("session ", hung->id(), " closed: no call for");
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!absl::StrContains(daemon_->ReadLog(), closed)) {
    ASSERT_LT(absl::Now(), deadline) << "the hung session was never closed";
    ASSERT_TRUE(busy->GetPendingGradients().ok());  // busy keeps calling
    absl::SleepFor(absl::Milliseconds(100));
  }
  // Past another lease, busy still calling.
  for (int i = 0; i < 15; ++i) {
    ASSERT_TRUE(busy->GetPendingGradients().ok());
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(hung->GetPendingGradients().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Counter("sessions_expired"), 1);
  ASSERT_EQ(Stats().sessions.size(), 1u);
  EXPECT_EQ(Stats().sessions[0].name, "busy");
}

// A trainer quiet for longer than the idle lease (its own checkpoint, a
// barrier) keeps its session: its client calls every quarter of the lease,
// which the daemon told it at open.
TEST_F(DaemonTest, AQuietTrainerKeepsItsSessionThroughItsKeepalive) {
  daemon_.reset();
  StartDaemon({"--server.idle_lease_seconds=1"});
  auto quiet = Open("quiet");
  ASSERT_TRUE(quiet);
  auto w = quiet->Register("w", 1024, DType::kFp32, DType::kFp32);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(quiet->Release(*w).ok());
  absl::SleepFor(absl::Seconds(3));  // three leases without a call of its own
  EXPECT_TRUE(quiet->Fetch(w->id).ok());
  EXPECT_EQ(Counter("sessions_expired"), 0);
  EXPECT_EQ(Stats().sessions.size(), 1u);
}

// Names are bytes on the wire: invalid UTF-8 is INVALID_ARGUMENT naming the
// byte (it used to fail to parse: INTERNAL with an empty message).
TEST_F(DaemonTest, NamesThatAreNotUtf8AreRefusedByName) {
  auto channel = grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::PartitionService::NewStub(channel);
  v1::OpenSessionRequest open;
  open.set_name("rank\xff");
  v1::OpenSessionResponse opened;
  {
    grpc::ClientContext ctx;
    grpc::Status s = stub->OpenSession(&ctx, open, &opened);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(s.error_message(), "session name is not UTF-8 (byte 4"))
        << s.error_message();
  }
  // Valid UTF-8 that would forge what a terminal shows: a right-to-left
  // override, a C1 control.
  for (const char* name : {"rank\xe2\x80\xae"
                           "0",
                           "rank\xc2\x9b"
                           "0"}) {
    open.set_name(name);
    grpc::ClientContext ctx;
    grpc::Status s = stub->OpenSession(&ctx, open, &opened);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(s.error_message(), "at byte 4)")) << s.error_message();
  }
  open.set_name("r\xc3\xa9seau");  // valid: é
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->OpenSession(&ctx, open, &opened).ok());
  }
  v1::RegisterPartitionRequest reg;
  *reg.mutable_session() = opened.session();
  reg.set_name("w\xc0\xaf");  // an overlong '/'
  reg.set_numel(10);
  reg.set_param_dtype(v1::DTYPE_FP32);
  reg.set_grad_dtype(v1::DTYPE_FP32);
  v1::RegisterPartitionResponse reg_resp;
  {
    grpc::ClientContext ctx;
    grpc::Status s = stub->RegisterPartition(&ctx, reg, &reg_resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(s.error_message(), "partition name is not UTF-8"))
        << s.error_message();
  }
  auto config = v1::ConfigService::NewStub(channel);
  v1::GetTunableRequest get;
  get.set_name("optimizer.\xff");
  v1::Tunable got;
  grpc::ClientContext ctx;
  grpc::Status bad_tunable = config->GetTunable(&ctx, get, &got);
  EXPECT_EQ(bad_tunable.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(bad_tunable.error_message(), "tunable name is not UTF-8 (byte 10"))
      << bad_tunable.error_message();
  // Still serving, and the session with the valid name works.
  EXPECT_EQ(Stats().sessions.size(), 1u);
  EXPECT_EQ(Stats().sessions[0].name, "r\xc3\xa9seau");
}

int ThreadsOf(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
  }
  return -1;
}

// A burst of concurrent calls from many connections: the daemon's threads
// stay within server.max_threads of where they were, every call is answered
// (OK, or RESOURCE_EXHAUSTED when all threads are busy), and it serves on.
TEST_F(DaemonTest, ABurstOfCallsMakesBoundedThreads) {
  daemon_.reset();
  StartDaemon({"--server.max_threads=16"});
  const int before = ThreadsOf(daemon_->pid());
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, exhausted{0}, other{0};
  std::vector<std::thread> callers;
  for (int i = 0; i < 96; ++i) {
    callers.emplace_back([&] {
      auto stub = v1::StatsService::NewStub(
          grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials()));
      while (!stop) {
        v1::GetStatsResponse resp;
        grpc::ClientContext ctx;
        grpc::Status s = stub->GetStats(&ctx, {}, &resp);
        (s.ok()                                                   ? ok
         : s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED ? exhausted
                                                                  : other)++;
      }
    });
  }
  int peak = before;
  const absl::Time end = absl::Now() + absl::Seconds(2);
  while (absl::Now() < end) {
    peak = std::max(peak, ThreadsOf(daemon_->pid()));
    absl::SleepFor(absl::Milliseconds(5));
  }
  stop = true;
  for (std::thread& t : callers) t.join();
  std::fprintf(stderr, "threads: %d before, %d at most; calls ok %d, exhausted %d, other %d\n",
               before, peak, ok.load(), exhausted.load(), other.load());
  // The bound, plus a few threads gRPC starts lazily for itself (timers,
  // its executor) whatever the load; without the bound this burst reached
  // 75 threads.
  EXPECT_LE(peak, before + 16 + 4);
  EXPECT_GT(ok.load(), 0);
  EXPECT_EQ(other.load(), 0);
  // Still serving: a call right after the burst may still find the bound
  // full (RESOURCE_EXHAUSTED while the burst's last calls drain), not more.
  absl::StatusOr<DaemonStats> after = client_->GetStats();
  for (const absl::Time until = absl::Now() + absl::Seconds(2);
       absl::IsResourceExhausted(after.status()) && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(20));
    after = client_->GetStats();
  }
  EXPECT_TRUE(after.ok()) << after.status();
}

TEST_F(DaemonTest, RawRequestsAreCheckedToo) {
  auto channel = grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::PartitionService::NewStub(channel);
  v1::OpenSessionResponse opened;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->OpenSession(&ctx, {}, &opened).ok());
  }
  auto call_fetch = [&](uint64_t id, const std::string& token) {
    v1::FetchParamsRequest req;
    req.mutable_session()->set_session_id(id);
    req.mutable_session()->set_token(token);
    v1::FetchParamsResponse resp;
    grpc::ClientContext ctx;
    return stub->FetchParams(&ctx, req, &resp);
  };
  EXPECT_TRUE(call_fetch(opened.session().session_id(), opened.session().token()).ok());
  EXPECT_EQ(call_fetch(424242, opened.session().token()).error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::Status forged = call_fetch(opened.session().session_id(), std::string(16, 'x'));
  EXPECT_EQ(forged.error_code(), grpc::StatusCode::PERMISSION_DENIED);

  v1::RegisterPartitionRequest reg;
  *reg.mutable_session() = opened.session();
  reg.set_name("w");
  reg.set_numel(10);
  reg.set_param_dtype(v1::DTYPE_FP32);  // grad_dtype left unspecified
  v1::RegisterPartitionResponse reg_resp;
  grpc::ClientContext ctx;
  grpc::Status s = stub->RegisterPartition(&ctx, reg, &reg_resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "grad_dtype"));

  // Double close through the wire.
  for (grpc::StatusCode want : {grpc::StatusCode::OK, grpc::StatusCode::FAILED_PRECONDITION}) {
    v1::CloseSessionRequest close;
    *close.mutable_session() = opened.session();
    v1::CloseSessionResponse close_resp;
    grpc::ClientContext close_ctx;
    EXPECT_EQ(stub->CloseSession(&close_ctx, close, &close_resp).error_code(), want);
  }
}

TEST_F(DaemonTest, ArenaGoesOnlyToTheTokenHolder) {
  auto channel = grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::PartitionService::NewStub(channel);
  v1::OpenSessionResponse opened;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub->OpenSession(&ctx, {}, &opened).ok());
  const std::string arena = opened.arena_socket();
  EXPECT_EQ(arena, daemon_->socket_path() + ".arena");

  auto good = AttachArena(arena, {opened.session().session_id(), opened.session().token()});
  ASSERT_TRUE(good.ok()) << good.status();
  struct stat st;
  ASSERT_EQ(fstat(good->arena.get(), &st), 0);

  std::string wrong = opened.session().token();
  wrong[0] ^= 1;
  auto bad = AttachArena(arena, {opened.session().session_id(), wrong});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(AttachArena(arena, {999, wrong}).status().code(), absl::StatusCode::kNotFound);
}

// Another real Unix user (nobody) can reach neither socket: the data
// directory and sockets are owner-only. And with those permissions opened
// up, the arena channel still refuses it by its peer credentials
// (SO_PEERCRED), even with a valid session id and token.
TEST_F(DaemonTest, AnotherUnixUserIsKeptOut) {
  if (geteuid() != 0) GTEST_SKIP() << "becoming another user needs root";
  auto channel = grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::PartitionService::NewStub(channel);
  v1::OpenSessionResponse opened;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->OpenSession(&ctx, {}, &opened).ok());
  }
  const std::string grpc_socket = daemon_->socket_path();
  const std::string arena = opened.arena_socket();
  const AttachRequest request{opened.session().session_id(), opened.session().token()};
  // As nobody: 1 = reached the gRPC socket, 2 = reached the arena socket,
  // 4 = got an arena; 8 = could not become nobody.
  auto as_nobody = [&](bool only_arena_attach) {
    const pid_t pid = fork();
    if (pid == 0) {
      if (!BecomeNobody(/*in_users=*/false)) _exit(8);
      int result = 0;
      if (!only_arena_attach) {
        if (ConnectUnix(grpc_socket).ok()) result |= 1;
        if (ConnectUnix(arena).ok()) result |= 2;
      }
      auto attached = AttachArena(arena, request);
      if (attached.ok()) result |= 4;
      if (only_arena_attach &&
          !absl::StrContains(attached.status().message(), "uid 65534 may not attach")) {
        result |= 16;
      }
      _exit(result);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  EXPECT_EQ(as_nobody(false), 0);
  // Open the doors; only the credential check is left.
  ASSERT_EQ(chmod(daemon_->data_dir().c_str(), 0777), 0);
  ASSERT_EQ(chmod(arena.c_str(), 0777), 0);
  EXPECT_EQ(as_nobody(true), 0);
  ASSERT_EQ(chmod(arena.c_str(), 0600), 0);
  ASSERT_EQ(chmod(daemon_->data_dir().c_str(), 0700), 0);
  // The owner still attaches.
  EXPECT_TRUE(AttachArena(arena, request).ok());
}

TEST_F(DaemonTest, SocketsAndDataDirAreOwnerOnly) {
  struct stat st;
  ASSERT_EQ(stat(daemon_->socket_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(stat((daemon_->socket_path() + ".arena").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(stat(daemon_->data_dir().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
}

// A budget below the state homed on the host (which never leaves the pool)
// is refused, naming it; it was taken, and every session's next step failed
// for want of room.
TEST_F(DaemonTest, ABudgetBelowTheStateHomedOnTheHostIsRefused) {
  auto s = Open("homed");
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->Register("w", 1 << 20, DType::kFp32, DType::kFp32).ok());
  const std::string before = client_->GetTunable("memory.host_budget_bytes")->value;
  auto low = client_->SetTunable("memory.host_budget_bytes", "4MiB");
  EXPECT_EQ(low.status().code(), absl::StatusCode::kFailedPrecondition) << low.status();
  EXPECT_TRUE(absl::StrContains(low.status().message(), "placed on the host")) << low.status();
  EXPECT_EQ(client_->GetTunable("memory.host_budget_bytes")->value, before);
}

TEST_F(DaemonTest, TunablesChangeLiveOrSayWhyNot) {
  auto set = client_->SetTunable("optimizer.threads", "1");
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->value, "1");
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_TRUE(absl::StrContains(stats->optimizer, "1 threads")) << stats->optimizer;
  auto frozen = client_->SetTunable("server.tcp_port", "9999");
  EXPECT_EQ(frozen.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client_->SetTunable("optimizer.threads", "-3").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->GetTunable("nope").status().code(), absl::StatusCode::kNotFound);

  // A lower host budget refuses the next registration with RESOURCE_EXHAUSTED.
  ASSERT_TRUE(client_->SetTunable("memory.host_budget_bytes", "1MiB").ok());
  auto s = Open("small");
  ASSERT_TRUE(s);
  auto big = s->Register("big", 1 << 20, DType::kFp32, DType::kFp32);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(s->Register("fits", 1000, DType::kFp32, DType::kFp32).ok());
  // A budget past what the process may use is refused when it is set, not
  // by the OOM killer later; the budget in force stays.
  auto huge = client_->SetTunable("memory.host_budget_bytes", "1125899906842624");
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(huge.status().message(), "more than this process may use"))
      << huge.status();
  EXPECT_EQ(client_->GetTunable("memory.host_budget_bytes")->value, "1MiB");
  EXPECT_EQ(s->Register("big2", 1 << 20, DType::kFp32, DType::kFp32).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(DaemonStartup, AHostBudgetPastTheMachinesMemoryIsRefused) {
  auto d = DaemonProcess::Start({"--memory.host_budget_bytes=1125899906842624"});
  ASSERT_FALSE(d.ok());
  EXPECT_TRUE(absl::StrContains(d.status().message(), "more than this process may use"))
      << d.status();
}

TEST_F(DaemonTest, StopsCleanlyOnSigtermAndRemovesSockets) {
  auto s = Open("x");
  ASSERT_TRUE(s);
  auto code = daemon_->Stop();
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0) << daemon_->ReadLog();
  EXPECT_NE(access(daemon_->socket_path().c_str(), F_OK), 0);
  EXPECT_NE(access((daemon_->socket_path() + ".arena").c_str(), F_OK), 0);
  std::string log = daemon_->ReadLog();
  EXPECT_TRUE(absl::StrContains(log, "serving gRPC on unix:")) << log;
  EXPECT_TRUE(absl::StrContains(log, "tier host: budget")) << log;
  EXPECT_TRUE(absl::StrContains(log, "stopped cleanly")) << log;
}

// Peers that connect to the arena channel and send nothing delay nobody:
// each waits alone for its deadline (before, attaches were answered one at a
// time with a 2 s wait each, so 30 such peers held a trainer for a minute).
TEST_F(DaemonTest, SilentPeersOnTheArenaChannelDelayNobody) {
  std::vector<UniqueFd> silent;
  for (int i = 0; i < 30; ++i) {
    auto c = ConnectUnix(daemon_->socket_path() + ".arena");
    ASSERT_TRUE(c.ok()) << c.status();
    silent.push_back(std::move(*c));
  }
  const absl::Time start = absl::Now();
  auto s = client_->OpenSession("behind the silent ones");
  ASSERT_TRUE(s.ok()) << s.status();
  RecordProperty("open_ms", std::to_string(absl::ToInt64Milliseconds(absl::Now() - start)));
  ASSERT_TRUE((*s)->Register("w", 10, DType::kFp32, DType::kFp32).ok());
}

// Descriptors of process `pid` open now.
int64_t OpenDescriptorsOf(pid_t pid) {
  int64_t n = 0;
  for (const auto& e :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    (void)e;
    ++n;
  }
  return n;
}

// The lowest descriptor number process `pid` has free: the number its next
// accept or open takes (EMFILE where the limit is at or below it).
rlim_t LowestFreeDescriptorOf(pid_t pid) {
  std::set<rlim_t> used;
  for (const auto& e :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    used.insert(std::stoul(e.path().filename().string()));
  }
  rlim_t n = 0;
  while (used.count(n) != 0) ++n;
  return n;
}

// Sets process `pid`'s soft limit on open descriptors; returns the old one.
rlim_t SetDescriptorLimitOf(pid_t pid, rlim_t soft) {
  rlimit old{};
  EXPECT_EQ(prlimit(pid, RLIMIT_NOFILE, nullptr, &old), 0);
  rlimit now = old;
  now.rlim_cur = soft;
  EXPECT_EQ(prlimit(pid, RLIMIT_NOFILE, &now, nullptr), 0) << std::strerror(errno);
  return old.rlim_cur;
}

// User and system CPU seconds process `pid` used so far.
double CpuSecondsOf(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  std::istringstream fields(text.substr(text.rfind(')') + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);  // utime, stime
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Issue 29: at EMFILE gRPC 1.51's listener stopped accepting for good and
// the arena channel spun on its readable listener, logging each time.
TEST(DaemonStartup, OutOfDescriptorsItRefusesInWordsAndItsListenersComeBack) {
  auto d = DaemonProcess::Start({"--server.max_sessions=6", "--server.reserved_descriptors=32",
                                 "--server.handshake_timeout_seconds=1", "--server.tcp_port=0"});
  ASSERT_TRUE(d.ok()) << d.status();
  const pid_t pid = (*d)->pid();
  auto c = Client::Connect({(*d)->address()});
  ASSERT_TRUE(c.ok()) << c.status();
  std::string tcp;  // 127.0.0.1:port
  auto listening = (*c)->GetStats();
  ASSERT_TRUE(listening.ok()) << listening.status();
  for (const std::string& l : listening->listening) {
    if (absl::StartsWith(l, "127.0.0.1:")) tcp = l;
  }
  ASSERT_FALSE(tcp.empty());
  auto connect_tcp = [&] {
    UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(std::stoi(tcp.substr(tcp.rfind(':') + 1))));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0)
        << std::strerror(errno);
    return fd;
  };
  // Sessions stop at server.max_sessions...
  {
    std::vector<std::unique_ptr<Session>> sessions;
    for (int i = 0; i < 6; ++i) {
      auto s = (*c)->OpenSession(absl::StrCat("s", i));
      ASSERT_TRUE(s.ok()) << s.status();
      sessions.push_back(std::move(*s));
    }
    auto over = (*c)->OpenSession("one too many");
    EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_TRUE(absl::StrContains(over.status().message(), "server.max_sessions 6"))
        << over.status();
  }
  // ... and where fewer than the reserved descriptors would be left; the
  // owner's control calls are still served.
  const rlim_t limit = SetDescriptorLimitOf(pid, OpenDescriptorsOf(pid) + 20);
  auto tight = (*c)->OpenSession("tight");
  EXPECT_EQ(tight.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(tight.status().message(), "server.reserved_descriptors"))
      << tight.status();
  EXPECT_TRUE((*c)->GetStats().ok());

  // Out of descriptors altogether: both listeners' accepts fail (EMFILE;
  // the kernel refuses a number at or past the limit, and hands out the
  // lowest free one).
  SetDescriptorLimitOf(pid, LowestFreeDescriptorOf(pid));
  const double cpu_before = CpuSecondsOf(pid);
  std::vector<UniqueFd> peers;
  for (int i = 0; i < 20; ++i) {
    auto arena = ConnectUnix((*d)->socket_path() + ".arena");
    ASSERT_TRUE(arena.ok()) << arena.status();
    peers.push_back(std::move(*arena));
  }
  // An attach is refused in words, not left hanging.
  timeval tv{5, 0};
  ASSERT_EQ(setsockopt(peers[0].get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0);
  char reply[1024] = {};
  const ssize_t got = recv(peers[0].get(), reply, sizeof(reply) - 1, 0);
  ASSERT_GT(got, 0) << std::strerror(errno);
  EXPECT_TRUE(absl::StrContains(reply, "out of file descriptors")) << reply;
  for (int i = 0; i < 5; ++i) {
    auto raw = ConnectUnix((*d)->socket_path());
    ASSERT_TRUE(raw.ok()) << raw.status();
    peers.push_back(std::move(*raw));
  }
  // The gRPC socket's acceptor pauses (the connections stay queued) and
  // tries again every 100 ms, logging once; on TCP, gRPC's own listener
  // gives up.
  ASSERT_TRUE((*d)->WaitForLog("gRPC acceptor: accept").ok()) << (*d)->ReadLog();
  for (int i = 0; i < 3; ++i) peers.push_back(connect_tcp());
  ASSERT_TRUE((*d)->WaitForLog("gRPC stopped accepting").ok()) << (*d)->ReadLog();
  absl::SleepFor(absl::Seconds(1));
  // No loop spinning on a readable listener (before: a whole core), no
  // line per attempt.
  EXPECT_LT(CpuSecondsOf(pid) - cpu_before, 0.5);
  const std::string log = (*d)->ReadLog();
  int lines = 0;
  for (size_t at = 0; (at = log.find("arena channel: offloadd is out of file descriptors", at)) !=
                      std::string::npos;
       ++at) {
    ++lines;
  }
  EXPECT_GE(lines, 1) << log;
  EXPECT_LE(lines, 2) << log;

  int acceptor_lines = 0;
  for (size_t at = 0; (at = log.find("gRPC acceptor: accept", at)) != std::string::npos; ++at) {
    ++acceptor_lines;
  }
  EXPECT_LE(acceptor_lines, 2) << log;

  // Descriptors come back: the acceptor takes the queued connections and
  // a new client is served (before offloadd accepted them itself, gRPC's
  // listener stopped for good and was rebuilt; before that, deaf until a
  // restart).
  peers.clear();
  SetDescriptorLimitOf(pid, limit);
  ASSERT_TRUE((*d)->WaitForLog("gRPC listeners rebuilt").ok()) << (*d)->ReadLog();
  auto over_tcp = Client::Connect({tcp});
  ASSERT_TRUE(over_tcp.ok()) << over_tcp.status();
  EXPECT_TRUE((*over_tcp)->GetStats().ok());
  auto fresh = Client::Connect({(*d)->address()});
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  auto s = (*fresh)->OpenSession("after");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE((*s)->Register("w", 10, DType::kFp32, DType::kFp32).ok());
  EXPECT_TRUE((*c)->GetStats().ok());  // the first client (Unix socket) never lost its way in
  // The operator sees it in the counters: the acceptor paused, TCP's
  // listener was rebuilt once, the queued connections (silent: closed after
  // the handshake timeout) and the clients' got in.
  EXPECT_GE(CounterOf(**c, "grpc_unix_accept_pauses"), 1);
  EXPECT_EQ(CounterOf(**c, "grpc_tcp_listener_rebuilds"), 1);
  EXPECT_GE(CounterOf(**c, "grpc_unix_connections_accepted"), 2);
}

// Connections that never start HTTP/2 give their descriptors back.
TEST(DaemonStartup, SilentConnectionsAreClosedAfterTheHandshakeTimeout) {
  auto d = DaemonProcess::Start({"--server.handshake_timeout_seconds=1"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto c = Client::Connect({(*d)->address()});
  ASSERT_TRUE(c.ok()) << c.status();
  const int64_t dropped = CounterOf(**c, "grpc_unix_connections_dropped");
  const int64_t before = OpenDescriptorsOf((*d)->pid());
  std::vector<UniqueFd> silent;
  for (int i = 0; i < 100; ++i) {
    auto raw = ConnectUnix((*d)->socket_path());
    ASSERT_TRUE(raw.ok()) << raw.status();
    silent.push_back(std::move(*raw));
  }
  // Each is closed by the daemon: a read sees the end.
  for (UniqueFd& fd : silent) {
    timeval tv{10, 0};
    ASSERT_EQ(setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0);
    char buf[256];
    ssize_t got;
    while ((got = recv(fd.get(), buf, sizeof(buf), 0)) > 0) {
    }
    ASSERT_EQ(got, 0) << std::strerror(errno);
  }
  // (gRPC shuts a connection down at once and closes it a moment later.)
  auto pidfd = ::offload::testing::OpenPidFd((*d)->pid());
  ASSERT_TRUE(pidfd.ok()) << pidfd.status();
  EXPECT_TRUE(::offload::testing::PollWithBackoff(
                  [&] { return OpenDescriptorsOf((*d)->pid()) <= before + 5; }, pidfd->get())
                  .ok())
      << OpenDescriptorsOf((*d)->pid()) << " descriptors open, " << before << " before";
  // Counted as dropped; the client's connection as accepted.
  EXPECT_EQ(CounterOf(**c, "grpc_unix_connections_dropped"), dropped + 100);
  EXPECT_EQ(CounterOf(**c, "grpc_unix_connections_accepted"), 1);
  EXPECT_EQ(CounterOf(**c, "grpc_unix_connections_refused"), 0);
}

// offloadd raises its open-descriptor limit to the hard limit at start
// (it inherits a lowered one here).
TEST(DaemonStartup, RaisesItsDescriptorLimit) {
  rlimit ours{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &ours), 0);
  rlimit low = ours;
  low.rlim_cur = std::min<rlim_t>(ours.rlim_max, 256);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  auto d = DaemonProcess::Start({});
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &ours), 0);
  ASSERT_TRUE(d.ok()) << d.status();
  std::ifstream limits("/proc/" + std::to_string((*d)->pid()) + "/limits");
  std::string line;
  bool found = false;
  while (std::getline(limits, line)) {
    if (line.rfind("Max open files", 0) != 0) continue;
    found = true;
    std::istringstream fields(line.substr(std::string("Max open files").size()));
    std::string soft, hard;
    fields >> soft >> hard;
    EXPECT_EQ(soft, hard) << line;
    EXPECT_EQ(soft, std::to_string(ours.rlim_max)) << line;
  }
  EXPECT_TRUE(found);
}

TEST_F(DaemonTest, SecondDaemonOnTheSameSocketRefusesToStart) {
  auto result = ::offload::testing::RunCommand(
      {"daemon/offloadd", "--server.data_dir=" + daemon_->data_dir()});
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->exit_code, 1);
  // (Its data directory, the first's, is what it finds taken first.)
  EXPECT_TRUE(absl::StrContains(result->output, "is in use by another offloadd")) << result->output;
  // And the first one is unharmed.
  EXPECT_TRUE(client_->GetStats().ok());
}

// Another offloadd in the same data directory, with a socket of its own,
// refuses to start (it would reopen the same kept sessions, mark this
// one's live checkpoints lost and replace its token); this one is unharmed.
TEST_F(DaemonTest, ASecondDaemonOnTheSameDataDirRefusesToStart) {
  const std::string token = daemon_->data_dir() + "/tcp_token";
  const bool had_token = std::filesystem::exists(token);
  // Its own NVMe and pool directories: it touches neither (no swap file
  // reserved there, no pool claimed) before it finds the data directory
  // taken.
  char nvme[] = "/var/tmp/offloadd_second_nvme.XXXXXX";
  char pool[] = "/dev/shm/offloadd_second_pool.XXXXXX";
  ASSERT_NE(mkdtemp(nvme), nullptr);
  ASSERT_NE(mkdtemp(pool), nullptr);
  RemoveOnExit remove_nvme(nvme), remove_pool(pool);
  auto result = ::offload::testing::RunCommand(
      {"daemon/offloadd", "--server.data_dir=" + daemon_->data_dir(),
       "--server.socket=" + daemon_->data_dir() + "/second.sock",
       std::string("--nvme.dirs=") + nvme, std::string("--memory.pool_dir=") + pool});
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->exit_code, 1);
  EXPECT_TRUE(absl::StrContains(
      result->output, "is in use by another offloadd (pid " + std::to_string(daemon_->pid())))
      << result->output;
  EXPECT_EQ(std::filesystem::exists(token), had_token);
  EXPECT_TRUE(std::filesystem::is_empty(nvme));
  EXPECT_TRUE(std::filesystem::is_empty(pool));
  EXPECT_TRUE(client_->GetStats().ok());
}

// A log line to a pipe whose reader went (offloadd 2>&1 | tee, the tee
// gone) ends nothing: offloadd serves on and stops cleanly.
TEST(DaemonStartup, ALogLineToAPipeNobodyReadsEndsNothing) {
  char dir[] = "/tmp/offloadd_pipe.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  RemoveOnExit remove(dir);
  int out[2];
  ASSERT_EQ(pipe2(out, O_CLOEXEC), 0);
  const std::string data_dir = std::string("--server.data_dir=") + dir;
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    dup2(out[1], STDERR_FILENO);
    execl("daemon/offloadd", "daemon/offloadd", data_dir.c_str(), nullptr);
    _exit(127);
  }
  ASSERT_GT(pid, 0);
  close(out[1]);
  std::string said;
  char buf[4096];
  while (said.find("serving gRPC") == std::string::npos) {
    const ssize_t n = read(out[0], buf, sizeof(buf));
    if (n <= 0) break;
    said.append(buf, static_cast<size_t>(n));
  }
  ASSERT_NE(said.find("serving gRPC"), std::string::npos) << said;
  close(out[0]);                    // the reader goes
  ASSERT_EQ(kill(pid, SIGHUP), 0);  // and offloadd logs
  absl::SleepFor(absl::Milliseconds(300));
  auto c = Client::Connect({std::string("unix:") + dir + "/offloadd.sock"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->GetStats().ok());
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// A socket listening on a port of 127.0.0.1 the kernel chose (`*port`), with
// SO_REUSEPORT where asked; -1 if any step failed.
int ListenOnLoopback(int* port, bool reuse_port) {
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const int yes = 1;
  if (!fd.valid() ||
      (reuse_port && setsockopt(fd.get(), SOL_SOCKET, SO_REUSEPORT, &yes, sizeof(yes)) != 0)) {
    return -1;
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(fd.get(), 1) != 0 ||
      getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return -1;
  }
  *port = ntohs(addr.sin_port);
  return fd.release();
}

// memory.pool_dir is checked before anything in it is read: one others may
// write is refused, and a marker that is not a file (a FIFO another user
// planted before the directory was first made: the start hung on it; a
// link to /dev/zero: it read until memory ran out) is named, not read. A
// data directory that is another user's symbolic link is refused; a start
// that fails after writing its TCP token (its port taken) removes it.
TEST(DaemonStartup, ChecksWhatOthersCouldHavePlantedBeforeReadingIt) {
  char dir[] = "/tmp/offloadd_planted.XXXXXX";
  char pool[] = "/dev/shm/offloadd_planted_pool.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  ASSERT_NE(mkdtemp(pool), nullptr);
  RemoveOnExit remove(dir), remove_pool(pool);
  const std::string data_dir = std::string("--server.data_dir=") + dir + "/data";
  auto start = [&](const std::vector<std::string>& flags) {
    std::vector<std::string> argv = {"/usr/bin/timeout", "-s",    "KILL", "20",
                                     "daemon/offloadd",  data_dir};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto r = ::offload::testing::RunCommand(argv);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : ::offload::testing::CommandResult{};
  };
  const std::string pool_flag = std::string("--memory.pool_dir=") + pool;
  ASSERT_EQ(chmod(pool, 0777), 0);
  auto open = start({pool_flag});
  EXPECT_EQ(open.exit_code, 1) << open.output;
  EXPECT_TRUE(absl::StrContains(open.output, "writable by other users")) << open.output;
  ASSERT_EQ(chmod(pool, 0700), 0);
  for (const char* planted : {"fifo", "/dev/zero"}) {
    SCOPED_TRACE(planted);
    const std::string marker = std::string(pool) + "/data_dir";
    unlink(marker.c_str());
    if (std::string(planted) == "fifo") {
      ASSERT_EQ(mkfifo(marker.c_str(), 0600), 0);
    } else {
      ASSERT_EQ(symlink(planted, marker.c_str()), 0);
    }
    auto r = start({pool_flag});
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_TRUE(absl::StrContains(r.output, "data_dir")) << r.output;
  }
  // Another user's link as the data directory (making one needs root).
  if (geteuid() == 0) {
    const std::string own = std::string(dir) + "/own";
    ASSERT_EQ(mkdir(own.c_str(), 0700), 0);
    const std::string link = std::string(dir) + "/link";
    ASSERT_EQ(symlink(own.c_str(), link.c_str()), 0);
    ASSERT_EQ(lchown(link.c_str(), 65534, 65534), 0);
    auto linked = ::offload::testing::RunCommand(
        {"/usr/bin/timeout", "-s", "KILL", "20", "daemon/offloadd", "--server.data_dir=" + link});
    ASSERT_TRUE(linked.ok());
    EXPECT_EQ(linked->exit_code, 1) << linked->output;
    EXPECT_TRUE(absl::StrContains(linked->output, "is a symbolic link uid 65534 made"))
        << linked->output;
  }
  // The TCP port taken: the start fails after writing its token.
  int taken_port = 0;
  const int taken = ListenOnLoopback(&taken_port, /*reuse_port=*/false);
  ASSERT_GE(taken, 0);
  auto port = start({absl::StrCat("--server.tcp_port=", taken_port)});
  close(taken);
  EXPECT_EQ(port.exit_code, 1) << port.output;
  EXPECT_FALSE(std::filesystem::exists(std::string(dir) + "/data/tcp_token"));
}

// server.socket_group with the socket where the group cannot reach it (the
// default: in the data directory, 0700): the start says so (it said the
// group was served, and its members were refused); with the socket in a
// directory they may search, nothing is said.
TEST(DaemonStartup, ASocketGroupThatCannotReachTheSocketIsWarnedOf) {
  auto d = DaemonProcess::Start({"--server.socket_group=users"});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE((*d)->WaitForLog("its members cannot reach the socket").ok()) << (*d)->ReadLog();
  ASSERT_TRUE((*d)->Stop().ok());
  std::string dir;
  std::unique_ptr<RemoveOnExit> remove_dir;
  auto shared = StartGroupShared({}, &dir, &remove_dir);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_FALSE(absl::StrContains((*shared)->ReadLog(), "cannot reach")) << (*shared)->ReadLog();
}

// A client that finds no answer says why, as far as a plain connection
// tells: a socket file nobody listens on (an offloadd gone) and one that
// takes connections but never answers (a stopped offloadd, or one refusing
// this user) are told apart; both said "is it running? start it", which
// misleads for the second (a second offloadd there would be refused).
TEST(ClientConnect, SaysWhyNothingAnswers) {
  char dir[] = "/tmp/offloadd_noanswer.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  RemoveOnExit remove(dir);
  auto bound = [&](const std::string& name, bool listening) {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    EXPECT_GE(fd, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string path = std::string(dir) + "/" + name;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
    EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    if (listening) {
      EXPECT_EQ(listen(fd, 8), 0);
    }
    return std::make_pair(fd, path);
  };
  auto [stale, stale_path] = bound("gone.sock", false);
  close(stale);  // (the file stays)
  ClientOptions options;
  options.connect_timeout = absl::Milliseconds(300);
  options.address = "unix:" + stale_path;
  auto gone = Client::Connect(options);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(gone.status().message(), "no offloadd listens on"))
      << gone.status();
  auto [silent, silent_path] = bound("silent.sock", true);
  options.address = "unix:" + silent_path;
  auto mute = Client::Connect(options);
  close(silent);
  EXPECT_EQ(mute.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(mute.status().message(), "takes connections but nothing answered"))
      << mute.status();
  // Its queue full (a stopped offloadd, clients still knocking): said at
  // once, where a blocking probe waited for good.
  auto [full, full_path] = bound("full.sock", true);
  std::vector<int> knocking;
  for (int i = 0; i < 4096; ++i) {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", full_path.c_str());
    const bool in = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    knocking.push_back(fd);
    if (!in) break;
  }
  options.address = "unix:" + full_path;
  auto queued = Client::Connect(options);
  for (int fd : knocking) close(fd);
  close(full);
  EXPECT_EQ(queued.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(queued.status().message(), "queue of connections full"))
      << queued.status();
}

// A TCP or metrics port another process listens on with SO_REUSEPORT (as
// gRPC's and httplib's listeners did by default: a second offloadd given
// the first's ports started, and the kernel shared each port's
// connections between the two) is taken: the start fails, naming it.
TEST(DaemonStartup, APortListenedOnWithReusePortIsTaken) {
  char dir[] = "/tmp/offloadd_reuseport.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  RemoveOnExit remove(dir);
  for (const char* flag : {"--server.tcp_port=", "--metrics.port="}) {
    SCOPED_TRACE(flag);
    int port = 0;
    const int taken = ListenOnLoopback(&port, /*reuse_port=*/true);
    ASSERT_GE(taken, 0);
    auto r = ::offload::testing::RunCommand(
        {"/usr/bin/timeout", "-s", "KILL", "20", "daemon/offloadd",
         std::string("--server.data_dir=") + dir + "/data", absl::StrCat(flag, port)});
    close(taken);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->exit_code, 1) << r->output;
    EXPECT_TRUE(absl::StrContains(r->output, absl::StrCat("127.0.0.1:", port))) << r->output;
  }
}

// Issue 11's known breaks: a socket path naming a regular file deleted it;
// a data directory others can write was accepted.
TEST(DaemonStartup, RefusesToReplaceAFileOrUseAnOpenDirectory) {
  char dir[] = "/tmp/offloadd_cfg.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  RemoveOnExit remove(dir);
  const std::string file = std::string(dir) + "/precious.txt";
  std::ofstream(file) << "keep me";
  auto r = ::offload::testing::RunCommand(
      {"daemon/offloadd", std::string("--server.data_dir=") + dir, "--server.socket=" + file});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->exit_code, 1);
  EXPECT_TRUE(absl::StrContains(r->output, "is not a Unix socket")) << r->output;
  std::ifstream in(file);
  std::string kept;
  std::getline(in, kept);
  EXPECT_EQ(kept, "keep me");

  const std::string open_dir = std::string(dir) + "/open";
  ASSERT_EQ(mkdir(open_dir.c_str(), 0700), 0);
  ASSERT_EQ(chmod(open_dir.c_str(), 0777), 0);
  auto o = ::offload::testing::RunCommand({"daemon/offloadd", "--server.data_dir=" + open_dir});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->exit_code, 1);
  EXPECT_TRUE(absl::StrContains(o->output, "writable by other users (mode 0777)")) << o->output;
}

// Where systemd's notifications ($NOTIFY_SOCKET) come, in `dir`: each
// datagram, as offloadd sent it.
class NotifyListener {
 public:
  explicit NotifyListener(const std::string& dir) : path_(dir + "/notify") {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path_.c_str(), sizeof(addr.sun_path) - 1);
    EXPECT_EQ(bind(fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    timeval tv{20, 0};
    EXPECT_EQ(setsockopt(fd_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0);
  }
  const std::string& path() const { return path_; }
  // The next datagram; "(nothing)" after 20 s without one.
  std::string Next() {
    char buf[256] = {};
    const ssize_t got = recv(fd_.get(), buf, sizeof(buf) - 1, 0);
    return got > 0 ? std::string(buf, static_cast<size_t>(got)) : std::string("(nothing)");
  }

 private:
  const std::string path_;
  UniqueFd fd_{socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0)};
};

// Under systemd (Type=notify): READY=1 once it serves; SIGHUP re-reads the
// config file, applying what can change live and naming what cannot.
TEST(DaemonStartup, TellsSystemdItIsReadyAndRereadsItsConfigOnSighup) {
  char dir[] = "/tmp/offloadd_notify.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  RemoveOnExit remove_dir(dir);
  NotifyListener listener(dir);
  auto next = [&] { return listener.Next(); };
  const std::string config = std::string(dir) + "/offloadd.yaml";
  std::ofstream(config) << "optimizer:\n  threads: 1\ncheckpoint:\n  auto_every_steps: 5\n";
  setenv("NOTIFY_SOCKET", listener.path().c_str(), 1);
  auto d = DaemonProcess::Start({"--config=" + config, "--checkpoint.auto_every_steps=3"});
  unsetenv("NOTIFY_SOCKET");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(next(), "READY=1");
  auto c = Client::Connect({(*d)->address()});
  ASSERT_TRUE(c.ok()) << c.status();
  std::ofstream(config, std::ios::trunc)
      << "optimizer:\n  threads: 2\nmemory:\n  lock_pool: true\ncheckpoint:\n"
         "  auto_every_steps: 5\n  auto_interval_seconds: 10min\n  auto_dir: \"\"\n";
  ASSERT_EQ(kill((*d)->pid(), SIGHUP), 0);
  EXPECT_EQ(next(), "RELOADING=1");
  EXPECT_EQ(next(), "READY=1");
  ASSERT_TRUE((*d)->WaitForLog("SIGHUP: re-read").ok());
  EXPECT_EQ((*c)->GetTunable("optimizer.threads")->value, "2");            // applied live
  EXPECT_EQ((*c)->GetTunable("memory.lock_pool")->value, "false");         // at the next start
  EXPECT_EQ((*c)->GetTunable("checkpoint.auto_every_steps")->value, "3");  // the command line's
  ASSERT_TRUE((*d)->WaitForLog("memory.lock_pool=true cannot change while offloadd runs").ok())
      << (*d)->ReadLog();
  ASSERT_TRUE(
      (*d)->WaitForLog("refused (the value in force stays): checkpoint.auto_interval_").ok())
      << (*d)->ReadLog();
  // Its default, unchanged, is not said to need a restart.
  EXPECT_FALSE(absl::StrContains((*d)->ReadLog(), "checkpoint.auto_dir")) << (*d)->ReadLog();
  // A file that no longer parses changes nothing.
  std::ofstream(config, std::ios::trunc) << "optimizer: [\n";
  ASSERT_EQ(kill((*d)->pid(), SIGHUP), 0);
  ASSERT_TRUE((*d)->WaitForLog("nothing changed").ok()) << (*d)->ReadLog();
  EXPECT_EQ((*c)->GetTunable("optimizer.threads")->value, "2");
  // A setting the file no longer names goes back to its default, as a
  // restart would have it (it kept the file's old value); a bad value of
  // one the command line sets is refused all the same, as the next start
  // would refuse it (it was not looked at).
  std::ofstream(config, std::ios::trunc) << "checkpoint:\n  auto_every_steps: lots\n";
  ASSERT_EQ(kill((*d)->pid(), SIGHUP), 0);
  ASSERT_TRUE(
      (*d)->WaitForLog("refused (the value in force stays): checkpoint.auto_every_steps").ok())
      << (*d)->ReadLog();
  auto threads = (*c)->GetTunable("optimizer.threads");
  ASSERT_TRUE(threads.ok());
  EXPECT_EQ(threads->value, threads->default_value);
  EXPECT_EQ((*c)->GetTunable("checkpoint.auto_every_steps")->value, "3");
  EXPECT_TRUE((*c)->GetStats().ok());
  auto stopped = (*d)->Stop();
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(*stopped, 0);
  // (RELOADING and READY of the second and third SIGHUP come first.)
  std::string last;
  for (int i = 0; i < 5; ++i) last = next();
  EXPECT_EQ(last, "STOPPING=1");
}

// A user other than offloadd's own (a member of the socket's group) has at
// most server.max_sessions_per_user sessions attached: its next attach is
// RESOURCE_EXHAUSTED naming the bound, and the session it asked for (new,
// never attached) is closed; offloadd's own user is not bound by it.
TEST(DaemonStartup, AnotherUserHoldsAtMostItsShareOfSessions) {
  if (geteuid() != 0) GTEST_SKIP() << "becoming another user needs root";
  std::string dir;
  std::unique_ptr<RemoveOnExit> remove_dir;
  auto d = StartGroupShared({"--server.max_sessions_per_user=2"}, &dir, &remove_dir);
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string socket_path = dir + "/offloadd.sock";
  auto channel = grpc::CreateChannel("unix:" + socket_path, grpc::InsecureChannelCredentials());
  auto stub = v1::PartitionService::NewStub(channel);
  auto open = [&] {
    v1::OpenSessionResponse opened;
    grpc::ClientContext ctx;
    EXPECT_TRUE(stub->OpenSession(&ctx, {}, &opened).ok());
    return opened;
  };
  std::vector<v1::OpenSessionResponse> sessions;
  for (int i = 0; i < 4; ++i) sessions.push_back(open());
  // As nobody, in group users, holding each attachment: bit i set if the
  // i-th attached, bit 4 + i if it was refused for the bound.
  const pid_t pid = fork();
  if (pid == 0) {
    if (!BecomeNobody(/*in_users=*/true)) _exit(255);
    int result = 0;
    std::vector<Attachment> held;
    for (int i = 0; i < 4; ++i) {
      const AttachRequest request{sessions[i].session().session_id(),
                                  sessions[i].session().token()};
      absl::StatusOr<Attachment> a = AttachArena(sessions[i].arena_socket(), request);
      if (a.ok()) {
        result |= 1 << i;
        held.push_back(*std::move(a));
      } else if (absl::IsResourceExhausted(a.status()) &&
                 absl::StrContains(a.status().message(), "server.max_sessions_per_user 2") &&
                 absl::StrContains(a.status().message(), "is closed")) {
        result |= 1 << (4 + i);
      }
    }
    _exit(result);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 0x03 | 0xc0);
  // The refused ones are closed; offloadd's own user attaches past the bound.
  for (int i = 2; i < 4; ++i) {
    v1::GetPendingGradientsRequest req;
    *req.mutable_session() = sessions[i].session();
    v1::GetPendingGradientsResponse resp;
    grpc::ClientContext ctx;
    EXPECT_EQ(stub->GetPendingGradients(&ctx, req, &resp).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  std::vector<Attachment> mine;
  for (int i = 0; i < 3; ++i) {
    const v1::OpenSessionResponse opened = open();
    absl::StatusOr<Attachment> a = AttachArena(
        opened.arena_socket(), {opened.session().session_id(), opened.session().token()});
    ASSERT_TRUE(a.ok()) << a.status();
    mine.push_back(*std::move(a));
  }
}

// A user other than offloadd's own opens at most
// server.max_sessions_per_user sessions, attached or not (one never
// attached would otherwise hold its descriptor and thread until the attach
// lease): its next OpenSession is RESOURCE_EXHAUSTED naming the bound and
// the user, one more opens once one of its sessions closes, and offloadd's
// own user is not bound by it.
TEST(DaemonStartup, AnotherUserOpensAtMostItsShareOfSessions) {
  if (geteuid() != 0) GTEST_SKIP() << "becoming another user needs root";
  std::string dir;
  std::unique_ptr<RemoveOnExit> remove_dir;
  auto d = StartGroupShared({"--server.max_sessions_per_user=2"}, &dir, &remove_dir);
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string socket_path = dir + "/offloadd.sock";
  // As nobody, in group users: its lines, one per OpenSession.
  auto open_as_nobody = [&](int count) {
    const RanAsNobody ran =
        RunAsNobody(dir, "tests/open_sessions", {"unix:" + socket_path, std::to_string(count)},
                    /*with_stderr=*/false);
    EXPECT_EQ(ran.status, 0) << ran.output;
    return std::vector<std::string>(absl::StrSplit(ran.output, '\n', absl::SkipEmpty()));
  };
  const std::vector<std::string> first = open_as_nobody(3);
  ASSERT_EQ(first.size(), 3u) << absl::StrJoin(first, "\n");
  EXPECT_TRUE(absl::StartsWith(first[0], "OK ")) << first[0];
  EXPECT_TRUE(absl::StartsWith(first[1], "OK ")) << first[1];
  const std::string refused = absl::StrCat(static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED),
                                           " uid 65534 has 2 sessions open");
  EXPECT_TRUE(absl::StartsWith(first[2], refused)) << first[2];
  EXPECT_TRUE(absl::StrContains(first[2], "server.max_sessions_per_user 2")) << first[2];
  // offloadd's own user opens past the bound.
  auto channel = grpc::CreateChannel("unix:" + socket_path, grpc::InsecureChannelCredentials());
  auto stub = v1::PartitionService::NewStub(channel);
  for (int i = 0; i < 3; ++i) {
    v1::OpenSessionResponse opened;
    grpc::ClientContext ctx;
    EXPECT_TRUE(stub->OpenSession(&ctx, {}, &opened).ok());
  }
  // One of nobody's sessions closes (with its token): nobody opens one more,
  // and no more than that.
  const std::vector<std::string> ok = absl::StrSplit(first[0], ' ');
  ASSERT_EQ(ok.size(), 3u);
  v1::CloseSessionRequest close_request;
  uint64_t id = 0;
  ASSERT_TRUE(absl::SimpleAtoi(ok[1], &id));
  close_request.mutable_session()->set_session_id(id);
  close_request.mutable_session()->set_token(absl::HexStringToBytes(ok[2]));
  {
    v1::CloseSessionResponse closed;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->CloseSession(&ctx, close_request, &closed).ok());
  }
  const std::vector<std::string> second = open_as_nobody(2);
  ASSERT_EQ(second.size(), 2u) << absl::StrJoin(second, "\n");
  EXPECT_TRUE(absl::StartsWith(second[0], "OK ")) << second[0];
  EXPECT_TRUE(absl::StartsWith(second[1], refused)) << second[1];
}

// offloadd accepts its gRPC socket's connections itself: a user other than
// its own holds at most server.max_connections_per_user of them (waiting for
// their first bytes or serving calls); its next is closed at once, while
// offloadd's own user still gets in.
TEST(DaemonStartup, AnotherUserHoldsAtMostItsShareOfConnections) {
  if (geteuid() != 0) GTEST_SKIP() << "becoming another user needs root";
  std::string dir;
  std::unique_ptr<RemoveOnExit> remove_dir;
  auto d = StartGroupShared({"--server.max_connections_per_user=3"}, &dir, &remove_dir);
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string socket_path = dir + "/offloadd.sock";
  // As nobody, in group users: five connections, each starting HTTP/2 (the
  // client preface and an empty SETTINGS frame) and held open. Exit status:
  // how many the daemon closed (its end read within a second), plus 10 if,
  // once one of the kept ones was closed by the client, a new one is kept.
  const pid_t pid = fork();
  if (pid == 0) {
    if (!BecomeNobody(/*in_users=*/true)) _exit(255);
    static constexpr char kHello[] =
        "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";
    auto start = [&]() -> UniqueFd {
      absl::StatusOr<UniqueFd> c = ConnectUnix(socket_path);
      if (!c.ok()) _exit(254);
      (void)!send(c->get(), kHello, sizeof(kHello) - 1, MSG_NOSIGNAL);
      timeval tv{1, 0};
      setsockopt(c->get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      return *std::move(c);
    };
    // Closed by the daemon: its end read (a kept one answers with its
    // SETTINGS).
    auto closed = [](UniqueFd& c) {
      char buf[256];
      const ssize_t n = recv(c.get(), buf, sizeof(buf), 0);
      return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);  // (ECONNRESET)
    };
    std::vector<UniqueFd> held;
    for (int i = 0; i < 5; ++i) {
      held.push_back(start());
      absl::SleepFor(absl::Milliseconds(50));  // one after another, as counted
    }
    int result = 0;
    for (UniqueFd& c : held) result += closed(c) ? 1 : 0;
    held.front().reset();  // one of the kept ones goes: room for another,
    // once gRPC closed its end (asynchronously: tried for up to 5 s)
    for (int tries = 0; tries < 50; ++tries) {
      UniqueFd again = start();
      if (!closed(again)) {
        result += 10;
        break;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    _exit(result);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 12);
  EXPECT_TRUE(absl::StrContains((*d)->ReadLog(), "server.max_connections_per_user 3"))
      << (*d)->ReadLog();
  auto c = Client::Connect({"unix:" + socket_path});
  ASSERT_TRUE(c.ok()) << c.status();
  // The two refused at once and those refused while waiting for room.
  EXPECT_GE(CounterOf(**c, "grpc_unix_connections_refused"), 2);
}

// A member of the socket group that opens connections to the arena socket
// and sends nothing holds at most a quarter of the slots for attaches
// waiting for their request (64 of 256, each for up to 2 s): offloadd's own
// user (and every other member) still attaches meanwhile.
TEST(DaemonStartup, AnotherUserHoldsAtMostItsShareOfWaitingAttaches) {
  if (geteuid() != 0) GTEST_SKIP() << "becoming another user needs root";
  std::string dir;
  std::unique_ptr<RemoveOnExit> remove_dir;
  auto d = StartGroupShared({}, &dir, &remove_dir);
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string socket_path = dir + "/offloadd.sock";
  int ready[2], done[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(done), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    close(ready[0]);
    close(done[1]);
    if (!BecomeNobody(/*in_users=*/true)) _exit(8);
    std::vector<UniqueFd> held;
    for (int i = 0; i < 300; ++i) {
      absl::StatusOr<UniqueFd> c = ConnectUnix(socket_path + ".arena");
      if (c.ok()) held.push_back(*std::move(c));
    }
    absl::SleepFor(absl::Milliseconds(200));  // (accepted, or refused, by now)
    (void)!write(ready[1], "r", 1);
    char b;
    (void)!read(done[0], &b, 1);  // held until offloadd's user attached
    _exit(held.size() == 300 ? 0 : 9);
  }
  close(ready[1]);
  close(done[0]);
  char b;
  ASSERT_EQ(read(ready[0], &b, 1), 1);
  auto c = Client::Connect({"unix:" + socket_path});
  ASSERT_TRUE(c.ok()) << c.status();
  auto session = (*c)->OpenSession("beside");
  EXPECT_TRUE(session.ok()) << session.status();
  (void)!write(done[1], "d", 1);
  close(ready[0]);
  close(done[1]);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 0);
}

// server.socket_group: the trainers' group reaches both sockets and
// attaches; other users still do not.
TEST(DaemonStartup, ASocketGroupLetsItsMembersIn) {
  if (geteuid() != 0) GTEST_SKIP() << "becoming another user needs root";
  std::string dir;
  std::unique_ptr<RemoveOnExit> remove_dir;
  auto d = StartGroupShared({}, &dir, &remove_dir);
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string socket_path = dir + "/offloadd.sock";
  struct stat st;
  ASSERT_EQ(stat(socket_path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  EXPECT_EQ(st.st_gid, 100u);
  ASSERT_EQ(stat((socket_path + ".arena").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  auto c = Client::Connect({"unix:" + socket_path});
  ASSERT_TRUE(c.ok()) << c.status();
  auto channel = grpc::CreateChannel("unix:" + socket_path, grpc::InsecureChannelCredentials());
  auto stub = v1::PartitionService::NewStub(channel);
  v1::OpenSessionResponse opened;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->OpenSession(&ctx, {}, &opened).ok());
  }
  const AttachRequest request{opened.session().session_id(), opened.session().token()};
  // As nobody, in group users or not: 1 = reached the gRPC socket, 2 =
  // got an arena; 8 = could not become nobody. (Raw sockets only: gRPC
  // does not survive a fork of a process with its threads running.)
  auto as_nobody = [&](bool in_group) {
    const pid_t pid = fork();
    if (pid == 0) {
      if (!BecomeNobody(in_group)) _exit(8);
      int result = 0;
      if (ConnectUnix(socket_path).ok()) result |= 1;
      if (AttachArena(opened.arena_socket(), request).ok()) result |= 2;
      _exit(result);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  EXPECT_EQ(as_nobody(true), 3);
  EXPECT_EQ(as_nobody(false), 0);
  // A member may not act as the operator: offloadctl share, run as nobody
  // in the group, is PERMISSION_DENIED. (On a session of its own: the
  // attaches above closed the first when their processes exited.)
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->OpenSession(&ctx, {}, &opened).ok());
  }
  {
    const RanAsNobody ran = RunAsNobody(dir, "client/offloadctl",
                                        {"--address=unix:" + socket_path, "share",
                                         std::to_string(opened.session().session_id()), "7"},
                                        /*with_stderr=*/true);
    EXPECT_EQ(ran.status, 1) << ran.output;
    EXPECT_TRUE(absl::StrContains(ran.output, "PERMISSION_DENIED")) << ran.output;
    const RanAsNobody closed = RunAsNobody(
        dir, "client/offloadctl",
        {"--address=unix:" + socket_path, "close", std::to_string(opened.session().session_id())},
        /*with_stderr=*/true);
    EXPECT_EQ(closed.status, 1) << closed.output;
    EXPECT_TRUE(absl::StrContains(closed.output, "PERMISSION_DENIED")) << closed.output;
  }
  // The operator's actions need the token the daemon wrote for its own user.
  std::ifstream token_file((*d)->data_dir() + "/tcp_token");
  std::string token((std::istreambuf_iterator<char>(token_file)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(token.empty());
  EXPECT_EQ((*c)->SetShare(opened.session().session_id(), 7).code(),
            absl::StatusCode::kPermissionDenied);
  ClientOptions with_token;
  with_token.address = "unix:" + socket_path;
  with_token.token = token;
  auto operator_client = Client::Connect(with_token);
  ASSERT_TRUE(operator_client.ok()) << operator_client.status();
  const absl::Status by_operator = (*operator_client)->SetShare(opened.session().session_id(), 7);
  EXPECT_TRUE(by_operator.ok()) << by_operator;
  EXPECT_EQ((*c)->SetTunable("optimizer.threads", "1").status().code(),
            absl::StatusCode::kPermissionDenied);
  // A group that does not exist: offloadd does not start.
  auto bad = DaemonProcess::Start({"--server.socket_group=no-such-group-here"});
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "no group named")) << bad.status();
}

TEST(DaemonStartup, ConfigFileFlagsAndLoopbackTcp) {
  char dir[] = "/tmp/offloadd_cfg.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  RemoveOnExit remove_1(dir);
  std::string config = std::string(dir) + "/offloadd.yaml";
  std::ofstream(config) << "optimizer:\n  threads: 1\n  tile_elems: 8192\nserver:\n  tcp_port: 0\n";
  auto d = DaemonProcess::Start({"--config=" + config, "--optimizer.tile_elems=16384"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto c = Client::Connect({(*d)->address()});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->GetTunable("optimizer.threads")->value, "1");
  EXPECT_EQ((*c)->GetTunable("optimizer.tile_elems")->value, "16384");  // flag beats file
  auto stats = (*c)->GetStats();
  ASSERT_TRUE(stats.ok());
  std::string tcp;
  for (const std::string& l : stats->listening) {
    if (absl::StartsWith(l, "127.0.0.1:")) tcp = l;
  }
  ASSERT_FALSE(tcp.empty());
  auto over_tcp = Client::Connect({tcp});
  ASSERT_TRUE(over_tcp.ok()) << over_tcp.status();
  // Status is read-only and every local user's, but session names are the
  // owner's: left out over TCP without the token.
  auto named = (*c)->OpenSession("secret-experiment");
  ASSERT_TRUE(named.ok()) << named.status();
  auto tcp_stats = (*over_tcp)->GetStats();
  ASSERT_TRUE(tcp_stats.ok()) << tcp_stats.status();
  ASSERT_EQ(tcp_stats->sessions.size(), 1u);
  EXPECT_EQ(tcp_stats->sessions[0].name, "");
  EXPECT_EQ((*c)->GetStats()->sessions[0].name, "secret-experiment");
  // Over TCP, any local user could connect: read-only status without the
  // token (issue 11's known break: tunables, sessions and budget were open).
  EXPECT_TRUE((*over_tcp)->GetTunable("optimizer.threads").ok());
  auto set = (*over_tcp)->SetTunable("optimizer.threads", "2");
  EXPECT_EQ(set.status().code(), absl::StatusCode::kPermissionDenied) << set.status();
  EXPECT_TRUE(absl::StrContains(set.status().message(), "tcp_token")) << set.status();
  EXPECT_EQ((*over_tcp)->OpenSession("x").status().code(), absl::StatusCode::kPermissionDenied);
  // The token: a file only offloadd's user can read; with it, TCP may change.
  const std::string token_file = (*d)->data_dir() + "/tcp_token";
  struct stat st;
  ASSERT_EQ(stat(token_file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  std::string token;
  std::getline(std::ifstream(token_file), token);
  EXPECT_EQ(token.size(), 32u);
  ClientOptions with_token;
  with_token.address = tcp;
  with_token.token = "0" + token.substr(1);  // a wrong one first
  if (with_token.token == token) with_token.token = "1" + token.substr(1);
  auto wrong = Client::Connect(with_token);
  ASSERT_TRUE(wrong.ok());
  EXPECT_EQ((*wrong)->SetTunable("optimizer.threads", "2").status().code(),
            absl::StatusCode::kPermissionDenied);
  with_token.token = token;
  auto right = Client::Connect(with_token);
  ASSERT_TRUE(right.ok());
  EXPECT_TRUE((*right)->SetTunable("optimizer.threads", "2").ok());
  EXPECT_EQ((*right)->GetStats()->sessions[0].name, "secret-experiment");
  ASSERT_TRUE((*named)->Close().ok());
  // The Unix socket needs none.
  EXPECT_TRUE((*c)->SetTunable("optimizer.threads", "1").ok());
  ASSERT_TRUE((*d)->Stop().ok());
  EXPECT_NE(access(token_file.c_str(), F_OK), 0);  // removed at exit
}

// Every kind of data at `percent` on the host.
Placement AllAt(int percent) {
  Placement p;
  p.params_host_percent = percent;
  p.grads_host_percent = percent;
  p.optimizer_state_host_percent = percent;
  return p;
}

// The tiered store end to end: the demo MLP with its parameters, gradients
// and optimizer state all on the NVMe tier, its optimizer state (with the
// gradient accumulator) alone over four times the host pool, trains to exactly the losses of the
// same model with everything in memory, following the residency contract (the demo holds one
// partition at a time).
TEST(DaemonStartup, EverythingOnNvmeTrainsTheDemoToTheSameLosses) {
  char dir[] = "/tmp/offloadd_ooc.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  RemoveOnExit remove_2(dir);
  auto d = DaemonProcess::Start({std::string("--nvme.dirs=") + dir, "--nvme.bytes_per_dir=64MiB",
                                 "--placement.state_chunk_bytes=8KiB"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto c = Client::Connect({(*d)->address()});
  ASSERT_TRUE(c.ok());
  // A wide, shallow MLP in bf16: w1 (2 x 8192) is half of its 32769
  // parameters, so that holding the largest partition (64 KiB of parameters
  // and gradients) takes a small part of the optimizer state's 384 KiB.
  demo::MlpConfig config;
  config.inputs = 2;
  config.hidden = 8192;
  config.steps = 20;
  config.param_dtype = DType::kBf16;
  constexpr uint64_t kParams = 2 * 8192 + 8192 + 8192 + 1;
  constexpr uint64_t kStateBytes = kParams * 16;  // master, m, v, accumulator
  constexpr uint64_t kPool = 96 << 10;
  static_assert(kStateBytes >= 4 * kPool, "the issue asks for state 4x the pool");
  auto train = [&](const Placement& placement) -> std::vector<double> {
    SessionOptions options;
    options.placement = placement;
    auto session = (*c)->OpenSession("demo", options);
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return {};
    auto store = demo::MakeDaemonStore(config, session->get());
    auto losses = demo::Train(config, store.get());
    EXPECT_TRUE(losses.ok()) << losses.status();
    if (placement.params_host_percent == 0) {
      auto stats = (*c)->GetStats();
      EXPECT_TRUE(stats.ok());
      EXPECT_EQ(stats->sessions.size(), 1u);
      EXPECT_EQ(stats->sessions[0].state_nvme_bytes, kStateBytes);
      EXPECT_EQ(stats->sessions[0].params_nvme_bytes, kParams * 2);
      EXPECT_EQ(stats->sessions[0].grads_nvme_bytes, kParams * 2);
      EXPECT_EQ(stats->sessions[0].state_host_bytes + stats->sessions[0].params_host_bytes +
                    stats->sessions[0].grads_host_bytes,
                0u);
      EXPECT_EQ(stats->sessions[0].held, 0u);
      // Its blocks' traffic: at least its state in and out once a step.
      EXPECT_GE(stats->sessions[0].nvme_read_bytes, kStateBytes);
      EXPECT_GE(stats->sessions[0].nvme_write_bytes, kStateBytes);
      EXPECT_GT(stats->sessions[0].io_queued_nanos, 0);
      // The pool holds less than its state: blocks evicted, the room they
      // hold within the pool.
      EXPECT_GT(stats->sessions[0].pool_evictions, 0u);
      EXPECT_GT(stats->sessions[0].pool_room_bytes, 0u);
      EXPECT_LE(stats->sessions[0].pool_room_bytes, kPool);
    }
    return losses.ok() ? *losses : std::vector<double>{};
  };
  const std::vector<double> in_memory = train(AllAt(100));
  ASSERT_EQ(in_memory.size(), 20u);
  ASSERT_TRUE((*c)->SetTunable("memory.host_budget_bytes", std::to_string(kPool)).ok());
  const std::vector<double> out_of_core = train(AllAt(0));
  EXPECT_EQ(in_memory, out_of_core);  // bit for bit
  auto stats = (*c)->GetStats();
  ASSERT_TRUE(stats.ok());
  int64_t swap_outs = -1, io_errors = -1;
  for (const auto& counter : stats->counters) {
    if (counter.name == "swap_outs") swap_outs = counter.value;
    if (counter.name == "swap_io_errors") io_errors = counter.value;
  }
  EXPECT_GT(swap_outs, 0);
  EXPECT_EQ(io_errors, 0);
  // Placement changes live over the wire, one kind at a time.
  ASSERT_TRUE((*c)->SetTunable("memory.host_budget_bytes", "64MiB").ok());
  auto live = (*c)->OpenSession("live");
  ASSERT_TRUE(live.ok());
  ASSERT_TRUE((*live)->Register("w", 5000, DType::kFp32, DType::kFp32).ok());
  Placement state_only;
  state_only.optimizer_state_host_percent = 0;
  EXPECT_TRUE((*live)->SetPlacement(state_only).ok());
  auto moved = (*c)->GetStats();
  ASSERT_TRUE(moved.ok());
  ASSERT_EQ(moved->sessions.size(), 1u);
  EXPECT_EQ(moved->sessions[0].state_nvme_bytes, 5000u * 16);
  EXPECT_EQ(moved->sessions[0].params_nvme_bytes, 0u);
  EXPECT_EQ(moved->sessions[0].held, 1u);  // registered and not released
  Placement bad;
  bad.grads_host_percent = 150;
  EXPECT_EQ((*live)->SetPlacement(bad).code(), absl::StatusCode::kInvalidArgument);
  // Without an NVMe tier, asking for NVMe placement says why not.
  auto plain = DaemonProcess::Start({});
  ASSERT_TRUE(plain.ok());
  auto pc = Client::Connect({(*plain)->address()});
  ASSERT_TRUE(pc.ok());
  SessionOptions nvme;
  nvme.placement.params_host_percent = 0;
  auto refused = (*pc)->OpenSession("x", nvme);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "nvme.dirs")) << refused.status();
}

// The daemon's peak resident memory, its sessions' arena pages included,
// stays within the host pool plus a fixed overhead while a session whose
// data is five times the pool trains through it.
// Parameters, gradients and optimizer state 5x the pool, swapped through
// NVMe; `chunk` sets the state chunk: 2 MiB makes 1 MiB blocks of bf16,
// which the arena lays out for small pages, 4 MiB makes 2 MiB blocks, laid
// out for huge pages where the kernel gives shared memory huge pages.
// A field of /proc/<pid>/smaps_rollup, in kB (-1 if absent).
int64_t SmapsRollupKb(pid_t pid, const std::string& field) {
  std::ostringstream rollup;
  rollup << std::ifstream("/proc/" + std::to_string(pid) + "/smaps_rollup").rdbuf();
  return SmapsKb(rollup.str(), field);
}

// The daemon's memory where its own pages do not show all of it: its
// anonymous resident pages (the pool's leases, stacks, heap) and every page
// its session arenas hold, mapped by the daemon or not (the swapper puts
// parameters read from NVMe into an arena on small pages through its file,
// so they show in the trainer's RSS, not the daemon's).
struct DaemonMemory {
  uint64_t anonymous = 0, arenas = 0;
};
DaemonMemory DaemonAndArenaBytes(pid_t pid) {
  const std::string proc = "/proc/" + std::to_string(pid);
  DaemonMemory m;
  std::ifstream status(proc + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("RssAnon:", 0) == 0) m.anonymous = std::stoull(line.substr(8)) * 1024;
  }
  for (const auto& entry : std::filesystem::directory_iterator(proc + "/fd")) {
    std::error_code error;
    const std::string target = std::filesystem::read_symlink(entry.path(), error).string();
    struct stat st;
    if (error || target.rfind("/memfd:", 0) != 0 || stat(entry.path().c_str(), &st) != 0) continue;
    m.arenas += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return m;
}

void ExpectResidentMemoryWithinThePool(const std::string& chunk, bool huge_pages) {
  char dir[] = "/var/tmp/offloadd_rss.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  RemoveOnExit remove_3(dir);
  constexpr uint64_t kMiB = 1 << 20;
  constexpr uint64_t kPool = 64 * kMiB;
  // The daemon's own memory besides the pool: code, gRPC's and the thread
  // pools' stacks and arenas, the allocator.
  constexpr uint64_t kOverhead = 48 * kMiB;
  auto d = DaemonProcess::Start(
      {std::string("--nvme.dirs=") + dir, "--nvme.bytes_per_dir=800MiB",
       "--memory.host_budget_bytes=64MiB", "--placement.params_host_percent=0",
       "--placement.grads_host_percent=0", "--placement.optimizer_state_host_percent=0",
       "--placement.state_chunk_bytes=" + chunk});
  ASSERT_TRUE(d.ok()) << d.status();
  auto c = Client::Connect({(*d)->address()});
  ASSERT_TRUE(c.ok());
  auto session = (*c)->OpenSession("big");
  ASSERT_TRUE(session.ok()) << session.status();
  // 16 partitions of 1M parameters: bf16 working copy and gradients (4 MiB
  // each), 16 MiB of optimizer state and gradient accumulator each: 320 MiB,
  // 5x the pool. Held one at a time, as ZeRO-3 holds a layer's.
  constexpr int kParts = 16;
  std::vector<uint64_t> ids;
  for (int i = 0; i < kParts; ++i) {
    auto p = (*session)->Register("p" + std::to_string(i), 1 << 20, DType::kBf16, DType::kBf16);
    ASSERT_TRUE(p.ok()) << p.status();
    for (auto& w : p->params_as<uint16_t>()) w = FloatToBf16(0.5f);
    ASSERT_TRUE((*session)->Release(*p).ok());
    ids.push_back(p->id);
  }
  FetchOptions backward;
  backward.grads = true;
  // Of DaemonAndArenaBytes, at each fetch and step.
  uint64_t sampled_peak = 0, arena_peak = 0;
  auto sample = [&] {
    const DaemonMemory m = DaemonAndArenaBytes((*d)->pid());
    sampled_peak = std::max(sampled_peak, m.anonymous + m.arenas);
    arena_peak = std::max(arena_peak, m.arenas);
  };
  for (int step = 0; step < 2; ++step) {
    for (uint64_t id : ids) {
      auto p = (*session)->Fetch(id);
      ASSERT_TRUE(p.ok()) << p.status();
      sample();
      ASSERT_TRUE((*session)->Release(*p).ok());
    }
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
      auto p = (*session)->Fetch(*it, backward);
      ASSERT_TRUE(p.ok()) << p.status();
      for (auto& g : p->grads_as<uint16_t>()) g = FloatToBf16(0.01f * static_cast<float>(step + 1));
      sample();
      ASSERT_TRUE((*session)->ReturnGradients(*p).ok());
      ASSERT_TRUE((*session)->Release(*p).ok());
    }
    auto r = (*session)->Step(AdamHyperparams{});
    sample();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->partitions_updated, static_cast<uint64_t>(kParts));
    EXPECT_GT(r->wall_us, 0u);
    EXPECT_GT(r->compute_us, 0u);
    EXPECT_LE(r->state_wait_us + r->compute_us, r->wall_us);
  }
  std::ifstream status("/proc/" + std::to_string((*d)->pid()) + "/status");
  uint64_t peak_kib = 0;
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) peak_kib = std::stoull(line.substr(6));
  }
  ASSERT_GT(peak_kib, 0u);
  const uint64_t peak = peak_kib * 1024;
  ::testing::Test::RecordProperty("peak_rss_bytes", std::to_string(peak));
  std::printf(
      "daemon peak RSS %.1f MiB, anonymous and arena pages at most %.1f MiB when "
      "sampled; pool %.0f MiB + stated overhead %.0f MiB\n",
      static_cast<double>(peak) / kMiB, static_cast<double>(sampled_peak) / kMiB,
      static_cast<double>(kPool) / kMiB, static_cast<double>(kOverhead) / kMiB);
  EXPECT_LE(peak, kPool + kOverhead);
  EXPECT_GE(arena_peak, 2 * kMiB);  // a held partition's parameters were counted
  EXPECT_LE(sampled_peak, kPool + kOverhead);
  auto stats = (*c)->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sessions[0].state_nvme_bytes, uint64_t{256} << 20);
  EXPECT_EQ(stats->sessions[0].params_nvme_bytes, uint64_t{32} << 20);
  // Holding more than the pool at once is refused with the numbers, and the
  // daemon goes on serving.
  auto huge = (*session)->Register("huge", 20 << 20, DType::kFp32, DType::kFp32);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(huge.status().message(), "host pool")) << huge.status();
  // Every partition's parameters and gradient buffer at once are exactly the
  // pool (the accounting is exact): they can all be held, and then nothing
  // more.
  auto all = (*session)->Fetch(absl::Span<const uint64_t>{}, backward);
  EXPECT_TRUE(all.ok()) << all.status();
  if (huge_pages) {
    // The daemon read them into huge pages (held, so still there).
    EXPECT_GT(SmapsRollupKb((*d)->pid(), "ShmemPmdMapped"), 0);
  }
  auto more = (*session)->Register("more", 1024, DType::kBf16, DType::kBf16);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(more.status().message(), "held by callers")) << more.status();
  ASSERT_TRUE((*session)->Release(absl::Span<const uint64_t>{}).ok());
  EXPECT_TRUE((*session)->Register("more", 1024, DType::kBf16, DType::kBf16).ok());
  session->reset();
  ASSERT_TRUE((*d)->Stop().ok());
}

TEST(DaemonStartup, ResidentMemoryStaysWithinThePool) {
  ExpectResidentMemoryWithinThePool("2MiB", false);
}

TEST(DaemonStartup, ResidentMemoryStaysWithinThePoolOnHugePages) {
  if (SharedHugePageBytes() == 0) {
    std::printf("shared memory gets no huge pages here: small pages, as the other test\n");
  }
  ExpectResidentMemoryWithinThePool("4MiB", SharedHugePageBytes() != 0);
}

// The client maps a large partition asking for huge pages where the daemon
// laid it out for them (the kernel gives shared memory huge pages), and
// every other partition asking for small pages only.
TEST_F(DaemonTest, ClientsMapLargePartitionsForTheirPages) {
  auto session = Open("pages");
  ASSERT_NE(session, nullptr);
  // The default state chunk (16 MiB) makes 8 MiB bf16 blocks.
  auto large = session->Register("large", 4 << 20, DType::kBf16, DType::kBf16);
  auto small = session->Register("small", 1000, DType::kBf16, DType::kBf16);
  ASSERT_TRUE(large.ok() && small.ok());
  const std::string large_flags = VmFlagsAt(large->params), small_flags = VmFlagsAt(small->params);
  ASSERT_FALSE(large_flags.empty() || small_flags.empty()) << "no /proc/self/smaps";
  // (A kernel without transparent huge pages refuses both requests.)
  const bool thp = access("/sys/kernel/mm/transparent_hugepage/enabled", F_OK) == 0;
  if (SharedHugePageBytes() != 0) {
    EXPECT_TRUE(absl::StrContains(large_flags, " hg ")) << large_flags;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(large->params) % SharedHugePageBytes(), 0u);
  } else if (thp) {
    EXPECT_TRUE(absl::StrContains(large_flags, " nh ")) << large_flags;
  }
  if (thp) {
    EXPECT_TRUE(absl::StrContains(small_flags, " nh ")) << small_flags;
  }
  // Either way the bytes are the partition's: written and read back.
  for (auto& w : large->params_as<uint16_t>()) w = FloatToBf16(0.25f);
  ASSERT_TRUE(session->Release(*large).ok());
  auto again = session->Fetch(large->id);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->params_as<uint16_t>().back(), FloatToBf16(0.25f));
}

TEST(DaemonStartup, ServesPrometheusMetricsOnLoopbackWhenAsked) {
  auto d = DaemonProcess::Start({"--metrics.port=0"});
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string marker = "metrics (Prometheus) on http://127.0.0.1:";
  ASSERT_TRUE((*d)->WaitForLog(marker).ok());
  const std::string log = (*d)->ReadLog();
  const int port = std::atoi(log.c_str() + log.find(marker) + marker.size());
  ASSERT_GT(port, 0) << log;
  auto c = Client::Connect({(*d)->address()});
  ASSERT_TRUE(c.ok());
  // offloadctl status lists it, the port the kernel chose (only the log
  // said it).
  auto stats = (*c)->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_TRUE(
      absl::c_linear_search(stats->listening, absl::StrCat("http://127.0.0.1:", port, "/metrics")))
      << absl::StrJoin(stats->listening, ", ");
  auto session = (*c)->OpenSession("rank0");
  ASSERT_TRUE(session.ok());
  httplib::Client http("127.0.0.1", port);
  auto res = http.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_TRUE(absl::StrContains(res->body, "offloadd_sessions_opened_total 1")) << res->body;
  EXPECT_TRUE(absl::StrContains(res->body, "offloadd_tier_budget_bytes{tier=\"host\"}"));
  // Names only where asked (any local user reads the port).
  EXPECT_FALSE(absl::StrContains(res->body, "rank0")) << res->body;
  EXPECT_TRUE(absl::StrContains(res->body, "name=\"\""));
  EXPECT_TRUE(absl::StrContains(res->body, "offloadd_session_nvme_bytes_total{session="));
  EXPECT_TRUE(absl::StrContains(res->body, "offloadd_session_io_queued_seconds_total{session="));
  EXPECT_TRUE(absl::StrContains(res->body, "offloadd_session_pool_room_bytes{session="));
  EXPECT_TRUE(absl::StrContains(res->body, "# TYPE offloadd_session_pool_evictions_total counter"));
  EXPECT_TRUE(absl::StrContains(res->body, "# TYPE offloadd_swap_hits_total counter"));
  auto named = DaemonProcess::Start({"--metrics.port=0", "--metrics.session_names=true"});
  ASSERT_TRUE(named.ok()) << named.status();
  ASSERT_TRUE((*named)->WaitForLog(marker).ok());
  const std::string named_log = (*named)->ReadLog();
  const int named_port = std::atoi(named_log.c_str() + named_log.find(marker) + marker.size());
  auto nc = Client::Connect({(*named)->address()});
  ASSERT_TRUE(nc.ok());
  auto named_session = (*nc)->OpenSession("rank0");
  ASSERT_TRUE(named_session.ok());
  auto named_res = httplib::Client("127.0.0.1", named_port).Get("/metrics");
  ASSERT_TRUE(named_res);
  EXPECT_TRUE(absl::StrContains(named_res->body, "name=\"rank0\"")) << named_res->body;
  // Off by default (the banner's last line is the data directory).
  auto plain = DaemonProcess::Start({});
  ASSERT_TRUE(plain.ok());
  ASSERT_TRUE((*plain)->WaitForLog("data directory").ok());
  EXPECT_FALSE(absl::StrContains((*plain)->ReadLog(), "metrics"));
}

TEST(DaemonStartup, NvmeTierStartsReportsAndTunesLive) {
  char dir[] = "/tmp/offloadd_nvme.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  RemoveOnExit remove_4(dir);
  const std::string a = std::string(dir) + "/a", b = std::string(dir) + "/b";
  ASSERT_EQ(mkdir(a.c_str(), 0700), 0);
  ASSERT_EQ(mkdir(b.c_str(), 0700), 0);
  auto d = DaemonProcess::Start({"--nvme.dirs=" + a + "," + b, "--nvme.bytes_per_dir=64MiB"});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(access((a + "/offloadd.swap").c_str(), F_OK), 0);
  auto c = Client::Connect({(*d)->address()});
  ASSERT_TRUE(c.ok());
  auto stats = (*c)->GetStats();
  ASSERT_TRUE(stats.ok());
  bool found = false;
  for (const auto& t : stats->tiers) {
    if (t.name == "nvme") {
      found = true;
      EXPECT_EQ(t.budget_bytes, uint64_t{128} << 20);
      EXPECT_EQ(t.used_bytes, 0u);
    }
  }
  EXPECT_TRUE(found);
  EXPECT_TRUE((*c)->SetTunable("nvme.queue_depth", "8").ok());
  EXPECT_TRUE((*c)->SetTunable("nvme.checksum", "false").ok());
  EXPECT_EQ((*c)->SetTunable("nvme.queue_depth", "0").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*c)->SetTunable("nvme.request_bytes", "1000").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*c)->SetTunable("nvme.rings", "4").status().code(),
            absl::StatusCode::kFailedPrecondition);
  // offloadd describes its tiers in the log after it starts serving.
  absl::Status described = (*d)->WaitForLog("tier nvme: ");
  EXPECT_TRUE(described.ok()) << described;
  std::string log = (*d)->ReadLog();
  EXPECT_TRUE(absl::StrContains(log, "tier nvme: 128MiB preallocated")) << log;
  EXPECT_TRUE(absl::StrContains(log, "io_uring backend")) << log;
  auto code = (*d)->Stop();
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  EXPECT_NE(access((a + "/offloadd.swap").c_str(), F_OK), 0);  // scratch removed

  // A directory that does not exist stops start-up with the reason.
  auto bad = ::offload::testing::RunCommand({"daemon/offloadd",
                                             std::string("--server.data_dir=") + dir + "/data",
                                             "--nvme.dirs=/nonexistent/nvme0"});
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ(bad->exit_code, 1);
  EXPECT_TRUE(absl::StrContains(bad->output, "/nonexistent/nvme0")) << bad->output;
  EXPECT_TRUE(absl::StrContains(bad->output, "nvme.dirs")) << bad->output;
}

TEST(DaemonStartup, AFailedStartIsReportedAtOnceWithTheLog) {
  // Start() watches the daemon's pidfd: a daemon that exits is reported when
  // it exits, not when the wait would time out.
  const absl::Time begin = absl::Now();
  auto d = DaemonProcess::Start({"--nvme.dirs=/nonexistent/nvme0"});
  EXPECT_LT(absl::Now() - begin, ::offload::testing::kWaitLimit / 2);
  ASSERT_FALSE(d.ok());
  EXPECT_TRUE(absl::StrContains(d.status().message(), "exited with 1")) << d.status();
  EXPECT_TRUE(absl::StrContains(d.status().message(), "/nonexistent/nvme0")) << d.status();
}

// A tmpfs mounted with `options` ("size=4m") on a fresh directory under
// /tmp for as long as this lives, or (not root, mount refused) not, saying
// why.
class SmallFilesystem {
 public:
  explicit SmallFilesystem(const std::string& options) {
    if (geteuid() != 0) {
      why_not_ = "mounting a small filesystem needs root";
      return;
    }
    if (mkdtemp(dir_) == nullptr) {
      why_not_ = absl::StrCat("mkdtemp: ", std::strerror(errno));
      return;
    }
    if (mount("tmpfs", dir_, "tmpfs", 0, options.c_str()) != 0) {
      why_not_ = absl::StrCat("mount is not permitted here: ", std::strerror(errno));
      rmdir(dir_);
      return;
    }
    mounted_ = true;
  }
  ~SmallFilesystem() {
    if (!mounted_) return;
    umount2(dir_, MNT_DETACH);
    rmdir(dir_);
  }
  bool mounted() const { return mounted_; }
  const std::string& why_not() const { return why_not_; }
  const char* path() const { return dir_; }

 private:
  char dir_[32] = "/tmp/offloadd_small.XXXXXX";
  bool mounted_ = false;
  std::string why_not_;
};

// A real filesystem too small for the swap space (a 4 MiB tmpfs): offloadd
// refuses to start naming the tier, the file and ENOSPC, and leaves no
// partial swap file behind.
TEST(DaemonStartup, ASwapFilesystemTooSmallIsRefusedAndLeftClean) {
  SmallFilesystem small("size=4m");
  if (!small.mounted()) GTEST_SKIP() << small.why_not();
  const char* dir = small.path();
  auto d = DaemonProcess::Start({absl::StrCat("--nvme.dirs=", dir), "--nvme.bytes_per_dir=64MiB"});
  ASSERT_FALSE(d.ok());
  EXPECT_TRUE(absl::StrContains(d.status().message(), "exited with 1")) << d.status();
  EXPECT_TRUE(absl::StrContains(d.status().message(), "RESOURCE_EXHAUSTED: NVMe tier (nvme.dirs)"))
      << d.status();
  EXPECT_TRUE(absl::StrContains(d.status().message(), "ENOSPC")) << d.status();
  DIR* listing = opendir(dir);
  ASSERT_NE(listing, nullptr);
  int entries = 0;
  while (dirent* e = readdir(listing)) entries += e->d_name[0] != '.';
  closedir(listing);
  EXPECT_EQ(entries, 0) << "a partial swap file was left behind";
}

// A restart right after a clean stop: the stopped offloadd's swap file was
// unlinked at its exit, and its space comes back to the filesystem some
// milliseconds later. Space that comes back within a few seconds is waited
// for, not ENOSPC (here a file filling a small tmpfs is removed 300 ms after
// offloadd starts).
TEST(DaemonStartup, SwapSpaceBeingFreedIsWaitedFor) {
  SmallFilesystem small("size=8m");
  if (!small.mounted()) GTEST_SKIP() << small.why_not();
  const std::string filler = absl::StrCat(small.path(), "/filler");
  {
    std::ofstream out(filler, std::ios::binary);
    const std::string mib(1 << 20, 'x');
    for (int i = 0; i < 6; ++i) out << mib;
  }
  std::thread frees([&] {
    absl::SleepFor(absl::Milliseconds(300));
    unlink(filler.c_str());
  });
  auto d = DaemonProcess::Start(
      {absl::StrCat("--nvme.dirs=", small.path()), "--nvme.bytes_per_dir=4MiB"});
  frees.join();
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(absl::StrContains((*d)->ReadLog(), "no room yet")) << (*d)->ReadLog();
}

// What no restart resumed (a lost session's automatic checkpoints) goes at
// a start once checkpoint.lost_keep_hours passed since a start first found
// it lost (not since its checkpoint was made: a node that was off keeps
// what its jobs would resume from); the others stay, named in the log.
TEST(DaemonStartup, LostCheckpointsGoOnceKeptLongEnough) {
  auto first = DaemonProcess::Start();
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string data_dir = (*first)->data_dir();
  ASSERT_TRUE((*first)->Stop().ok());
  // A lost directory whose checkpoint is `age` old; found lost `found_ago`
  // (no marker: never found yet).
  auto plant = [&](uint64_t id, absl::Duration age, std::optional<absl::Duration> found_ago) {
    const std::string dir = absl::StrCat(data_dir, "/auto-checkpoints/", id);
    EXPECT_EQ(mkdir(dir.c_str(), 0700), 0) << dir;
    checkpoint::Manifest m;
    m.set_format_version(checkpoint::kFormatVersion);
    m.set_session_name("job/rank0");
    m.set_steps(7);
    m.set_created_unix_ms(absl::ToUnixMillis(absl::Now() - age));
    m.set_data_file("job_rank0.1.data");
    EXPECT_TRUE(checkpoint::CommitManifest(*checkpoint::Directory::Open(dir),
                                           checkpoint::StemFor("job/rank0"), m)
                    .ok());
    if (found_ago.has_value()) {
      const std::string marker = dir + "/.lost_since";
      std::ofstream(marker).flush();
      const timeval then{absl::ToTimeT(absl::Now() - *found_ago), 0};
      const timeval times[2] = {then, then};
      EXPECT_EQ(utimes(marker.c_str(), times), 0);
    }
    return dir;
  };
  const std::string gone = plant(11, absl::Hours(300), absl::Hours(200));
  const std::string recent = plant(12, absl::Hours(300), absl::Hours(1));
  const std::string off_long = plant(13, absl::Hours(24 * 400), std::nullopt);
  auto second = DaemonProcess::StartIn(data_dir);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_FALSE(std::filesystem::exists(gone));
  EXPECT_TRUE(std::filesystem::exists(recent));
  EXPECT_TRUE(std::filesystem::exists(off_long));
  EXPECT_TRUE(std::filesystem::exists(off_long + "/.lost_since"));  // found now
  const std::string log = (*second)->ReadLog();
  EXPECT_TRUE(absl::StrContains(log, "within checkpoint.lost_keep_hours (168)")) << log;
  EXPECT_TRUE(absl::StrContains(log, "session 12 ('job/rank0') was lost")) << log;
  // 0 keeps them.
  ASSERT_TRUE((*second)->Stop().ok());
  const std::string older = plant(14, absl::Hours(300), absl::Hours(24 * 400));
  auto third = DaemonProcess::StartIn(data_dir, {"--checkpoint.lost_keep_hours=0"});
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_TRUE(std::filesystem::exists(older));
}

// A checkpoint into a real filesystem that fills up while it is written (a
// 4 MiB tmpfs holding one checkpoint but not a second beside it): the
// checkpoint fails with RESOURCE_EXHAUSTED naming the directory, leaves
// nothing of itself behind, the previous checkpoint restores bit for bit,
// and the daemon trains on.
// The restart tests' trainer: one bf16 partition "w" of kRestartNumel
// elements, initialised to 0.5 (unless restored), trained with gradients
// 0.01 * step.
constexpr uint64_t kRestartNumel = 10000;

void TrainSteps(Session* s, uint64_t id, int from, int to) {
  for (int step = from; step <= to; ++step) {
    FetchOptions grads;
    grads.grads = true;
    auto held = s->Fetch(id, grads);
    ASSERT_TRUE(held.ok()) << held.status();
    for (auto& g : held->grads_as<uint16_t>()) g = FloatToBf16(0.01f * static_cast<float>(step));
    ASSERT_TRUE(s->ReturnGradients(*held).ok());
    ASSERT_TRUE(s->Release(*held).ok());
    auto stepped = s->Step(AdamHyperparams{});
    ASSERT_TRUE(stepped.ok()) << stepped.status();
  }
}

std::vector<uint16_t> ParamsOf(Session* s, uint64_t id) {
  auto held = s->Fetch(id);
  EXPECT_TRUE(held.ok()) << held.status();
  std::vector<uint16_t> out;
  if (!held.ok()) return out;
  out.assign(held->params_as<uint16_t>().begin(), held->params_as<uint16_t>().end());
  EXPECT_TRUE(s->Release(*held).ok());
  return out;
}

std::pair<std::unique_ptr<Session>, PartitionView> OpenTrainer(
    Client* c, const std::string& name, const std::string& restore_from = "") {
  SessionOptions options;
  options.restore_from = restore_from;
  auto s = c->OpenSession(name, options);
  EXPECT_TRUE(s.ok()) << s.status();
  auto p = (*s)->Register("w", kRestartNumel, DType::kBf16, DType::kBf16);
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p->restored) {
    for (auto& w : p->params_as<uint16_t>()) w = FloatToBf16(0.5f);
  }
  EXPECT_TRUE((*s)->Release(*p).ok());
  return std::make_pair(*std::move(s), *std::move(p));
}

// A session "kept" on `c`, trained two steps before a restart: what its
// resume is checked against.
struct TrainedBeforeRestart {
  std::unique_ptr<Session> session;
  uint64_t id = 0, partition_id = 0;
  std::string token;
  std::vector<uint16_t> params;
};
TrainedBeforeRestart TrainBeforeRestart(Client* c) {
  auto [s, p] = OpenTrainer(c, "kept");
  TrainSteps(s.get(), p.id, 1, 2);
  TrainedBeforeRestart t;
  t.params = ParamsOf(s.get(), p.id);
  t.id = s->id();
  t.token = s->token();
  t.partition_id = p.id;
  t.session = std::move(s);
  return t;
}

// A lost session's latest automatic checkpoint that the disk corrupted:
// the next start names the one kept before it (said "remove it", with an
// intact checkpoint in the directory); a lost directory with nothing in it
// (a session made it and died before checkpointing) goes.
TEST(DaemonRestart, ACorruptedAutomaticCheckpointIsNamedWithTheOneBeforeIt) {
  const std::vector<std::string> flags = {"--checkpoint.auto_every_steps=2",
                                          "--checkpoint.auto_interval_seconds=0"};
  auto first = DaemonProcess::Start(flags);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string data_dir = (*first)->data_dir();
  const std::string auto_dir = data_dir + "/auto-checkpoints";
  std::string lost_dir;
  {
    auto client = Client::Connect({(*first)->address()});
    ASSERT_TRUE(client.ok()) << client.status();
    auto [lost, p] = OpenTrainer(client->get(), "lost");
    lost_dir = absl::StrCat(auto_dir, "/", lost->id());
    for (int step = 1; step <= 4; step += 2) {
      TrainSteps(lost.get(), p.id, step, step + 1);
      // (Polled: nothing announces a background checkpoint's commit.)
      const absl::Time deadline = absl::Now() + testing::kWaitLimit;
      while (checkpoint::CheckpointSteps(lost_dir, checkpoint::StemFor("lost")).size() <
                 static_cast<size_t>(step / 2 + 1) &&
             absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(5));
      }
    }
    ASSERT_EQ(checkpoint::CheckpointSteps(lost_dir, checkpoint::StemFor("lost")),
              (std::vector<uint64_t>{4, 2}));
    (*first)->Kill();
  }
  const std::string manifest = lost_dir + "/" + checkpoint::StemFor("lost") + ".manifest";
  {
    std::fstream f(manifest, std::ios::in | std::ios::out | std::ios::binary);
    char c = 0;
    f.seekg(20);
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0xFF);
    f.seekp(20);
    f.write(&c, 1);
  }
  const std::string empty = auto_dir + "/12345";
  std::filesystem::create_directories(empty);
  auto second = DaemonProcess::StartIn(data_dir, flags);
  ASSERT_TRUE(second.ok()) << second.status();
  const std::string log = (*second)->ReadLog();
  EXPECT_TRUE(absl::StrContains(log, "its latest automatic checkpoint is unreadable")) << log;
  EXPECT_TRUE(absl::StrContains(log, "of step 2 of session 'lost'")) << log;
  EXPECT_FALSE(absl::StrContains(log, "remove it")) << log;
  EXPECT_TRUE(std::filesystem::exists(lost_dir));
  EXPECT_FALSE(std::filesystem::exists(empty));
}

// Automatic checkpoints: a kill -9 of offloadd loses the steps since each
// session's last one, not the job. The next offloadd names each lost
// session's checkpoint; a session restoring it goes on bit for bit as one
// that never died; a session that closed left none behind, and the lost
// one's goes when the session that restored it closes.
TEST(DaemonRestart, AKilledOffloaddLeavesEachSessionItsAutomaticCheckpoint) {
  const std::vector<std::string> flags = {"--checkpoint.auto_every_steps=2",
                                          "--checkpoint.auto_interval_seconds=0"};
  auto counter = [](Client* c, const std::string& name) -> int64_t {
    auto stats = c->GetStats();
    if (!stats.ok()) return -1;
    for (const auto& x : stats->counters) {
      if (x.name == name) return x.value;
    }
    return -1;
  };
  auto await_counter = [&](Client* c, const std::string& name, int64_t value) {
    const absl::Time deadline = absl::Now() + testing::kWaitLimit;
    while (counter(c, name) < value && absl::Now() < deadline)
      absl::SleepFor(absl::Milliseconds(5));
    EXPECT_EQ(counter(c, name), value) << name;
  };
  auto await_gone = [](const std::string& path) {
    const absl::Time deadline = absl::Now() + testing::kWaitLimit;
    while (std::filesystem::exists(path) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    return !std::filesystem::exists(path);
  };

  auto first = DaemonProcess::Start(flags);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string data_dir = (*first)->data_dir();
  const std::string auto_dir = data_dir + "/auto-checkpoints";
  uint64_t lost_id = 0, lost_partition = 0;
  std::vector<uint16_t> at_step_4;
  // The trainer of the lost session stays up through the crash.
  std::unique_ptr<Client> stale_client;
  std::unique_ptr<Session> stale;
  {
    auto client = Client::Connect({(*first)->address()});
    ASSERT_TRUE(client.ok()) << client.status();
    // A session that closes: its automatic checkpoint goes with it.
    auto [closed, q] = OpenTrainer(client->get(), "closed");
    TrainSteps(closed.get(), q.id, 1, 2);
    await_counter(client->get(), "auto_checkpoints", 1);
    const std::string closed_dir = absl::StrCat(auto_dir, "/", closed->id());
    EXPECT_TRUE(std::filesystem::exists(closed_dir));
    ASSERT_TRUE(closed->Close().ok());
    EXPECT_TRUE(await_gone(closed_dir)) << closed_dir;
    // The session the kill loses: checkpointed after steps 2 and 4 (one
    // due while the previous is written would wait for the next step).
    auto [lost, p] = OpenTrainer(client->get(), "lost");
    TrainSteps(lost.get(), p.id, 1, 2);
    await_counter(client->get(), "auto_checkpoints", 2);
    TrainSteps(lost.get(), p.id, 3, 4);
    await_counter(client->get(), "auto_checkpoints", 3);
    at_step_4 = ParamsOf(lost.get(), p.id);
    lost_id = lost->id();
    lost_partition = p.id;
    (*first)->Kill();
    stale = std::move(lost);
    stale_client = *std::move(client);
  }
  // A closed session's directory, renamed aside but not yet removed when
  // offloadd died: the next start removes it.
  const std::string aside = auto_dir + "/77.closing.77";
  std::filesystem::create_directories(aside);
  std::ofstream(aside + "/x.manifest") << "left";
  auto second = DaemonProcess::StartIn(data_dir, flags);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_FALSE(std::filesystem::exists(aside));
  const std::string lost_dir = absl::StrCat(auto_dir, "/", lost_id);
  const std::string log = (*second)->ReadLog();
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat("session ", lost_id,
                                                  " ('lost') was lost with the previous offloadd: "
                                                  "its automatic checkpoint of step 4")))
      << log;
  EXPECT_TRUE(absl::StrContains(log, lost_dir)) << log;
  // Its trainer's calls get one definite answer, not UNAVAILABLE for ever:
  // the request ring is gone with the old offloadd, so the client turns to
  // gRPC, and the new offloadd says where the session's state is.
  absl::Status answer;
  for (const absl::Time deadline = absl::Now() + testing::kWaitLimit; absl::Now() < deadline;) {
    answer = stale->Fetch(lost_partition).status();
    if (!absl::IsUnavailable(answer)) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(answer.code(), absl::StatusCode::kNotFound) << answer;
  EXPECT_TRUE(absl::StrContains(answer.message(),
                                absl::StrCat("automatic checkpoint of step 4 is in ", lost_dir)))
      << answer;
  auto client = Client::Connect({(*second)->address()});
  ASSERT_TRUE(client.ok()) << client.status();
  auto [restored, p] = OpenTrainer(client->get(), "lost", lost_dir);
  EXPECT_TRUE(p.restored);
  EXPECT_EQ(ParamsOf(restored.get(), p.id), at_step_4);
  // Step 5 equals that of a session that never died.
  auto [reference, r] = OpenTrainer(client->get(), "reference");
  TrainSteps(reference.get(), r.id, 1, 5);
  TrainSteps(restored.get(), p.id, 5, 5);
  EXPECT_EQ(ParamsOf(restored.get(), p.id), ParamsOf(reference.get(), r.id));
  ASSERT_TRUE(restored->Close().ok());
  EXPECT_TRUE(await_gone(lost_dir)) << lost_dir;
}

// A restart that fails after it reopened the kept sessions (here a
// socket group that does not exist) keeps them again: with the pool in a
// file (memory.pool_dir) reopening took them out of the previous
// offloadd's keeping, and the failed start lost every one of them.
TEST(DaemonRestart, AFailedStartKeepsTheSessionsItReopened) {
  char pool_dir[] = "/dev/shm/offloadd_failed_start_XXXXXX";
  ASSERT_NE(mkdtemp(pool_dir), nullptr);
  RemoveOnExit remove_pool(pool_dir);  // (after the daemons below: declared first)
  const std::vector<std::string> flags = {"--server.reconnect_lease_seconds=30",
                                          absl::StrCat("--memory.pool_dir=", pool_dir)};
  auto first = DaemonProcess::Start(flags);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string data_dir = (*first)->data_dir();
  TrainedBeforeRestart trained;
  {
    auto client = Client::Connect({(*first)->address()});
    ASSERT_TRUE(client.ok()) << client.status();
    trained = TrainBeforeRestart(client->get());
    auto stopped = (*first)->Stop();
    ASSERT_TRUE(stopped.ok()) << stopped.status();
    trained.session.reset();
  }
  const uint64_t id = trained.id;
  const std::string& token = trained.token;
  const std::vector<uint16_t>& before = trained.params;
  // (Not through DaemonProcess, whose failed start removes the directory.)
  std::vector<std::string> bad = {"daemon/offloadd", "--server.data_dir=" + data_dir,
                                  "--server.socket_group=offloadd_no_such_group"};
  bad.insert(bad.end(), flags.begin(), flags.end());
  auto failed = ::offload::testing::RunCommand(bad);
  ASSERT_TRUE(failed.ok());
  ASSERT_EQ(failed->exit_code, 1) << failed->output;
  auto third = DaemonProcess::StartIn(data_dir, flags);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_TRUE(absl::StrContains((*third)->ReadLog(), "reopened 1 session(s)"))
      << (*third)->ReadLog();
  auto client = Client::Connect({(*third)->address()});
  ASSERT_TRUE(client.ok()) << client.status();
  auto resumed = (*client)->ResumeSession(id, token);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  auto listed = (*resumed)->Fetch(std::vector<uint64_t>{});
  ASSERT_TRUE(listed.ok() && listed->size() == 1u);
  const uint64_t pid = (*listed)[0].id;
  ASSERT_TRUE((*resumed)->Release((*listed)[0]).ok());
  EXPECT_EQ(ParamsOf(resumed->get(), pid), before);
  ASSERT_TRUE((*resumed)->Close().ok());
  (void)(*third)->Stop();
}

// A stop that cannot keep a session (here: <data_dir>/preserved is a file)
// says so and exits 1, so that a service manager sees the stop fail (it
// said "stopped cleanly" and exited 0 with the session's state gone).
TEST(DaemonRestart, AStopThatLosesASessionExitsWithAFailure) {
  auto d = DaemonProcess::Start({"--server.reconnect_lease_seconds=30"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto client = Client::Connect({(*d)->address()});
  ASSERT_TRUE(client.ok()) << client.status();
  TrainedBeforeRestart trained = TrainBeforeRestart(client->get());
  std::ofstream(absl::StrCat((*d)->data_dir(), "/preserved")) << "in the way\n";
  auto stopped = (*d)->Stop();
  trained.session.reset();
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  EXPECT_EQ(*stopped, 1);
  const std::string log = (*d)->ReadLog();
  EXPECT_TRUE(absl::StrContains(log, "1 session(s) could not be kept")) << log;
  EXPECT_FALSE(absl::StrContains(log, "stopped cleanly")) << log;
}

// A session the stop could not keep (here its directory is taken by a
// file) is said to its trainer by the next offloadd: NOT_FOUND with why
// (it was told its id was wrong, or from before a restart).
TEST(DaemonRestart, ASessionAStopCouldNotKeepIsSaidToItsTrainer) {
  const std::vector<std::string> flags = {"--server.reconnect_lease_seconds=30"};
  auto d = DaemonProcess::Start(flags);
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string data_dir = (*d)->data_dir();
  uint64_t id = 0;
  {
    auto client = Client::Connect({(*d)->address()});
    ASSERT_TRUE(client.ok()) << client.status();
    TrainedBeforeRestart trained = TrainBeforeRestart(client->get());
    id = trained.id;
    std::filesystem::create_directories(data_dir + "/preserved");
    std::ofstream(absl::StrCat(data_dir, "/preserved/", id)) << "in the way\n";
    auto stopped = (*d)->Stop();
    trained.session.reset();
    ASSERT_TRUE(stopped.ok()) << stopped.status();
    EXPECT_EQ(*stopped, 1);
  }
  auto next = DaemonProcess::StartIn(data_dir, flags);
  ASSERT_TRUE(next.ok()) << next.status();
  auto client = Client::Connect({(*next)->address()});
  ASSERT_TRUE(client.ok()) << client.status();
  const absl::Status answer = (*client)->CloseUnattachedSession(id);
  EXPECT_EQ(answer.code(), absl::StatusCode::kNotFound) << answer;
  EXPECT_TRUE(
      absl::StrContains(answer.message(), "the offloadd before could not keep it across its stop"))
      << answer;
}

// A session a stop kept whose kept memory is gone at the next start (the
// pool's directory on tmpfs emptied, as by a reboot) is said to be beyond
// reopening, not "left for restore_from" (which fails the same way); and it
// is not called lost with the previous offloadd (a clean stop kept it)
// where its automatic checkpoint is found.
TEST(DaemonRestart, AKeptSessionWhoseMemoryWentIsSaidSo) {
  char pool_dir[] = "/dev/shm/offloadd_memory_gone_XXXXXX";
  ASSERT_NE(mkdtemp(pool_dir), nullptr);
  RemoveOnExit remove_pool(pool_dir);
  const std::vector<std::string> flags = {
      "--server.reconnect_lease_seconds=30", absl::StrCat("--memory.pool_dir=", pool_dir),
      "--checkpoint.auto_every_steps=1", "--checkpoint.auto_interval_seconds=0"};
  auto first = DaemonProcess::Start(flags);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string data_dir = (*first)->data_dir();
  {
    auto client = Client::Connect({(*first)->address()});
    ASSERT_TRUE(client.ok()) << client.status();
    TrainedBeforeRestart trained = TrainBeforeRestart(client->get());
    auto stopped = (*first)->Stop();
    ASSERT_TRUE(stopped.ok()) << stopped.status();
    trained.session.reset();
    // (Its automatic checkpoint, taken at a step, stays beside what the
    // stop kept.)
    ASSERT_TRUE(std::filesystem::exists(absl::StrCat(data_dir, "/auto-checkpoints/", trained.id)));
  }
  for (const auto& entry : std::filesystem::directory_iterator(pool_dir)) {
    if (absl::StartsWith(entry.path().filename().string(), "kept-")) {
      std::filesystem::remove(entry.path());
    }
  }
  auto second = DaemonProcess::StartIn(data_dir, flags);
  ASSERT_TRUE(second.ok()) << second.status();
  const std::string log = (*second)->ReadLog();
  EXPECT_TRUE(absl::StrContains(log, "cannot be reopened")) << log;
  EXPECT_TRUE(absl::StrContains(log, "its state went with that memory")) << log;
  EXPECT_FALSE(absl::StrContains(log, "was lost with the previous offloadd")) << log;
  (void)(*second)->Stop();
}

// Under systemd, keeping sessions at a stop and reading them back at the
// next start may take minutes (the disk's speed): before each session
// offloadd tells systemd to wait longer, and what it does, so that the
// unit's timeouts do not end it mid-write or loop its restarts.
TEST(DaemonRestart, TellsSystemdToWaitWhileItKeepsAndReopensSessions) {
  char dir[] = "/tmp/offloadd_notify.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  RemoveOnExit remove_dir(dir);
  NotifyListener listener(dir);
  const std::vector<std::string> lease = {"--server.reconnect_lease_seconds=30"};
  setenv("NOTIFY_SOCKET", listener.path().c_str(), 1);
  auto first = DaemonProcess::Start(lease);
  unsetenv("NOTIFY_SOCKET");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(listener.Next(), "READY=1");
  auto client = Client::Connect({(*first)->address()});
  ASSERT_TRUE(client.ok()) << client.status();
  auto [kept, p] = OpenTrainer(client->get(), "kept");
  TrainSteps(kept.get(), p.id, 1, 1);
  const std::string wait = absl::StrCat("EXTEND_TIMEOUT_USEC=600000000\nSTATUS=");
  ASSERT_TRUE((*first)->Stop().ok());
  EXPECT_EQ(listener.Next(), "STOPPING=1");
  EXPECT_EQ(listener.Next(), absl::StrCat(wait, "keeping kept session ", kept->id()));
  setenv("NOTIFY_SOCKET", listener.path().c_str(), 1);
  auto second = DaemonProcess::StartIn((*first)->data_dir(), lease);
  unsetenv("NOTIFY_SOCKET");
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(listener.Next(), absl::StrCat(wait, "reopening kept session ", kept->id()));
  EXPECT_EQ(listener.Next(), "READY=1");
}

// A stale Session object whose calls go over gRPC (no request ring) is
// told to resume too: the next offloadd, which kept the session, would
// serve them while this object reads and writes its memory through the
// stopped one's mapping (gradients lost, parameters stale).
TEST(DaemonRestart, AStaleSessionWithoutARingIsToldToResume) {
  const std::vector<std::string> lease = {"--server.reconnect_lease_seconds=8"};
  auto first = DaemonProcess::Start(lease);
  ASSERT_TRUE(first.ok()) << first.status();
  ClientOptions no_ring{(*first)->address()};
  no_ring.request_ring = false;
  auto client = Client::Connect(no_ring);
  ASSERT_TRUE(client.ok()) << client.status();
  auto [stale, p] = OpenTrainer(client->get(), "kept");
  TrainSteps(stale.get(), p.id, 1, 2);
  auto stopped = (*first)->Stop();
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  auto second = DaemonProcess::StartIn((*first)->data_dir(), lease);
  ASSERT_TRUE(second.ok()) << second.status();
  // (The old channel's first call may find its connection broken.)
  absl::Status fetched;
  for (const absl::Time deadline = absl::Now() + testing::kWaitLimit; absl::Now() < deadline;) {
    fetched = stale->Fetch(p.id).status();
    if (!absl::IsUnavailable(fetched)) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  for (const absl::Status& call :
       {fetched, stale->ReturnGradients(p),
        stale->Register("another", 8, DType::kFp32, DType::kFp32).status(),
        stale->Step(AdamHyperparams{}).status()}) {
    EXPECT_EQ(call.code(), absl::StatusCode::kFailedPrecondition) << call;
    EXPECT_TRUE(absl::StrContains(call.message(), "ResumeSession")) << call;
  }
}

// With a reconnect lease, a stopped offloadd (SIGTERM) keeps its sessions:
// the next one in the same data directory reopens them, and a trainer
// resumes its session by id and token, with its partitions (their ids too)
// and its optimizer state: its next step equals that of a session that never
// stopped, bit for bit. A kept session no trainer resumes goes after the
// lease; an offloadd without the lease reopens nothing. (The lease, 8 s,
// bounds how long this test may take from the restart to the resume.)
TEST(DaemonRestart, KeepsSessionsForTheirTrainersWithAReconnectLease) {
  const std::vector<std::string> lease = {"--server.reconnect_lease_seconds=8"};
  auto first = DaemonProcess::Start(lease);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string data_dir = (*first)->data_dir();
  uint64_t id = 0, partition_id = 0, forgotten_id = 0;
  std::string token;
  std::vector<uint16_t> before;
  // The first trainer's Session object outlives its offloadd.
  std::unique_ptr<Client> first_client;
  std::unique_ptr<Session> stale;
  {
    auto client = Client::Connect({(*first)->address()});
    ASSERT_TRUE(client.ok()) << client.status();
    TrainedBeforeRestart trained = TrainBeforeRestart(client->get());
    std::unique_ptr<Session> kept = std::move(trained.session);
    before = trained.params;
    id = trained.id;
    token = trained.token;
    partition_id = trained.partition_id;
    auto [forgotten, q] = OpenTrainer(client->get(), "forgotten");
    forgotten_id = forgotten->id();
    auto stopped = (*first)->Stop();
    ASSERT_TRUE(stopped.ok()) << stopped.status();
    EXPECT_EQ(*stopped, 0) << (*first)->ReadLog();
    EXPECT_TRUE(absl::StrContains((*first)->ReadLog(), "kept 2 session(s)")) << (*first)->ReadLog();
    stale = std::move(kept);
    first_client = *std::move(client);
  }

  auto second = DaemonProcess::StartIn(data_dir, lease);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(absl::StrContains((*second)->ReadLog(), "reopened 2 session(s)"))
      << (*second)->ReadLog();
  auto client = Client::Connect({(*second)->address()});
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->ResumeSession(id, std::string(token.size(), 'x')).status().code(),
            absl::StatusCode::kPermissionDenied);
  auto resumed = (*client)->ResumeSession(id, token);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  auto listed = (*resumed)->Fetch(std::vector<uint64_t>{});
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  const PartitionView p = (*listed)[0];
  EXPECT_EQ(p.id, partition_id);
  ASSERT_TRUE((*resumed)->Release(p).ok());
  // The stale Session object's shared memory is the stopped offloadd's:
  // its calls are refused, saying to resume (not served over views of a
  // dead mapping, nor UNAVAILABLE for ever).
  absl::Status stale_call;
  for (const absl::Time deadline = absl::Now() + testing::kWaitLimit; absl::Now() < deadline;) {
    stale_call = stale->Fetch(p.id).status();
    if (!absl::IsUnavailable(stale_call)) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(stale_call.code(), absl::StatusCode::kFailedPrecondition) << stale_call;
  EXPECT_TRUE(absl::StrContains(stale_call.message(), "ResumeSession")) << stale_call;
  // So are its calls that only gRPC carries: not served to the kept
  // session through the stale object (a wrong answer, or a change to it).
  for (const absl::Status& grpc_only :
       {stale->WaitCheckpoint().status(), stale->SetDelayedUpdate(true),
        stale->ReadMoments(p.id, 0, 1).status()}) {
    EXPECT_EQ(grpc_only.code(), absl::StatusCode::kFailedPrecondition) << grpc_only;
    EXPECT_TRUE(absl::StrContains(grpc_only.message(), "ResumeSession")) << grpc_only;
  }
  auto pending = (*resumed)->GetPendingGradients();
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_FALSE(pending->delayed_update);
  // The stale Session object goes with a restarted offloadd at its address:
  // it must not close the session its trainer just resumed.
  stale.reset();
  first_client.reset();
  EXPECT_EQ(ParamsOf(resumed->get(), p.id), before);
  TrainSteps(resumed->get(), p.id, 3, 3);
  // The same three steps in a session that never stopped.
  auto [reference, r] = OpenTrainer(client->get(), "reference");
  TrainSteps(reference.get(), r.id, 1, 3);
  EXPECT_EQ(ParamsOf(resumed->get(), p.id), ParamsOf(reference.get(), r.id));

  // "forgotten": nobody resumed it; it goes once the lease is over.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  auto open_ids = [&] {
    std::vector<uint64_t> ids;
    auto stats = (*client)->GetStats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (stats.ok()) {
      for (const auto& s : stats->sessions) ids.push_back(s.id);
    }
    return ids;
  };
  while (absl::c_linear_search(open_ids(), forgotten_id) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_FALSE(absl::c_linear_search(open_ids(), forgotten_id));
  EXPECT_TRUE(absl::c_linear_search(open_ids(), id));
  // Neither is on disk any more: one resumed (its copy stale), one closed
  // (its directory removed just after the session leaves the list: waited
  // for, as a loaded machine may take a moment).
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(data_dir, "/preserved/", id)));
  const std::string forgotten_dir = absl::StrCat(data_dir, "/preserved/", forgotten_id);
  while (std::filesystem::exists(forgotten_dir) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_FALSE(std::filesystem::exists(forgotten_dir));
  // Its id is of the first offloadd, but this one knew it: closed, not unknown.
  const absl::Status late = (*client)->ResumeSession(forgotten_id, token).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition) << late;
  EXPECT_TRUE(absl::StrContains(late.message(), "is closed")) << late;

  // Stopped again (keeping "kept" and "reference"), and restarted without
  // the lease: nothing is reopened, and offloadd says where they are.
  auto stopped = (*second)->Stop();
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  resumed->reset();
  reference.reset();
  auto third = DaemonProcess::StartIn(data_dir, {"--server.reconnect_lease_seconds=0"});
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_TRUE(absl::StrContains((*third)->ReadLog(), "are not reopened")) << (*third)->ReadLog();
  auto client3 = Client::Connect({(*third)->address()});
  ASSERT_TRUE(client3.ok());
  auto gone = (*client3)->ResumeSession(id, token);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound)
      << gone.status() << (*third)->ReadLog();
}

TEST_F(DaemonTest, ACheckpointIntoAFullFilesystemFailsCleanlyAndKeepsThePreviousOne) {
  SmallFilesystem small("size=4m,mode=0700");
  if (!small.mounted()) GTEST_SKIP() << small.why_not();
  const std::string dir = small.path();
  auto listing = [&] {
    std::vector<std::string> names;
    DIR* d = opendir(dir.c_str());
    while (dirent* e = d != nullptr ? readdir(d) : nullptr) {
      if (e->d_name[0] != '.') names.push_back(e->d_name);
    }
    if (d != nullptr) closedir(d);
    std::sort(names.begin(), names.end());
    return names;
  };
  // 160K parameters: a checkpoint's data is 14 bytes each (fp32 master and
  // moments, the bf16 working copy), 2.2 MB: one fits in 4 MiB, two do not.
  constexpr uint64_t kNumel = 160 << 10;
  auto session = Open("full");
  ASSERT_NE(session, nullptr);
  auto p = session->Register("w", kNumel, DType::kBf16, DType::kBf16);
  ASSERT_TRUE(p.ok()) << p.status();
  for (auto& w : p->params_as<uint16_t>()) w = FloatToBf16(0.5f);
  ASSERT_TRUE(session->Release(*p).ok());
  auto step = [&](float grad) {
    HoldGrads(session.get(), *p);
    for (auto& g : p->grads_as<uint16_t>()) g = FloatToBf16(grad);
    ASSERT_TRUE(session->ReturnGradients(*p).ok());
    ASSERT_TRUE(session->Release(*p).ok());
    auto r = session->Step(AdamHyperparams{});
    ASSERT_TRUE(r.ok()) << r.status();
  };
  auto params = [&] {
    auto held = session->Fetch(p->id);
    EXPECT_TRUE(held.ok()) << held.status();
    std::vector<uint16_t> out(held->params_as<uint16_t>().begin(),
                              held->params_as<uint16_t>().end());
    EXPECT_TRUE(session->Release(*held).ok());
    return out;
  };
  step(0.01f);
  auto first = session->Checkpoint(dir);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::vector<uint16_t> after_first = params();
  const std::vector<std::string> committed = listing();
  ASSERT_EQ(committed.size(), 2u);  // the manifest and its data file
  step(0.02f);
  auto second = session->Checkpoint(dir);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted) << second.status();
  EXPECT_TRUE(absl::StrContains(second.status().message(), dir)) << second.status();
  EXPECT_TRUE(absl::StrContains(second.status().message(), "ENOSPC")) << second.status();
  // Nothing of the failed attempt stays to fill the filesystem further.
  EXPECT_EQ(listing(), committed);
  // The daemon trains on, and checkpoints again where there is room.
  step(0.03f);
  char roomy[] = "/tmp/offloadd_roomy.XXXXXX";
  ASSERT_NE(mkdtemp(roomy), nullptr);
  RemoveOnExit remove_roomy(roomy);
  auto third = session->Checkpoint(roomy);
  EXPECT_TRUE(third.ok()) << third.status();
  ASSERT_TRUE(session->Close().ok());
  // The full filesystem still holds the first checkpoint, whole.
  SessionOptions restore;
  restore.restore_from = dir;
  auto restored = client_->OpenSession("full", restore);
  ASSERT_TRUE(restored.ok()) << restored.status();
  auto q = (*restored)->Register("w", kNumel, DType::kBf16, DType::kBf16);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(q->restored);
  EXPECT_EQ(q->step, 1u);
  const auto got = q->params_as<uint16_t>();
  EXPECT_TRUE(std::equal(got.begin(), got.end(), after_first.begin(), after_first.end()));
}

TEST_F(DaemonTest, WaitForLogGivesUpAtItsDeadline) {
  absl::Status s = daemon_->WaitForLog("a line offloadd never writes", absl::Milliseconds(50));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(daemon_->WaitForLog("serving gRPC on unix:", absl::Milliseconds(50)).ok());
}

// memory.host_home_pages: the start-up lines say which pages the state homed
// on the host lives on and why; a value that is none of auto, huge, small
// is a bad flag (exit 2), naming the setting.
TEST(DaemonStartup, HostHomePagesAreSaidAtStartAndABadValueIsRefused) {
  auto d = DaemonProcess::Start({"--memory.host_home_pages=small"});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE((*d)->WaitForLog("host pool: state homed on the host on 4 KiB pages "
                               "(memory.host_home_pages is small)")
                  .ok())
      << (*d)->ReadLog();
  ASSERT_TRUE((*d)->Stop().ok());
  auto bad = DaemonProcess::Start({"--memory.host_home_pages=medium"});
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "exited with 2")) << bad.status();
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "memory.host_home_pages")) << bad.status();
}

TEST(DaemonStartup, BadConfigIsRefusedWithTheReason) {
  char dir[] = "/tmp/offloadd_cfg.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  RemoveOnExit remove_5(dir);
  std::string config = std::string(dir) + "/bad.yaml";
  std::ofstream(config) << "optimizer:\n  threads: lots\n";
  auto r = ::offload::testing::RunCommand({"daemon/offloadd", "--config=" + config});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_TRUE(absl::StrContains(r->output, "bad.yaml")) << r->output;
  EXPECT_TRUE(absl::StrContains(r->output, "optimizer.threads")) << r->output;
  auto flag = ::offload::testing::RunCommand({"daemon/offloadd", "--no.such=1"});
  ASSERT_TRUE(flag.ok());
  EXPECT_EQ(flag->exit_code, 2);
  EXPECT_TRUE(absl::StrContains(flag->output, "no.such")) << flag->output;
  // A setting of a few values given another: a bad flag too (these exited
  // 1, "cannot start", once the start got to them).
  for (const char* bad : {"--optimizer.kernel=avx9", "--nvme.backend=spdk"}) {
    auto r = ::offload::testing::RunCommand({"daemon/offloadd", bad});
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->exit_code, 2) << bad << ": " << r->output;
    EXPECT_TRUE(absl::StrContains(r->output, "is one of")) << r->output;
  }
}

}  // namespace
}  // namespace offload
