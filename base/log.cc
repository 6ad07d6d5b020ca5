#include "base/log.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace offload {
namespace {

// Whether stderr is the systemd journal's stream: JOURNAL_STREAM names its
// device and inode (systemd.exec(5)), so that a child that inherited the
// variable but not the stream does not take its file for the journal.
bool StderrIsTheJournal() {
  static const bool journal = [] {
    const char* stream = std::getenv("JOURNAL_STREAM");
    struct stat st;
    if (stream == nullptr || fstat(STDERR_FILENO, &st) != 0) return false;
    return absl::StrCat(st.st_dev, ":", st.st_ino) == stream;
  }();
  return journal;
}

}  // namespace

std::string FormatLogLine(LogLevel level, const std::string& message, bool journal,
                          absl::Time now) {
  if (journal) {
    // The journal stamps the time itself and takes the priority from the
    // "<N>" prefix (sd-daemon(3): 6 info, 4 warning, 3 error).
    const char* priority = level == LogLevel::kInfo      ? "<6>"
                           : level == LogLevel::kWarning ? "<4>"
                                                         : "<3>";
    return absl::StrCat(priority, "offloadd: ", message, "\n");
  }
  const char* tag = level == LogLevel::kInfo ? "I" : level == LogLevel::kWarning ? "W" : "E";
  return absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", now, absl::UTCTimeZone()), " ", tag,
                      " offloadd: ", message, "\n");
}

void LogLine(LogLevel level, const std::string& message) {
  const std::string line = FormatLogLine(level, message, StderrIsTheJournal(), absl::Now());
  // A single write keeps lines from different threads whole.
  ssize_t unused = ::write(STDERR_FILENO, line.data(), line.size());
  (void)unused;
}

int64_t LogLimiter::Admit(absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (now < next_) {
    ++held_;
    return -1;
  }
  next_ = now + interval_;
  const int64_t held = held_;
  held_ = 0;
  return held;
}

std::string LogLimiter::Held(int64_t held) {
  return held > 0 ? absl::StrCat(" (", held, " more like it since the last report)") : "";
}

}  // namespace offload
