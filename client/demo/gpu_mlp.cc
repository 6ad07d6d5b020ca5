#include "client/demo/gpu_mlp.h"

#include <array>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "cpu_adam/dtype.h"

namespace offload::demo {
namespace {

class EmulatedMlpKernels final : public MlpKernels {
 public:
  explicit EmulatedMlpKernels(gpu::EmulatedDevice* device) : device_(device) {}

  absl::Status ForwardBackward(const MlpConfig& config, const float* x, const float* y, int count,
                               const float* const p[4], float* const g[4], float* loss,
                               const gpu::Stream& stream) override {
    std::array<const float*, 4> params{p[0], p[1], p[2], p[3]};
    std::array<float*, 4> grads{g[0], g[1], g[2], g[3]};
    return device_->Launch(stream, [config, x, y, count, params, grads, loss]() {
      *loss = static_cast<float>(
          demo::ForwardBackward(config, x, y, count, params.data(), grads.data()));
    });
  }

 private:
  gpu::EmulatedDevice* const device_;
};

constexpr uint64_t kAlign = 256;

// Lays out aligned float arrays in one allocation: Take returns offsets,
// At turns them into addresses once the allocation is there.
class Layout {
 public:
  uint64_t Take(uint64_t floats) {
    const uint64_t at = bytes_;
    bytes_ += (floats * sizeof(float) + kAlign - 1) / kAlign * kAlign;
    return at;
  }
  uint64_t bytes() const { return bytes_; }
  static float* At(const gpu::DeviceMemory& memory, uint64_t offset) {
    return reinterpret_cast<float*>(static_cast<char*>(memory.get()) + offset);
  }

 private:
  uint64_t bytes_ = 0;
};

}  // namespace

std::unique_ptr<MlpKernels> MakeEmulatedMlpKernels(gpu::EmulatedDevice* device) {
  return std::make_unique<EmulatedMlpKernels>(device);
}

absl::StatusOr<GpuTrainResult> TrainZero3(const MlpConfig& c, const GpuRank& r) {
  if (r.session == nullptr || r.device == nullptr || r.comm == nullptr || r.kernels == nullptr) {
    return absl::InvalidArgumentError(
        "TrainZero3 needs a session, a device, a communicator "
        "and kernels");
  }
  const int ranks = r.comm->size();
  const int me = r.comm->rank();
  if (c.param_dtype != DType::kFp32) {
    return absl::InvalidArgumentError("the GPU demo trains fp32 working parameters");
  }
  if (c.inputs < 2 || c.hidden < 1 || c.steps < 0 || c.batch < ranks || c.batch % ranks != 0 ||
      c.batch / ranks > c.samples) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the GPU demo needs inputs >= 2, a batch that is a multiple of the ", ranks,
        " ranks, and at most samples per rank (batch ", c.batch, ", samples ", c.samples, ")"));
  }
  const int local = c.batch / ranks;
  const std::vector<TensorShape> tensors = MlpTensors(c);
  const std::vector<std::vector<float>> initial = InitialWeights(c);
  const Dataset data = MakeDataset(c);

  // This rank's slice of each tensor, registered with its initial values.
  uint64_t ids[4], slice[4], full[4];
  for (int t = 0; t < 4; ++t) {
    slice[t] = Zero3::SliceNumel(tensors[t].numel, ranks);
    full[t] = slice[t] * ranks;
    ASSIGN_OR_RETURN(PartitionView view,
                     r.session->Register(tensors[t].name, slice[t], DType::kFp32, DType::kFp32));
    float* dst = static_cast<float*>(view.params);
    const uint64_t first = me * slice[t];
    for (uint64_t i = 0; i < slice[t]; ++i) {
      dst[i] = first + i < tensors[t].numel ? initial[t][first + i] : 0.0f;
    }
    RETURN_IF_ERROR(r.session->Release(view));
    ids[t] = view.id;
  }

  ASSIGN_OR_RETURN(std::unique_ptr<GpuTier> tier, GpuTier::Create(r.session, r.device, r.tier));
  ASSIGN_OR_RETURN(std::unique_ptr<Zero3> zero3,
                   Zero3::Create(tier.get(), r.device, r.comm, r.zero3));
  // Two units, as the two layers: (w1, b1) and (w2, b2).
  int units[2];
  for (int u = 0; u < 2; ++u) {
    const int w = 2 * u, b = 2 * u + 1;
    ASSIGN_OR_RETURN(units[u], zero3->AddUnit({{ids[w], slice[w] * sizeof(float)},
                                               {ids[b], slice[b] * sizeof(float)}}));
  }

  // Device memory: full parameters and gradients, the dataset twice over
  // (so that every batch is one contiguous window), the loss with the
  // automatic checkpoint's due flag beside it, and every rank's pair.
  Layout layout;
  uint64_t params_at[4], grads_at[4];
  for (int t = 0; t < 4; ++t) params_at[t] = layout.Take(full[t]);
  for (int t = 0; t < 4; ++t) grads_at[t] = layout.Take(full[t]);
  const uint64_t grads_bytes = layout.bytes() - grads_at[0];
  const uint64_t x_at = layout.Take(2ull * c.samples * c.inputs);
  const uint64_t y_at = layout.Take(2ull * c.samples);
  const uint64_t loss_at = layout.Take(2);
  const uint64_t losses_at = layout.Take(2 * ranks);
  ASSIGN_OR_RETURN(gpu::DeviceMemory memory, r.device->Allocate(layout.bytes()));
  float *params[4], *grads[4];
  for (int t = 0; t < 4; ++t) {
    params[t] = Layout::At(memory, params_at[t]);
    grads[t] = Layout::At(memory, grads_at[t]);
  }
  float* x = Layout::At(memory, x_at);
  float* y = Layout::At(memory, y_at);
  float* loss = Layout::At(memory, loss_at);
  float* losses = Layout::At(memory, losses_at);

  ASSIGN_OR_RETURN(gpu::Stream compute, r.device->CreateStream());
  ASSIGN_OR_RETURN(gpu::Event done, r.device->CreateEvent());
  // On every way out, the work still issued on `compute` finishes before
  // the memory it uses goes.
  // Host buffers copies read or write: declared before `finish`, so that
  // they outlive the work it waits for.
  std::vector<float> x2(data.x), y2(data.y);
  x2.insert(x2.end(), data.x.begin(), data.x.end());
  y2.insert(y2.end(), data.y.begin(), data.y.end());
  const std::vector<char> zeros(grads_bytes, 0);  // the gradients' padding stays zero
  std::vector<float> rank_losses(2 * ranks);      // each rank's loss and due flag
  float due = 0;
  absl::Cleanup finish = [&] {
    if (r.device->Record(done, compute).ok()) r.device->Synchronize(done).IgnoreError();
  };
  RETURN_IF_ERROR(r.device->CopyAsync(x, x2.data(), x2.size() * sizeof(float),
                                      gpu::Direction::kHostToDevice, compute));
  RETURN_IF_ERROR(r.device->CopyAsync(y, y2.data(), y2.size() * sizeof(float),
                                      gpu::Direction::kHostToDevice, compute));
  RETURN_IF_ERROR(r.device->CopyAsync(grads[0], zeros.data(), zeros.size(),
                                      gpu::Direction::kHostToDevice, compute));
  RETURN_IF_ERROR(r.device->Record(done, compute));
  RETURN_IF_ERROR(r.device->Synchronize(done));

  GpuTrainResult result;
  for (int step = 0; step < c.steps; ++step) {
    RETURN_IF_ERROR(tier->BeginIteration());
    float* const layer1[] = {params[0], params[1]};
    float* const layer2[] = {params[2], params[3]};
    RETURN_IF_ERROR(zero3->Gather(units[0], {reinterpret_cast<void* const*>(layer1), 2}, compute));
    RETURN_IF_ERROR(zero3->Gather(units[1], {reinterpret_cast<void* const*>(layer2), 2}, compute));
    const uint64_t first = (static_cast<uint64_t>(step) * c.batch + me * local) % c.samples;
    const float* const p[4] = {params[0], params[1], params[2], params[3]};
    RETURN_IF_ERROR(r.kernels->ForwardBackward(c, x + first * c.inputs, y + first, local, p, grads,
                                               loss, compute));
    for (int t = 3; t >= 0; --t) {  // in the order backward produces them
      RETURN_IF_ERROR(zero3->ReduceScatter(ids[t], grads[t], full[t], compute));
    }
    ASSIGN_OR_RETURN(std::vector<uint64_t> returned, zero3->FinishBackward(compute));
    if (returned.size() != 4) {
      return absl::InternalError(
          absl::StrCat("rank ", me, " step ", step, ": ", returned.size(), " of 4 gradients went"));
    }
    // The losses gathered, and with them whether any rank's automatic
    // checkpoint is due: then every rank takes one at this step (each
    // daemon's clock alone puts the ranks' steps apart).
    ASSIGN_OR_RETURN(PendingGradients pending, r.session->GetPendingGradients());
    due = pending.auto_checkpoint_due ? 1.0f : 0.0f;
    RETURN_IF_ERROR(
        r.device->CopyAsync(loss + 1, &due, sizeof(float), gpu::Direction::kHostToDevice, compute));
    RETURN_IF_ERROR(r.comm->AllGather({{loss, losses, 2 * sizeof(float)}}, compute));
    RETURN_IF_ERROR(r.device->CopyAsync(rank_losses.data(), losses, 2 * ranks * sizeof(float),
                                        gpu::Direction::kDeviceToHost, compute));
    RETURN_IF_ERROR(r.device->Record(done, compute));
    RETURN_IF_ERROR(r.device->Synchronize(done));
    RETURN_IF_ERROR(r.comm->Check());  // (a broken all-gather wrote nothing to use)
    double sum = 0;
    StepOptions options;
    if (ranks > 1) options.auto_checkpoint = false;
    for (int k = 0; k < ranks; ++k) {
      sum += rank_losses[2 * k];
      if (ranks > 1 && rank_losses[2 * k + 1] != 0) options.auto_checkpoint = true;
    }
    result.losses.push_back(sum / ranks);
    RETURN_IF_ERROR(tier->EndIteration());
    ASSIGN_OR_RETURN(StepResult stepped, r.session->Step(c.adam, options));
    if (stepped.partitions_updated != 4) {
      return absl::InternalError(absl::StrCat("rank ", me, " step ", step, " updated ",
                                              stepped.partitions_updated, " of 4 partitions"));
    }
    RETURN_IF_ERROR(tier->params().Invalidate(compute));
    // The next iteration's copies of the new values start now, while this
    // thread comes round to its gathers (where the budget does not hold
    // both layers, the gathers bring them as before).
    if (step + 1 < c.steps) {
      absl::Status ahead = tier->PrefetchUnits(units);
      if (!ahead.ok() && !absl::IsResourceExhausted(ahead)) return ahead;
    }
  }
  result.zero3 = zero3->stats();
  result.tier = tier->stats();
  return result;
}

}  // namespace offload::demo
