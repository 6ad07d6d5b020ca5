// The tunable registry: binds dotted names ("optimizer.threads") to fields of
// the components' Options structs, so a config file, command-line flags and
// the live config service all read and write those same fields.
//
// A tunable's default is its field's value at Bind() time (the in-class
// initializer). Dynamic tunables may change while the daemon runs: Set()
// runs the tunable's apply hook first (which pushes the value into the live
// component and may refuse it) and stores the value only if the hook
// succeeded. Static tunables can be set only before Freeze().
//
// Thread-safety: all methods are safe from any thread. Hooks run under the
// registry's lock and must not call back into the registry.
#ifndef OFFLOADD_ENGINE_CONFIG_H_
#define OFFLOADD_ENGINE_CONFIG_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <typeinfo>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace offload {

struct TunableInfo {
  std::string name;
  std::string type;  // "int", "double", "bool", "string"
  std::string value;
  std::string default_value;
  std::string unit;  // "bytes", "threads", ... or empty
  bool dynamic = false;
  std::string description;
};

struct TunableSpec {
  std::string unit;
  std::string description;
  bool dynamic = false;
  // Inclusive bounds for "int" and "double" tunables.
  double min = -1e300;
  double max = 1e300;
};

class ConfigRegistry {
 public:
  ConfigRegistry() = default;
  ConfigRegistry(const ConfigRegistry&) = delete;
  ConfigRegistry& operator=(const ConfigRegistry&) = delete;

  // `field` must outlive the registry. Integers with unit "bytes" also
  // accept suffixes: 512MiB, 8GiB, 1G, 64K.
  void Bind(std::string name, int64_t* field, TunableSpec spec);
  void Bind(std::string name, double* field, TunableSpec spec);
  void Bind(std::string name, bool* field, TunableSpec spec);
  void Bind(std::string name, std::string* field, TunableSpec spec);

  // Runs before a new value of a dynamic tunable is stored, once the
  // registry is frozen (before that, components read their options when they
  // are built); the value is parsed and range-checked already. A failing
  // hook leaves the old value. T must be the bound field's type.
  template <typename T>
  using Hook = std::function<absl::Status(const T&)>;
  template <typename T>
  void SetHook(const std::string& name, Hook<T> hook);

  // After Freeze(), setting a static tunable fails with FAILED_PRECONDITION.
  void Freeze();

  // NOT_FOUND for an unknown name; INVALID_ARGUMENT for a value that does not
  // parse or is out of range; FAILED_PRECONDITION for a static tunable once
  // frozen. Returns the tunable as stored afterwards.
  absl::StatusOr<TunableInfo> Set(absl::string_view name, absl::string_view value);
  absl::StatusOr<TunableInfo> Get(absl::string_view name) const;
  std::vector<TunableInfo> List() const;

  // Applies a YAML document: nested maps name tunables by their dotted path
  // (`optimizer: {threads: 2}` sets optimizer.threads). Stops at the first
  // error, naming the key and `source`.
  absl::Status ApplyYaml(absl::string_view yaml_text, absl::string_view source);
  absl::Status ApplyYamlFile(const std::string& path);

 private:
  struct Tunable {
    TunableInfo info;  // value is refreshed from the field on read
    TunableSpec spec;
    std::function<std::string()> format;
    // Parses and range-checks `text`, runs the hook when `run_hook`, stores.
    std::function<absl::Status(absl::string_view text, bool run_hook)> set;
    // A Hook<T> for the field's T, shared with `set`.
    std::shared_ptr<void> hook;
    const std::type_info* hook_type = nullptr;
  };

  template <typename T>
  void BindTyped(std::string name, T* field, TunableSpec spec, const char* type,
                 std::function<absl::Status(absl::string_view, T*)> parse,
                 std::function<std::string(const T&)> format);

  TunableInfo Snapshot(const Tunable& t) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Tunable, std::less<>> tunables_ ABSL_GUARDED_BY(mu_);
  bool frozen_ ABSL_GUARDED_BY(mu_) = false;
};

template <typename T>
void ConfigRegistry::SetHook(const std::string& name, Hook<T> hook) {
  absl::MutexLock lock(&mu_);
  auto it = tunables_.find(name);
  // Hooks are wired by code at start-up: a wrong name or type is a bug.
  if (it == tunables_.end() || *it->second.hook_type != typeid(T)) {
    std::fprintf(stderr, "ConfigRegistry::SetHook: no %s tunable '%s'\n", typeid(T).name(),
                 name.c_str());
    std::abort();
  }
  *std::static_pointer_cast<Hook<T>>(it->second.hook) = std::move(hook);
}

// Parses "4096", "64K", "512MiB", "8GiB", "1.5G" (binary multiples).
absl::StatusOr<int64_t> ParseByteSize(absl::string_view text);
// Formats bytes as the shortest exact binary-suffixed form ("8GiB", "4097").
std::string FormatByteSize(int64_t bytes);

}  // namespace offload

#endif  // OFFLOADD_ENGINE_CONFIG_H_
