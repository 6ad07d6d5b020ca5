#include "base/env.h"

#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/posix_error.h"

namespace offload {
namespace {

class PosixEnv final : public Env {
 public:
  absl::StatusOr<HostMemory> Allocate(uint64_t bytes, Pages pages) override {
    return HostMemory::Allocate(bytes, pages);
  }

  absl::StatusOr<HostMemory> MapShared(int fd, uint64_t offset, uint64_t bytes,
                                       Pages pages) override {
    return HostMemory::MapShared(fd, offset, bytes, pages);
  }

  absl::StatusOr<UniqueFd> CreateMemfd(const std::string& label) override {
    UniqueFd fd(memfd_create(label.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!fd.valid()) return PosixError(absl::StrCat("memfd_create ", label), errno);
    return fd;
  }

  absl::Status ResizeFile(int fd, uint64_t bytes) override {
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      return PosixError(absl::StrCat("resizing descriptor ", fd, " to ", bytes, " bytes"), errno);
    }
    return absl::OkStatus();
  }

  absl::Status RandomBytes(void* out, size_t bytes) override {
    auto* p = static_cast<char*>(out);
    size_t got = 0;
    while (got < bytes) {
      ssize_t n = getrandom(p + got, bytes - got, 0);
      if (n < 0) {
        if (errno == EINTR) continue;
        return PosixError("getrandom", errno);
      }
      got += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::thread> StartThread(std::function<void()> body) override {
    try {
      return std::thread(std::move(body));
    } catch (const std::system_error& e) {
      return PosixError("starting a thread", e.code().value());
    }
  }
};

}  // namespace

Env* Env::Default() {
  static Env* const env = new PosixEnv();
  return env;
}

}  // namespace offload
