// The demo model: a two-layer MLP (tanh hidden layer) regressing a fixed
// nonlinear function of generated inputs. Its four tensors (w1, b1, w2, b2)
// live behind a ParameterStore, so the same training loop runs against
// offloadd (DaemonStore) or entirely in-process (InProcessStore) with the
// same Adam kernel; the two loss curves must agree.
//
// Everything is deterministic: data and initial weights come from a fixed
// SplitMix64 stream, and the math runs in a fixed order.
#ifndef OFFLOADD_CLIENT_DEMO_MLP_H_
#define OFFLOADD_CLIENT_DEMO_MLP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "cpu_adam/adam.h"
#include "cpu_adam/dtype.h"

namespace offload::demo {

struct MlpConfig {
  int inputs = 16;
  int hidden = 256;
  int samples = 1024;
  int batch = 128;
  int steps = 200;
  uint64_t seed = 42;
  DType param_dtype = DType::kFp32;  // working copy and gradient dtype
  AdamHyperparams adam{/*lr=*/3e-3,
                       0.9,
                       0.999,
                       1e-8,
                       /*weight_decay=*/1e-4,
                       /*decoupled_weight_decay=*/true,
                       /*bias_correction=*/true};
};

struct TensorShape {
  std::string name;
  uint64_t numel;
};

// w1 (hidden x inputs), b1 (hidden), w2 (hidden), b2 (1).
std::vector<TensorShape> MlpTensors(const MlpConfig& config);

// The samples (x: samples x inputs, y: samples) and initial weights (one
// vector per tensor of MlpTensors) of `config`.
struct Dataset {
  std::vector<float> x;
  std::vector<float> y;
};
Dataset MakeDataset(const MlpConfig& config);
std::vector<std::vector<float>> InitialWeights(const MlpConfig& config);

// The mean squared error of `count` samples (x: count x inputs, y: count)
// under parameters `p` (w1, b1, w2, b2), and its gradients into `g`
// (overwritten), in a fixed order. Step k trains on samples
// [k * batch, (k + 1) * batch) modulo samples.
double ForwardBackward(const MlpConfig& config, const float* x, const float* y, int count,
                       const float* const p[4], float* const g[4]);

// Where the model's parameters live and who updates them.
class ParameterStore {
 public:
  virtual ~ParameterStore() = default;
  // Registers the tensors; `initial` are fp32 values, stored in the working
  // dtype (rounded).
  virtual absl::Status Init(const std::vector<TensorShape>& tensors,
                            const std::vector<std::vector<float>>& initial) = 0;
  // The current working parameters, widened to fp32.
  virtual absl::Status Read(std::vector<std::vector<float>>* params) = 0;
  // Hands over this step's gradients (rounded to the working dtype) and
  // runs one optimizer step.
  virtual absl::Status Update(const std::vector<std::vector<float>>& grads) = 0;
};

// Keeps master weights and moments in-process, updated by cpu_adam's
// Optimizer exactly as the daemon does.
std::unique_ptr<ParameterStore> MakeInProcessStore(const MlpConfig& config);

// Keeps the tensors as partitions of an offloadd session.
std::unique_ptr<ParameterStore> MakeDaemonStore(const MlpConfig& config, Session* session);

// Trains for config.steps steps and returns the loss before each step.
absl::StatusOr<std::vector<double>> Train(const MlpConfig& config, ParameterStore* store);

}  // namespace offload::demo

#endif  // OFFLOADD_CLIENT_DEMO_MLP_H_
