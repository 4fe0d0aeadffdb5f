#include "namm/tasks/python_text.h"

#include <unicode/uchar.h>
#include <unicode/ucasemap.h>
#include <unicode/ustring.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>

#include "namm/utf8.h"

namespace namm::tasks {

namespace {

// Applies an ICU full case mapping (root locale) to UTF-8 text.
std::string CaseMap(const std::string& utf8, bool lower) {
  UErrorCode error = U_ZERO_ERROR;
  std::unique_ptr<UCaseMap, decltype(&ucasemap_close)> map(ucasemap_open("", 0, &error), ucasemap_close);
  if (U_FAILURE(error)) return utf8;
  std::string out(utf8.size() * 3 + 16, '\0');
  for (int attempt = 0; attempt < 2; ++attempt) {
    error = U_ZERO_ERROR;
    const int32_t n = lower ? ucasemap_utf8ToLower(map.get(), out.data(), static_cast<int32_t>(out.size()),
                                                   utf8.data(), static_cast<int32_t>(utf8.size()), &error)
                            : ucasemap_utf8ToUpper(map.get(), out.data(), static_cast<int32_t>(out.size()),
                                                   utf8.data(), static_cast<int32_t>(utf8.size()), &error);
    if (error == U_BUFFER_OVERFLOW_ERROR) {
      out.assign(static_cast<std::size_t>(n) + 1, '\0');
      continue;
    }
    if (U_FAILURE(error)) return utf8;
    out.resize(static_cast<std::size_t>(n));
    return out;
  }
  return utf8;
}


// The ASCII form of a number as Python's int()/float() read it: whitespace stripped, decimal digits of any
// script mapped to '0'-'9', underscores dropped where they sit singly between two digits. Any other non-ASCII
// character, or a misplaced underscore, makes the text unreadable (nullopt).
std::optional<std::string> AsciiNumber(const std::string& text) {
  const std::u32string s = py_strip(to_u32(text));
  auto digit = [](char32_t c) { return u_charType(static_cast<UChar32>(c)) == U_DECIMAL_DIGIT_NUMBER; };
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char32_t c = s[i];
    if (c == '_') {
      if (i == 0 || i + 1 == s.size() || !digit(s[i - 1]) || !digit(s[i + 1])) return std::nullopt;
    } else if (digit(c)) {
      out += static_cast<char>('0' + u_charDigitValue(static_cast<UChar32>(c)));
    } else if (c < 0x80) {
      out += static_cast<char>(c);
    } else {
      return std::nullopt;
    }
  }
  return out;
}

bool AllDigits(const std::string& s, std::size_t begin, std::size_t end) {
  if (begin >= end) return false;
  for (std::size_t i = begin; i < end; ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
  }
  return true;
}

// Python's float() grammar after AsciiNumber: [sign] (digits [. [digits]] | . digits) [(e|E) [sign] digits],
// or [sign] inf / infinity / nan in any case. strtod alone would also take hex and "nan(...)".
bool IsPythonFloatLiteral(const std::string& s) {
  std::size_t i = (!s.empty() && (s[0] == '+' || s[0] == '-')) ? 1 : 0;
  std::string word = s.substr(i);
  std::transform(word.begin(), word.end(), word.begin(), [](char c) { return static_cast<char>(std::tolower(c)); });
  if (word == "inf" || word == "infinity" || word == "nan") return true;
  const std::size_t exponent = s.find_first_of("eE", i);
  const std::size_t mantissa_end = exponent == std::string::npos ? s.size() : exponent;
  const std::size_t dot = s.find('.', i);
  bool mantissa_ok;
  if (dot == std::string::npos || dot >= mantissa_end) {
    mantissa_ok = AllDigits(s, i, mantissa_end);
  } else {
    const bool whole = AllDigits(s, i, dot), fraction = AllDigits(s, dot + 1, mantissa_end);
    mantissa_ok = (whole || dot == i) && (fraction || dot + 1 == mantissa_end) && (whole || fraction);
  }
  if (!mantissa_ok) return false;
  if (exponent == std::string::npos) return true;
  std::size_t e = exponent + 1;
  if (e < s.size() && (s[e] == '+' || s[e] == '-')) ++e;
  return AllDigits(s, e, s.size());
}

// repr() of a str: quotes and escapes as CPython chooses them (printable characters stay as they are).
std::string PyReprString(const std::u32string& text) {
  const bool has_single = text.find(U'\'') != std::u32string::npos;
  const bool has_double = text.find(U'"') != std::u32string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : text) {
    const int8_t type = u_charType(static_cast<UChar32>(c));
    const bool printable = c == ' ' || !(type == U_CONTROL_CHAR || type == U_FORMAT_CHAR || type == U_SURROGATE ||
                                          type == U_PRIVATE_USE_CHAR || type == U_UNASSIGNED ||
                                          type == U_LINE_SEPARATOR || type == U_PARAGRAPH_SEPARATOR ||
                                          type == U_SPACE_SEPARATOR);
    char escape[16];
    if (c == '\\' || c == static_cast<char32_t>(quote)) {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (printable) {
      out += to_utf8(c);
    } else {
      const char* form = c < 0x100 ? "\\x%02x" : c < 0x10000 ? "\\u%04x" : "\\U%08x";
      std::snprintf(escape, sizeof escape, form, static_cast<unsigned>(c));
      out += escape;
    }
  }
  return out + quote;
}

std::string PyRepr(const nlohmann::json& value) {
  return value.is_string() ? PyReprString(to_u32(value.get<std::string>())) : py_str(value);
}

}  // namespace

std::u32string to_u32(const std::string& s) {
  std::u32string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const int n = utf8_sequence_length(s, i);
    if (n < 0) {
      out.push_back(0xFFFD);
      i += static_cast<std::size_t>(-n);
      continue;
    }
    const auto b = [&](std::size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(s[i + k])); };
    char32_t c = 0;
    switch (n) {
      case 1: c = b(0); break;
      case 2: c = ((b(0) & 0x1F) << 6) | (b(1) & 0x3F); break;
      case 3: c = ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F); break;
      default: c = ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F); break;
    }
    out.push_back(c);
    i += static_cast<std::size_t>(n);
  }
  return out;
}

std::string to_utf8(char32_t c) { return utf8_encode(static_cast<uint32_t>(c)); }

std::string to_utf8(const std::u32string& text) {
  std::string out;
  out.reserve(text.size());
  for (char32_t c : text) out += to_utf8(c);
  return out;
}

bool py_isspace(char32_t c) {
  switch (c) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x1C: case 0x1D: case 0x1E: case 0x1F:
    case 0x20: case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F:
    case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

std::vector<std::u32string> py_split(const std::u32string& text) {
  std::vector<std::u32string> words;
  std::u32string word;
  for (char32_t c : text) {
    if (py_isspace(c)) {
      if (!word.empty()) words.push_back(std::move(word));
      word.clear();
    } else {
      word.push_back(c);
    }
  }
  if (!word.empty()) words.push_back(std::move(word));
  return words;
}

std::string py_lower(const std::string& utf8) { return CaseMap(utf8, true); }
std::string py_upper(const std::string& utf8) { return CaseMap(utf8, false); }

bool is_ascii_punctuation(char32_t c) {
  return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) || (c >= 0x7B && c <= 0x7E);
}

bool is_unicode_punctuation(char32_t c) { return u_ispunct(static_cast<UChar32>(c)) != 0; }

std::u32string py_lstrip(const std::u32string& text, const std::u32string& chars) {
  std::size_t begin = 0;
  while (begin < text.size() && chars.find(text[begin]) != std::u32string::npos) ++begin;
  return text.substr(begin);
}

std::u32string py_strip(const std::u32string& text, const std::u32string& chars) {
  std::u32string s = py_lstrip(text, chars);
  std::size_t end = s.size();
  while (end > 0 && chars.find(s[end - 1]) != std::u32string::npos) --end;
  s.resize(end);
  return s;
}

std::u32string py_strip(const std::u32string& text) {
  std::size_t begin = 0, end = text.size();
  while (begin < end && py_isspace(text[begin])) ++begin;
  while (end > begin && py_isspace(text[end - 1])) --end;
  return text.substr(begin, end - begin);
}

std::optional<int64_t> py_int(const std::string& text) {
  const auto s = AsciiNumber(text);
  if (!s) return std::nullopt;
  const std::size_t digits = (!s->empty() && ((*s)[0] == '+' || (*s)[0] == '-')) ? 1 : 0;
  if (!AllDigits(*s, digits, s->size())) return std::nullopt;
  errno = 0;
  const long long value = std::strtoll(s->c_str(), nullptr, 10);
  if (errno == ERANGE) return std::nullopt;
  return static_cast<int64_t>(value);
}

std::optional<double> py_float(const std::string& text) {
  const auto s = AsciiNumber(text);
  if (!s || !IsPythonFloatLiteral(*s)) return std::nullopt;
  return std::strtod(s->c_str(), nullptr);  // overflow gives ±inf, as float("1e999") does
}

std::string py_str(const nlohmann::json& value) {
  switch (value.type()) {
    case nlohmann::json::value_t::string: return value.get<std::string>();
    case nlohmann::json::value_t::boolean: return value.get<bool>() ? "True" : "False";
    case nlohmann::json::value_t::null: return "None";
    case nlohmann::json::value_t::number_integer: return std::to_string(value.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: return std::to_string(value.get<uint64_t>());
    case nlohmann::json::value_t::number_float: return py_repr_float(value.get<double>());
    case nlohmann::json::value_t::array: {
      std::string out = "[";
      for (std::size_t i = 0; i < value.size(); ++i) out += (i ? ", " : "") + PyRepr(value[i]);
      return out + "]";
    }
    case nlohmann::json::value_t::object: {  // nlohmann keeps keys sorted; Python keeps file order
      std::string out = "{";
      bool first = true;
      for (auto it = value.begin(); it != value.end(); ++it, first = false) {
        out += (first ? "" : ", ") + PyReprString(to_u32(it.key())) + ": " + PyRepr(it.value());
      }
      return out + "}";
    }
    default: return value.dump();  // binary / discarded: not produced by the JSON parser
  }
}

Result<std::string> py_format(const std::string& format, const std::map<std::string, FormatValue>& fields) {
  std::string out;
  out.reserve(format.size());
  for (std::size_t i = 0; i < format.size(); ++i) {
    const char c = format[i];
    if (c == '}') {
      if (i + 1 < format.size() && format[i + 1] == '}') {
        out += '}';
        ++i;
        continue;
      }
      return Status::InvalidArgument("format string: single '}' at byte " + std::to_string(i));
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < format.size() && format[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    const auto close = format.find('}', i + 1);
    if (close == std::string::npos) {
      return Status::InvalidArgument("format string: unmatched '{' at byte " + std::to_string(i));
    }
    std::string field = format.substr(i + 1, close - i - 1);
    if (field.find_first_of(":!") != std::string::npos) {
      return Status::Unimplemented("format string: conversions and format specs in '{" + field + "}'");
    }
    int64_t index = -1;
    const auto bracket = field.find('[');
    if (bracket != std::string::npos) {
      if (field.back() != ']') return Status::InvalidArgument("format string: malformed field '{" + field + "}'");
      try {
        index = std::stoll(field.substr(bracket + 1, field.size() - bracket - 2));
      } catch (const std::exception&) {
        return Status::InvalidArgument("format string: malformed index in '{" + field + "}'");
      }
      field.resize(bracket);
    }
    auto it = fields.find(field);
    if (it == fields.end()) return Status::InvalidArgument("format string uses field '" + field + "', which the row lacks");
    if (index >= 0) {
      if (index >= static_cast<int64_t>(it->second.items.size())) {
        return Status::InvalidArgument("field '" + field + "' has no item " + std::to_string(index));
      }
      out += it->second.items[static_cast<std::size_t>(index)];
    } else {
      out += it->second.text;
    }
    i = close;
  }
  return out;
}

}  // namespace namm::tasks
