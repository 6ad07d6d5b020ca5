// Writes the safetensors format (https://huggingface.co/docs/safetensors,
// "Format"): an 8-byte little-endian header length N, N bytes of JSON
// header (padded with spaces to a multiple of 8), then the tensors' bytes
// back to back. The header maps each tensor's name to its dtype, shape and
// [begin, end) byte offsets within the data, plus optional string-to-string
// "__metadata__". Only F32 is written here.
//
// The file appears whole or not at all: written to <path>.tmp, fsynced and
// renamed.
#ifndef OFFLOADD_CHECKPOINT_SAFETENSORS_H_
#define OFFLOADD_CHECKPOINT_SAFETENSORS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace offload::checkpoint {

struct SafetensorsEntry {
  std::string name;
  std::vector<uint64_t> shape;  // numel = product (1 for an empty shape)
  // Writes the tensor's numel float values into `dst`.
  std::function<absl::Status(float* dst)> fill;
};

// INVALID_ARGUMENT for duplicate or empty names.
absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                              const std::map<std::string, std::string>& metadata);

// A JSON string literal of `s` (quotes, backslashes and control characters
// escaped), as the header needs.
std::string JsonString(const std::string& s);

}  // namespace offload::checkpoint

#endif  // OFFLOADD_CHECKPOINT_SAFETENSORS_H_
