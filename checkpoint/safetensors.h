// Writes the safetensors format (https://huggingface.co/docs/safetensors,
// "Format"): an 8-byte little-endian header length N, N bytes of JSON
// header (padded with spaces to a multiple of 8), then the tensors' bytes
// back to back. The header maps each tensor's name to its dtype, shape and
// [begin, end) byte offsets within the data, plus optional string-to-string
// "__metadata__". Only F32 is written here.
//
// The file appears whole or not at all: written to a temporary file of its
// own beside `path` (created afresh, never one found there), fsynced and
// renamed. Memory: one chunk of at most kSafetensorsChunk values at a time,
// whatever the tensors' sizes.
#ifndef OFFLOADD_CHECKPOINT_SAFETENSORS_H_
#define OFFLOADD_CHECKPOINT_SAFETENSORS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace offload::checkpoint {

// The most values WriteSafetensors asks a tensor's `fill` for at once.
inline constexpr uint64_t kSafetensorsChunk = uint64_t{1} << 22;

struct SafetensorsEntry {
  std::string name;
  std::vector<uint64_t> shape;  // numel = product (1 for an empty shape)
  // Writes the tensor's float values [begin, begin + n) into `dst`; called
  // in order, n at most kSafetensorsChunk.
  std::function<absl::Status(uint64_t begin, uint64_t n, float* dst)> fill;
};

// INVALID_ARGUMENT for duplicate or empty names, or a file past 2^63 bytes.
absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                              const std::map<std::string, std::string>& metadata);

// A JSON string literal of `s` (quotes, backslashes and control characters
// escaped), as the header needs.
std::string JsonString(const std::string& s);

}  // namespace offload::checkpoint

#endif  // OFFLOADD_CHECKPOINT_SAFETENSORS_H_
