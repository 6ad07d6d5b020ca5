// The daemon's YAML configuration file, applied to the tunable registry
// (base/config_registry.h): nested maps name tunables by their dotted path,
// so `optimizer: {threads: 2}` sets optimizer.threads. Here rather than in
// base/ because only the daemon reads files, and only it links yaml-cpp.
#ifndef OFFLOADD_DAEMON_CONFIG_FILE_H_
#define OFFLOADD_DAEMON_CONFIG_FILE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "base/config_registry.h"

namespace offload {

// Applies a YAML document. Stops at the first error, naming the key and
// `source`: INVALID_ARGUMENT for malformed YAML or values, NOT_FOUND for an
// unknown setting.
absl::Status ApplyYaml(ConfigRegistry& registry, absl::string_view yaml_text,
                       absl::string_view source);
// NOT_FOUND if `path` cannot be read.
absl::Status ApplyYamlFile(ConfigRegistry& registry, const std::string& path);

}  // namespace offload

#endif  // OFFLOADD_DAEMON_CONFIG_FILE_H_
