#include "daemon/config_file.h"

#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "yaml-cpp/yaml.h"

namespace offload {

namespace {

absl::Status ApplyNode(ConfigRegistry& registry, const YAML::Node& node, const std::string& prefix,
                       absl::string_view source) {
  if (node.IsMap()) {
    for (const auto& kv : node) {
      std::string key = kv.first.as<std::string>();
      std::string name = prefix.empty() ? key : absl::StrCat(prefix, ".", key);
      RETURN_IF_ERROR(ApplyNode(registry, kv.second, name, source));
    }
    return absl::OkStatus();
  }
  if (!node.IsScalar()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": '", prefix, "' must be a scalar value or a map of settings"));
  }
  auto set = registry.Set(prefix, node.Scalar());
  if (!set.ok()) {
    return absl::Status(set.status().code(), absl::StrCat(source, ": ", set.status().message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ApplyYaml(ConfigRegistry& registry, absl::string_view yaml_text,
                       absl::string_view source) {
  YAML::Node root;
  // yaml-cpp reports errors by exception; they stop here.
  try {
    root = YAML::Load(std::string(yaml_text));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid YAML: ", e.what()));
  }
  if (root.IsNull()) return absl::OkStatus();
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": the top level must be a map of settings"));
  }
  try {
    return ApplyNode(registry, root, "", source);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", e.what()));
  }
}

absl::Status ApplyYamlFile(ConfigRegistry& registry, const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read config file '", path, "'"));
  }
  std::stringstream text;
  text << in.rdbuf();
  return ApplyYaml(registry, text.str(), path);
}

}  // namespace offload
