// Env: the operating-system calls the daemon's engine makes for memory and
// secrets, behind one interface (LevelDB's Env), so that tests can make each
// of them fail (fault_injecting_env.h) and check that nothing leaks and the
// caller gets a clear status. Production code uses Env::Default().
//
// Every method returns a status built by PosixError ("<operation>: <strerror>
// (<ENAME>)", code by what the caller should do: ENOMEM/EMFILE/ENOSPC are
// RESOURCE_EXHAUSTED).
//
// Thread-safety: implementations must be safe to call from any thread.
#ifndef OFFLOADD_BASE_ENV_H_
#define OFFLOADD_BASE_ENV_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/host_memory.h"
#include "base/unique_fd.h"

namespace offload {

class Env {
 public:
  virtual ~Env() = default;

  // The real operating system. Never destroyed.
  static Env* Default();

  // Private zeroed memory (HostMemory::Allocate).
  virtual absl::StatusOr<HostMemory> Allocate(uint64_t bytes, Pages pages) = 0;

  // A shared mapping of `bytes` of `fd` from `offset`, asking the kernel for
  // `pages` (HostMemory::MapShared).
  virtual absl::StatusOr<HostMemory> MapShared(int fd, uint64_t offset, uint64_t bytes,
                                               Pages pages) = 0;

  // An anonymous memory file that can be sealed (memfd_create with
  // MFD_CLOEXEC | MFD_ALLOW_SEALING). `label` only names it in /proc.
  virtual absl::StatusOr<UniqueFd> CreateMemfd(const std::string& label) = 0;

  // Sets the length of the file behind `fd` (ftruncate).
  virtual absl::Status ResizeFile(int fd, uint64_t bytes) = 0;

  // Fills `out` with `bytes` cryptographically random bytes (getrandom).
  virtual absl::Status RandomBytes(void* out, size_t bytes) = 0;

  // A thread running `body`; the errno's status where none can be had
  // (EAGAIN: a limit on threads or processes) instead of an exception.
  virtual absl::StatusOr<std::thread> StartThread(std::function<void()> body) = 0;
};

}  // namespace offload

#endif  // OFFLOADD_BASE_ENV_H_
