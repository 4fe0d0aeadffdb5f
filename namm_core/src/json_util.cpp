#include "namm/json_util.h"

#include <algorithm>

#include "namm/utf8.h"

namespace namm {

// Counts brackets outside strings, stopping as soon as the nesting passes `max_depth`. Exact for valid JSON; for
// invalid JSON the parser reports the error that matters.
bool json_nests_deeper_than(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;  // the escaped character cannot end the string
      if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

Result<nlohmann::json> parse_json_bounded(std::string_view text, std::string_view what, int max_depth) {
  if (json_nests_deeper_than(text, max_depth)) {
    return Status::Corruption(std::string(what) + ": JSON nests arrays and objects more than " +
                              std::to_string(max_depth) + " levels deep");
  }
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range (a number beyond double)
    return Status::Corruption(std::string(what) + ": not valid JSON: " + e.what());
  }
}

std::string json_summary(const nlohmann::json& value, std::size_t max_chars) {
  if (value.is_array()) return "an array of " + std::to_string(value.size()) + " items";
  if (value.is_object()) {
    if (value.empty()) return "an empty object";
    std::string keys;
    for (auto it = value.begin(); it != value.end() && keys.size() < max_chars; ++it) {
      keys += (keys.empty() ? "" : ", ") + utf8_prefix(it.key(), max_chars);
    }
    return "an object with keys " + keys + " (" + std::to_string(value.size()) + " keys)";
  }
  if (value.is_string() && value.get_ref<const std::string&>().size() > max_chars) {
    return nlohmann::json(utf8_prefix(value.get_ref<const std::string&>(), max_chars)).dump() + "...";
  }
  return value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace namm
