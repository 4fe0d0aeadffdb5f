// Reading JSON from outside bytes (tokenizer files, safetensors headers, task rows). nlohmann parses without
// recursion, but copying, comparing and dumping a value recurse once per nesting level, as do our own
// walkers: a file of a million '[' would overflow the stack there. parse_json_bounded refuses such nesting
// before any tree is built; json_summary describes a value in error messages without dumping all of it.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "namm/status.h"

namespace namm {

// Nesting every real file of ours stays far below (tokenizer.json: 5 levels; task rows: 3).
constexpr int kMaxJsonDepth = 64;

// Whether arrays and objects in `text` nest more than `max_depth` levels (read without building anything).
bool json_nests_deeper_than(std::string_view text, int max_depth = kMaxJsonDepth);

// `text` parsed, or Corruption "<what>: ..." when it is not valid JSON or nests arrays and objects more than
// `max_depth` levels deep (the message names the limit).
Result<nlohmann::json> parse_json_bounded(std::string_view text, std::string_view what,
                                          int max_depth = kMaxJsonDepth);

// At most about `max_chars` characters saying what `value` is: a scalar as JSON (a long string cut), an array
// as "an array of N items", an object as "an object with keys a, b, ... (N keys)".
std::string json_summary(const nlohmann::json& value, std::size_t max_chars = 200);

}  // namespace namm
