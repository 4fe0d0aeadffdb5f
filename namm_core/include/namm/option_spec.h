// Compact "name:key=value,key=value" option strings used on command lines, e.g. "topk:budget=1024",
// "h2o:budget=512,recent=256", "ntk:factor=4,alpha=2".
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "namm/status.h"

namespace namm {

struct OptionSpec {
  std::string name;
  std::map<std::string, std::string> options;

  // The integer option `key` (default if absent); an error names the spec, the key and the bad value.
  Result<int64_t> GetInt(const std::string& key, int64_t default_value) const;
  Result<double> GetDouble(const std::string& key, double default_value) const;
  // Error unless every given key is in `allowed`.
  Status CheckKeys(const std::vector<std::string>& allowed) const;
  std::string ToString() const;
};

// Parses "name" or "name:key=value[,key=value...]"; names and keys are non-empty, keys unique.
Result<OptionSpec> parse_option_spec(const std::string& text);

}  // namespace namm
