#include "base/file_io.h"

#include <unistd.h>

#include <cerrno>

namespace offload {

int PwriteAll(int fd, const void* data, size_t bytes, uint64_t offset) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = pwrite(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return 0;
}

int PreadAll(int fd, void* data, size_t bytes, uint64_t offset, size_t* missing) {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = pread(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) {
      *missing = bytes;
      return -1;
    }
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return 0;
}

}  // namespace offload
