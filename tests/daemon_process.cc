#include "tests/daemon_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/posix_error.h"
#include "ipc/fd_passing.h"

extern char** environ;

namespace offload::testing {
namespace {

absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, const std::string& output) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, output.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return PosixError(absl::StrCat("spawning ", argv[0]), rc);
  return pid;
}

int ExitCode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Start(
    const std::vector<std::string>& flags, const std::string& binary) {
  char dir[] = "/tmp/offloadd_test.XXXXXX";
  if (mkdtemp(dir) == nullptr) return PosixError("mkdtemp", errno);
  std::vector<std::string> argv = {binary, absl::StrCat("--server.data_dir=", dir)};
  argv.insert(argv.end(), flags.begin(), flags.end());
  absl::StatusOr<pid_t> pid = Spawn(argv, absl::StrCat(dir, "/offloadd.log"));
  if (!pid.ok()) return pid.status();
  std::unique_ptr<DaemonProcess> d(new DaemonProcess(dir, *pid));
  // Poll for readiness: the gRPC socket is the last thing offloadd creates.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!UnixSocketIsLive(d->socket_path())) {
    int status;
    if (waitpid(d->pid_, &status, WNOHANG) == d->pid_) {
      d->pid_ = -1;
      return absl::InternalError(absl::StrCat("offloadd exited with ", ExitCode(status),
                                              " before serving:\n", d->ReadLog()));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("offloadd did not serve within 20 s:\n", d->ReadLog()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return d;
}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

absl::StatusOr<int> DaemonProcess::Stop() {
  if (pid_ <= 0) return absl::FailedPreconditionError("offloadd is not running");
  if (kill(pid_, SIGTERM) != 0) return PosixError("kill SIGTERM", errno);
  int status;
  if (waitpid(pid_, &status, 0) != pid_) return PosixError("waitpid", errno);
  pid_ = -1;
  return ExitCode(status);
}

std::string DaemonProcess::ReadLog() const { return ReadFile(log_path()); }

absl::StatusOr<pid_t> SpawnProcess(const std::vector<std::string>& argv,
                                   const std::string& output) {
  return Spawn(argv, output);
}

absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv) {
  char path[] = "/tmp/offloadd_cmd.XXXXXX";
  int fd = mkstemp(path);
  if (fd < 0) return PosixError("mkstemp", errno);
  close(fd);
  absl::StatusOr<pid_t> pid = Spawn(argv, path);
  if (!pid.ok()) return pid.status();
  int status;
  if (waitpid(*pid, &status, 0) != *pid) return PosixError("waitpid", errno);
  CommandResult result{ExitCode(status), ReadFile(path)};
  unlink(path);
  return result;
}

}  // namespace offload::testing
