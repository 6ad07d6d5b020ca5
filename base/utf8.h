// UTF-8 validation for names that arrive as bytes (proto `bytes` fields):
// the daemon answers invalid text with INVALID_ARGUMENT naming the byte,
// instead of letting a request fail to parse.
#ifndef OFFLOADD_BASE_UTF8_H_
#define OFFLOADD_BASE_UTF8_H_

#include <cstddef>
#include <cstdint>
#include <optional>

#include "absl/strings/string_view.h"

namespace offload {

// The offset of the first byte that does not start or continue a valid
// UTF-8 sequence (RFC 3629: no overlong forms, no surrogates, at most
// U+10FFFF), or nullopt if `s` is valid UTF-8.
std::optional<size_t> FirstInvalidUtf8(absl::string_view s);

// In valid UTF-8 `s` (FirstInvalidUtf8 found nothing): the first code point
// that a name shown in a terminal or a log must not carry, with its offset:
// a C1 control (U+0080-U+009F; C0 controls are ASCII, checked by the
// caller) or a bidirectional embedding, override or isolate (U+202A-U+202E,
// U+2066-U+2069), which reorder the text around them on screen.
struct CodePointAt {
  size_t offset = 0;
  uint32_t code_point = 0;
};
std::optional<CodePointAt> FirstUnsafeCodePoint(absl::string_view s);

}  // namespace offload

#endif  // OFFLOADD_BASE_UTF8_H_
