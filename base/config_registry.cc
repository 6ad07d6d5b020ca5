#include "base/config_registry.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace offload {
namespace {

absl::Status BadValue(absl::string_view name, absl::string_view text, absl::string_view want) {
  return absl::InvalidArgumentError(
      absl::StrCat("tunable ", name, " expects ", want, ", got '", text, "'"));
}

}  // namespace

absl::Status IntRange::Check(absl::string_view name, int64_t v) const {
  if (Contains(v)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(name, " must be in [", min, ", ", max, "], got ", v));
}

absl::StatusOr<int64_t> ParseByteSize(absl::string_view text) {
  std::string t(absl::StripAsciiWhitespace(text));
  size_t split = 0;
  while (split < t.size() && (absl::ascii_isdigit(t[split]) || t[split] == '.')) ++split;
  absl::string_view number(t.data(), split);
  std::string suffix = absl::AsciiStrToLower(absl::StripAsciiWhitespace(t.substr(split)));
  double multiplier = 1;
  if (suffix.empty() || suffix == "b") {
    multiplier = 1;
  } else if (suffix == "k" || suffix == "kb" || suffix == "kib") {
    multiplier = 1024.0;
  } else if (suffix == "m" || suffix == "mb" || suffix == "mib") {
    multiplier = 1024.0 * 1024;
  } else if (suffix == "g" || suffix == "gb" || suffix == "gib") {
    multiplier = 1024.0 * 1024 * 1024;
  } else if (suffix == "t" || suffix == "tb" || suffix == "tib") {
    multiplier = 1024.0 * 1024 * 1024 * 1024;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown size suffix in '", text, "'"));
  }
  if (!number.empty() && number.find('.') == absl::string_view::npos) {
    // Whole numbers exactly (a double holds 2^53 at most).
    uint64_t whole = 0, product = 0;
    if (!absl::SimpleAtoi(number, &whole) ||
        __builtin_mul_overflow(whole, static_cast<uint64_t>(multiplier), &product) ||
        product > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(
          absl::StrCat("byte size '", text, "' is not a whole number of bytes in range"));
    }
    return static_cast<int64_t>(product);
  }
  double value;
  if (number.empty() || !absl::SimpleAtod(number, &value)) {
    return absl::InvalidArgumentError(absl::StrCat("not a byte size: '", text, "'"));
  }
  double bytes = value * multiplier;
  if (bytes > 9.2e18 || bytes != std::floor(bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte size '", text, "' is not a whole number of bytes in range"));
  }
  return static_cast<int64_t>(bytes);
}

std::string FormatByteSize(int64_t bytes) {
  static const char* const kSuffixes[] = {"TiB", "GiB", "MiB", "KiB"};
  static const int kShifts[] = {40, 30, 20, 10};
  if (bytes > 0) {
    for (int i = 0; i < 4; ++i) {
      int64_t unit = int64_t{1} << kShifts[i];
      if (bytes % unit == 0) return absl::StrCat(bytes / unit, kSuffixes[i]);
    }
  }
  return absl::StrCat(bytes);
}

template <typename T>
void ConfigRegistry::BindTyped(std::string name, T* field, TunableSpec spec, const char* type,
                               std::function<absl::Status(absl::string_view, T*)> parse,
                               std::function<std::string(const T&)> format) {
  auto hook = std::make_shared<Hook<T>>();
  Tunable t;
  t.info.name = name;
  t.info.type = type;
  t.format = [field, format] { return format(*field); };
  // Called by Set() with mu_ held.
  t.set = [field, name, parse, hook](absl::string_view text, bool run_hook) -> absl::Status {
    T value;
    absl::Status parsed = parse(text, &value);
    if (!parsed.ok()) return parsed;
    if (run_hook && *hook) RETURN_IF_ERROR((*hook)(value));
    *field = std::move(value);
    return absl::OkStatus();
  };
  t.normalize = [parse, format](absl::string_view text) -> absl::StatusOr<std::string> {
    T value;
    RETURN_IF_ERROR(parse(text, &value));
    return format(value);
  };
  t.hook = hook;
  t.hook_type = &typeid(T);
  t.has_hook = [hook] { return static_cast<bool>(*hook); };
  t.spec = std::move(spec);
  t.info.default_value = t.format();
  absl::MutexLock lock(&mu_);
  tunables_[name] = std::move(t);
}

void ConfigRegistry::Bind(std::string name, int64_t* field, TunableSpec spec) {
  const bool bytes = spec.unit == "bytes";
  auto parse = [name, bytes, spec](absl::string_view text, int64_t* v) -> absl::Status {
    if (bytes && spec.range.min < 0 && absl::StartsWith(absl::StripAsciiWhitespace(text), "-")) {
      // A setting whose negative values mean something (-1: none set).
      if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), v)) {
        return BadValue(name, text, "a byte size such as 4096, 512MiB or 8GiB, or -1");
      }
    } else if (bytes) {
      auto parsed = ParseByteSize(text);
      if (!parsed.ok()) return BadValue(name, text, "a byte size such as 4096, 512MiB or 8GiB");
      *v = *parsed;
    } else if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), v)) {
      return BadValue(name, text, "an integer");
    }
    return spec.range.Check(absl::StrCat("tunable ", name), *v);
  };
  auto format = [bytes](const int64_t& v) { return bytes ? FormatByteSize(v) : absl::StrCat(v); };
  BindTyped<int64_t>(name, field, spec, "int", parse, format);
}

void ConfigRegistry::Bind(std::string name, bool* field, TunableSpec spec) {
  auto parse = [name](absl::string_view text, bool* v) -> absl::Status {
    if (!absl::SimpleAtob(absl::StripAsciiWhitespace(text), v)) {
      return BadValue(name, text, "true or false");
    }
    return absl::OkStatus();
  };
  auto format = [](const bool& v) { return std::string(v ? "true" : "false"); };
  BindTyped<bool>(name, field, spec, "bool", parse, format);
}

void ConfigRegistry::Bind(std::string name, std::string* field, TunableSpec spec) {
  auto parse = [name, choices = spec.choices](absl::string_view text,
                                              std::string* v) -> absl::Status {
    if (!choices.empty() && std::find(choices.begin(), choices.end(), text) == choices.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tunable ", name, " is one of ", absl::StrJoin(choices, ", "), "; got '", text, "'"));
    }
    *v = std::string(text);
    return absl::OkStatus();
  };
  auto format = [](const std::string& v) { return v; };
  BindTyped<std::string>(name, field, spec, "string", parse, format);
}

absl::Status ConfigRegistry::Freeze() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> unapplied, static_hooked;
  for (const auto& [name, t] : tunables_) {
    const bool hooked = t.has_hook();
    if (t.spec.dynamic && !hooked) unapplied.push_back(name);
    if (!t.spec.dynamic && hooked) static_hooked.push_back(name);
  }
  if (!unapplied.empty() || !static_hooked.empty()) {
    std::string why;
    if (!unapplied.empty()) {
      absl::StrAppend(&why, "dynamic tunables with nothing to apply them while running: ",
                      absl::StrJoin(unapplied, ", "));
    }
    if (!static_hooked.empty()) {
      absl::StrAppend(
          &why, why.empty() ? "" : "; ",
          "static tunables with a hook that would never run: ", absl::StrJoin(static_hooked, ", "));
    }
    return absl::InternalError(absl::StrCat("tunable registry wiring: ", why));
  }
  frozen_ = true;
  return absl::OkStatus();
}

TunableInfo ConfigRegistry::Snapshot(const Tunable& t) const {
  TunableInfo info = t.info;
  info.value = t.format();
  info.unit = t.spec.unit;
  info.dynamic = t.spec.dynamic;
  info.description = t.spec.description;
  return info;
}

absl::StatusOr<TunableInfo> ConfigRegistry::Set(absl::string_view name, absl::string_view value) {
  absl::MutexLock lock(&mu_);
  auto it = tunables_.find(name);
  if (it == tunables_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no tunable named '", name,
                     "' (offloadd --help, or offloadctl config list, shows them all)"));
  }
  if (frozen_ && !it->second.spec.dynamic) {
    return absl::FailedPreconditionError(
        absl::StrCat("tunable ", name,
                     " cannot change while offloadd runs; set it in the config file or "
                     "on the command line and restart"));
  }
  RETURN_IF_ERROR(it->second.set(value, /*run_hook=*/frozen_));
  return Snapshot(it->second);
}

absl::StatusOr<std::string> ConfigRegistry::Normalize(absl::string_view name,
                                                      absl::string_view value) const {
  absl::MutexLock lock(&mu_);
  auto it = tunables_.find(name);
  if (it == tunables_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no tunable named '", name,
                     "' (offloadd --help, or offloadctl config list, shows them all)"));
  }
  return it->second.normalize(value);
}

absl::StatusOr<TunableInfo> ConfigRegistry::Get(absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = tunables_.find(name);
  if (it == tunables_.end()) {
    return absl::NotFoundError(absl::StrCat("no tunable named '", name, "'"));
  }
  return Snapshot(it->second);
}

std::vector<TunableInfo> ConfigRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<TunableInfo> out;
  for (const auto& [name, t] : tunables_) out.push_back(Snapshot(t));
  return out;
}

}  // namespace offload
