// Test helper: runs a real offloadd binary as a child process in a fresh
// temporary directory, waits until it serves, and stops it with SIGTERM.
//
// Waits block on inotify (for files the daemon writes) and on pidfds (for
// processes exiting), under an overall deadline so that a test never hangs.
// PollWithBackoff is the one exception, for what only polling can observe.
#ifndef OFFLOADD_TESTS_DAEMON_PROCESS_H_
#define OFFLOADD_TESTS_DAEMON_PROCESS_H_

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/unique_fd.h"

namespace offload::testing {

// How long a test waits for anything before it fails instead of hanging.
inline constexpr absl::Duration kWaitLimit = absl::Seconds(20);

class DaemonProcess {
 public:
  // Starts `binary` (default: daemon/offloadd in the test's runfiles) with
  // --server.data_dir set to a new directory under /tmp plus `flags`, and
  // returns once it serves (see WaitUntilServing).
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(
      const std::vector<std::string>& flags = {}, const std::string& binary = "daemon/offloadd");
  // As Start, in the existing `data_dir` (another offloadd's, stopped: a
  // restart). Its log starts afresh.
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> StartIn(
      const std::string& data_dir, const std::vector<std::string>& flags = {},
      const std::string& binary = "daemon/offloadd");
  ~DaemonProcess();  // SIGKILLs the daemon if still running

  // SIGTERM, then waits; returns the exit status (or 128 + signal).
  absl::StatusOr<int> Stop();
  // SIGKILL (a crash), then waits; the data directory stays for StartIn.
  void Kill();

  // Waits until the daemon's log contains `text`; fails at once if the
  // daemon exits first, and after `timeout` otherwise.
  absl::Status WaitForLog(absl::string_view text, absl::Duration timeout = kWaitLimit) const;

  const std::string& data_dir() const { return data_dir_; }
  std::string socket_path() const {
    return socket_path_.empty() ? data_dir_ + "/offloadd.sock" : socket_path_;
  }
  std::string address() const { return "unix:" + socket_path(); }
  std::string log_path() const { return data_dir_ + "/offloadd.log"; }
  std::string ReadLog() const;
  pid_t pid() const { return pid_; }

 private:
  DaemonProcess(std::string data_dir, pid_t pid, UniqueFd pidfd)
      : data_dir_(std::move(data_dir)), pid_(pid), pidfd_(std::move(pidfd)) {}
  std::string data_dir_;
  std::string socket_path_;  // --server.socket's, if given
  pid_t pid_;
  UniqueFd pidfd_;  // becomes readable when the daemon exits
};

// A descriptor that becomes readable when process `pid` exits (pidfd_open,
// Linux >= 5.3). `pid` must not be reaped yet: an unreaped child, or a
// process that is not ours.
absl::StatusOr<UniqueFd> OpenPidFd(pid_t pid);

// Waits until the log file at `log_path` contains `text`, re-reading it each
// time inotify reports a write to it. Fails with the log's contents if the
// process behind `pidfd` exits before the text appears, and with
// DEADLINE_EXCEEDED after `timeout`. The log file need not exist yet.
absl::Status WaitForLogText(int pidfd, const std::string& log_path, absl::string_view text,
                            absl::Duration timeout = kWaitLimit);

// Waits until the offloadd process behind `pidfd`, logging to `log_path`,
// has returned from Daemon::Start (it then logs "serving gRPC on
// unix:SOCKET") and accepts connections on `socket_path`. The rest of its
// start-up description (tiers, optimizer) may still be on its way to the
// log: a test that checks those lines waits for them with WaitForLogText.
absl::Status WaitUntilServing(int pidfd, const std::string& log_path,
                              const std::string& socket_path, absl::Duration timeout = kWaitLimit);

// For a condition that no event announces (only polling can observe it):
// evaluates `condition` with exponential backoff (1 ms doubling to 64 ms)
// until it holds. The backoff waits in poll() on `pidfd`, so that if the
// process behind it exits first this returns ABORTED at once (pidfd -1
// watches nothing); DEADLINE_EXCEEDED after `timeout`. Callers must say in a
// comment why no event exists.
absl::Status PollWithBackoff(const std::function<bool()>& condition, int pidfd,
                             absl::Duration timeout = kWaitLimit);

// Removes a directory tree (a test's scratch under /tmp, which bazel's
// TEST_TMPDIR cannot hold: Unix socket paths are limited to 108 bytes) when
// it goes out of scope.
class RemoveOnExit {
 public:
  explicit RemoveOnExit(std::string path) : path_(std::move(path)) {}
  ~RemoveOnExit();
  RemoveOnExit(const RemoveOnExit&) = delete;
  RemoveOnExit& operator=(const RemoveOnExit&) = delete;

 private:
  std::string path_;
};

// Runs `argv` to completion, returning its exit status and its stdout and
// stderr together.
struct CommandResult {
  int exit_code;
  std::string output;
};
absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv);

// Starts `argv` without waiting, its stdout and stderr going to `output`.
absl::StatusOr<pid_t> SpawnProcess(const std::vector<std::string>& argv, const std::string& output);

}  // namespace offload::testing

#endif  // OFFLOADD_TESTS_DAEMON_PROCESS_H_
