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

namespace {

// libxxhash picks the dispatch's vector unit at the first call of more than
// 240 bytes and keeps it in a plain global: made here, at load time, before
// any thread of ours can race on it.
const uint64_t kDispatchChosen = [] {
  unsigned char bytes[256] = {};
  return Checksum64(bytes, sizeof(bytes));
}();

}  // namespace

}  // namespace offload
