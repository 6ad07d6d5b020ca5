// wait_for_daemon PID LOG SOCKET: for shell tests, which have neither inotify
// nor pidfds. Returns once the offloadd process PID, writing its log to LOG,
// serves on SOCKET (see WaitUntilServing); exits 1 with the reason and the
// log if the daemon exits first or does not serve within 20 seconds, and 2
// on a usage error.
#include <cstdio>

#include "absl/strings/numbers.h"
#include "tests/daemon_process.h"

namespace offload::testing {
namespace {

int Main(int argc, char** argv) {
  pid_t pid = 0;
  if (argc != 4 || !absl::SimpleAtoi(argv[1], &pid) || pid <= 0) {
    std::fprintf(stderr, "usage: wait_for_daemon PID LOG SOCKET\n");
    return 2;
  }
  absl::StatusOr<UniqueFd> pidfd = OpenPidFd(pid);
  if (!pidfd.ok()) {
    std::fprintf(stderr, "wait_for_daemon: %s\n", pidfd.status().ToString().c_str());
    return 1;
  }
  absl::Status serving = WaitUntilServing(pidfd->get(), argv[2], argv[3]);
  if (!serving.ok()) {
    std::fprintf(stderr, "wait_for_daemon: offloadd is not serving: %s\n",
                 serving.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace offload::testing

int main(int argc, char** argv) { return offload::testing::Main(argc, argv); }
