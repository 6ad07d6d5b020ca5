// The Python binding: a pybind11 module over the C++ client (client/client.h;
// there is no second client). Partition memory reaches Python without a
// copy: `params` and `grads` are writable memoryviews over the shared arena
// (torch.frombuffer(view, dtype=...) makes a tensor of them), valid while the
// session holds the partition, as the residency contract says. Blocking
// calls release the GIL. Errors are offloadd.Error (with .code, the gRPC
// code's name) or a subclass for the codes callers act on.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "checkpoint/format.h"
#include "client/client.h"
#include "client/gpu_tier.h"
#include "gpu/cuda_device.h"
#include "gpu/emulated_device.h"

namespace py = pybind11;
using namespace pybind11::literals;  // NOLINT: "x"_a

namespace offload::python {
namespace {

// The exception classes, created at import.
struct Errors {
  py::object base, unavailable, resource_exhausted, invalid_argument, failed_precondition,
      not_found, permission_denied, data_loss;
};
Errors* errors = nullptr;

[[noreturn]] void Raise(const absl::Status& s) {
  py::object type = errors->base;
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
      type = errors->unavailable;
      break;
    case absl::StatusCode::kResourceExhausted:
      type = errors->resource_exhausted;
      break;
    case absl::StatusCode::kInvalidArgument:
      type = errors->invalid_argument;
      break;
    case absl::StatusCode::kFailedPrecondition:
      type = errors->failed_precondition;
      break;
    case absl::StatusCode::kNotFound:
      type = errors->not_found;
      break;
    case absl::StatusCode::kPermissionDenied:
      type = errors->permission_denied;
      break;
    case absl::StatusCode::kDataLoss:
      type = errors->data_loss;
      break;
    default:
      break;
  }
  py::object e = type(std::string(s.message()));
  e.attr("code") = absl::StatusCodeToString(s.code());
  PyErr_SetObject(type.ptr(), e.ptr());
  throw py::error_already_set();
}

// Both with the GIL held.
void Check(const absl::Status& s) {
  if (!s.ok()) Raise(s);
}

template <typename T>
T Value(absl::StatusOr<T> v) {
  Check(v.status());
  return *std::move(v);
}

DType ParseDTypeOrRaise(const std::string& name) {
  std::optional<DType> d = ParseDType(name);
  if (!d.has_value()) {
    Raise(absl::InvalidArgumentError("dtype must be fp32, bf16 or fp16, got '" + name + "'"));
  }
  return *d;
}

// A writable memoryview of `bytes` bytes at `data`.
// Runs `f` (a blocking client call) without the GIL; its status is checked
// after, with the GIL held again.
template <typename F>
auto Unlocked(F&& f) {
  py::gil_scoped_release release;
  return f();
}

// The Python Session's holder: a Session collected unclosed closes itself
// in its destructor (a call to offloadd, its threads joined), which must
// not hold every other Python thread up meanwhile.
template <typename T>
struct DeleteWithoutGil {
  void operator()(T* s) const {
    if (s == nullptr) return;
    if constexpr (std::is_same_v<T, GpuTier>) {
      // (A data loader's worker's copy: left, not destroyed; see
      // GpuTier::forked_copy. A child hung in its locks' destructors.)
      if (s->forked_copy()) return;
    }
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      delete s;
    } else {
      delete s;
    }
  }
};
using SessionHolder = std::unique_ptr<Session, DeleteWithoutGil<Session>>;
// A GpuTier's destructor waits for its copies and lets its holds go (a call
// to offloadd): the same.
using TierHolder = std::unique_ptr<GpuTier, DeleteWithoutGil<GpuTier>>;

SessionHolder Held(std::unique_ptr<Session> s) { return SessionHolder(s.release()); }

// Bytes of a partition's mapping as Python holds them: a buffer that keeps
// the mapping (PartitionView::memory), so that a memoryview of it, and a
// tensor over that, stay mapped after the Session closes or is collected
// (their bytes stale then, never a fault).
struct MappedBytes {
  std::shared_ptr<const void> owner;
  void* data = nullptr;
  uint64_t bytes = 0;
};

py::memoryview View(const PartitionView& p, void* data, uint64_t bytes) {
  return py::memoryview(py::cast(MappedBytes{p.memory, data, bytes}));
}

py::dict CheckpointDict(const CheckpointResult& r) {
  py::dict d;
  d["manifest"] = r.manifest;
  d["partitions"] = r.partitions;
  d["bytes"] = r.bytes;
  d["steps"] = r.steps;
  d["pause_us"] = r.pause_us;
  d["wall_us"] = r.wall_us;
  d["running"] = r.running;
  return d;
}

py::dict StepDict(const StepResult& r) {
  py::dict d;
  d["partitions_updated"] = r.partitions_updated;
  d["params_updated"] = r.params_updated;
  d["skipped"] = r.skipped;
  d["nonfinite_gradients"] = r.nonfinite_gradients;
  d["wall_us"] = r.wall_us;
  d["state_wait_us"] = r.state_wait_us;
  d["compute_us"] = r.compute_us;
  d["loss_scale"] = r.loss_scale;
  d["running"] = r.running;
  d["delayed_update"] = r.delayed_update;
  return d;
}

py::dict TunableDict(const Tunable& t) {
  return py::dict("name"_a = t.name, "type"_a = t.type, "value"_a = t.value,
                  "default"_a = t.default_value, "unit"_a = t.unit, "description"_a = t.description,
                  "dynamic"_a = t.dynamic);
}

py::dict GpuCountersDict(const GpuTierCounters& g) {
  return py::dict("h2d_bytes"_a = g.h2d_bytes, "h2d_staged_bytes"_a = g.h2d_staged_bytes,
                  "d2h_bytes"_a = g.d2h_bytes, "tensor_uses"_a = g.tensor_uses,
                  "resident_hits"_a = g.resident_hits, "prefetch_hits"_a = g.prefetch_hits,
                  "host_waits"_a = g.host_waits, "evictions"_a = g.evictions,
                  "resident_bytes"_a = g.resident_bytes, "budget_bytes"_a = g.budget_bytes,
                  "dma_bytes"_a = g.dma_bytes, "prefetch_depth"_a = g.prefetch_depth,
                  "prefetch_bytes"_a = g.prefetch_bytes);
}

py::dict StatsDict(const DaemonStats& s) {
  py::dict counters, tiers;
  for (const DaemonStats::Counter& c : s.counters) counters[py::str(c.name)] = c.value;
  for (const DaemonStats::Tier& t : s.tiers) {
    tiers[py::str(t.name)] =
        py::dict("used_bytes"_a = t.used_bytes, "budget_bytes"_a = t.budget_bytes);
  }
  py::list sessions;
  for (const DaemonStats::Session& x : s.sessions) {
    sessions.append(py::dict(
        "id"_a = x.id, "name"_a = x.name, "partitions"_a = x.partitions,
        "arena_bytes"_a = x.arena_bytes, "steps"_a = x.steps, "held"_a = x.held,
        "params_host_bytes"_a = x.params_host_bytes, "params_nvme_bytes"_a = x.params_nvme_bytes,
        "grads_host_bytes"_a = x.grads_host_bytes, "grads_nvme_bytes"_a = x.grads_nvme_bytes,
        "state_host_bytes"_a = x.state_host_bytes, "state_nvme_bytes"_a = x.state_nvme_bytes,
        "gpu"_a = x.gpu.has_value() ? py::object(GpuCountersDict(*x.gpu)) : py::none(),
        "step_wall_nanos"_a = x.step_wall_nanos, "step_wait_nanos"_a = x.step_wait_nanos,
        "step_compute_nanos"_a = x.step_compute_nanos, "share_weight"_a = x.share_weight,
        "optimizer_params"_a = x.optimizer_params,
        "optimizer_queued_nanos"_a = x.optimizer_queued_nanos,
        "nvme_read_bytes"_a = x.nvme_read_bytes, "nvme_write_bytes"_a = x.nvme_write_bytes,
        "io_queued_nanos"_a = x.io_queued_nanos, "pool_room_bytes"_a = x.pool_room_bytes,
        "pool_evictions"_a = x.pool_evictions,
        "detached_seconds"_a =
            x.detached_seconds < 0 ? py::object(py::none()) : py::int_(x.detached_seconds)));
  }
  return py::dict("version"_a = s.version, "pid"_a = s.pid, "uptime_ms"_a = s.uptime_ms,
                  "optimizer"_a = s.optimizer, "counters"_a = counters, "tiers"_a = tiers,
                  "sessions"_a = sessions);
}

AdamHyperparams Hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                      bool adamw, bool bias_correction, double grad_scale) {
  AdamHyperparams h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.decoupled_weight_decay = adamw;
  h.bias_correction = bias_correction;
  h.grad_scale = grad_scale;
  return h;
}

// The GPU tier (client/gpu_tier.h): devices, DMA, parameters on the device
// ahead of use, gradients back while backward runs. Streams are passed as
// integers: a cudaStream_t (torch.cuda.Stream.cuda_stream) on CUDA, 0 for
// the host stream on the emulated device.
gpu::Stream StreamOf(gpu::Device& d, uintptr_t stream) {
  return d.BorrowStream(reinterpret_cast<void*>(stream));
}

py::dict TierStatsDict(const GpuTierStats& s) {
  const gpu::ParamCacheStats& p = s.params;
  return py::dict(
      "uses"_a = p.uses, "tensor_uses"_a = p.tensor_uses, "resident_hits"_a = p.resident_hits,
      "prefetch_hits"_a = p.prefetch_hits, "in_flight_at_use"_a = p.in_flight_at_use,
      "prefetched_units"_a = p.prefetched_units, "h2d_copies"_a = p.copies,
      "h2d_bytes"_a = p.h2d_bytes, "h2d_staged_bytes"_a = p.staged_bytes,
      "evictions"_a = p.evictions, "invalidations"_a = p.invalidations,
      "h2d_failures"_a = p.copy_failures, "off_trace_uses"_a = p.off_trace_uses,
      "over_live_cap"_a = p.over_live_cap, "resident_bytes"_a = p.resident_bytes,
      "peak_resident_bytes"_a = p.peak_resident_bytes, "budget_bytes"_a = p.budget_bytes,
      "d2h_copies"_a = s.gradients.copies, "d2h_bytes"_a = s.gradients.d2h_bytes,
      "d2h_staged_bytes"_a = s.gradients.staged_bytes, "d2h_host_waits"_a = s.gradients.host_waits,
      "d2h_failures"_a = s.gradients.copy_failures, "gradients_returned"_a = s.gradients_returned,
      "dma_regions"_a = s.dma.regions, "dma_bytes"_a = s.dma.bytes,
      "dma_failed_regions"_a = s.dma.failed_regions, "dma_register_us"_a = s.dma.register_us,
      "daemon_calls"_a = s.daemon_calls, "daemon_us"_a = s.daemon_us, "reports"_a = s.reports,
      "prefetch_depth"_a = s.prefetch_depth, "prefetch_bytes"_a = s.prefetch_bytes);
}

void BindGpu(py::module_& m) {
  py::class_<gpu::Device, std::shared_ptr<gpu::Device>>(m, "Device")
      .def_property_readonly("name", &gpu::Device::name)
      .def("free_bytes", [](gpu::Device& d) { return Value(d.FreeBytes()); });
  m.def(
      "open_device",
      [](const std::string& spec, uint64_t memory_bytes,
         std::optional<int64_t> max_copy_delay_us) -> std::shared_ptr<gpu::Device> {
        if (spec == "emulated") {
          gpu::EmulatedDeviceOptions o;
          if (memory_bytes) o.memory_bytes = memory_bytes;
          if (max_copy_delay_us) {
            if (*max_copy_delay_us < 0) {
              Raise(absl::InvalidArgumentError("max_copy_delay_us must be >= 0, got " +
                                               std::to_string(*max_copy_delay_us)));
            }
            o.max_copy_delay = absl::Microseconds(*max_copy_delay_us);
          }
          o.any_address_is_device = true;  // torch's CPU tensors play the device's memory
          return std::make_shared<gpu::EmulatedDevice>(o);
        }
        int ordinal = 0;
        if (spec.rfind("cuda", 0) == 0) {
          const std::string rest = spec.substr(4);
          if (!rest.empty() && (rest[0] != ':' || rest.size() < 2 ||
                                rest.find_first_not_of("0123456789", 1) != std::string::npos)) {
            Raise(absl::InvalidArgumentError(
                "device must be 'cuda', 'cuda:N' or 'emulated', got '" + spec + "'"));
          }
          if (!rest.empty() && !absl::SimpleAtoi(rest.substr(1), &ordinal)) {
            Raise(absl::InvalidArgumentError("device ordinal out of range in '" + spec + "'"));
          }
        } else {
          Raise(absl::InvalidArgumentError("device must be 'cuda', 'cuda:N' or 'emulated', got '" +
                                           spec + "'"));
        }
        std::unique_ptr<gpu::Device> d =
            Value(Unlocked([&] { return gpu::OpenCudaDevice(ordinal); }));
        return std::shared_ptr<gpu::Device>(std::move(d));
      },
      py::arg("spec"), py::arg("memory_bytes") = 0, py::arg("max_copy_delay_us") = py::none(),
      "a device for the GPU tier: 'cuda:N', or 'emulated' (host memory, memory_bytes of it) for "
      "tests without a GPU; its copies wait a random time below max_copy_delay_us (default 200) "
      "so that streams complete out of order, 0 for none (profiling the trainer's thread)");
  m.def("built_with_cuda", &gpu::BuiltWithCuda);
  m.def(
      "checkpoint_steps",
      [](const std::string& directory, const std::string& session_name) {
        return checkpoint::CheckpointSteps(directory, checkpoint::StemFor(session_name));
      },
      py::arg("directory"), py::arg("session_name"),
      "the steps of the session's checkpoints in `directory` that read back (its latest first, "
      "then the one kept before it): what restore_steps can name");

  py::class_<GpuTier, TierHolder>(m, "GpuTier")
      .def(py::init([](Session& session, std::shared_ptr<gpu::Device> device, uint64_t budget_bytes,
                       int prefetch_depth, uint64_t prefetch_bytes,
                       uint64_t persistence_threshold_bytes, uint64_t max_live_bytes,
                       uint64_t max_reuse_distance_bytes, uint64_t staging_bytes,
                       bool register_arena, uintptr_t slab, uint64_t slab_bytes,
                       bool hold_per_iteration, int64_t report_interval_ms) {
             GpuTierOptions o;
             o.params.budget_bytes = budget_bytes;
             o.params.prefetch_depth = prefetch_depth;
             o.params.prefetch_bytes = prefetch_bytes;
             o.params.persistence_threshold_bytes = persistence_threshold_bytes;
             o.params.max_live_bytes = max_live_bytes;
             o.params.max_reuse_distance_bytes = max_reuse_distance_bytes;
             o.params.staging_bytes = staging_bytes;
             o.gradient_staging_bytes = staging_bytes;
             o.register_arena = register_arena;
             o.hold_per_iteration = hold_per_iteration;
             o.report_interval = report_interval_ms < 0 ? absl::InfiniteDuration()
                                                        : absl::Milliseconds(report_interval_ms);
             gpu::DeviceMemory borrowed;
             if (slab != 0) {
               borrowed = gpu::DeviceMemory(device.get(), reinterpret_cast<void*>(slab), slab_bytes,
                                            /*owned=*/false);
             }
             return TierHolder(Value(Unlocked([&] {
                                 return GpuTier::Create(&session, device.get(), o,
                                                        std::move(borrowed));
                               })).release());
           }),
           py::arg("session"), py::arg("device"), py::arg("budget_bytes") = 1ull << 30,
           py::arg("prefetch_depth") = 2, py::arg("prefetch_bytes") = 256ull << 20,
           py::arg("persistence_threshold_bytes") = 0, py::arg("max_live_bytes") = 0,
           py::arg("max_reuse_distance_bytes") = 0, py::arg("staging_bytes") = 16ull << 20,
           py::arg("register_arena") = true, py::arg("slab") = 0, py::arg("slab_bytes") = 0,
           py::arg("hold_per_iteration") = false, py::arg("report_interval_ms") = 1000,
           // The tier keeps its session and device; the session keeps the
           // device too: the tier enables DMA, and the session's
           // registrations are given back to the device when it closes or
           // goes, which may be after the tier.
           py::keep_alive<1, 2>(), py::keep_alive<1, 3>(), py::keep_alive<2, 3>())
      .def_property_readonly(
          "slab_address", [](GpuTier& t) { return reinterpret_cast<uintptr_t>(t.params().slab()); })
      .def_property_readonly("slab_bytes", [](GpuTier& t) { return t.params().slab_bytes(); })
      .def(
          "add_unit",
          [](GpuTier& t, const std::vector<std::pair<uint64_t, uint64_t>>& tensors, bool holder) {
            return Value(Unlocked([&] { return t.params().AddUnit(tensors, holder); }));
          },
          py::arg("tensors"), py::arg("holder") = false,
          "a unit of (partition id, device bytes); returns its index. holder: it stays in use "
          "while other units are used (a parent module's parameters while its children run)")
      .def("begin_iteration",
           [](GpuTier& t) { Check(Unlocked([&] { return t.BeginIteration(); })); })
      .def(
          "end_iteration", [](GpuTier& t) { Check(Unlocked([&] { return t.EndIteration(); })); },
          "waits for the iteration's copies and lets its holds go (before a step)")
      .def(
          "use",
          [](GpuTier& t, int unit, uintptr_t stream, std::shared_ptr<gpu::Device> d) {
            return Value(Unlocked([&] { return t.params().Use(unit, StreamOf(*d, stream)); }));
          },
          py::arg("unit"), py::arg("stream"), py::arg("device").none(false),
          "the unit's tensors' byte offsets in the slab; `stream` waits for their copies")
      .def(
          "use_units",
          [](GpuTier& t, const std::vector<int>& units, uintptr_t stream,
             std::shared_ptr<gpu::Device> d) {
            return Value(Unlocked([&] { return t.params().Use(units, StreamOf(*d, stream)); }));
          },
          py::arg("units"), py::arg("stream"), py::arg("device").none(false),
          "use of every unit named, in one call (their copies issued together): each one's "
          "offsets, as use's")
      .def(
          "prefetch_units",
          [](GpuTier& t, const std::vector<int>& units) {
            Check(Unlocked([&] { return t.PrefetchUnits(units); }));
          },
          py::arg("units"),
          "before an iteration: its holds taken and the units' copies issued now, ahead of "
          "their use (GpuTier::PrefetchUnits)")
      .def(
          "done",
          [](GpuTier& t, int unit, uintptr_t stream, std::shared_ptr<gpu::Device> d) {
            Check(Unlocked([&] { return t.params().Done(unit, StreamOf(*d, stream)); }));
          },
          py::arg("unit"), py::arg("stream"), py::arg("device").none(false))
      .def(
          "done_units",
          [](GpuTier& t, const std::vector<int>& units, uintptr_t stream,
             std::shared_ptr<gpu::Device> d) {
            Check(Unlocked([&] { return t.params().Done(units, StreamOf(*d, stream)); }));
          },
          py::arg("units"), py::arg("stream"), py::arg("device").none(false))
      .def(
          "invalidate",
          [](GpuTier& t, uintptr_t stream, std::shared_ptr<gpu::Device> d) {
            Check(Unlocked([&] { return t.params().Invalidate(StreamOf(*d, stream)); }));
          },
          py::arg("stream"), py::arg("device").none(false))
      .def("synchronize",
           [](GpuTier& t) { Check(Unlocked([&] { return t.params().Synchronize(); })); })
      .def(
          "set_gradients_per_batch",
          [](GpuTier& t, bool per_batch) { Unlocked([&] { t.SetGradientsPerBatch(per_batch); }); },
          py::arg("per_batch"),
          "gradient buffers held each batch's own as gradients come (while the step before "
          "may still read them) or all at the first")
      .def(
          "set_prefetch",
          [](GpuTier& t, int depth, uint64_t bytes) {
            Unlocked([&] { t.SetPrefetch(depth, bytes); });
          },
          py::arg("depth"), py::arg("bytes"))
      .def(
          "add_gradient",
          [](GpuTier& t, uint64_t pid, uintptr_t src, uint64_t bytes, uintptr_t stream,
             std::shared_ptr<gpu::Device> d) {
            Check(Unlocked([&] {
              return t.AddGradient(pid, reinterpret_cast<const void*>(src), bytes,
                                   StreamOf(*d, stream));
            }));
          },
          py::arg("partition_id"), py::arg("address"), py::arg("bytes"), py::arg("stream"),
          py::arg("device").none(false))
      .def(
          "add_gradients",
          [](GpuTier& t, const std::vector<std::tuple<uint64_t, uintptr_t, uint64_t>>& items,
             uintptr_t stream, std::shared_ptr<gpu::Device> d) {
            std::vector<gpu::GradientDrain::Item> batch;
            batch.reserve(items.size());
            for (const auto& [pid, src, bytes] : items) {
              batch.push_back({pid, reinterpret_cast<const void*>(src), bytes});
            }
            Check(Unlocked([&] { return t.AddGradients(batch, StreamOf(*d, stream)); }));
          },
          py::arg("items"), py::arg("stream"), py::arg("device").none(false),
          "add_gradient for several (partition_id, address, bytes), in order, at once")
      .def(
          "drop_gradients", [](GpuTier& t) { Check(Unlocked([&] { return t.DropGradients(); })); },
          "waits for the gradients' copies in flight and lets their buffers go unreturned")
      .def(
          "return_gradients",
          [](GpuTier& t, bool wait, bool hand_over, std::optional<py::dict> stats) {
            absl::flat_hash_map<uint64_t, GradientStats> given;
            if (stats.has_value()) {
              for (auto [k, v] : *stats) {
                auto pair = v.cast<std::pair<double, uint64_t>>();
                given[k.cast<uint64_t>()] = GradientStats{pair.first, pair.second};
              }
            }
            return Value(Unlocked([&] { return t.ReturnGradients(wait, hand_over, given); }));
          },
          py::arg("wait"), py::arg("hand_over") = false, py::arg("stats") = py::none(),
          "returns the gradients whose copies completed (all with wait); their ids")
      // (Each of these waits for locks a use() in another thread holds
      // across a call to offloadd: without the GIL meanwhile.)
      .def_property_readonly(
          "gradients_pending",
          [](GpuTier& t) { return Unlocked([&] { return t.gradients_pending(); }); })
      .def("stats", [](GpuTier& t) { return TierStatsDict(Unlocked([&] { return t.stats(); })); });
}

PYBIND11_MODULE(_offloadd, m) {
  m.doc() = "offloadd's client: sessions, partitions in shared memory, steps.";
  static Errors e;
  errors = &e;
  e.base = py::module_::import("builtins")
               .attr("type")("Error",
                             py::make_tuple(py::reinterpret_borrow<py::object>(PyExc_RuntimeError)),
                             py::dict("__module__"_a = "offloadd", "code"_a = "UNKNOWN"));
  // `code` is also a class attribute, so that errors raised in Python (by
  // offloadd.torch, offloadd.deepspeed) carry it too.
  auto sub = [&](const char* name, absl::StatusCode code) {
    return py::module_::import("builtins")
        .attr("type")(
            name, py::make_tuple(e.base),
            py::dict("__module__"_a = "offloadd", "code"_a = absl::StatusCodeToString(code)));
  };
  e.unavailable = sub("UnavailableError", absl::StatusCode::kUnavailable);
  e.resource_exhausted = sub("ResourceExhaustedError", absl::StatusCode::kResourceExhausted);
  e.invalid_argument = sub("InvalidArgumentError", absl::StatusCode::kInvalidArgument);
  e.failed_precondition = sub("FailedPreconditionError", absl::StatusCode::kFailedPrecondition);
  e.not_found = sub("NotFoundError", absl::StatusCode::kNotFound);
  e.permission_denied = sub("PermissionDeniedError", absl::StatusCode::kPermissionDenied);
  e.data_loss = sub("DataLossError", absl::StatusCode::kDataLoss);
  m.attr("Error") = e.base;
  m.attr("UnavailableError") = e.unavailable;
  m.attr("ResourceExhaustedError") = e.resource_exhausted;
  m.attr("InvalidArgumentError") = e.invalid_argument;
  m.attr("FailedPreconditionError") = e.failed_precondition;
  m.attr("NotFoundError") = e.not_found;
  m.attr("PermissionDeniedError") = e.permission_denied;
  m.attr("DataLossError") = e.data_loss;

  py::class_<MappedBytes>(m, "_MappedBytes", py::buffer_protocol()).def_buffer([](MappedBytes& b) {
    return py::buffer_info(b.data, 1, py::format_descriptor<uint8_t>::format(), 1,
                           {static_cast<ssize_t>(b.bytes)}, {ssize_t{1}}, /*readonly=*/false);
  });

  py::class_<PartitionView>(m, "Partition")
      .def_readonly("id", &PartitionView::id)
      .def_readonly("name", &PartitionView::name)
      .def_readonly("numel", &PartitionView::numel)
      .def_readonly("step", &PartitionView::step)
      .def_readonly("dma", &PartitionView::dma, "its span is registered for DMA (enable_dma)")
      .def_readonly("restored", &PartitionView::restored,
                    "its state and parameters came from the checkpoint the session restores")
      .def_property_readonly("param_dtype",
                             [](const PartitionView& p) { return DTypeName(p.param_dtype); })
      .def_property_readonly("grad_dtype",
                             [](const PartitionView& p) { return DTypeName(p.grad_dtype); })
      .def_property_readonly(
          "params",
          [](const PartitionView& p) {
            return View(p, p.params, p.numel * DTypeSize(p.param_dtype));
          },
          "the working parameters (bytes), while held")
      .def_property_readonly(
          "grads",
          [](const PartitionView& p) {
            return View(p, p.grads, p.numel * DTypeSize(p.grad_dtype));
          },
          "the gradient buffer (bytes), while held with grads")
      .def_property_readonly(
          "master_init",
          [](const PartitionView& p) -> py::object {
            if (p.master_init == nullptr) return py::none();
            return View(p, p.master_init, p.numel * sizeof(float));
          },
          "fp32 initial values (registered with fp32_master, until released)");

  py::class_<Session, SessionHolder>(m, "Session")
      .def_property_readonly("id", &Session::id)
      .def_property_readonly(
          "token", [](const Session& s) { return py::bytes(s.token()); },
          "the session's secret: with id, what Client.resume_session needs (keep it private)")
      .def_property_readonly(
          "auto_checkpoint_dir", &Session::auto_checkpoint_dir,
          "where offloadd writes this session's automatic checkpoints ('' when off): after a "
          "crash of offloadd, open a session with restore_from it to go on from the last")
      .def_property_readonly("restored_from", &Session::restored_from,
                             "the checkpoint directory it restored ('' if none)")
      .def_property_readonly("restorable_steps", &Session::restorable_steps,
                             "the steps of its checkpoints there: the latest first, then the "
                             "previous one an automatic checkpoint keeps")
      .def(
          "register",
          [](Session& s, const std::string& name, uint64_t numel, const std::string& param_dtype,
             const std::string& grad_dtype, bool fp32_master, std::optional<std::string> tensor,
             std::vector<uint64_t> shape, uint64_t offset) {
            const DType p = ParseDTypeOrRaise(param_dtype), g = ParseDTypeOrRaise(grad_dtype);
            std::optional<TensorSlice> slice;
            if (tensor.has_value()) slice = TensorSlice{*tensor, std::move(shape), offset};
            return Value(
                Unlocked([&] { return s.Register(name, numel, p, g, fp32_master, slice); }));
          },
          py::arg("name"), py::arg("numel"), py::arg("param_dtype") = "fp32",
          py::arg("grad_dtype") = "fp32", py::arg("fp32_master") = false,
          py::arg("tensor") = py::none(), py::arg("shape") = std::vector<uint64_t>{},
          py::arg("offset") = 0,
          "registers a partition; tensor/shape/offset: which slice of which tensor it is "
          "(for checkpoints across rank counts and export)")
      .def(
          "fetch",
          [](Session& s, const std::vector<uint64_t>& ids, bool grads, bool writable, bool load) {
            FetchOptions o;
            o.grads = grads;
            o.writable = writable;
            o.load = load;
            return Value(Unlocked([&] { return s.Fetch(ids, o); }));
          },
          py::arg("ids"), py::arg("grads") = false, py::arg("writable") = false,
          py::arg("load") = false)
      .def(
          "release",
          [](Session& s, const std::vector<uint64_t>& ids) {
            Check(Unlocked([&] { return s.Release(ids); }));
          },
          py::arg("ids"))
      .def(
          "return_gradients",
          [](Session& s, const PartitionView& p) {
            Check(Unlocked([&] { return s.ReturnGradients(p); }));
          },
          py::arg("partition"))
      .def(
          "return_gradients",
          [](Session& s, const std::vector<PartitionView>& parts, bool release, bool hand_over,
             const std::optional<std::vector<std::pair<double, uint64_t>>>& stats) {
            if (!stats.has_value()) {
              Check(Unlocked([&] { return s.ReturnGradients(parts, release, hand_over); }));
              return;
            }
            if (!hand_over) {
              Raise(absl::InvalidArgumentError("return_gradients: stats come with hand_over=True"));
            }
            std::vector<GradientStats> given;
            for (const auto& [sq_norm, nonfinite] : *stats) given.push_back({sq_norm, nonfinite});
            Check(Unlocked([&] { return s.HandOverGradients(parts, given, release); }));
          },
          py::arg("partitions"), py::arg("release") = false, py::arg("hand_over") = false,
          py::arg("stats") = py::none(),
          "returns several partitions' gradients in one call (in order), then with release "
          "lets their holds go; with hand_over the step reads a step's only micro-batch where "
          "it is, and the buffers are the daemon's until then (see ReturnGradientsRequest); "
          "stats, with hand_over: one (sq_norm, nonfinite) per partition, the trainer's own "
          "statistics of the buffer as written, computed where the gradients were made (a GPU), "
          "taken instead of the daemon measuring the buffer (Session::HandOverGradients)")
      .def("pending_gradients",
           [](Session& s) {
             const PendingGradients p = Value(Unlocked([&] { return s.GetPendingGradients(); }));
             py::dict d;
             d["sq_norm"] = p.sq_norm;
             d["nonfinite"] = p.nonfinite;
             d["partitions"] = p.partitions;
             d["micro_batches"] = p.micro_batches;
             d["loss_scale"] = p.loss_scale;
             d["delayed_update"] = p.delayed_update;
             d["auto_checkpoint_due"] = p.auto_checkpoint_due;
             return d;
           })
      .def(
          "step",
          [](Session& s, double lr, double beta1, double beta2, double eps, double weight_decay,
             bool adamw, bool bias_correction, double grad_scale, bool skip, bool overflow,
             bool overlap, const std::vector<py::dict>& groups,
             std::optional<bool> auto_checkpoint) {
            StepOptions o;
            o.skip = skip;
            o.overflow = overflow;
            o.overlap = overlap;
            o.auto_checkpoint = auto_checkpoint;
            // torch-style param groups: {"ids": [...], "lr": ..., ...}; unset
            // fields take the step's.
            for (const py::dict& g : groups) {
              StepOptions::Group group;
              group.partition_ids = g["ids"].cast<std::vector<uint64_t>>();
              auto get = [&g](const char* key, double fallback) {
                return g.contains(key) ? g[key].cast<double>() : fallback;
              };
              group.hyperparams =
                  Hyper(get("lr", lr), get("beta1", beta1), get("beta2", beta2), get("eps", eps),
                        get("weight_decay", weight_decay),
                        g.contains("adamw") ? g["adamw"].cast<bool>() : adamw,
                        g.contains("bias_correction") ? g["bias_correction"].cast<bool>()
                                                      : bias_correction,
                        grad_scale);
              o.groups.push_back(std::move(group));
            }
            const AdamHyperparams h =
                Hyper(lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale);
            return StepDict(Value(Unlocked([&] { return s.Step(h, o); })));
          },
          py::arg("lr") = 1e-3, py::arg("beta1") = 0.9, py::arg("beta2") = 0.999,
          py::arg("eps") = 1e-8, py::arg("weight_decay") = 0.0, py::arg("adamw") = true,
          py::arg("bias_correction") = true, py::arg("grad_scale") = 1.0, py::arg("skip") = false,
          py::arg("overflow") = false, py::arg("overlap") = false,
          py::arg("groups") = std::vector<py::dict>{}, py::arg("auto_checkpoint") = py::none(),
          "auto_checkpoint: None, offloadd takes the automatic checkpoint when this session's "
          "is due; True/False, the job decided (its ranks agreed on pending_gradients' "
          "auto_checkpoint_due), every rank alike")
      .def("wait_step",
           [](Session& s) { return StepDict(Value(Unlocked([&] { return s.WaitStep(); }))); })
      .def(
          "set_delayed_update",
          [](Session& s, bool on) { Check(Unlocked([&] { return s.SetDelayedUpdate(on); })); },
          py::arg("enabled"))
      .def(
          "read_moments",
          [](Session& s, uint64_t id, uint64_t begin, uint64_t count, bool master) {
            Session::Moments m =
                Value(Unlocked([&] { return s.ReadMoments(id, begin, count, master); }));
            auto bytes = [](const std::vector<float>& v) {
              return py::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
            };
            if (master) {
              return py::make_tuple(m.step, bytes(m.exp_avg), bytes(m.exp_avg_sq), bytes(m.master));
            }
            return py::make_tuple(m.step, bytes(m.exp_avg), bytes(m.exp_avg_sq));
          },
          py::arg("id"), py::arg("begin"), py::arg("count"), py::arg("master") = false,
          "(step, exp_avg, exp_avg_sq): partition id's Adam step count and elements [begin, "
          "begin + count) of its moments, as fp32 bytes; with master=True, (step, exp_avg, "
          "exp_avg_sq, master): its fp32 master weights too (the newest)")
      .def(
          "write_moments",
          [](Session& s, uint64_t id, uint64_t step, uint64_t begin, py::buffer exp_avg,
             py::buffer exp_avg_sq) {
            // Each buffer exported (py::buffer_info holds the export) until
            // the write returns: read without the GIL, it must stay put
            // (another thread may not resize it meanwhile).
            auto floats = [](const py::buffer_info& info, const char* name) {
              if (info.itemsize != sizeof(float) ||
                  info.format != py::format_descriptor<float>::format() || info.ndim != 1 ||
                  info.strides[0] != static_cast<py::ssize_t>(sizeof(float))) {
                Raise(absl::InvalidArgumentError(std::string(name) +
                                                 " must be a contiguous 1-D buffer of float32"));
              }
              return absl::Span<const float>(static_cast<const float*>(info.ptr),
                                             static_cast<size_t>(info.shape[0]));
            };
            const py::buffer_info m_info = exp_avg.request(), v_info = exp_avg_sq.request();
            absl::Span<const float> m = floats(m_info, "exp_avg");
            absl::Span<const float> v = floats(v_info, "exp_avg_sq");
            Check(Unlocked([&] { return s.WriteMoments(id, step, begin, m, v); }));
          },
          py::arg("id"), py::arg("step"), py::arg("begin"), py::arg("exp_avg"),
          py::arg("exp_avg_sq"),
          "sets partition id's Adam step count and elements [begin, begin + len) of its moments "
          "(float32 buffers, e.g. numpy arrays)")
      .def(
          "set_placement",
          [](Session& s, std::optional<int> params, std::optional<int> grads,
             std::optional<int> optimizer_state) {
            Placement p;
            p.params_host_percent = params;
            p.grads_host_percent = grads;
            p.optimizer_state_host_percent = optimizer_state;
            Check(Unlocked([&] { return s.SetPlacement(p); }));
          },
          py::arg("params_host_percent") = py::none(), py::arg("grads_host_percent") = py::none(),
          py::arg("optimizer_state_host_percent") = py::none())
      .def(
          "checkpoint",
          [](Session& s, const std::string& directory, bool background) {
            return CheckpointDict(
                Value(Unlocked([&] { return s.Checkpoint(directory, background); })));
          },
          py::arg("directory"), py::arg("background") = false,
          "writes the session's checkpoint into directory (absolute) at the next step boundary")
      .def("wait_checkpoint",
           [](Session& s) {
             return CheckpointDict(Value(Unlocked([&] { return s.WaitCheckpoint(); })));
           })
      .def(
          "enable_dma",
          [](Session& s, std::shared_ptr<gpu::Device> d) {
            Check(Unlocked([&] { return s.EnableDma(d.get()); }));
          },
          py::arg("device"), py::keep_alive<1, 2>(),
          "registers the session's arena with the device for DMA (params and grads wholly on "
          "the host only)")
      .def("dma_stats",
           [](const Session& s) {
             Session::DmaStats d = Unlocked([&] { return s.dma_stats(); });
             return py::dict("regions"_a = d.regions, "bytes"_a = d.bytes,
                             "failed_regions"_a = d.failed_regions,
                             "register_us"_a = d.register_us);
           })
      .def(
          "close",
          [](Session& s, bool finished) { Check(Unlocked([&] { return s.Close(finished); })); },
          py::arg("finished") = true,
          "closes the session; finished=False: the job did not end (a failure unwinding), and "
          "automatic checkpoints kept for a resume (keep_for_resume) stay");

  py::class_<Client, std::unique_ptr<Client>>(m, "Client")
      .def(py::init([](const std::string& address) {
             ClientOptions o;
             o.address = address;
             return Value(Unlocked([&] { return Client::Connect(o); }));
           }),
           py::arg("address") = "")
      .def_property_readonly("address", &Client::address)
      .def(
          "open_session",
          [](Client& c, const std::string& name, std::optional<int> params_host_percent,
             std::optional<int> grads_host_percent, std::optional<int> optimizer_state_host_percent,
             std::optional<uint64_t> delayed_update_after_steps,
             std::optional<py::dict> loss_scaling, const std::string& restore_from,
             uint32_t share_weight, bool resume_lost, std::optional<uint64_t> restore_steps,
             bool keep_for_resume) {
            SessionOptions o;
            o.restore_from = restore_from;
            o.resume_lost = resume_lost;
            o.restore_steps = restore_steps;
            o.keep_for_resume = keep_for_resume;
            o.share_weight = share_weight;
            if (loss_scaling.has_value()) {
              // fp16: {"initial_scale": ..., "growth_interval": ..., ...}
              LossScaling l;
              const py::dict& d = *loss_scaling;
              if (d.contains("initial_scale")) l.initial_scale = d["initial_scale"].cast<double>();
              if (d.contains("growth_interval")) {
                l.growth_interval = d["growth_interval"].cast<int64_t>();
              }
              if (d.contains("growth_factor")) l.growth_factor = d["growth_factor"].cast<double>();
              if (d.contains("backoff_factor")) {
                l.backoff_factor = d["backoff_factor"].cast<double>();
              }
              if (d.contains("hysteresis")) l.hysteresis = d["hysteresis"].cast<int64_t>();
              if (d.contains("min_scale")) l.min_scale = d["min_scale"].cast<double>();
              o.loss_scaling = l;
            }
            o.placement.params_host_percent = params_host_percent;
            o.placement.grads_host_percent = grads_host_percent;
            o.placement.optimizer_state_host_percent = optimizer_state_host_percent;
            o.delayed_update_after_steps = delayed_update_after_steps;
            return Held(Value(Unlocked([&] { return c.OpenSession(name, o); })));
          },
          py::arg("name") = "", py::arg("params_host_percent") = py::none(),
          py::arg("grads_host_percent") = py::none(),
          py::arg("optimizer_state_host_percent") = py::none(),
          py::arg("delayed_update_after_steps") = py::none(), py::arg("loss_scaling") = py::none(),
          py::arg("restore_from") = "", py::arg("share_weight") = 0, py::arg("resume_lost") = false,
          py::arg("restore_steps") = py::none(), py::arg("keep_for_resume") = false)
      .def(
          "set_share",
          [](Client& c, uint64_t session_id, uint32_t weight) {
            Check(Unlocked([&] { return c.SetShare(session_id, weight); }));
          },
          py::arg("session_id"), py::arg("weight"),
          "a session's weight in the node's optimizer (1-1000), as the operator")
      .def(
          "resume_session",
          [](Client& c, uint64_t id, const py::bytes& token) {
            const std::string t = token;
            return Held(Value(Unlocked([&] { return c.ResumeSession(id, t); })));
          },
          py::arg("id"), py::arg("token"),
          "takes back a session whose trainer went away (within offloadd's "
          "server.reconnect_lease_seconds)")
      .def(
          "stats",
          [](Client& c) {
            const DaemonStats s = Value(Unlocked([&] { return c.GetStats(); }));
            return StatsDict(s);
          },
          "the daemon's status: counters by name, tiers, sessions (as offloadctl stats)")
      .def(
          "get_tunable",
          [](Client& c, const std::string& name) {
            return TunableDict(Value(Unlocked([&] { return c.GetTunable(name); })));
          },
          py::arg("name"))
      .def(
          "set_tunable",
          [](Client& c, const std::string& name, const std::string& value) {
            return TunableDict(Value(Unlocked([&] { return c.SetTunable(name, value); })));
          },
          py::arg("name"), py::arg("value"), "changes a node-wide setting (offloadctl config set)");
  BindGpu(m);
}

}  // namespace
}  // namespace offload::python
