// gpu::Device over the CUDA runtime API. Built only where bazel/cuda.bzl
// found the toolkit; cuda_device_none.cc stands in for it elsewhere.
#include "gpu/cuda_device.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <sys/resource.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "base/log.h"

namespace offload::gpu {
namespace {

// What a caller should do about `err` (see the header).
absl::StatusCode CudaErrorCode(cudaError_t err) {
  switch (err) {
    case cudaSuccess:
      return absl::StatusCode::kOk;
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorHostMemoryNotRegistered:
      return absl::StatusCode::kInvalidArgument;
    case cudaErrorHostMemoryAlreadyRegistered:
      return absl::StatusCode::kAlreadyExists;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorInitializationError:
    case cudaErrorSystemNotReady:
    case cudaErrorNotSupported:
    case cudaErrorNotPermitted:
      return absl::StatusCode::kFailedPrecondition;
    case cudaErrorDevicesUnavailable:  // exclusive mode, held by another process
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

// "<what>: <CUDA's text> (<error name>[; <context>])" with CudaErrorCode's
// code. Clears the runtime's last error, which the failed call also set
// (sticky errors, which poison the context, stay whatever is done).
absl::Status CudaError(absl::string_view what, cudaError_t err, absl::string_view context = {}) {
  (void)cudaGetLastError();
  return absl::Status(CudaErrorCode(err),
                      absl::StrCat(what, ": ", cudaGetErrorString(err), " (", cudaGetErrorName(err),
                                   context.empty() ? "" : "; ", context, ")"));
}

// RLIMIT_MEMLOCK as a message's context: "RLIMIT_MEMLOCK is 8388608 bytes".
std::string MemlockLimit() {
  struct rlimit limit {};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return "RLIMIT_MEMLOCK unknown";
  if (limit.rlim_cur == RLIM_INFINITY) return "RLIMIT_MEMLOCK is unlimited";
  return absl::StrCat("RLIMIT_MEMLOCK is ", limit.rlim_cur, " bytes");
}

// Whether the driver library the runtime opens (libcuda.so.1) can be
// loaded, as a message's context: "libcuda.so.1 loads", or dlerror's text.
std::string DriverLoads() {
  void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (driver == nullptr) {
    const char* why = dlerror();
    return why == nullptr ? "libcuda.so.1 does not load" : why;
  }
  dlclose(driver);
  return "libcuda.so.1 loads";
}

const char* DirectionName(Direction direction) {
  return direction == Direction::kHostToDevice ? "host to device" : "device to host";
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, std::string name) : ordinal_(ordinal), name_(std::move(name)) {}

  std::string name() const override { return name_; }

  absl::StatusOr<uint64_t> FreeBytes() override {
    if (absl::Status s = MakeCurrent("cudaMemGetInfo"); !s.ok()) return s;
    size_t free = 0;
    size_t total = 0;
    if (cudaError_t err = cudaMemGetInfo(&free, &total); err != cudaSuccess) {
      return CudaError(absl::StrCat("cudaMemGetInfo on ", name_), err);
    }
    return free;
  }

  absl::StatusOr<DeviceMemory> Allocate(uint64_t bytes) override {
    if (absl::Status s = MakeCurrent("cudaMalloc"); !s.ok()) return s;
    void* data = nullptr;
    if (cudaError_t err = cudaMalloc(&data, bytes); err != cudaSuccess) {
      return CudaError(absl::StrCat("cudaMalloc of ", bytes, " bytes on ", name_), err);
    }
    return DeviceMemory(this, data, bytes, /*owned=*/true);
  }

  absl::StatusOr<PinnedMemory> AllocatePinned(uint64_t bytes) override {
    if (absl::Status s = MakeCurrent("cudaMallocHost"); !s.ok()) return s;
    void* data = nullptr;
    if (cudaError_t err = cudaMallocHost(&data, bytes); err != cudaSuccess) {
      return CudaError(absl::StrCat("cudaMallocHost of ", bytes, " bytes for ", name_), err);
    }
    return PinnedMemory(this, data, bytes, /*owned=*/true);
  }

  absl::StatusOr<HostRegistration> RegisterHost(void* data, uint64_t bytes) override {
    if (absl::Status s = MakeCurrent("cudaHostRegister"); !s.ok()) return s;
    if (cudaError_t err = cudaHostRegister(data, bytes, cudaHostRegisterDefault);
        err != cudaSuccess) {
      return CudaError(
          absl::StrFormat("cudaHostRegister of %d bytes at %p for %s", bytes, data, name_), err,
          MemlockLimit());
    }
    return HostRegistration(this, data, bytes, /*owned=*/true);
  }

  absl::StatusOr<Stream> CreateStream() override {
    if (absl::Status s = MakeCurrent("cudaStreamCreateWithFlags"); !s.ok()) return s;
    cudaStream_t stream = nullptr;
    if (cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        err != cudaSuccess) {
      return CudaError(absl::StrCat("cudaStreamCreateWithFlags on ", name_), err);
    }
    return Stream(this, stream, 0, /*owned=*/true);
  }

  Stream BorrowStream(void* native) override { return Stream(this, native, 0, /*owned=*/false); }

  absl::StatusOr<Event> CreateEvent() override {
    if (absl::Status s = MakeCurrent("cudaEventCreateWithFlags"); !s.ok()) return s;
    cudaEvent_t event = nullptr;
    if (cudaError_t err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
        err != cudaSuccess) {
      return CudaError(absl::StrCat("cudaEventCreateWithFlags on ", name_), err);
    }
    return Event(this, event, 0, /*owned=*/true);
  }

  absl::Status CopyAsync(void* dst, const void* src, uint64_t bytes, Direction direction,
                         const Stream& stream) override {
    if (absl::Status s = Mine(stream, "stream", "cudaMemcpyAsync"); !s.ok()) return s;
    if (absl::Status s = MakeCurrent("cudaMemcpyAsync"); !s.ok()) return s;
    // cudaMemcpyDefault: with unified addressing the runtime knows where
    // each pointer lives; `direction` only labels errors.
    if (cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, Native(stream));
        err != cudaSuccess) {
      return CudaError(
          absl::StrFormat("cudaMemcpyAsync of %d bytes from %p to %p (%s) on stream %p of %s",
                          bytes, src, dst, DirectionName(direction), stream.get(), name_),
          err);
    }
    return absl::OkStatus();
  }

  absl::Status Record(const Event& event, const Stream& stream) override {
    if (absl::Status s = Mine(event, "event", "cudaEventRecord"); !s.ok()) return s;
    if (absl::Status s = Mine(stream, "stream", "cudaEventRecord"); !s.ok()) return s;
    if (absl::Status s = MakeCurrent("cudaEventRecord"); !s.ok()) return s;
    if (cudaError_t err = cudaEventRecord(Native(event), Native(stream)); err != cudaSuccess) {
      return CudaError(absl::StrFormat("cudaEventRecord of event %p on stream %p of %s",
                                       event.get(), stream.get(), name_),
                       err);
    }
    return absl::OkStatus();
  }

  absl::Status WaitOn(const Stream& stream, const Event& event) override {
    if (absl::Status s = Mine(event, "event", "cudaStreamWaitEvent"); !s.ok()) return s;
    if (absl::Status s = Mine(stream, "stream", "cudaStreamWaitEvent"); !s.ok()) return s;
    if (absl::Status s = MakeCurrent("cudaStreamWaitEvent"); !s.ok()) return s;
    if (cudaError_t err = cudaStreamWaitEvent(Native(stream), Native(event), 0);
        err != cudaSuccess) {
      return CudaError(absl::StrFormat("cudaStreamWaitEvent of stream %p on event %p of %s",
                                       stream.get(), event.get(), name_),
                       err);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<bool> Query(const Event& event) override {
    if (absl::Status s = Mine(event, "event", "cudaEventQuery"); !s.ok()) return s;
    if (absl::Status s = MakeCurrent("cudaEventQuery"); !s.ok()) return s;
    const cudaError_t err = cudaEventQuery(Native(event));
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error, but the runtime records it as one
      return false;
    }
    return CudaError(absl::StrFormat("cudaEventQuery of event %p of %s", event.get(), name_), err);
  }

  absl::Status Synchronize(const Event& event) override {
    if (absl::Status s = Mine(event, "event", "cudaEventSynchronize"); !s.ok()) return s;
    if (absl::Status s = MakeCurrent("cudaEventSynchronize"); !s.ok()) return s;
    if (cudaError_t err = cudaEventSynchronize(Native(event)); err != cudaSuccess) {
      return CudaError(
          absl::StrFormat("cudaEventSynchronize of event %p of %s", event.get(), name_), err);
    }
    return absl::OkStatus();
  }

 protected:
  void Destroy(Kind kind, void* handle, uint64_t bytes) override {
    const char* op = "?";
    cudaError_t err = cudaSetDevice(ordinal_);
    if (err == cudaSuccess) {
      switch (kind) {
        case Kind::kDeviceMemory:
          op = "cudaFree";
          err = cudaFree(handle);
          break;
        case Kind::kPinnedMemory:
          op = "cudaFreeHost";
          err = cudaFreeHost(handle);
          break;
        case Kind::kHostRegistration:
          op = "cudaHostUnregister";
          err = cudaHostUnregister(handle);
          break;
        case Kind::kStream:
          op = "cudaStreamDestroy";
          err = cudaStreamDestroy(static_cast<cudaStream_t>(handle));
          break;
        case Kind::kEvent:
          op = "cudaEventDestroy";
          err = cudaEventDestroy(static_cast<cudaEvent_t>(handle));
          break;
      }
    } else {
      op = "cudaSetDevice";
    }
    // cudaErrorCudartUnloading: a Handle outlived the runtime (destroyed at
    // process exit, after the runtime's own teardown), which gave back
    // everything already.
    if (err == cudaSuccess || err == cudaErrorCudartUnloading) return;
    (void)cudaGetLastError();
    LogError("%s of %p (%d bytes) on %s failed: %s (%s)", op, handle, bytes, name_,
             cudaGetErrorString(err), cudaGetErrorName(err));
  }

 private:
  static cudaStream_t Native(const Stream& stream) {
    return static_cast<cudaStream_t>(stream.get());
  }
  static cudaEvent_t Native(const Event& event) { return static_cast<cudaEvent_t>(event.get()); }

  // Makes this device current on the calling thread, before `op`.
  absl::Status MakeCurrent(const char* op) const {
    if (cudaError_t err = cudaSetDevice(ordinal_); err != cudaSuccess) {
      return CudaError(absl::StrCat("cudaSetDevice(", ordinal_, ") for ", op), err);
    }
    return absl::OkStatus();
  }

  // INVALID_ARGUMENT unless `handle` is one of this device's (created or
  // borrowed here; an empty Handle is no one's).
  template <Kind K>
  absl::Status Mine(const Handle<K>& handle, const char* what, const char* op) const {
    if (handle.device() == this) return absl::OkStatus();
    if (!handle) return absl::InvalidArgumentError(absl::StrCat(op, ": empty ", what, " handle"));
    return absl::InvalidArgumentError(
        absl::StrCat(op, " on ", name_, ": the ", what, " is ", handle.device()->name(), "'s"));
  }

  // Constant after construction.
  const int ordinal_;
  const std::string name_;  // "cuda:0 (NVIDIA H200)"
};

}  // namespace

bool BuiltWithCuda() { return true; }

absl::StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int ordinal) {
  int count = 0;
  if (cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    // The runtime says "driver version is insufficient" also where there is
    // no driver at all; say which.
    return CudaError("cudaGetDeviceCount", err, DriverLoads());
  }
  if (ordinal < 0 || ordinal >= count) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    const std::string visible_text =
        visible == nullptr ? std::string("unset") : absl::StrCat("is \"", visible, "\"");
    return absl::InvalidArgumentError(absl::StrCat("no CUDA device ", ordinal, ": ", count,
                                                   " visible (CUDA_VISIBLE_DEVICES ", visible_text,
                                                   ")"));
  }
  // Since CUDA 12 cudaSetDevice also initialises the device's primary
  // context, so a device that cannot be used fails here, not at first use.
  if (cudaError_t err = cudaSetDevice(ordinal); err != cudaSuccess) {
    return CudaError(absl::StrCat("cudaSetDevice(", ordinal, ")"), err);
  }
  cudaDeviceProp prop{};
  if (cudaError_t err = cudaGetDeviceProperties(&prop, ordinal); err != cudaSuccess) {
    return CudaError(absl::StrCat("cudaGetDeviceProperties(", ordinal, ")"), err);
  }
  return std::make_unique<CudaDevice>(ordinal,
                                      absl::StrCat("cuda:", ordinal, " (", prop.name, ")"));
}

}  // namespace offload::gpu
