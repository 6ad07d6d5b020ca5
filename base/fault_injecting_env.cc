#include "base/fault_injecting_env.h"

#include "absl/strings/str_cat.h"
#include "base/posix_error.h"

namespace offload {

void FaultInjectingEnv::FailNth(EnvOp op, int n, int err) {
  absl::MutexLock lock(&mu_);
  Plan& p = plans_[static_cast<size_t>(op)];
  p.fail_at = p.calls + n;
  p.err = err;
}

int64_t FaultInjectingEnv::calls(EnvOp op) const {
  absl::MutexLock lock(&mu_);
  return plans_[static_cast<size_t>(op)].calls;
}

int FaultInjectingEnv::Next(EnvOp op) {
  absl::MutexLock lock(&mu_);
  Plan& p = plans_[static_cast<size_t>(op)];
  return ++p.calls == p.fail_at ? p.err : 0;
}

absl::StatusOr<HostMemory> FaultInjectingEnv::Allocate(uint64_t bytes, Pages pages) {
  if (int err = Next(EnvOp::kAllocate)) {
    return PosixError(absl::StrCat("mmap ", bytes, " bytes (injected)"), err);
  }
  return target_->Allocate(bytes, pages);
}

absl::StatusOr<HostMemory> FaultInjectingEnv::MapShared(int fd, uint64_t offset, uint64_t bytes,
                                                        Pages pages) {
  if (int err = Next(EnvOp::kMapShared)) {
    return PosixError(absl::StrCat("mmap ", bytes, " bytes shared (injected)"), err);
  }
  return target_->MapShared(fd, offset, bytes, pages);
}

absl::StatusOr<UniqueFd> FaultInjectingEnv::CreateMemfd(const std::string& label) {
  if (int err = Next(EnvOp::kCreateMemfd)) {
    return PosixError(absl::StrCat("memfd_create ", label, " (injected)"), err);
  }
  return target_->CreateMemfd(label);
}

absl::Status FaultInjectingEnv::ResizeFile(int fd, uint64_t bytes) {
  if (int err = Next(EnvOp::kResizeFile)) {
    return PosixError(absl::StrCat("resizing to ", bytes, " bytes (injected)"), err);
  }
  return target_->ResizeFile(fd, bytes);
}

absl::Status FaultInjectingEnv::RandomBytes(void* out, size_t bytes) {
  if (int err = Next(EnvOp::kRandomBytes)) return PosixError("getrandom (injected)", err);
  return target_->RandomBytes(out, bytes);
}

absl::StatusOr<std::thread> FaultInjectingEnv::StartThread(std::function<void()> body) {
  if (int err = Next(EnvOp::kStartThread)) return PosixError("starting a thread (injected)", err);
  return target_->StartThread(std::move(body));
}

}  // namespace offload
