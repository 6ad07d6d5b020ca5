// Test helper: runs a real offloadd binary as a child process in a fresh
// temporary directory, waits until it serves, and stops it with SIGTERM.
#ifndef OFFLOADD_TESTS_DAEMON_PROCESS_H_
#define OFFLOADD_TESTS_DAEMON_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace offload::testing {

class DaemonProcess {
 public:
  // Starts `binary` (default: engine/offloadd in the test's runfiles) with
  // --server.data_dir set to a new directory under /tmp plus `flags`.
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(
      const std::vector<std::string>& flags = {}, const std::string& binary = "engine/offloadd");
  ~DaemonProcess();  // SIGKILLs the daemon if still running

  // SIGTERM, then waits; returns the exit status (or 128 + signal).
  absl::StatusOr<int> Stop();

  const std::string& data_dir() const { return data_dir_; }
  std::string socket_path() const { return data_dir_ + "/offloadd.sock"; }
  std::string address() const { return "unix:" + socket_path(); }
  std::string log_path() const { return data_dir_ + "/offloadd.log"; }
  std::string ReadLog() const;
  pid_t pid() const { return pid_; }

 private:
  DaemonProcess(std::string data_dir, pid_t pid) : data_dir_(std::move(data_dir)), pid_(pid) {}
  std::string data_dir_;
  pid_t pid_;
};

// Runs `argv` to completion, returning its exit status and its stdout and
// stderr together.
struct CommandResult {
  int exit_code;
  std::string output;
};
absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv);

// Starts `argv` without waiting, its stdout and stderr going to `output`.
absl::StatusOr<pid_t> SpawnProcess(const std::vector<std::string>& argv,
                                   const std::string& output);

}  // namespace offload::testing

#endif  // OFFLOADD_TESTS_DAEMON_PROCESS_H_
