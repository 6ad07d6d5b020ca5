// Checksum64: the 64-bit XXH3 of a byte range (what the NVMe tier records
// per stripe and checkpoints per record), computed on the widest vector unit
// the CPU has. XXH3 gives the same value on every unit (its specification
// fixes the result, not the instructions), so data checksummed on one
// machine verifies on another.
//
// libxxhash's XXH3_64bits is compiled for the baseline x86-64 (SSE2); its
// run-time dispatch (XXH3_64bits_dispatch, part of the same library: AVX-512,
// AVX2 or SSE2, chosen once) reads 3-4x faster from the cache and 1.4-1.6x
// faster from memory on this project's AVX-512 VMs (benches/nvme prints
// both). Elsewhere than x86-64 it is XXH3_64bits.
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
