// The daemon's YAML configuration file, applied to the tunable registry
// (base/config_registry.h): nested maps name tunables by their dotted path,
// so `optimizer: {threads: 2}` sets optimizer.threads. Here rather than in
// base/ because only the daemon reads files, and only it links yaml-cpp.
#ifndef OFFLOADD_DAEMON_CONFIG_FILE_H_
#define OFFLOADD_DAEMON_CONFIG_FILE_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "base/config_registry.h"

namespace offload {

// Applies a YAML document. Stops at the first error, naming the key and
// `source`: INVALID_ARGUMENT for malformed YAML or values, NOT_FOUND for an
// unknown setting.
absl::Status ApplyYaml(ConfigRegistry& registry, absl::string_view yaml_text,
                       absl::string_view source);
// NOT_FOUND if `path` cannot be read. `names`, if given, gets the settings
// the file set (ReloadYamlFile's `from_file`).
absl::Status ApplyYamlFile(ConfigRegistry& registry, const std::string& path,
                           std::vector<std::string>* names = nullptr);

// The settings a YAML document names, as (dotted name, value), in its order.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ReadYamlSettings(
    absl::string_view yaml_text, absl::string_view source);

// What re-reading the config file while offloadd runs did (SIGHUP).
struct ConfigReload {
  std::vector<std::string> applied;       // "name=value", changed now
  std::vector<std::string> need_restart;  // "name=value", static: at the next start
  std::vector<std::string> refused;       // "name: why" (a bad value: the old one stays)
  std::vector<std::string> kept;          // names the command line set: it wins
};
// Re-reads `path` and applies what changed from the values in force:
// dynamic settings at once (their hooks run, as offloadctl config set),
// static ones listed as needing a restart; settings in `from_command_line`
// are left as the command line set them (the file's value checked all the
// same: a bad one is refused, as the next start would refuse it); a
// setting the file set before (`from_file`: the names it set at the start
// or the last reload; updated) and no longer names goes back to its
// default, as a restart would have it (settings the file never named keep
// what offloadctl config set gave them). Fails (changing nothing) if the
// file cannot be read or parsed, or names an unknown setting.
absl::StatusOr<ConfigReload> ReloadYamlFile(ConfigRegistry& registry, const std::string& path,
                                            const std::vector<std::string>& from_command_line,
                                            std::vector<std::string>* from_file);

}  // namespace offload

#endif  // OFFLOADD_DAEMON_CONFIG_FILE_H_
