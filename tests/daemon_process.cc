#include "tests/daemon_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/inotify.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/posix_error.h"
#include "base/status_macros.h"
#include "ipc/unix_socket.h"

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

// Milliseconds until `deadline` for poll(): 0 once it has passed, rounded up
// otherwise so that a wait never ends just short of it.
int MillisecondsUntil(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  const int64_t ms = absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)));
  return static_cast<int>(std::min<int64_t>(ms, 1 << 30));
}

// Watches the directory holding `path` for changes to the file of that name.
// Watching the directory rather than the file works before the file exists.
class FileWatch {
 public:
  static absl::StatusOr<FileWatch> Create(const std::string& path) {
    const size_t slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
    std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
    UniqueFd fd(inotify_init1(IN_NONBLOCK | IN_CLOEXEC));
    if (!fd.valid()) return PosixError("inotify_init1", errno);
    if (inotify_add_watch(fd.get(), dir.c_str(),
                          IN_CREATE | IN_MOVED_TO | IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE |
                              IN_DELETE_SELF) < 0) {
      return PosixError(absl::StrCat("inotify_add_watch ", dir), errno);
    }
    return FileWatch(std::move(fd), std::move(name));
  }

  int fd() const { return fd_.get(); }

  // Reads the pending events: true if one concerned the watched file (or
  // events were lost), NOT_FOUND if the directory itself went away.
  absl::StatusOr<bool> Drain() {
    bool changed = false;
    alignas(inotify_event) char buf[4096];
    for (;;) {
      const ssize_t got = read(fd_.get(), buf, sizeof(buf));
      if (got < 0) {
        if (errno == EAGAIN) return changed;
        if (errno == EINTR) continue;
        return PosixError("read inotify", errno);
      }
      for (ssize_t at = 0; at < got;) {
        const auto* event = reinterpret_cast<const inotify_event*>(buf + at);
        if (event->mask & (IN_DELETE_SELF | IN_IGNORED)) {
          return absl::NotFoundError("the watched directory was removed");
        }
        if ((event->mask & IN_Q_OVERFLOW) || (event->len > 0 && name_ == event->name)) {
          changed = true;
        }
        at += static_cast<ssize_t>(sizeof(inotify_event) + event->len);
      }
    }
  }

 private:
  FileWatch(UniqueFd fd, std::string name) : fd_(std::move(fd)), name_(std::move(name)) {}
  UniqueFd fd_;
  std::string name_;
};

}  // namespace

absl::StatusOr<UniqueFd> OpenPidFd(pid_t pid) {
  UniqueFd fd(static_cast<int>(syscall(SYS_pidfd_open, pid, 0)));  // close-on-exec
  if (!fd.valid()) return PosixError(absl::StrCat("pidfd_open ", pid), errno);
  return fd;
}

absl::Status WaitForLogText(int pidfd, const std::string& log_path, absl::string_view text,
                            absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  // Watch first, then look: a write between the two still wakes the poll.
  ASSIGN_OR_RETURN(FileWatch watch, FileWatch::Create(log_path));
  auto found = [&] { return absl::StrContains(ReadFile(log_path), text); };
  if (found()) return absl::OkStatus();
  for (;;) {
    pollfd fds[2] = {{watch.fd(), POLLIN, 0}, {pidfd, POLLIN, 0}};
    const int n = poll(fds, 2, MillisecondsUntil(deadline));
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError("poll", errno);
    }
    if (fds[0].revents != 0) {
      ASSIGN_OR_RETURN(bool changed, watch.Drain());
      if (changed && found()) return absl::OkStatus();
    }
    if (fds[1].revents != 0) {
      // Whatever it wrote before exiting is in the file by now.
      if (found()) return absl::OkStatus();
      return absl::AbortedError(absl::StrCat("the process exited before ", log_path, " said \"",
                                             text, "\"; it holds:\n", ReadFile(log_path)));
    }
    if (n == 0 || absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(log_path, " did not say \"", text,
                                                      "\" within ", absl::FormatDuration(timeout),
                                                      "; it holds:\n", ReadFile(log_path)));
    }
  }
}

absl::Status WaitUntilServing(int pidfd, const std::string& log_path,
                              const std::string& socket_path, absl::Duration timeout) {
  // The "serving gRPC on unix:..." line is the event that means ready;
  // offloadd_main logs it only after Daemon::Start has returned. The socket
  // file appearing is not: gRPC creates it at bind() and listens only after,
  // so a connect in between is refused, and Daemon::Start still sets the
  // tunables' hooks and freezes the registry once the server runs. (The
  // line's wording is already asserted by StopsCleanlyOnSigtermAndRemovesSockets.)
  RETURN_IF_ERROR(
      WaitForLogText(pidfd, log_path, absl::StrCat("serving gRPC on unix:", socket_path), timeout));
  if (!UnixSocketIsLive(socket_path)) {
    return absl::InternalError(absl::StrCat("offloadd says it serves on ", socket_path,
                                            " but a connect there fails:\n", ReadFile(log_path)));
  }
  return absl::OkStatus();
}

absl::Status PollWithBackoff(const std::function<bool()>& condition, int pidfd,
                             absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = absl::Milliseconds(1);
  for (;;) {
    if (condition()) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("the condition did not hold within ", absl::FormatDuration(timeout)));
    }
    pollfd fd = {pidfd, POLLIN, 0};
    const int n = poll(&fd, 1, MillisecondsUntil(std::min(deadline, now + backoff)));
    if (n < 0 && errno != EINTR) return PosixError("poll", errno);
    if (n > 0) {
      if (condition()) return absl::OkStatus();
      return absl::AbortedError("the process exited before the condition held");
    }
    backoff = std::min(2 * backoff, absl::Milliseconds(64));
  }
}

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Start(
    const std::vector<std::string>& flags, const std::string& binary) {
  char dir[] = "/tmp/offloadd_test.XXXXXX";
  if (mkdtemp(dir) == nullptr) return PosixError("mkdtemp", errno);
  return StartIn(dir, flags, binary);
}

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::StartIn(
    const std::string& dir, const std::vector<std::string>& flags, const std::string& binary) {
  std::vector<std::string> argv = {binary, absl::StrCat("--server.data_dir=", dir)};
  argv.insert(argv.end(), flags.begin(), flags.end());
  absl::StatusOr<pid_t> pid = Spawn(argv, absl::StrCat(dir, "/offloadd.log"));
  if (!pid.ok()) return pid.status();
  absl::StatusOr<UniqueFd> pidfd = OpenPidFd(*pid);
  if (!pidfd.ok()) {
    kill(*pid, SIGKILL);
    waitpid(*pid, nullptr, 0);
    return pidfd.status();
  }
  std::unique_ptr<DaemonProcess> d(new DaemonProcess(dir, *pid, std::move(*pidfd)));
  for (const std::string& flag : flags) {  // a socket named on the command line
    if (absl::StartsWith(flag, "--server.socket=")) {
      d->socket_path_ = flag.substr(std::string("--server.socket=").size());
    }
  }
  absl::Status serving = WaitUntilServing(d->pidfd_.get(), d->log_path(), d->socket_path());
  if (!serving.ok()) {
    int status;
    if (waitpid(d->pid_, &status, WNOHANG) == d->pid_) {
      d->pid_ = -1;
      return absl::InternalError(absl::StrCat("offloadd exited with ", ExitCode(status),
                                              " before serving:\n", d->ReadLog()));
    }
    return serving;  // the destructor kills it
  }
  return d;
}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  RemoveOnExit remove(data_dir_);
}

RemoveOnExit::~RemoveOnExit() {
  std::error_code ignored;  // best effort: a test's scratch
  std::filesystem::remove_all(path_, ignored);
}

void DaemonProcess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

absl::StatusOr<int> DaemonProcess::Stop() {
  if (pid_ <= 0) return absl::FailedPreconditionError("offloadd is not running");
  if (kill(pid_, SIGTERM) != 0) return PosixError("kill SIGTERM", errno);
  int status;
  if (waitpid(pid_, &status, 0) != pid_) return PosixError("waitpid", errno);
  pid_ = -1;
  return ExitCode(status);
}

absl::Status DaemonProcess::WaitForLog(absl::string_view text, absl::Duration timeout) const {
  return WaitForLogText(pidfd_.get(), log_path(), text, timeout);
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
