// String operations with Python 3 semantics, as the reference's scorers use them: code-point strings,
// str.isspace / str.split() / str.lower() / str.upper(), string.punctuation, and str.format with named fields.
// Scores must be bit-compatible with the reference, so these follow Python rather than C++ locales.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "namm/python_repr.h"
#include "namm/status.h"

namespace namm::tasks {

// UTF-8 <-> code points. Invalid UTF-8 decodes to U+FFFD per maximal subpart (Python's errors="replace").
std::u32string to_u32(const std::string& utf8);
std::string to_utf8(const std::u32string& text);
std::string to_utf8(char32_t c);

// Python's str.isspace(): Unicode White_Space plus the separators \x1c-\x1f.
bool py_isspace(char32_t c);
// Python's str.split() without arguments: runs of whitespace separate words; no empty words.
std::vector<std::u32string> py_split(const std::u32string& text);
// Python's str.lower() / str.upper(): full Unicode case mapping (ICU root locale: multi-character mappings and
// the final-sigma rule, as CPython implements them).
std::string py_lower(const std::string& utf8);
std::string py_upper(const std::string& utf8);
// Python's string.punctuation: the 32 ASCII punctuation characters.
bool is_ascii_punctuation(char32_t c);
// Unicode general category P* (Python: unicodedata.category(c).startswith("P")), e.g. "。" and "，".
bool is_unicode_punctuation(char32_t c);

// Python's str.strip(chars) / lstrip(chars) on code points; py_strip(text) is str.strip() (py_isspace).
std::u32string py_strip(const std::u32string& text, const std::u32string& chars);
std::u32string py_lstrip(const std::u32string& text, const std::u32string& chars);
std::u32string py_strip(const std::u32string& text);

// Python's int(text) / float(text) for a str: surrounding whitespace, an optional sign, decimal digits of any
// script (Unicode Nd: int("٣") == 3), single underscores between digits; float() also takes a fraction, an
// exponent, "inf"/"infinity"/"nan" and overflows to inf. nullopt where Python raises ValueError, and for ints
// outside int64 (the scorers compare against int64 labels, which such a value can never equal).
std::optional<int64_t> py_int(const std::string& text);
std::optional<double> py_float(const std::string& text);

// Python's repr(float) (namm/python_repr.h).
using ::namm::py_repr_float;
// Python's str(value) of a JSON value as json.loads returns it: strings as they are, True/False/None, floats
// as repr(float), lists and dicts with repr() of their items (['a', 1]).
std::string py_str(const nlohmann::json& value);

// Python's `template.format(**fields)` for named fields: "{name}", "{name[0]}" (list items), "{{" and "}}".
// Values are the fields' string forms (JSON strings as they are, numbers as Python prints them, lists as
// str(list)). A field missing from `fields` is an error naming it, like Python's KeyError.
struct FormatValue {
  std::string text;                 // str(value)
  std::vector<std::string> items;   // for list values: str(item) of each item
};
Result<std::string> py_format(const std::string& format, const std::map<std::string, FormatValue>& fields);

}  // namespace namm::tasks
