// offload_gpu_demo: trains the demo MLP on a device with ZeRO-3 through
// offloadd (client/demo/gpu_mlp.h), and the same model in-process on the
// host, and compares the loss curves.
//
//   offload_gpu_demo --device=emulated [--ranks=N]
//       N ranks as threads of this process, each with its own session and
//       emulated device, over an emulated communicator: runs anywhere.
//   offload_gpu_demo --device=cuda [--gpu=ORDINAL] [--rank=R --world=W
//                    --nccl_id_file=PATH]
//       one rank of W, one process each, over NCCL. Rank 0 creates the
//       NCCL id and writes it to PATH (a filesystem every rank sees); the
//       others wait up to a minute for it. With W = 1 no file is needed.
//       Rank 0 removes PATH once the communicator is made (every rank has
//       read it then): a later run finds no stale id there (after a crash,
//       remove it by hand, or give each run its own PATH).
//   common: [--address=ADDR] [--steps=N] [--batch=N] [--bucket_bytes=B]
//
// Exits 1 unless every loss agrees with in-process training to 1e-4
// relative (the batch's gradient is summed in another order than on the
// host; the emulated device runs the host's math and agrees to 1e-5).
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/demo/gpu_mlp.h"
#include "client/demo/mlp.h"
#include "gpu/cuda_device.h"
#include "gpu/emulated_communicator.h"
#include "gpu/emulated_device.h"
#include "gpu/nccl_communicator.h"

namespace offload::demo {
namespace {

struct Flags {
  std::string device = "emulated";
  int ranks = 2;  // emulated
  int gpu = 0, rank = 0, world = 1;
  std::string nccl_id_file;
  ClientOptions client;
  MlpConfig config;
  Zero3Options zero3;
};

// Trains one rank: its own connection and session.
absl::StatusOr<GpuTrainResult> RunRank(const Flags& f, GpuRank rank) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(f.client);
  if (!client.ok()) return client.status();
  absl::StatusOr<std::unique_ptr<Session>> session =
      (*client)->OpenSession(absl::StrCat("offload_gpu_demo rank ", rank.comm->rank()));
  if (!session.ok()) return session.status();
  rank.session = session->get();
  rank.tier.params.budget_bytes = 64ull << 20;
  rank.zero3 = f.zero3;
  absl::StatusOr<GpuTrainResult> result = TrainZero3(f.config, rank);
  absl::Status closed = (*session)->Close();
  if (result.ok() && !closed.ok()) return closed;
  return result;
}

// Rank 0 writes a new id to `path`; the others wait for it.
absl::StatusOr<std::string> ShareNcclId(const std::string& path, int rank) {
  if (rank == 0) {
    absl::StatusOr<std::string> id = gpu::NewNcclId();
    if (!id.ok()) return id.status();
    const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
    std::ofstream out(tmp, std::ios::binary);
    out << *id;
    out.close();
    if (!out || std::rename(tmp.c_str(), path.c_str()) != 0) {
      std::remove(tmp.c_str());
      return absl::InternalError(absl::StrCat("cannot write the NCCL id to ", path));
    }
    return id;
  }
  const absl::Time deadline = absl::Now() + absl::Minutes(1);
  while (absl::Now() < deadline) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    if (bytes.str().size() == 128) return bytes.str();
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("rank ", rank, ": no NCCL id in ", path, " after a minute (rank 0 writes it)"));
}

int Report(const Flags& f, const GpuTrainResult& result) {
  MlpConfig host = f.config;
  auto store = MakeInProcessStore(host);
  absl::StatusOr<std::vector<double>> reference = Train(host, store.get());
  if (!reference.ok()) {
    std::fprintf(stderr, "offload_gpu_demo: in-process training: %s\n",
                 reference.status().ToString().c_str());
    return 1;
  }
  double worst = 0;
  for (size_t i = 0; i < result.losses.size(); ++i) {
    if (i % 50 == 0 || i + 1 == result.losses.size()) {
      std::printf("step %4zu  loss %.6f  (in-process %.6f)\n", i, result.losses[i],
                  (*reference)[i]);
    }
    worst = std::max(worst, std::abs(result.losses[i] - (*reference)[i]) /
                                std::max(1e-12, std::abs((*reference)[i])));
  }
  const Zero3Stats& z = result.zero3;
  std::printf(
      "rank 0: %llu all-gathers of %llu tensors, %llu reduce-scatters of %llu tensors, %llu "
      "gradients to the daemon; %llu parameter copies to the device (%llu bytes)\n",
      static_cast<unsigned long long>(z.all_gathers),
      static_cast<unsigned long long>(z.gathered_tensors),
      static_cast<unsigned long long>(z.reduce_scatters),
      static_cast<unsigned long long>(z.scattered_tensors),
      static_cast<unsigned long long>(z.gradients_returned),
      static_cast<unsigned long long>(result.tier.params.copies),
      static_cast<unsigned long long>(result.tier.params.h2d_bytes));
  const bool ok = worst <= 1e-4;
  std::printf("losses %s in-process training: max relative difference %.3g over %zu steps\n",
              ok ? "agree with" : "DIFFER FROM", worst, result.losses.size());
  return ok ? 0 : 1;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "offload_gpu_demo: %s\n", s.ToString().c_str());
  return 1;
}

int Emulated(const Flags& f) {
  std::vector<std::unique_ptr<gpu::EmulatedDevice>> devices;
  std::vector<gpu::EmulatedDevice*> raw;
  std::vector<std::unique_ptr<MlpKernels>> kernels;
  for (int r = 0; r < f.ranks; ++r) {
    devices.push_back(std::make_unique<gpu::EmulatedDevice>(gpu::EmulatedDeviceOptions{
        .memory_bytes = 256ull << 20, .seed = static_cast<uint64_t>(r + 1)}));
    raw.push_back(devices.back().get());
    kernels.push_back(MakeEmulatedMlpKernels(devices.back().get()));
  }
  auto comms = gpu::EmulatedCommunicator::CreateGroup(raw);
  std::printf("training a %d-%d-1 MLP with ZeRO-3 on %d emulated devices through offloadd\n",
              f.config.inputs, f.config.hidden, f.ranks);
  std::vector<absl::StatusOr<GpuTrainResult>> results(f.ranks, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < f.ranks; ++r) {
    threads.emplace_back([&, r] {
      GpuRank rank;
      rank.device = devices[r].get();
      rank.comm = comms[r].get();
      rank.kernels = kernels[r].get();
      results[r] = RunRank(f, rank);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < f.ranks; ++r) {
    if (!results[r].ok())
      return Fail(absl::Status(results[r].status().code(),
                               absl::StrCat("rank ", r, ": ", results[r].status().message())));
  }
  return Report(f, *results[0]);
}

int Cuda(const Flags& f) {
  absl::StatusOr<std::unique_ptr<gpu::Device>> device = gpu::OpenCudaDevice(f.gpu);
  if (!device.ok()) return Fail(device.status());
  absl::StatusOr<std::unique_ptr<MlpKernels>> kernels = MakeCudaMlpKernels(device->get());
  if (!kernels.ok()) return Fail(kernels.status());
  absl::StatusOr<std::string> id =
      f.world == 1 ? gpu::NewNcclId() : ShareNcclId(f.nccl_id_file, f.rank);
  if (!id.ok()) return Fail(id.status());
  absl::StatusOr<std::unique_ptr<gpu::Communicator>> comm =
      gpu::OpenNcclCommunicator(f.gpu, *id, f.rank, f.world);
  // Made (or failed) on every rank: the id is spent; a later run must not
  // take it for its own.
  if (f.world > 1 && f.rank == 0) std::remove(f.nccl_id_file.c_str());
  if (!comm.ok()) return Fail(comm.status());
  std::printf("training a %d-%d-1 MLP with ZeRO-3 on %s as %s through offloadd\n", f.config.inputs,
              f.config.hidden, (*device)->name().c_str(), (*comm)->name().c_str());
  GpuRank rank;
  rank.device = device->get();
  rank.comm = comm->get();
  rank.kernels = kernels->get();
  absl::StatusOr<GpuTrainResult> result = RunRank(f, rank);
  if (!result.ok()) return Fail(result.status());
  return f.rank == 0 ? Report(f, *result) : 0;
}

int Main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&a](absl::string_view flag) -> std::optional<std::string> {
      if (!absl::StartsWith(a, flag)) return std::nullopt;
      return a.substr(flag.size());
    };
    std::optional<std::string> v;
    bool ok = true;
    if ((v = value("--address="))) {
      f.client.address = *v;
    } else if ((v = value("--device=")) && (*v == "emulated" || *v == "cuda")) {
      f.device = *v;
    } else if ((v = value("--ranks="))) {
      ok = absl::SimpleAtoi(*v, &f.ranks) && f.ranks >= 1 && f.ranks <= 64;
    } else if ((v = value("--gpu="))) {
      ok = absl::SimpleAtoi(*v, &f.gpu);
    } else if ((v = value("--rank="))) {
      ok = absl::SimpleAtoi(*v, &f.rank);
    } else if ((v = value("--world="))) {
      ok = absl::SimpleAtoi(*v, &f.world) && f.world >= 1;
    } else if ((v = value("--nccl_id_file="))) {
      f.nccl_id_file = *v;
    } else if ((v = value("--steps="))) {
      ok = absl::SimpleAtoi(*v, &f.config.steps);
    } else if ((v = value("--batch="))) {
      ok = absl::SimpleAtoi(*v, &f.config.batch);
    } else if ((v = value("--bucket_bytes="))) {
      ok = absl::SimpleAtoi(*v, &f.zero3.bucket_bytes) && f.zero3.bucket_bytes > 0;
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "usage: offload_gpu_demo [--device=emulated|cuda] [--ranks=N] [--gpu=ORDINAL] "
                   "[--rank=R --world=W --nccl_id_file=PATH] [--address=ADDR] [--steps=N] "
                   "[--batch=N] [--bucket_bytes=B]\n");
      return 2;
    }
  }
  if (f.device == "cuda" && f.world > 1 && f.nccl_id_file.empty()) {
    std::fprintf(stderr, "offload_gpu_demo: --world > 1 needs --nccl_id_file\n");
    return 2;
  }
  return f.device == "emulated" ? Emulated(f) : Cuda(f);
}

}  // namespace
}  // namespace offload::demo

int main(int argc, char** argv) { return offload::demo::Main(argc, argv); }
