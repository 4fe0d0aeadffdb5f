#include "namm/option_spec.h"

#include <cerrno>
#include <cstdlib>

namespace namm {

Result<OptionSpec> parse_option_spec(const std::string& text) {
  OptionSpec spec;
  const auto colon = text.find(':');
  spec.name = text.substr(0, colon);
  if (spec.name.empty()) return Status::InvalidArgument("'" + text + "': missing a name before ':'");
  if (colon == std::string::npos) return spec;
  const std::string rest = text.substr(colon + 1);
  std::size_t start = 0;
  while (start <= rest.size()) {
    auto comma = rest.find(',', start);
    if (comma == std::string::npos) comma = rest.size();
    const std::string item = rest.substr(start, comma - start);
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
      return Status::InvalidArgument("'" + text + "': expected key=value, got '" + item + "'");
    }
    if (!spec.options.emplace(item.substr(0, eq), item.substr(eq + 1)).second) {
      return Status::InvalidArgument("'" + text + "': key '" + item.substr(0, eq) + "' given twice");
    }
    start = comma + 1;
  }
  return spec;
}

Result<int64_t> OptionSpec::GetInt(const std::string& key, int64_t default_value) const {
  auto it = options.find(key);
  if (it == options.end()) return default_value;
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(it->second.c_str(), &end, 10);
  if (errno != 0 || end == it->second.c_str() || *end != '\0') {
    return Status::InvalidArgument("'" + ToString() + "': " + key + " must be an integer, got '" + it->second + "'");
  }
  return static_cast<int64_t>(value);
}

Result<double> OptionSpec::GetDouble(const std::string& key, double default_value) const {
  auto it = options.find(key);
  if (it == options.end()) return default_value;
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(it->second.c_str(), &end);
  if (errno != 0 || end == it->second.c_str() || *end != '\0') {
    return Status::InvalidArgument("'" + ToString() + "': " + key + " must be a number, got '" + it->second + "'");
  }
  return value;
}

Status OptionSpec::CheckKeys(const std::vector<std::string>& allowed) const {
  for (const auto& [key, value] : options) {
    bool known = false;
    for (const auto& a : allowed) known = known || a == key;
    if (!known) {
      std::string list;
      for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
      return Status::InvalidArgument("'" + ToString() + "': unknown option '" + key + "' for " + name +
                                     (list.empty() ? " (it takes none)" : " (known: " + list + ")"));
    }
  }
  return Status::Ok();
}

std::string OptionSpec::ToString() const {
  std::string out = name;
  char sep = ':';
  for (const auto& [key, value] : options) {
    out += sep + key + "=" + value;
    sep = ',';
  }
  return out;
}

}  // namespace namm
