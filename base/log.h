// Minimal leveled logging to stderr for the daemon: one line per call,
// prefixed with a UTC timestamp and the level; where stderr is the systemd
// journal (JOURNAL_STREAM), with the journal's priority prefix instead and
// no timestamp (the journal adds its own). Thread-safe (one write(2) per
// line). absl's 2022 LTS has no logging library.
#ifndef OFFLOADD_BASE_LOG_H_
#define OFFLOADD_BASE_LOG_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace offload {

enum class LogLevel { kInfo, kWarning, kError };

void LogLine(LogLevel level, const std::string& message);

// The line LogLine writes (for the journal, or with the time `now`).
std::string FormatLogLine(LogLevel level, const std::string& message, bool journal, absl::Time now);

template <typename... Args>
void LogInfo(const absl::FormatSpec<Args...>& format, const Args&... args) {
  LogLine(LogLevel::kInfo, absl::StrFormat(format, args...));
}
template <typename... Args>
void LogWarning(const absl::FormatSpec<Args...>& format, const Args&... args) {
  LogLine(LogLevel::kWarning, absl::StrFormat(format, args...));
}
template <typename... Args>
void LogError(const absl::FormatSpec<Args...>& format, const Args&... args) {
  LogLine(LogLevel::kError, absl::StrFormat(format, args...));
}

// One line per `interval` for a message the environment may repeat without
// end (accept failing with EMFILE on every poll): the first occurrence is
// let through, then at most one an interval, each saying how many were held
// back since the last. Thread-safe.
//
//   static LogLimiter limiter(absl::Seconds(10));
//   if (int64_t held = limiter.Admit(absl::Now()); held >= 0) {
//     LogWarning("accept: %s%s", why, LogLimiter::Held(held));
//   }
class LogLimiter {
 public:
  explicit LogLimiter(absl::Duration interval) : interval_(interval) {}

  // -1 if this occurrence is held back; else how many were held back
  // before it (0 for the first).
  int64_t Admit(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // " (N more like it since the last report)", or "" for 0.
  static std::string Held(int64_t held);

 private:
  const absl::Duration interval_;
  absl::Mutex mu_;
  absl::Time next_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t held_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace offload

#endif  // OFFLOADD_BASE_LOG_H_
