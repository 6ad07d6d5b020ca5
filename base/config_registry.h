// The tunable registry: binds dotted names ("optimizer.threads") to fields of
// the components' Options structs, so a config file, command-line flags and
// the live config service all read and write those same fields.
//
// One definition per setting: each component's options header holds its
// fields (in-class defaults, units, trade-offs) and its ranges (IntRange
// constants its own validation uses too); its Bind*Tunables function binds
// them here with their name, unit, range and whether they are dynamic. Nothing
// is copied field by field into another struct.
//
// A tunable's default is its field's value at Bind() time. Dynamic tunables
// may change while the daemon runs: Set() runs the tunable's apply hook first
// (which pushes the value into the live component and may refuse it) and
// stores the value only if the hook succeeded. Static tunables can be set only
// before Freeze(), which refuses to freeze a registry where a dynamic tunable
// has no hook (nothing would apply it) or a static one has one.
//
// Thread-safety: all methods are safe from any thread. Hooks run under the
// registry's lock and must not call back into the registry (lock order: the
// registry's lock before any component lock a hook takes).
#ifndef OFFLOADD_BASE_CONFIG_REGISTRY_H_
#define OFFLOADD_BASE_CONFIG_REGISTRY_H_

#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace offload {

// An inclusive range of integers: the one definition of a setting's bounds,
// checked by the registry and by the component's own validation alike.
struct IntRange {
  int64_t min = INT64_MIN;
  int64_t max = INT64_MAX;

  bool Contains(int64_t v) const { return v >= min && v <= max; }
  // INVALID_ARGUMENT "<name> must be in [min, max], got <v>" unless inside.
  absl::Status Check(absl::string_view name, int64_t v) const;
};

struct TunableInfo {
  std::string name;
  std::string type;  // "int", "bool", "string"
  std::string value;
  std::string default_value;
  std::string unit;  // "bytes", "threads", ... or empty
  bool dynamic = false;
  std::string description;
};

struct TunableSpec {
  std::string unit;
  std::string description;
  // May change while offloadd runs (then it needs a hook: see Freeze).
  bool dynamic = false;
  // Bounds of an "int" tunable.
  IntRange range{};
  // The values a "string" tunable takes (empty: any).
  std::vector<std::string> choices{};
};

class ConfigRegistry {
 public:
  ConfigRegistry() = default;
  ConfigRegistry(const ConfigRegistry&) = delete;
  ConfigRegistry& operator=(const ConfigRegistry&) = delete;

  // `field` must outlive the registry. Integers with unit "bytes" also
  // accept suffixes: 512MiB, 8GiB, 1G, 64K.
  void Bind(std::string name, int64_t* field, TunableSpec spec);
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

  // Ends start-up: from now on hooks run, and setting a static tunable fails
  // with FAILED_PRECONDITION. INTERNAL, naming the tunables, if a dynamic
  // tunable has no hook or a static one has a hook (a wiring bug: refuse to
  // run rather than accept changes that apply to nothing); the registry stays
  // unfrozen then.
  absl::Status Freeze();

  // NOT_FOUND for an unknown name; INVALID_ARGUMENT for a value that does not
  // parse or is out of range; FAILED_PRECONDITION for a static tunable once
  // frozen. Returns the tunable as stored afterwards.
  absl::StatusOr<TunableInfo> Set(absl::string_view name, absl::string_view value);
  absl::StatusOr<TunableInfo> Get(absl::string_view name) const;
  // `value` as Get would show it once set ("8GiB" for "8192MiB"), checked
  // as Set checks it, changing nothing: NOT_FOUND or INVALID_ARGUMENT as Set.
  absl::StatusOr<std::string> Normalize(absl::string_view name, absl::string_view value) const;
  std::vector<TunableInfo> List() const;

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
    // Whether a non-empty hook was set.
    std::function<bool()> has_hook;
    // Parses and range-checks `text`; formats it as `format` would.
    std::function<absl::StatusOr<std::string>(absl::string_view text)> normalize;
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

#endif  // OFFLOADD_BASE_CONFIG_REGISTRY_H_
