// kill -9 of offloadd at random points (inside a step, while partitions
// swap to and from NVMe, while a checkpoint is written), then a fresh
// offloadd restoring the checkpoint directory: the next steps equal those of
// an uninterrupted run from the same checkpoint, bit for bit, and a crash
// while a checkpoint is written leaves the previous one valid.
//
// The trainer is this process (the C++ client); the daemon is a child
// process with its optimizer state on an NVMe tier four times its host
// pool, so that every step swaps. A killer thread SIGKILLs it after a
// random delay; the trainer records what it was doing at that moment.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "checkpoint/format.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/daemon_process.h"

namespace offload {
namespace {

using ::offload::testing::DaemonProcess;
using ::offload::testing::RemoveOnExit;

constexpr uint64_t kNumel[] = {300000, 200000, 77777};  // 2.3 MiB of fp32 state... per kind
constexpr int kCheckpointStep = 3;  // the checkpoint every trial restores holds 3 steps
constexpr int kVerifySteps = 3;

float Value(uint64_t seed, uint64_t i) {
  uint64_t h = (seed * 0x9E3779B97F4A7C15ull) ^ (i * 0xC2B2AE3D27D4EB4Full);
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return static_cast<float>(static_cast<int64_t>(h % 2001) - 1000) * (1.0f / 1024);
}

std::vector<std::string> DaemonFlags(const std::string& nvme) {
  // State: 4 kinds x 2.3 MiB = 9.2 MiB on NVMe; the pool holds the working
  // copies and gradients (3.5 MiB) and a quarter of the state.
  return {"--nvme.dirs=" + nvme, "--nvme.bytes_per_dir=128MiB", "--memory.host_budget_bytes=6MiB",
          "--placement.optimizer_state_host_percent=0", "--placement.state_chunk_bytes=256KiB"};
}

using Params = std::vector<std::vector<float>>;

// The job: one session "job" holding kNumel's partitions (bf16 working
// copy, fp32 master from fp32 initial values).
class Job {
 public:
  // Connects and opens (or, with `restore_from`, restores) the session.
  absl::Status Open(const std::string& address, const std::string& restore_from = "") {
    ClientOptions o;
    o.address = address;
    o.call_timeout = absl::Seconds(60);
    auto c = Client::Connect(o);
    if (!c.ok()) return c.status();
    client_ = *std::move(c);
    SessionOptions so;
    so.restore_from = restore_from;
    auto s = client_->OpenSession("job", so);
    if (!s.ok()) return s.status();
    session_ = *std::move(s);
    parts_.clear();
    for (size_t t = 0; t < std::size(kNumel); ++t) {
      auto p = session_->Register("w" + std::to_string(t), kNumel[t], DType::kBf16, DType::kFp32,
                                  /*fp32_master=*/true);
      if (!p.ok()) return p.status();
      if (p->restored != !restore_from.empty()) return absl::InternalError("restored flag");
      if (!p->restored) {
        for (uint64_t j = 0; j < kNumel[t]; ++j) p->master_init[j] = Value(t, j);
      }
      parts_.push_back(*p);
      if (absl::Status r = session_->Release(*p); !r.ok()) return r;
    }
    return absl::OkStatus();
  }

  // Returns step `step`'s gradients and steps.
  absl::Status Train(int step) {
    FetchOptions grads;
    grads.grads = true;
    for (size_t t = 0; t < parts_.size(); ++t) {
      auto v = session_->Fetch(parts_[t].id, grads);
      if (!v.ok()) return v.status();
      float* g = static_cast<float*>(v->grads);
      for (uint64_t j = 0; j < v->numel; ++j) g[j] = Value(100 + step, j);
      if (absl::Status s = session_->ReturnGradients(*v); !s.ok()) return s;
      if (absl::Status s = session_->Release(*v); !s.ok()) return s;
    }
    AdamHyperparams h;
    h.lr = 1e-2;
    h.weight_decay = 0.01;
    auto r = session_->Step(h);
    return r.status();
  }

  absl::StatusOr<Params> Read() {
    Params out;
    for (const PartitionView& p : parts_) {
      auto v = session_->Fetch(p.id);
      if (!v.ok()) return v.status();
      std::vector<float> wide(v->numel);
      const auto* b = static_cast<const uint16_t*>(v->params);
      for (uint64_t j = 0; j < v->numel; ++j) {
        const uint32_t bits = static_cast<uint32_t>(b[j]) << 16;
        std::memcpy(&wide[j], &bits, 4);
      }
      out.push_back(std::move(wide));
      if (absl::Status s = session_->Release(*v); !s.ok()) return s;
    }
    return out;
  }

  Session& session() { return *session_; }

 private:
  std::unique_ptr<Client> client_;
  std::unique_ptr<Session> session_;
  std::vector<PartitionView> parts_;
};

std::string MakeTmp(const char* name) {
  std::string t = absl::StrCat("/tmp/offloadd_", name, ".XXXXXX");
  return mkdtemp(t.data());
}

// Inside `root` (which the test removes): a killed daemon leaves its swap
// file behind, 128 MiB each.
std::string MakeTmpIn(const std::string& root, const char* name) {
  std::string t = absl::StrCat(root, "/", name, ".XXXXXX");
  return mkdtemp(t.data());
}

void CopyDir(const std::string& from, const std::string& to) {
  std::filesystem::remove_all(to);
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive);
}

uint64_t ManifestSteps(const std::string& dir);

TEST(Crash, KillNineAnywhereThenRestoreContinuesBitForBit) {
  const std::string root = MakeTmp("crash");
  RemoveOnExit cleanup(root);
  const std::string ckpt = root + "/ckpt";
  // The uninterrupted run: checkpoint after step 3, then steps 4..12.
  std::map<int, Params> reference;
  {
    auto d = DaemonProcess::Start(DaemonFlags(MakeTmpIn(root, "nvme")));
    ASSERT_TRUE(d.ok()) << d.status();
    Job job;
    absl::Status opened = job.Open((*d)->address());
    ASSERT_TRUE(opened.ok()) << opened;
    for (int step = 1; step <= kCheckpointStep; ++step) ASSERT_TRUE(job.Train(step).ok());
    auto written = job.session().Checkpoint(ckpt);
    ASSERT_TRUE(written.ok()) << written.status();
    EXPECT_EQ(written->steps, static_cast<uint64_t>(kCheckpointStep));
    for (int step = kCheckpointStep + 1; step <= 12; ++step) {
      ASSERT_TRUE(job.Train(step).ok());
      auto p = job.Read();
      ASSERT_TRUE(p.ok());
      reference[step] = *p;
    }
  }
  // How long a trial's training takes (steps 4 to 9, a background
  // checkpoint at step 5), so that kills land anywhere in it.
  absl::Duration span;
  {
    auto d = DaemonProcess::Start(DaemonFlags(MakeTmpIn(root, "nvme")));
    ASSERT_TRUE(d.ok()) << d.status();
    Job job;
    ASSERT_TRUE(job.Open((*d)->address(), ckpt).ok());
    const absl::Time start = absl::Now();
    for (int step = kCheckpointStep + 1; step <= 9; ++step) {
      ASSERT_TRUE(job.Train(step).ok());
      if (step == 5) {
        ASSERT_TRUE(job.session().Checkpoint(root + "/timing", true).ok());
      }
    }
    ASSERT_TRUE(job.session().WaitCheckpoint().ok());
    span = absl::Now() - start;
  }

  std::mt19937 rng(static_cast<uint32_t>(absl::ToUnixNanos(absl::Now())));
  std::map<std::string, int> hits;  // what the trainer was doing when the daemon died
  constexpr int kTrials = 10;
  for (int trial = 0; trial < kTrials; ++trial) {
    SCOPED_TRACE(absl::StrCat("trial ", trial));
    // Each trial works on its own copy of the checkpoint directory, into
    // which the dying daemon also writes its own checkpoint.
    const std::string dir = absl::StrCat(root, "/trial", trial);
    CopyDir(ckpt, dir);
    std::atomic<const char*> phase{"opening"};
    {
      auto d = DaemonProcess::Start(DaemonFlags(MakeTmpIn(root, "nvme")));
      ASSERT_TRUE(d.ok()) << d.status();
      Job job;
      absl::Status reopened = job.Open((*d)->address(), dir);
      ASSERT_TRUE(reopened.ok()) << reopened;
      // Kill anywhere in the training: steps (with swaps) and a background
      // checkpoint into `dir` from step 5 on.
      const int delay_ms = std::uniform_int_distribution<int>(
          0, static_cast<int>(absl::ToInt64Milliseconds(span)))(rng);
      const pid_t pid = (*d)->pid();
      std::thread killer([pid, delay_ms] {
        absl::SleepFor(absl::Milliseconds(delay_ms));
        kill(pid, SIGKILL);
      });
      for (int step = kCheckpointStep + 1; step <= 9; ++step) {
        phase = step <= 5 ? "training (fetch, return, step: swapping)"
                          : "training while the checkpoint is written";
        if (!job.Train(step).ok()) break;
        if (step == 5) {
          phase = "starting a checkpoint";
          if (!job.session().Checkpoint(dir, /*background=*/true).ok()) break;
        }
      }
      if (phase.load() == std::string("training while the checkpoint is written")) {
        // Alive to the end: the checkpoint may still be being written.
        if (job.session().WaitCheckpoint().ok())
          phase = "idle: training and the checkpoint were done";
      }
      killer.join();
      // The daemon died at `phase` (or after all of it).
      std::string what = phase.load();
      if (what == std::string("training while the checkpoint is written")) {
        // Did the checkpoint commit before the kill?
        what += ManifestSteps(dir) == 5 ? " (committed)" : " (not committed)";
      }
      // A checkpoint the kill interrupted left its data file behind (the
      // next checkpoint of the stem removes it), and the previous one whole.
      int data_files = 0;
      for (const auto& e : std::filesystem::directory_iterator(dir)) {
        data_files += e.path().extension() == ".data";
      }
      if (data_files > 1) what += ", a partial data file left";
      ++hits[what];
    }
    // A fresh daemon restores whichever checkpoint `dir` holds: the one
    // copied in (step 3) or the one the dead daemon committed (step 5).
    const uint64_t steps = ManifestSteps(dir);
    ASSERT_TRUE(steps == 3 || steps == 5) << steps;
    auto d = DaemonProcess::Start(DaemonFlags(MakeTmpIn(root, "nvme")));
    ASSERT_TRUE(d.ok()) << d.status();
    Job job;
    absl::Status opened = job.Open((*d)->address(), dir);
    ASSERT_TRUE(opened.ok()) << opened;
    for (int step = static_cast<int>(steps) + 1; step <= static_cast<int>(steps) + kVerifySteps;
         ++step) {
      ASSERT_TRUE(job.Train(step).ok());
      auto p = job.Read();
      ASSERT_TRUE(p.ok());
      ASSERT_TRUE(*p == reference[step]) << "step " << step << " after restoring step " << steps;
    }
  }
  for (const auto& [what, n] : hits) {
    std::fprintf(stderr, "killed while %s: %d of %d trials\n", what.c_str(), n, kTrials);
  }
}

// bf16 round-to-nearest-even of an fp32 value, as the daemon narrows.
uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

TEST(Offloadctl, ChecksPointsASessionByIdAndExportsSafetensors) {
  const std::string root = MakeTmp("ctl");
  RemoveOnExit cleanup(root);
  auto d = DaemonProcess::Start(DaemonFlags(MakeTmpIn(root, "nvme")));
  ASSERT_TRUE(d.ok()) << d.status();
  Job job;
  ASSERT_TRUE(job.Open((*d)->address()).ok());
  for (int step = 1; step <= 2; ++step) ASSERT_TRUE(job.Train(step).ok());
  const std::string ctl = "client/offloadctl", address = "--address=" + (*d)->address();
  auto r = ::offload::testing::RunCommand(
      {ctl, address, "checkpoint", std::to_string(job.session().id()), root + "/ckpt"});
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->exit_code, 0) << r->output;
  EXPECT_NE(r->output.find("at step 2"), std::string::npos) << r->output;
  // Offline: no daemon address needed.
  r = ::offload::testing::RunCommand(
      {ctl, "export", "--format=safetensors", root + "/ckpt", root + "/w.safetensors"});
  ASSERT_EQ(r->exit_code, 0) << r->output;
  EXPECT_NE(r->output.find("3 tensors"), std::string::npos) << r->output;
  // The file, read by the format's definition: the fp32 master weights,
  // whose bf16 rounding is the working copy the trainer reads.
  FILE* f = fopen((root + "/w.safetensors").c_str(), "rb");
  ASSERT_NE(f, nullptr);
  uint64_t n = 0;
  ASSERT_EQ(fread(&n, 8, 1, f), 1u);
  std::string header(n, '\0');
  ASSERT_EQ(fread(header.data(), 1, n, f), n);
  const std::string w0 =
      "\"w0\":{\"dtype\":\"F32\",\"shape\":[300000],\"data_offsets\":[0,1200000]}";
  ASSERT_NE(header.find(w0), std::string::npos) << header;
  std::vector<float> master(kNumel[0]);
  ASSERT_EQ(fread(master.data(), 4, master.size(), f), master.size());
  fclose(f);
  auto params = job.Read();
  ASSERT_TRUE(params.ok());
  int differ = 0, finer = 0;
  for (uint64_t j = 0; j < kNumel[0]; ++j) {
    uint32_t bits = static_cast<uint32_t>(ToBf16(master[j])) << 16;
    float rounded;
    std::memcpy(&rounded, &bits, 4);
    differ += rounded != (*params)[0][j];
    finer += rounded != master[j];  // more precise than bf16: the fp32 master
  }
  EXPECT_EQ(differ, 0);
  EXPECT_GT(finer, static_cast<int>(kNumel[0] / 2));

  // Errors: an unknown session, an unknown format, a directory without a
  // checkpoint.
  r = ::offload::testing::RunCommand({ctl, address, "checkpoint", "12345", root + "/x"});
  EXPECT_EQ(r->exit_code, 1);
  EXPECT_NE(r->output.find("NOT_FOUND"), std::string::npos) << r->output;
  r = ::offload::testing::RunCommand({ctl, "export", "--format=npz", root + "/ckpt", "o"});
  EXPECT_EQ(r->exit_code, 2);
  r = ::offload::testing::RunCommand({ctl, "export", root, root + "/o.safetensors"});
  EXPECT_EQ(r->exit_code, 1);
  EXPECT_NE(r->output.find("NOT_FOUND"), std::string::npos) << r->output;
}

uint64_t ManifestSteps(const std::string& dir) {
  absl::StatusOr<checkpoint::Manifest> m = checkpoint::ReadManifest(dir + "/job.manifest");
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? m->steps() : 0;
}

}  // namespace
}  // namespace offload
