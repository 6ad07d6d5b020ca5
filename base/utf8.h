// UTF-8 validation for names that arrive as bytes (proto `bytes` fields):
// the daemon answers invalid text with INVALID_ARGUMENT naming the byte,
// instead of letting a request fail to parse.
#ifndef OFFLOADD_BASE_UTF8_H_
#define OFFLOADD_BASE_UTF8_H_

#include <cstddef>
#include <optional>

#include "absl/strings/string_view.h"

namespace offload {

// The offset of the first byte that does not start or continue a valid
// UTF-8 sequence (RFC 3629: no overlong forms, no surrogates, at most
// U+10FFFF), or nullopt if `s` is valid UTF-8.
std::optional<size_t> FirstInvalidUtf8(absl::string_view s);

}  // namespace offload

#endif  // OFFLOADD_BASE_UTF8_H_
