// The systemd notification protocol (sd_notify(3)), without libsystemd: a
// datagram of "KEY=VALUE" lines to the socket $NOTIFY_SOCKET names (a path,
// or "@name" in the abstract namespace). Where the variable is unset (not
// started by systemd with Type=notify) it does nothing.
#ifndef OFFLOADD_DAEMON_SD_NOTIFY_H_
#define OFFLOADD_DAEMON_SD_NOTIFY_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace offload {

// Sends `state` ("READY=1", "RELOADING=1", "STOPPING=1", "STATUS=...").
absl::Status NotifySystemd(absl::string_view state);

}  // namespace offload

#endif  // OFFLOADD_DAEMON_SD_NOTIFY_H_
