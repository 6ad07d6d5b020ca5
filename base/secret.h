// Comparing secrets (session tokens, the TCP token) without leaking through
// timing how much of a guess was right. Thread-safe; touches only its
// arguments.
#ifndef OFFLOADD_BASE_SECRET_H_
#define OFFLOADD_BASE_SECRET_H_

#include <cstddef>

#include "absl/strings/string_view.h"

namespace offload {

// True if `a` and `b` are equal. Takes the same time for any two strings of
// one length (no early exit on the first mismatch); a length mismatch is
// not hidden (lengths of our secrets are public).
inline bool SecretsEqual(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace offload

#endif  // OFFLOADD_BASE_SECRET_H_
