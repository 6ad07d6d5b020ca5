#include "daemon/config_file.h"

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "yaml-cpp/yaml.h"

namespace offload {

namespace {

using Settings = std::vector<std::pair<std::string, std::string>>;

absl::Status Collect(const YAML::Node& node, const std::string& prefix, absl::string_view source,
                     Settings* out, std::set<std::string>* seen) {
  if (node.IsMap()) {
    for (const auto& kv : node) {
      std::string key = kv.first.as<std::string>();
      std::string name = prefix.empty() ? key : absl::StrCat(prefix, ".", key);
      RETURN_IF_ERROR(Collect(kv.second, name, source, out, seen));
    }
    return absl::OkStatus();
  }
  if (!node.IsScalar()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": '", prefix, "' must be a scalar value or a map of settings"));
  }
  // (yaml-cpp takes a key given twice, and `a: {b: 1}` and `a.b: 2` name
  // one setting: the last would win unsaid.)
  if (!seen->insert(prefix).second) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": '", prefix, "' is set twice; keep one"));
  }
  out->emplace_back(prefix, node.Scalar());
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read config file '", path, "'"));
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

absl::StatusOr<Settings> ReadYamlSettings(absl::string_view yaml_text, absl::string_view source) {
  YAML::Node root;
  // yaml-cpp reports errors by exception; they stop here.
  try {
    root = YAML::Load(std::string(yaml_text));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid YAML: ", e.what()));
  }
  Settings out;
  if (root.IsNull()) return out;
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": the top level must be a map of settings"));
  }
  try {
    std::set<std::string> seen;
    RETURN_IF_ERROR(Collect(root, "", source, &out, &seen));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", e.what()));
  }
  return out;
}

absl::Status ApplyYaml(ConfigRegistry& registry, absl::string_view yaml_text,
                       absl::string_view source) {
  ASSIGN_OR_RETURN(Settings settings, ReadYamlSettings(yaml_text, source));
  for (const auto& [name, value] : settings) {
    auto set = registry.Set(name, value);
    if (!set.ok()) {
      return absl::Status(set.status().code(), absl::StrCat(source, ": ", set.status().message()));
    }
  }
  return absl::OkStatus();
}

absl::Status ApplyYamlFile(ConfigRegistry& registry, const std::string& path,
                           std::vector<std::string>* names) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  RETURN_IF_ERROR(ApplyYaml(registry, text, path));
  if (names != nullptr) {
    ASSIGN_OR_RETURN(Settings settings, ReadYamlSettings(text, path));
    names->clear();
    for (const auto& [name, value] : settings) names->push_back(name);
  }
  return absl::OkStatus();
}

absl::StatusOr<ConfigReload> ReloadYamlFile(ConfigRegistry& registry, const std::string& path,
                                            const std::vector<std::string>& from_command_line,
                                            std::vector<std::string>* from_file) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  ASSIGN_OR_RETURN(Settings settings, ReadYamlSettings(text, path));
  // Every name known before anything changes.
  for (const auto& [name, value] : settings) {
    auto known = registry.Get(name);
    if (!known.ok()) {
      return absl::Status(known.status().code(),
                          absl::StrCat(path, ": ", known.status().message()));
    }
  }
  // What the file set before and names no more: its default again.
  std::vector<std::string> now_named;
  for (const auto& [name, value] : settings) now_named.push_back(name);
  for (const std::string& name : *from_file) {
    if (absl::c_linear_search(now_named, name)) continue;
    absl::StatusOr<TunableInfo> known = registry.Get(name);
    if (known.ok()) settings.emplace_back(name, known->default_value);
  }
  *from_file = std::move(now_named);
  ConfigReload out;
  for (const auto& [name, value] : settings) {
    const TunableInfo now = *registry.Get(name);
    absl::StatusOr<std::string> wanted = registry.Normalize(name, value);
    if (!wanted.ok()) {
      out.refused.push_back(absl::StrCat(name, ": ", wanted.status().message()));
      continue;
    }
    if (absl::c_linear_search(from_command_line, name)) {
      out.kept.push_back(name);
      continue;
    }
    if (*wanted == now.value) continue;
    if (!now.dynamic) {
      out.need_restart.push_back(absl::StrCat(name, "=", *wanted));
      continue;
    }
    auto set = registry.Set(name, value);
    if (set.ok()) {
      out.applied.push_back(absl::StrCat(name, "=", set->value));
    } else {
      out.refused.push_back(absl::StrCat(name, ": ", set.status().message()));
    }
  }
  return out;
}

}  // namespace offload
