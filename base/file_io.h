// Positioned reads and writes that finish the job: pread and pwrite go on
// after a short transfer or EINTR until every byte has moved.
#ifndef OFFLOADD_BASE_FILE_IO_H_
#define OFFLOADD_BASE_FILE_IO_H_

#include <cstddef>
#include <cstdint>

namespace offload {

// Writes `bytes` from `data` at `offset`: 0, or the errno of the failure.
int PwriteAll(int fd, const void* data, size_t bytes, uint64_t offset);

// Reads `bytes` at `offset` into `data`: 0, the errno of the failure, or -1
// when the file ends first (`*missing` bytes short).
int PreadAll(int fd, void* data, size_t bytes, uint64_t offset, size_t* missing);

}  // namespace offload

#endif  // OFFLOADD_BASE_FILE_IO_H_
