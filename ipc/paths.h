// Where offloadd keeps its state and where clients find it by default.
// Shared by the daemon, the client library and offloadctl so that all three
// agree without configuration.
#ifndef OFFLOADD_IPC_PATHS_H_
#define OFFLOADD_IPC_PATHS_H_

#include <string>

#include "absl/status/status.h"

namespace offload {

// $XDG_STATE_HOME/offloadd, else $HOME/.local/state/offloadd, else
// /tmp/offloadd-<uid>.
std::string DefaultDataDir();

// The gRPC socket inside a data directory.
std::string SocketPathIn(const std::string& data_dir);

// With TCP on, the file (mode 0600) holding the token a TCP caller presents
// to do more than read status, and the gRPC metadata key it goes in.
std::string TcpTokenPathIn(const std::string& data_dir);
inline constexpr char kTokenMetadataKey[] = "x-offloadd-token";

// Where the system service (packaging/offloadd.service) listens.
inline constexpr char kSystemSocketPath[] = "/run/offloadd/offloadd.sock";

// The default client address: $OFFLOADD_ADDRESS if set, else
// unix:<DefaultDataDir()>/offloadd.sock, or the system service's socket
// where this user has no daemon of their own and the system one exists.
std::string DefaultClientAddress();

// Creates `dir` and missing parents. The last component is created 0700;
// an existing directory is accepted as is.
absl::Status MakeDirs(const std::string& dir);

// FAILED_PRECONDITION unless `dir` is owned by this process's user (or root)
// and writable by nobody else: another user who can write it could delete
// or replace the sockets in it. `dir` may be a symbolic link only of this
// user's (or root's): another's could be pointed elsewhere later.
absl::Status CheckPrivateDir(const std::string& dir);

}  // namespace offload

#endif  // OFFLOADD_IPC_PATHS_H_
