#include "client/demo/mlp.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "cpu_adam/optimizer.h"

namespace offload::demo {
namespace {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  float Uniform() { return static_cast<float>(static_cast<double>(Next() >> 11) * 0x1p-52 - 1.0); }

 private:
  uint64_t state_;
};

}  // namespace

Dataset MakeDataset(const MlpConfig& c) {
  SplitMix64 rng(c.seed * 7919 + 1);
  // Teacher direction with unit expected |a.x|, so the target is smooth.
  std::vector<float> a(c.inputs);
  const float norm = std::sqrt(3.0f / static_cast<float>(c.inputs));
  for (float& v : a) v = norm * rng.Uniform();
  Dataset d;
  d.x.resize(static_cast<size_t>(c.samples) * c.inputs);
  d.y.resize(c.samples);
  for (int s = 0; s < c.samples; ++s) {
    double dot = 0;
    for (int i = 0; i < c.inputs; ++i) {
      float v = rng.Uniform();
      d.x[static_cast<size_t>(s) * c.inputs + i] = v;
      dot += static_cast<double>(v) * a[i];
    }
    const float* xs = &d.x[static_cast<size_t>(s) * c.inputs];
    d.y[s] = static_cast<float>(std::sin(1.5 * dot) + 0.5 * xs[0] * xs[1]);
  }
  return d;
}

std::vector<std::vector<float>> InitialWeights(const MlpConfig& c) {
  // Xavier-style uniform initialisation.
  SplitMix64 rng(c.seed);
  std::vector<std::vector<float>> initial;
  for (const TensorShape& t : MlpTensors(c)) {
    const bool bias = t.name[0] == 'b';
    const float fan_in =
        t.name == "w1" ? static_cast<float>(c.inputs) : static_cast<float>(c.hidden);
    const float limit = bias ? 0.0f : std::sqrt(3.0f / fan_in);
    std::vector<float> v(t.numel);
    for (float& x : v) x = limit * rng.Uniform();
    initial.push_back(std::move(v));
  }
  return initial;
}

double ForwardBackward(const MlpConfig& c, const float* xs, const float* ys, int count,
                       const float* const p[4], float* const g[4]) {
  const float* w1 = p[0];
  const float* b1 = p[1];
  const float* w2 = p[2];
  const float* b2 = p[3];
  const std::vector<TensorShape> shapes = MlpTensors(c);
  for (int t = 0; t < 4; ++t) std::fill(g[t], g[t] + shapes[t].numel, 0.0f);
  float* gw1 = g[0];
  float* gb1 = g[1];
  float* gw2 = g[2];
  float* gb2 = g[3];
  std::vector<float> h(c.hidden);
  double loss = 0;
  const float scale = 2.0f / static_cast<float>(count);
  for (int k = 0; k < count; ++k) {
    const float* x = &xs[static_cast<size_t>(k) * c.inputs];
    float out = b2[0];
    for (int j = 0; j < c.hidden; ++j) {
      float z = b1[j];
      for (int i = 0; i < c.inputs; ++i) z += w1[static_cast<size_t>(j) * c.inputs + i] * x[i];
      h[j] = std::tanh(z);
      out += w2[j] * h[j];
    }
    const float err = out - ys[k];
    loss += static_cast<double>(err) * err;
    const float dout = scale * err;
    gb2[0] += dout;
    for (int j = 0; j < c.hidden; ++j) {
      gw2[j] += dout * h[j];
      const float dz = dout * w2[j] * (1.0f - h[j] * h[j]);
      gb1[j] += dz;
      for (int i = 0; i < c.inputs; ++i) gw1[static_cast<size_t>(j) * c.inputs + i] += dz * x[i];
    }
  }
  return loss / count;
}

namespace {

class InProcessStore final : public ParameterStore {
 public:
  explicit InProcessStore(const MlpConfig& c) : config_(c), optimizer_(OptimizerOptions{}) {}

  absl::Status Init(const std::vector<TensorShape>& tensors,
                    const std::vector<std::vector<float>>& initial) override {
    const size_t elem = DTypeSize(config_.param_dtype);
    for (size_t t = 0; t < tensors.size(); ++t) {
      Tensor x;
      const uint64_t n = tensors[t].numel;
      x.working.resize(n * elem);
      x.grads.resize(n * elem);
      x.master.resize(n);
      x.m.assign(n, 0.0f);
      x.v.assign(n, 0.0f);
      NarrowFromFloat(initial[t].data(), config_.param_dtype, x.working.data(), n);
      // As the daemon does on a partition's first step.
      WidenToFloat(x.working.data(), config_.param_dtype, x.master.data(), n);
      tensors_.push_back(std::move(x));
    }
    return absl::OkStatus();
  }

  absl::Status Read(std::vector<std::vector<float>>* params) override {
    params->resize(tensors_.size());
    for (size_t t = 0; t < tensors_.size(); ++t) {
      (*params)[t].resize(tensors_[t].master.size());
      WidenToFloat(tensors_[t].working.data(), config_.param_dtype, (*params)[t].data(),
                   tensors_[t].master.size());
    }
    return absl::OkStatus();
  }

  absl::Status Update(const std::vector<std::vector<float>>& grads) override {
    std::vector<AdamTask> tasks;
    ++step_;
    for (size_t t = 0; t < tensors_.size(); ++t) {
      Tensor& x = tensors_[t];
      NarrowFromFloat(grads[t].data(), config_.param_dtype, x.grads.data(), x.master.size());
      tasks.push_back(
          {{x.master.data(), x.m.data(), x.v.data(), x.grads.data(), config_.param_dtype,
            x.working.data(), config_.param_dtype, x.master.size()},
           step_});
    }
    absl::StatusOr<StepReport> report = optimizer_.Step(tasks, config_.adam);
    if (!report.ok()) return report.status();
    if (report->skipped) return absl::DataLossError("non-finite gradients in the demo model");
    return absl::OkStatus();
  }

 private:
  struct Tensor {
    std::vector<std::byte> working, grads;
    std::vector<float> master, m, v;
  };
  const MlpConfig config_;
  Optimizer optimizer_;
  std::vector<Tensor> tensors_;
  uint64_t step_ = 0;
};

class DaemonStore final : public ParameterStore {
 public:
  DaemonStore(const MlpConfig& c, Session* session) : config_(c), session_(session) {}

  absl::Status Init(const std::vector<TensorShape>& tensors,
                    const std::vector<std::vector<float>>& initial) override {
    for (size_t t = 0; t < tensors.size(); ++t) {
      // Registered partitions are held: write the initial values, release.
      ASSIGN_OR_RETURN(PartitionView view,
                       session_->Register(tensors[t].name, tensors[t].numel, config_.param_dtype,
                                          config_.param_dtype));
      NarrowFromFloat(initial[t].data(), config_.param_dtype, view.params, view.numel);
      RETURN_IF_ERROR(session_->Release(view));
      ids_.push_back(view.id);
    }
    return absl::OkStatus();
  }

  // As ZeRO-3's forward gathers each layer: hold, read, release, one
  // partition at a time, so that the daemon's pool needs to hold only one.
  absl::Status Read(std::vector<std::vector<float>>* params) override {
    params->resize(ids_.size());
    for (size_t t = 0; t < ids_.size(); ++t) {
      ASSIGN_OR_RETURN(PartitionView view, session_->Fetch(ids_[t]));
      (*params)[t].resize(view.numel);
      WidenToFloat(view.params, view.param_dtype, (*params)[t].data(), view.numel);
      RETURN_IF_ERROR(session_->Release(view));
    }
    return absl::OkStatus();
  }

  // As backward hands each layer's gradients over: hold the gradient
  // buffer, write, return it, release.
  absl::Status Update(const std::vector<std::vector<float>>& grads) override {
    FetchOptions backward;
    backward.grads = true;
    for (size_t t = ids_.size(); t-- > 0;) {
      ASSIGN_OR_RETURN(PartitionView view, session_->Fetch(ids_[t], backward));
      NarrowFromFloat(grads[t].data(), view.grad_dtype, view.grads, view.numel);
      RETURN_IF_ERROR(session_->ReturnGradients(view));
      RETURN_IF_ERROR(session_->Release(view));
    }
    ASSIGN_OR_RETURN(StepResult r, session_->Step(config_.adam));
    if (r.partitions_updated != ids_.size()) {
      return absl::InternalError(
          absl::StrCat("step updated ", r.partitions_updated, " of ", ids_.size(), " partitions"));
    }
    return absl::OkStatus();
  }

 private:
  const MlpConfig config_;
  Session* const session_;
  std::vector<uint64_t> ids_;
};

}  // namespace

std::vector<TensorShape> MlpTensors(const MlpConfig& c) {
  return {{"w1", static_cast<uint64_t>(c.hidden) * c.inputs},
          {"b1", static_cast<uint64_t>(c.hidden)},
          {"w2", static_cast<uint64_t>(c.hidden)},
          {"b2", 1}};
}

std::unique_ptr<ParameterStore> MakeInProcessStore(const MlpConfig& config) {
  return std::make_unique<InProcessStore>(config);
}

std::unique_ptr<ParameterStore> MakeDaemonStore(const MlpConfig& config, Session* session) {
  return std::make_unique<DaemonStore>(config, session);
}

absl::StatusOr<std::vector<double>> Train(const MlpConfig& c, ParameterStore* store) {
  if (c.inputs < 2 || c.hidden < 1 || c.samples < 1 || c.batch < 1 || c.steps < 0) {
    return absl::InvalidArgumentError("MLP config needs inputs >= 2 and positive sizes");
  }
  const Dataset data = MakeDataset(c);
  const std::vector<TensorShape> tensors = MlpTensors(c);
  RETURN_IF_ERROR(store->Init(tensors, InitialWeights(c)));
  std::vector<std::vector<float>> params, grads;
  for (const TensorShape& t : tensors) grads.emplace_back(t.numel);
  std::vector<float> x(static_cast<size_t>(c.batch) * c.inputs), y(c.batch);
  std::vector<double> losses;
  for (int step = 0; step < c.steps; ++step) {
    RETURN_IF_ERROR(store->Read(&params));
    for (int k = 0; k < c.batch; ++k) {
      const int s = static_cast<int>((static_cast<int64_t>(step) * c.batch + k) % c.samples);
      std::copy_n(&data.x[static_cast<size_t>(s) * c.inputs], c.inputs,
                  &x[static_cast<size_t>(k) * c.inputs]);
      y[k] = data.y[s];
    }
    const float* p[4] = {params[0].data(), params[1].data(), params[2].data(), params[3].data()};
    float* g[4] = {grads[0].data(), grads[1].data(), grads[2].data(), grads[3].data()};
    losses.push_back(ForwardBackward(c, x.data(), y.data(), c.batch, p, g));
    RETURN_IF_ERROR(store->Update(grads));
  }
  return losses;
}

}  // namespace offload::demo
