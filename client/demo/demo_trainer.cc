// offload_demo: trains the demo MLP with its parameters held by offloadd,
// and the same training in-process, and prints both loss curves.
//
//   offload_demo [--address=ADDR] [--steps=N] [--dtype=fp32|bf16|fp16]
//                [--mode=both|daemon|inprocess]
//
// In "both" mode it exits 1 unless every loss agrees to 1e-5 relative.
#include <cmath>
#include <cstdio>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "client/client.h"
#include "client/demo/mlp.h"

namespace offload::demo {
namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "offload_demo: %s\n", s.ToString().c_str());
  return 1;
}

int Main(int argc, char** argv) {
  MlpConfig config;
  ClientOptions options;
  std::string mode = "both";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (absl::StartsWith(a, "--address=")) {
      options.address = a.substr(10);
    } else if (absl::StartsWith(a, "--steps=") && absl::SimpleAtoi(a.substr(8), &config.steps)) {
    } else if (absl::StartsWith(a, "--dtype=") && ParseDType(a.substr(8)).has_value()) {
      config.param_dtype = *ParseDType(a.substr(8));
    } else if (a == "--mode=both" || a == "--mode=daemon" || a == "--mode=inprocess") {
      mode = a.substr(7);
    } else {
      std::fprintf(stderr,
                   "usage: offload_demo [--address=ADDR] [--steps=N] [--dtype=fp32|bf16|fp16] "
                   "[--mode=both|daemon|inprocess]\n");
      return 2;
    }
  }
  std::vector<double> remote, local;
  if (mode != "inprocess") {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    if (!client.ok()) return Fail(client.status());
    absl::StatusOr<std::unique_ptr<Session>> session = (*client)->OpenSession("offload_demo");
    if (!session.ok()) return Fail(session.status());
    std::printf("training a %d-%d-1 MLP (%s) through offloadd at %s, session %llu\n", config.inputs,
                config.hidden, DTypeName(config.param_dtype), (*client)->address().c_str(),
                static_cast<unsigned long long>((*session)->id()));
    auto store = MakeDaemonStore(config, session->get());
    absl::StatusOr<std::vector<double>> losses = Train(config, store.get());
    if (!losses.ok()) return Fail(losses.status());
    remote = *losses;
    if (absl::Status s = (*session)->Close(); !s.ok()) return Fail(s);
  }
  if (mode != "daemon") {
    auto store = MakeInProcessStore(config);
    absl::StatusOr<std::vector<double>> losses = Train(config, store.get());
    if (!losses.ok()) return Fail(losses.status());
    local = *losses;
  }
  double worst = 0;
  std::printf("%6s %14s %14s %10s\n", "step", "loss(offloadd)", "loss(local)", "rel.diff");
  for (int s = 0; s < config.steps; ++s) {
    double r = remote.empty() ? NAN : remote[s];
    double l = local.empty() ? NAN : local[s];
    double diff = (remote.empty() || local.empty()) ? 0 : std::fabs(r - l) / std::fabs(l);
    worst = std::max(worst, diff);
    if (s % 20 == 0 || s == config.steps - 1) {
      auto cell = [](double v) {
        return std::isnan(v) ? std::string("-") : absl::StrFormat("%.6f", v);
      };
      std::printf("%6d %14s %14s %10.2e\n", s, cell(r).c_str(), cell(l).c_str(), diff);
    }
  }
  if (mode == "both") {
    const bool ok = worst <= 1e-5;
    std::printf("max relative difference %.3e (limit 1e-5): %s\n", worst, ok ? "OK" : "MISMATCH");
    return ok ? 0 : 1;
  }
  return 0;
}

}  // namespace
}  // namespace offload::demo

int main(int argc, char** argv) { return offload::demo::Main(argc, argv); }
