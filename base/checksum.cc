#include "base/checksum.h"

#include "xxhash.h"
#if defined(__x86_64__)
// (Without this the header renames XXH3_64bits to the dispatch, and the
// baseline below would be the dispatch too.)
#define XXH_DISPATCH_DISABLE_REPLACE
#include "xxh_x86dispatch.h"
#endif

namespace offload {

uint64_t Checksum64(const void* data, size_t bytes) {
#if defined(__x86_64__)
  return XXH3_64bits_dispatch(data, bytes);
#else
  return XXH3_64bits(data, bytes);
#endif
}

uint64_t Checksum64Baseline(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

}  // namespace offload
