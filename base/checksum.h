// Checksum64: the 64-bit XXH3 of a byte range (what the NVMe tier records
// per stripe and checkpoints per record), computed on the widest vector unit
// the CPU has. XXH3 gives the same value on every unit (its specification
// fixes the result, not the instructions), so data checksummed on one
// machine verifies on another.
//
// Debian's libxxhash builds XXH3_64bits for the baseline x86-64 (SSE2) and
// ships its run-time dispatch too (XXH3_64bits_dispatch: AVX-512, AVX2 or
// SSE2, chosen at the first call, which this file makes at load time; a
// libxxhash built without DISPATCH=1 lacks it and this file does not link).
// The dispatch read 3.3-3.7x faster from the cache and 1.4-1.5x faster from
// memory on this project's Intel AVX-512 VM (benches/nvme prints both).
// Elsewhere than x86-64 it is XXH3_64bits.
//
// Thread-safety: safe from any thread.
#ifndef OFFLOADD_BASE_CHECKSUM_H_
#define OFFLOADD_BASE_CHECKSUM_H_

#include <cstddef>
#include <cstdint>

namespace offload {

uint64_t Checksum64(const void* data, size_t bytes);

// The same with libxxhash's baseline build, for comparison (tests, benches).
uint64_t Checksum64Baseline(const void* data, size_t bytes);

}  // namespace offload

#endif  // OFFLOADD_BASE_CHECKSUM_H_
