// Hugging Face chat templates (see the header): a lexer for Jinja's text and tags, a recursive-descent parser
// to a small syntax tree, and an evaluator over a small Python-like Value. Behaviour follows Jinja2 as
// transformers configures it, and Python for the operators and methods that templates use.
#include "namm/worker/chat_template.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <unordered_map>

#include "namm/file_util.h"
#include "namm/json_util.h"
#include "namm/python_repr.h"
#include "namm/utf8.h"
#include "utf8.h"

namespace namm::worker {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

// Limits against pathological templates and inputs; real chat templates stay far below each.
constexpr int kMaxNesting = 100;                      // syntax tree depth, parser recursion, value nesting
constexpr size_t kMaxStringBytes = size_t{64} << 20;  // the output, and any one string a template builds
constexpr size_t kMaxItems = size_t{1} << 20;         // items of one list; loop iterations of one render
constexpr uint64_t kMaxWork = uint64_t{1} << 30;      // total cost of the values computed: bounds render time
// A value's expanded size (see Value::expanded): what printing or comparing it walks. Bounded like the
// output, since lists share their items and {% set a = [a, a] %} doubles it with each step.
constexpr uint64_t kMaxExpanded = kMaxStringBytes;

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

size_t LineOf(const std::string& src, size_t pos) {
  return 1 + static_cast<size_t>(std::count(src.begin(), src.begin() + std::min(pos, src.size()), '\n'));
}

// "chat template line 3, column 7": where offset `pos` of the (normalized) source is.
std::string Where(const std::string& src, size_t pos) {
  pos = std::min(pos, src.size());
  const size_t newline = pos == 0 ? std::string::npos : src.rfind('\n', pos - 1);
  const size_t column = pos - (newline == std::string::npos ? 0 : newline + 1) + 1;
  return "chat template line " + std::to_string(LineOf(src, pos)) + ", column " + std::to_string(column);
}

// The first `needle` in `s` at or after `from`, or npos. glibc's memmem takes time linear in |s| + |needle|,
// where std::string::find can take |s| x |needle| (a long run of 'a' searched for "aa...ab").
size_t FindFrom(const std::string& s, const std::string& needle, size_t from) {
  if (from > s.size()) return std::string::npos;
  const void* found = memmem(s.data() + from, s.size() - from, needle.data(), needle.size());
  if (found == nullptr) return std::string::npos;
  return static_cast<size_t>(static_cast<const char*>(found) - s.data());
}

uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  uint64_t sum = 0;
  return __builtin_add_overflow(a, b, &sum) ? UINT64_MAX : sum;
}

// Where each character (code point, in UTF-8) of `s` starts, then s.size(): Python indexes, slices and counts
// strings by characters.
std::vector<size_t> CharStarts(const std::string& s) {
  std::vector<size_t> starts;
  for (size_t k = 0; k < s.size(); ++k) {
    if (k == 0 || (static_cast<unsigned char>(s[k]) & 0xC0) != 0x80) starts.push_back(k);
  }
  starts.push_back(s.size());
  return starts;
}

std::string CharAt(const std::string& s, const std::vector<size_t>& starts, size_t k) {
  return s.substr(starts[k], starts[k + 1] - starts[k]);
}

// ---- Values -----------------------------------------------------------------------------------------------

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // in insertion order, as Python's dicts iterate

// A Python value as a template sees it. Lists and dicts are shared and never changed once made; a namespace
// is shared and changed by `set ns.attr = ...`, which is how a loop body updates state outside the loop.
struct Value {
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kNamespace, kCallable };
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                     // kString; kCallable: its name; kUndefined: the name looked up
  std::shared_ptr<const List> list;  // kList
  std::shared_ptr<Dict> dict;        // kDict, kNamespace
  int depth = 0;                     // container nesting, bounded so that recursion over values is too
  // kList, kDict: the items and string bytes it has written out, a shared item counted each time it appears
  // (saturating). Printing, comparing or searching it walks that much, which can be exponentially more than
  // its memory; see Expanded().
  uint64_t expanded = 1;
};
using K = Value::Kind;

// What walking `v` in full (repr, ==, in, tojson) visits: one per value, plus string and key bytes.
uint64_t Expanded(const Value& v) {
  switch (v.kind) {
    case K::kList:
    case K::kDict: return v.expanded;
    case K::kNamespace: {  // changed in place by `set ns.attr`, so summed when asked (it holds no namespace)
      uint64_t size = 1;
      for (const auto& [key, item] : *v.dict) size = SaturatingAdd(size, key.size() + Expanded(item));
      return size;
    }
    default: return 1 + v.s.size();
  }
}

Value MakeScalar(K kind, bool b, int64_t i, double f, std::string s) {
  Value v;
  v.kind = kind;
  v.b = b;
  v.i = i;
  v.f = f;
  v.s = std::move(s);
  return v;
}
Value MakeUndefined(std::string name = {}) { return MakeScalar(K::kUndefined, false, 0, 0, std::move(name)); }
Value MakeNone() { return MakeScalar(K::kNone, false, 0, 0, {}); }
Value MakeBool(bool b) { return MakeScalar(K::kBool, b, 0, 0, {}); }
Value MakeInt(int64_t i) { return MakeScalar(K::kInt, false, i, 0, {}); }
Value MakeFloat(double f) { return MakeScalar(K::kFloat, false, 0, f, {}); }
Value MakeString(std::string s) { return MakeScalar(K::kString, false, 0, 0, std::move(s)); }
Value MakeCallable(std::string name) { return MakeScalar(K::kCallable, false, 0, 0, std::move(name)); }
Value MakeList(List items) {
  Value v;
  v.kind = K::kList;
  v.depth = 1;
  for (const Value& item : items) {
    v.depth = std::max(v.depth, item.depth + 1);
    v.expanded = SaturatingAdd(v.expanded, Expanded(item));
  }
  v.list = std::make_shared<const List>(std::move(items));
  return v;
}
Value MakeDict(Dict entries, K kind = K::kDict) {
  Value v;
  v.kind = kind;
  v.depth = 1;
  for (const auto& [key, item] : entries) {
    v.depth = std::max(v.depth, item.depth + 1);
    v.expanded = SaturatingAdd(v.expanded, SaturatingAdd(key.size(), Expanded(item)));
  }
  v.dict = std::make_shared<Dict>(std::move(entries));
  return v;
}

std::string TypeName(const Value& v) {
  switch (v.kind) {
    case K::kUndefined: return "undefined";
    case K::kNone: return "NoneType";
    case K::kBool: return "bool";
    case K::kInt: return "int";
    case K::kFloat: return "float";
    case K::kString: return "str";
    case K::kList: return "list";
    case K::kDict: return "dict";
    case K::kNamespace: return "Namespace";
    case K::kCallable: return "function";
  }
  return "?";
}

bool IsNumber(const Value& v) { return v.kind == K::kBool || v.kind == K::kInt || v.kind == K::kFloat; }
bool IsInteger(const Value& v) { return v.kind == K::kBool || v.kind == K::kInt; }  // as in Python
int64_t AsInt(const Value& v) { return v.kind == K::kBool ? int64_t{v.b} : v.i; }
double AsDouble(const Value& v) { return v.kind == K::kFloat ? v.f : static_cast<double>(AsInt(v)); }

bool Truthy(const Value& v) {
  switch (v.kind) {
    case K::kUndefined:
    case K::kNone: return false;
    case K::kBool: return v.b;
    case K::kInt: return v.i != 0;
    case K::kFloat: return v.f != 0;
    case K::kString: return !v.s.empty();
    case K::kList: return !v.list->empty();
    case K::kDict: return !v.dict->empty();
    default: return true;
  }
}

const Value* Find(const Dict& dict, const std::string& key) {
  for (const auto& [k, v] : dict) {
    if (k == key) return &v;
  }
  return nullptr;
}

void SetKey(Dict& dict, const std::string& key, Value value) {
  for (auto& entry : dict) {
    if (entry.first == key) {
      entry.second = std::move(value);
      return;
    }
  }
  dict.emplace_back(key, std::move(value));
}

Status TooLong() { return Status::InvalidArgument("the template built a string longer than 64 MiB"); }
Status TooMany() { return Status::InvalidArgument("the template built a list of more than 1048576 items"); }

Result<Value> StringValue(std::string s) {
  if (s.size() > kMaxStringBytes) return TooLong();
  return MakeString(std::move(s));
}

// Python's repr() of a str.
std::string QuoteRepr(const std::string& s) {
  const char quote = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, quote);
  for (const char c : s) {
    if (c == quote || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + quote;
}

std::string Repr(const Value& v);

// Python's str(): what {{ value }} prints.
std::string ToStr(const Value& v) {
  switch (v.kind) {
    case K::kUndefined: return "";
    case K::kNone: return "None";
    case K::kBool: return v.b ? "True" : "False";
    case K::kInt: return std::to_string(v.i);
    case K::kFloat: return py_repr_float(v.f);
    case K::kString: return v.s;
    default: return Repr(v);
  }
}

// Python's repr(), which str() uses for the items of lists and dicts.
std::string Repr(const Value& v) {
  switch (v.kind) {
    case K::kString: return QuoteRepr(v.s);
    case K::kList: {
      std::string out = "[";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k > 0 ? ", " : "") + Repr((*v.list)[k]);
      return out + "]";
    }
    case K::kDict:
    case K::kNamespace: {
      std::string out = "{";
      for (size_t k = 0; k < v.dict->size(); ++k) {
        out += (k > 0 ? ", " : "") + QuoteRepr((*v.dict)[k].first) + ": " + Repr((*v.dict)[k].second);
      }
      return v.kind == K::kDict ? out + "}" : "<Namespace " + out + "}>";
    }
    case K::kCallable: return "<function " + v.s + ">";
    case K::kUndefined: return "Undefined";
    default: return ToStr(v);
  }
}

void JsonQuote(const std::string& s, std::string& out) {
  out += '"';
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

// transformers' tojson: Python's json.dumps(v, ensure_ascii=False, indent=indent) (indent < 0: none, so
// ", " and ": " separators on one line).
Status ToJson(const Value& v, int indent, int level, std::string& out) {
  if (out.size() > kMaxStringBytes) return TooLong();
  switch (v.kind) {
    case K::kNone: out += "null"; return Status::Ok();
    case K::kBool: out += v.b ? "true" : "false"; return Status::Ok();
    case K::kInt: out += std::to_string(v.i); return Status::Ok();
    case K::kFloat:
      out += std::isnan(v.f) ? "NaN" : !std::isinf(v.f) ? py_repr_float(v.f) : v.f > 0 ? "Infinity" : "-Infinity";
      return Status::Ok();
    case K::kString: JsonQuote(v.s, out); return Status::Ok();
    case K::kList:
    case K::kDict: {
      const bool is_list = v.kind == K::kList;
      const size_t n = is_list ? v.list->size() : v.dict->size();
      out += is_list ? '[' : '{';
      for (size_t k = 0; k < n; ++k) {
        if (k > 0) out += indent < 0 ? ", " : ",";
        if (indent >= 0) out += "\n" + std::string(static_cast<size_t>(indent * (level + 1)), ' ');
        if (!is_list) {
          JsonQuote((*v.dict)[k].first, out);
          out += ": ";
        }
        NAMM_RETURN_IF_ERROR(ToJson(is_list ? (*v.list)[k] : (*v.dict)[k].second, indent, level + 1, out));
      }
      if (indent >= 0 && n > 0) out += "\n" + std::string(static_cast<size_t>(indent * level), ' ');
      out += is_list ? ']' : '}';
      return Status::Ok();
    }
    default: return Status::InvalidArgument("Object of type " + TypeName(v) + " is not JSON serializable");
  }
}

Result<Value> FromJson(const OrderedJson& j, int depth) {
  if (depth > kMaxNesting) return Status::InvalidArgument("chat template variables nest too deeply");
  switch (j.type()) {
    case OrderedJson::value_t::null: return MakeNone();
    case OrderedJson::value_t::boolean: return MakeBool(j.get<bool>());
    case OrderedJson::value_t::number_integer: return MakeInt(j.get<int64_t>());
    case OrderedJson::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      return u <= uint64_t{INT64_MAX} ? MakeInt(static_cast<int64_t>(u)) : MakeFloat(static_cast<double>(u));
    }
    case OrderedJson::value_t::number_float: return MakeFloat(j.get<double>());
    case OrderedJson::value_t::string: return MakeString(j.get<std::string>());
    case OrderedJson::value_t::array: {
      List items;
      for (const OrderedJson& item : j) {
        NAMM_ASSIGN_OR_RETURN(Value v, FromJson(item, depth + 1));
        items.push_back(std::move(v));
      }
      return MakeList(std::move(items));
    }
    case OrderedJson::value_t::object: {
      Dict entries;
      for (auto it = j.begin(); it != j.end(); ++it) {
        NAMM_ASSIGN_OR_RETURN(Value v, FromJson(it.value(), depth + 1));
        entries.emplace_back(it.key(), std::move(v));
      }
      return MakeDict(std::move(entries));
    }
    default: return Status::InvalidArgument("chat template variables: binary JSON values are not supported");
  }
}

// ---- Operations (errors carry no position; the evaluator adds it) -----------------------------------------

bool Equal(const Value& a, const Value& b) {
  if (IsNumber(a) && IsNumber(b)) {
    return IsInteger(a) && IsInteger(b) ? AsInt(a) == AsInt(b) : AsDouble(a) == AsDouble(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case K::kString: return a.s == b.s;
    // A shared list or dict equals itself without a walk, as in Python (which compares items by identity
    // first).
    case K::kList:
      return a.list == b.list ||
             std::equal(a.list->begin(), a.list->end(), b.list->begin(), b.list->end(), Equal);
    case K::kDict:
      return a.dict == b.dict || (a.dict->size() == b.dict->size() &&
                                  std::all_of(a.dict->begin(), a.dict->end(), [&](const auto& entry) {
                                    const Value* other = Find(*b.dict, entry.first);
                                    return other != nullptr && Equal(entry.second, *other);
                                  }));
    case K::kNamespace: return a.dict == b.dict;
    case K::kCallable: return a.s == b.s;
    default: return true;  // undefined == undefined, None == None
  }
}

Result<bool> Contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case K::kString:
      if (item.kind != K::kString) {
        return Status::InvalidArgument("'in <string>' needs a string as left operand, not " + TypeName(item));
      }
      return FindFrom(container.s, item.s, 0) != std::string::npos;
    case K::kList:
      return std::any_of(container.list->begin(), container.list->end(),
                         [&](const Value& v) { return Equal(v, item); });
    case K::kDict: return item.kind == K::kString && Find(*container.dict, item.s) != nullptr;
    case K::kUndefined: return false;
    default: return Status::InvalidArgument("argument of type '" + TypeName(container) + "' is not iterable");
  }
}

Result<bool> Compare(const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return Equal(a, b);
  if (op == "!=") return !Equal(a, b);
  if (op == "in" || op == "not in") {
    NAMM_ASSIGN_OR_RETURN(const bool found, Contains(b, a));
    return found == (op == "in");
  }
  int order = 0;
  if (IsInteger(a) && IsInteger(b)) {
    order = AsInt(a) < AsInt(b) ? -1 : AsInt(a) > AsInt(b);
  } else if (IsNumber(a) && IsNumber(b)) {
    if (std::isnan(AsDouble(a)) || std::isnan(AsDouble(b))) return false;
    order = AsDouble(a) < AsDouble(b) ? -1 : AsDouble(a) > AsDouble(b);
  } else if (a.kind == K::kString && b.kind == K::kString) {
    order = a.s.compare(b.s);  // UTF-8 byte order is code point order, as Python compares
  } else {
    return Status::InvalidArgument("'" + op + "' is not supported between '" + TypeName(a) + "' and '" +
                                   TypeName(b) + "'");
  }
  return op == "<" ? order < 0 : op == "<=" ? order <= 0 : op == ">" ? order > 0 : order >= 0;
}

// Python's + - * / // % on numbers (integers stay exact; overflow is an error), + on strings and lists, and
// string repetition; Jinja's ~ concatenates the operands' str().
Result<Value> Arithmetic(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") return StringValue(ToStr(a) + ToStr(b));
  if (op == "+" && a.kind == K::kString && b.kind == K::kString) return StringValue(a.s + b.s);
  if (op == "+" && a.kind == K::kList && b.kind == K::kList) {
    if (a.list->size() + b.list->size() > kMaxItems) return TooMany();
    List items = *a.list;
    items.insert(items.end(), b.list->begin(), b.list->end());
    return MakeList(std::move(items));
  }
  if (op == "*" && (a.kind == K::kString ? IsInteger(b) : b.kind == K::kString && IsInteger(a))) {
    const std::string& s = a.kind == K::kString ? a.s : b.s;
    const int64_t times = AsInt(a.kind == K::kString ? b : a);
    if (s.empty() || times <= 0) return MakeString("");
    if (static_cast<uint64_t>(times) > kMaxStringBytes / s.size()) return TooLong();
    std::string out;
    out.reserve(s.size() * static_cast<size_t>(times));
    for (int64_t k = 0; k < times; ++k) out += s;
    return MakeString(std::move(out));
  }
  if (!IsNumber(a) || !IsNumber(b)) {
    for (const Value* v : {&a, &b}) {
      if (v->kind == K::kUndefined && !v->s.empty()) {
        return Status::InvalidArgument("'" + v->s + "' is undefined");
      }
    }
    return Status::InvalidArgument("unsupported operand types for " + op + ": '" + TypeName(a) + "' and '" +
                                   TypeName(b) + "'");
  }
  const Status division_by_zero = Status::InvalidArgument("division by zero");
  if (op == "/") {
    if (AsDouble(b) == 0) return division_by_zero;
    return MakeFloat(AsDouble(a) / AsDouble(b));
  }
  if (IsInteger(a) && IsInteger(b)) {
    const int64_t x = AsInt(a), y = AsInt(b);
    int64_t r = 0;
    bool overflow = false;
    if (op == "+") {
      overflow = __builtin_add_overflow(x, y, &r);
    } else if (op == "-") {
      overflow = __builtin_sub_overflow(x, y, &r);
    } else if (op == "*") {
      overflow = __builtin_mul_overflow(x, y, &r);
    } else if (y == 0) {
      return division_by_zero;
    } else if (y == -1) {  // x / -1 can overflow; x % -1 is 0
      overflow = op == "//" && __builtin_sub_overflow(int64_t{0}, x, &r);
    } else {  // Python rounds // towards negative infinity, and % takes the divisor's sign
      int64_t q = x / y, m = x % y;
      if (m != 0 && (m < 0) != (y < 0)) {
        --q;
        m += y;
      }
      r = op == "//" ? q : m;
    }
    if (overflow) return Status::InvalidArgument("integer overflow in " + op);
    return MakeInt(r);
  }
  const double x = AsDouble(a), y = AsDouble(b);
  if (op == "+") return MakeFloat(x + y);
  if (op == "-") return MakeFloat(x - y);
  if (op == "*") return MakeFloat(x * y);
  if (y == 0) return division_by_zero;
  if (op == "//") return MakeFloat(std::floor(x / y));
  double m = std::fmod(x, y);
  if (m != 0 && (m < 0) != (y < 0)) m += y;
  return MakeFloat(m);
}

Result<Value> Negate(const std::string& op, const Value& v) {
  if (!IsNumber(v)) {
    return Status::InvalidArgument("bad operand type for unary " + op + ": '" + TypeName(v) + "'");
  }
  if (v.kind == K::kFloat) return MakeFloat(op == "-" ? -v.f : v.f);
  if (op == "+") return MakeInt(AsInt(v));
  if (AsInt(v) == INT64_MIN) return Status::InvalidArgument("integer overflow in unary -");
  return MakeInt(-AsInt(v));
}

// The items a for loop visits: a list's items, a dict's keys, a string's characters; none for undefined.
Result<List> Iterate(const Value& v) {
  List items;
  switch (v.kind) {
    case K::kList: return *v.list;
    case K::kDict:
      for (const auto& entry : *v.dict) items.push_back(MakeString(entry.first));
      return items;
    case K::kString: {
      const std::vector<size_t> starts = CharStarts(v.s);
      if (starts.size() - 1 > kMaxItems) return TooMany();
      for (size_t k = 0; k + 1 < starts.size(); ++k) items.push_back(MakeString(CharAt(v.s, starts, k)));
      return items;
    }
    case K::kUndefined: return items;
    default: return Status::InvalidArgument("'" + TypeName(v) + "' object is not iterable");
  }
}

Result<Value> Length(const Value& v) {
  switch (v.kind) {
    case K::kString: return MakeInt(static_cast<int64_t>(CharStarts(v.s).size() - 1));
    case K::kList: return MakeInt(static_cast<int64_t>(v.list->size()));
    case K::kDict: return MakeInt(static_cast<int64_t>(v.dict->size()));
    case K::kUndefined: return MakeInt(0);
    default: return Status::InvalidArgument("object of type '" + TypeName(v) + "' has no len()");
  }
}

// How many of begin, begin + step, begin + 2 step, ... come before `end` (in the step's direction).
uint64_t StepCount(int64_t begin, int64_t end, int64_t step) {
  const bool up = step > 0;
  if (up ? begin >= end : begin <= end) return 0;
  const uint64_t span = up ? static_cast<uint64_t>(end) - static_cast<uint64_t>(begin)
                           : static_cast<uint64_t>(begin) - static_cast<uint64_t>(end);
  const uint64_t stride = up ? static_cast<uint64_t>(step) : 0 - static_cast<uint64_t>(step);
  return (span - 1) / stride + 1;
}

// The items [start:stop:step] picks from `size` items: count of them, the k-th at index At(k). Python's rules
// for omitted (none or undefined) and out-of-range bounds.
struct SliceRange {
  int64_t begin, step;
  uint64_t count;
  size_t At(uint64_t k) const { return static_cast<size_t>(begin + static_cast<int64_t>(k) * step); }
};

SliceRange SliceOf(size_t size, const Value& start, const Value& stop, int64_t step) {
  const int64_t n = static_cast<int64_t>(size);
  const auto bound = [&](const Value& v, int64_t omitted) {
    if (!IsInteger(v)) return omitted;
    const int64_t i = AsInt(v) < 0 ? AsInt(v) + n : AsInt(v);
    return step > 0 ? std::clamp<int64_t>(i, 0, n) : std::clamp<int64_t>(i, -1, n - 1);
  };
  const int64_t begin = bound(start, step > 0 ? 0 : n - 1);
  return {begin, step, StepCount(begin, bound(stop, step > 0 ? n : -1), step)};
}

Result<Value> Slice(const Value& v, const Value& start, const Value& stop, const Value& step) {
  for (const Value* bound : {&start, &stop, &step}) {
    if (bound->kind != K::kNone && bound->kind != K::kUndefined && !IsInteger(*bound)) {
      return Status::InvalidArgument("slice indices must be integers or none, not " + TypeName(*bound));
    }
  }
  const int64_t stride = IsInteger(step) ? AsInt(step) : 1;
  if (stride == 0) return Status::InvalidArgument("slice step cannot be zero");
  if (v.kind == K::kList) {
    const SliceRange range = SliceOf(v.list->size(), start, stop, stride);
    List items;
    for (uint64_t k = 0; k < range.count; ++k) items.push_back((*v.list)[range.At(k)]);
    return MakeList(std::move(items));
  }
  if (v.kind == K::kUndefined) return MakeUndefined();
  if (v.kind != K::kString) return Status::InvalidArgument("'" + TypeName(v) + "' object cannot be sliced");
  const std::vector<size_t> starts = CharStarts(v.s);
  const SliceRange range = SliceOf(starts.size() - 1, start, stop, stride);
  std::string out;
  for (uint64_t k = 0; k < range.count; ++k) out += CharAt(v.s, starts, range.At(k));
  return MakeString(std::move(out));
}

// a.name, and a['name'] / a[index]: missing keys and out-of-range indexes are undefined, as in Jinja.
Value GetAttr(const Value& v, const std::string& name) {
  if (v.kind != K::kDict && v.kind != K::kNamespace) return MakeUndefined(name);
  const Value* found = Find(*v.dict, name);
  return found != nullptr ? *found : MakeUndefined(name);
}

Value GetItem(const Value& v, const Value& key) {
  if (key.kind == K::kString) return GetAttr(v, key.s);
  if (!IsInteger(key) || (v.kind != K::kList && v.kind != K::kString)) return MakeUndefined();
  const std::vector<size_t> starts = v.kind == K::kString ? CharStarts(v.s) : std::vector<size_t>{};
  const int64_t n = static_cast<int64_t>(v.kind == K::kList ? v.list->size() : starts.size() - 1);
  const int64_t i = AsInt(key) < 0 ? AsInt(key) + n : AsInt(key);
  if (i < 0 || i >= n) return MakeUndefined();
  const size_t index = static_cast<size_t>(i);
  return v.kind == K::kList ? (*v.list)[index] : MakeString(CharAt(v.s, starts, index));
}

using Bound = std::vector<const Value*>;  // a call's arguments by parameter; null where not given

// Binds a call's arguments to parameters as Python does: positional ones in order, then keywords by name. The
// first `required` parameters must be given; extra or unknown arguments are errors.
Result<Bound> Bind(const std::string& fn, const List& args, const Dict& kwargs,
                   const std::vector<std::string_view>& params, size_t required = 0) {
  if (args.size() > params.size()) {
    return Status::InvalidArgument(fn + "() takes at most " + std::to_string(params.size()) +
                                   " argument(s) (" + std::to_string(args.size()) + " given)");
  }
  Bound bound(params.size(), nullptr);
  for (size_t k = 0; k < args.size(); ++k) bound[k] = &args[k];
  for (const auto& [key, value] : kwargs) {
    const auto it = std::find(params.begin(), params.end(), key);
    if (it == params.end()) {
      return Status::InvalidArgument(fn + "() got an unexpected keyword argument '" + key + "'");
    }
    const Value*& slot = bound[static_cast<size_t>(it - params.begin())];
    if (slot != nullptr) {
      return Status::InvalidArgument(fn + "() got multiple values for argument '" + key + "'");
    }
    slot = &value;
  }
  for (size_t k = 0; k < required; ++k) {
    if (bound[k] == nullptr) {
      return Status::InvalidArgument(fn + "() is missing its argument '" + std::string(params[k]) + "'");
    }
  }
  return bound;
}

// Python's str.strip/lstrip/rstrip: the characters of `chars`, or whitespace when it is absent or none.
Result<Value> Strip(const std::string& s, const Value* chars, bool left, bool right) {
  const bool whitespace = chars == nullptr || chars->kind == K::kNone || chars->kind == K::kUndefined;
  if (!whitespace && chars->kind != K::kString) {
    return Status::InvalidArgument("strip characters must be a string or none, not " + TypeName(*chars));
  }
  std::vector<std::string> set;
  if (!whitespace) {
    const std::vector<size_t> starts = CharStarts(chars->s);
    for (size_t k = 0; k + 1 < starts.size(); ++k) set.push_back(CharAt(chars->s, starts, k));
  }
  std::string_view rest(s);
  // The length of the strippable character at the front (or back) of `rest`, 0 if there is none.
  const auto strippable = [&](bool front) -> size_t {
    if (whitespace) return IsSpace(front ? rest.front() : rest.back()) ? 1 : 0;
    for (const std::string& c : set) {
      const bool match = rest.size() >= c.size() &&
                         (front ? rest.substr(0, c.size()) : rest.substr(rest.size() - c.size())) == c;
      if (match) return c.size();
    }
    return 0;
  };
  while (left && !rest.empty()) {
    const size_t n = strippable(true);
    if (n == 0) break;
    rest.remove_prefix(n);
  }
  while (right && !rest.empty()) {
    const size_t n = strippable(false);
    if (n == 0) break;
    rest.remove_suffix(n);
  }
  return MakeString(std::string(rest));
}

// Python's str.split(sep=None, maxsplit=-1).
Result<Value> Split(const std::string& s, const Value* sep, const Value* maxsplit) {
  if (maxsplit != nullptr && !IsInteger(*maxsplit)) {
    return Status::InvalidArgument("split(): maxsplit must be an integer");
  }
  const int64_t max = maxsplit != nullptr ? AsInt(*maxsplit) : -1;
  const auto room = [&](const List& parts) { return max < 0 || static_cast<int64_t>(parts.size()) < max; };
  List parts;
  if (sep == nullptr || sep->kind == K::kNone) {  // runs of whitespace, ignoring it at both ends
    size_t k = 0;
    while (true) {
      while (k < s.size() && IsSpace(s[k])) ++k;
      if (k == s.size()) break;
      if (!room(parts)) {
        parts.push_back(MakeString(s.substr(k)));
        break;
      }
      size_t end = k;
      while (end < s.size() && !IsSpace(s[end])) ++end;
      parts.push_back(MakeString(s.substr(k, end - k)));
      if (parts.size() > kMaxItems) return TooMany();
      k = end;
    }
    return MakeList(std::move(parts));
  }
  if (sep->kind != K::kString) return Status::InvalidArgument("split(): separator must be a string or none");
  if (sep->s.empty()) return Status::InvalidArgument("split(): empty separator");
  size_t k = 0;
  while (room(parts)) {
    const size_t found = FindFrom(s, sep->s, k);
    if (found == std::string::npos) break;
    parts.push_back(MakeString(s.substr(k, found - k)));
    if (parts.size() > kMaxItems) return TooMany();
    k = found + sep->s.size();
  }
  parts.push_back(MakeString(s.substr(k)));
  return MakeList(std::move(parts));
}

// Python's str.replace(old, new, count=-1); p holds old, new and count.
Result<Value> Replace(const std::string& s, const Bound& p) {
  if (p[0]->kind != K::kString || p[1]->kind != K::kString || (p[2] != nullptr && !IsInteger(*p[2]))) {
    return Status::InvalidArgument("replace() takes two strings and an optional integer count");
  }
  const std::string &from = p[0]->s, &to = p[1]->s;
  if (from.empty()) return Status::InvalidArgument("replace(): replacing the empty string is not supported");
  const int64_t count = p[2] != nullptr ? AsInt(*p[2]) : -1;
  std::string out;
  size_t k = 0;
  for (int64_t done = 0; count < 0 || done < count; ++done) {
    const size_t found = FindFrom(s, from, k);
    if (found == std::string::npos) break;
    out.append(s, k, found - k).append(to);
    if (out.size() > kMaxStringBytes) return TooLong();
    k = found + from.size();
  }
  return StringValue(out.append(s, k));
}

std::string CaseMap(std::string s, bool upper) {
  for (char& c : s) {
    if (upper && c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
    if (!upper && c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return s;
}

// obj.name(...): the methods templates call on strings and dicts.
Result<Value> CallMethod(const Value& obj, const std::string& name, const List& args, const Dict& kwargs) {
  const auto bind = [&](const std::vector<std::string_view>& params, size_t required) {
    return Bind(name, args, kwargs, params, required);
  };
  if (obj.kind == K::kString) {
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      NAMM_ASSIGN_OR_RETURN(const Bound p, bind({"chars"}, 0));
      return Strip(obj.s, p[0], name != "rstrip", name != "lstrip");
    }
    if (name == "startswith" || name == "endswith") {
      NAMM_ASSIGN_OR_RETURN(const Bound p, bind({"affix"}, 1));
      if (p[0]->kind != K::kString) {
        return Status::InvalidArgument(name + "() takes a string, not " + TypeName(*p[0]));
      }
      const std::string &s = obj.s, &affix = p[0]->s;
      const size_t at = name == "startswith" ? 0 : s.size() - affix.size();
      return MakeBool(s.size() >= affix.size() && s.compare(at, affix.size(), affix) == 0);
    }
    if (name == "split") {
      NAMM_ASSIGN_OR_RETURN(const Bound p, bind({"sep", "maxsplit"}, 0));
      return Split(obj.s, p[0], p[1]);
    }
    if (name == "replace") {
      NAMM_ASSIGN_OR_RETURN(const Bound p, bind({"old", "new", "count"}, 2));
      return Replace(obj.s, p);
    }
    if (name == "upper" || name == "lower") {
      NAMM_RETURN_IF_ERROR(bind({}, 0).status());
      return MakeString(CaseMap(obj.s, name == "upper"));
    }
  } else if (obj.kind == K::kDict) {
    if (name == "get") {
      NAMM_ASSIGN_OR_RETURN(const Bound p, bind({"key", "default"}, 1));
      const Value* found = p[0]->kind == K::kString ? Find(*obj.dict, p[0]->s) : nullptr;
      return found != nullptr ? *found : p[1] != nullptr ? *p[1] : MakeNone();
    }
    if (name == "items" || name == "keys" || name == "values") {
      NAMM_RETURN_IF_ERROR(bind({}, 0).status());
      List out;
      for (const auto& [key, value] : *obj.dict) {
        out.push_back(name == "keys"     ? MakeString(key)
                      : name == "values" ? value
                                         : MakeList({MakeString(key), value}));
      }
      return MakeList(std::move(out));
    }
  }
  return Status::InvalidArgument("'" + TypeName(obj) + "' object has no method '" + name + "'");
}

// Tests: `value is [not] name`, and for those that take_arg, `value is name arg` or `value is name(arg)`.
struct TestDef {
  std::string_view name;
  bool takes_arg;
  bool (*test)(const Value& v, const Value& arg);  // arg: undefined for tests without one
};

const TestDef kTests[] = {
    {"defined", false, [](const Value& v, const Value&) { return v.kind != K::kUndefined; }},
    {"undefined", false, [](const Value& v, const Value&) { return v.kind == K::kUndefined; }},
    {"none", false, [](const Value& v, const Value&) { return v.kind == K::kNone; }},
    {"true", false, [](const Value& v, const Value&) { return v.kind == K::kBool && v.b; }},
    {"false", false, [](const Value& v, const Value&) { return v.kind == K::kBool && !v.b; }},
    {"boolean", false, [](const Value& v, const Value&) { return v.kind == K::kBool; }},
    {"integer", false, [](const Value& v, const Value&) { return v.kind == K::kInt; }},
    {"float", false, [](const Value& v, const Value&) { return v.kind == K::kFloat; }},
    {"number", false, [](const Value& v, const Value&) { return IsNumber(v); }},
    {"string", false, [](const Value& v, const Value&) { return v.kind == K::kString; }},
    {"mapping", false, [](const Value& v, const Value&) { return v.kind == K::kDict; }},
    {"sequence", false,  // undefined too, as in Jinja
     [](const Value& v, const Value&) {
       return v.kind == K::kString || v.kind == K::kList || v.kind == K::kDict || v.kind == K::kUndefined;
     }},
    {"iterable", false,
     [](const Value& v, const Value&) {
       return v.kind == K::kString || v.kind == K::kList || v.kind == K::kDict || v.kind == K::kUndefined;
     }},
    {"equalto", true, [](const Value& v, const Value& arg) { return Equal(v, arg); }},
    {"eq", true, [](const Value& v, const Value& arg) { return Equal(v, arg); }},
    {"ne", true, [](const Value& v, const Value& arg) { return !Equal(v, arg); }},
};

const TestDef* FindTest(const std::string& name) {
  for (const TestDef& test : kTests) {
    if (test.name == name) return &test;
  }
  return nullptr;
}

// selectattr(attribute, test, arg) keeps (rejectattr drops) the items whose attribute passes the test (or,
// with no test, is true).
Result<Value> SelectAttr(const Value& v, const Bound& p, bool select) {
  if (!Truthy(v)) return MakeList({});  // as in Jinja: none, false, 0 select nothing
  NAMM_ASSIGN_OR_RETURN(const List items, Iterate(v));
  if (p[0]->kind != K::kString) return Status::InvalidArgument("selectattr(): the attribute must be a name");
  const TestDef* test = p[1] != nullptr && p[1]->kind == K::kString ? FindTest(p[1]->s) : nullptr;
  if (p[1] != nullptr && test == nullptr) {
    return Status::InvalidArgument("selectattr(): unknown test " + Repr(*p[1]));
  }
  if (test != nullptr && test->takes_arg != (p[2] != nullptr)) {
    return Status::InvalidArgument("selectattr(): test '" + std::string(test->name) + "' takes " +
                                   (test->takes_arg ? "one argument" : "no argument"));
  }
  List kept;
  for (const Value& item : items) {
    const Value attr = GetAttr(item, p[0]->s);
    if ((test != nullptr ? test->test(attr, p[2] != nullptr ? *p[2] : Value{}) : Truthy(attr)) == select) {
      kept.push_back(item);
    }
  }
  return MakeList(std::move(kept));
}

// Filters: `value | name(args)`. Parameters are optional unless among the first `required`.
struct FilterDef {
  std::string_view name;
  std::array<std::string_view, 3> params;  // "" past the last
  size_t required;
  Result<Value> (*apply)(const Value& v, const Bound& p);
  bool walks = true;  // reads all of the value (prints or compares it), not just its top level
};

Result<Value> LengthFilter(const Value& v, const Bound&) { return Length(v); }

Result<Value> DefaultFilter(const Value& v, const Bound& p) {  // default(default_value='', boolean=false)
  const bool replace = v.kind == K::kUndefined || (p[1] != nullptr && Truthy(*p[1]) && !Truthy(v));
  return !replace ? v : p[0] != nullptr ? *p[0] : MakeString("");
}

Result<Value> FirstOrLast(const Value& v, bool first) {
  NAMM_ASSIGN_OR_RETURN(const List items, Iterate(v));
  if (items.empty()) return MakeUndefined();
  return first ? items.front() : items.back();
}

const FilterDef kFilters[] = {
    {"trim", {"chars"}, 0, [](const Value& v, const Bound& p) { return Strip(ToStr(v), p[0], true, true); }},
    {"length", {}, 0, LengthFilter, false},
    {"count", {}, 0, LengthFilter, false},
    {"string", {}, 0, [](const Value& v, const Bound&) -> Result<Value> { return MakeString(ToStr(v)); }},
    {"upper", {}, 0, [](const Value& v, const Bound&) { return StringValue(CaseMap(ToStr(v), true)); }},
    {"lower", {}, 0, [](const Value& v, const Bound&) { return StringValue(CaseMap(ToStr(v), false)); }},
    {"first", {}, 0, [](const Value& v, const Bound&) { return FirstOrLast(v, true); }, false},
    {"last", {}, 0, [](const Value& v, const Bound&) { return FirstOrLast(v, false); }, false},
    {"default", {"default_value", "boolean"}, 0, DefaultFilter, false},
    {"d", {"default_value", "boolean"}, 0, DefaultFilter, false},
    {"safe", {}, 0, [](const Value& v, const Bound&) -> Result<Value> { return MakeString(ToStr(v)); }},
    {"list", {}, 0,
     [](const Value& v, const Bound&) -> Result<Value> {
       NAMM_ASSIGN_OR_RETURN(List items, Iterate(v));
       return MakeList(std::move(items));
     },
     false},
    {"selectattr", {"attribute", "test", "arg"}, 1,
     [](const Value& v, const Bound& p) { return SelectAttr(v, p, true); }},
    {"rejectattr", {"attribute", "test", "arg"}, 1,
     [](const Value& v, const Bound& p) { return SelectAttr(v, p, false); }},
    {"join", {"d"}, 0,
     [](const Value& v, const Bound& p) -> Result<Value> {
       NAMM_ASSIGN_OR_RETURN(const List items, Iterate(v));
       const std::string separator = p[0] != nullptr ? ToStr(*p[0]) : "";
       std::string out;
       for (size_t k = 0; k < items.size(); ++k) {
         out += (k > 0 ? separator : "") + ToStr(items[k]);
         if (out.size() > kMaxStringBytes) return TooLong();
       }
       return MakeString(std::move(out));
     }},
    {"items", {}, 0,
     [](const Value& v, const Bound&) -> Result<Value> {
       if (v.kind == K::kUndefined) return MakeList({});
       return CallMethod(v, "items", {}, {});
     },
     false},
    {"replace", {"old", "new", "count"}, 2,
     [](const Value& v, const Bound& p) { return Replace(ToStr(v), p); }},
    {"tojson", {"indent", "ensure_ascii"}, 0,
     [](const Value& v, const Bound& p) -> Result<Value> {
       int indent = -1;
       if (p[0] != nullptr && p[0]->kind != K::kNone) {
         if (!IsInteger(*p[0]) || AsInt(*p[0]) < 0 || AsInt(*p[0]) > 16) {
           return Status::InvalidArgument("tojson(): indent must be an integer from 0 to 16, or none");
         }
         indent = static_cast<int>(AsInt(*p[0]));
       }
       if (p[1] != nullptr && Truthy(*p[1])) {
         return Status::InvalidArgument("tojson(): ensure_ascii=true is not supported");
       }
       std::string out;
       NAMM_RETURN_IF_ERROR(ToJson(v, indent, 0, out));
       return StringValue(std::move(out));
     }},
};

const FilterDef* FindFilter(const std::string& name) {
  for (const FilterDef& filter : kFilters) {
    if (filter.name == name) return &filter;
  }
  return nullptr;
}

// ---- Lexer ------------------------------------------------------------------------------------------------

struct Token {
  enum class Kind { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp,
                    kEnd };
  Kind kind;
  std::string text;  // kText, kName, kOp, kString (unescaped); the delimiter or source text for the others
  size_t pos;        // offset in the normalized source
  int64_t i = 0;     // kInt
  double f = 0;      // kFloat
};
using T = Token::Kind;

// Jinja reads "\r\n" and "\r" as "\n", and drops one newline at the very end (keep_trailing_newline=False).
std::string Normalize(const std::string& source) {
  std::string out;
  out.reserve(source.size());
  for (size_t k = 0; k < source.size(); ++k) {
    out += source[k] == '\r' ? '\n' : source[k];
    if (source[k] == '\r' && k + 1 < source.size() && source[k + 1] == '\n') ++k;
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

// Splits the source into text and the tokens inside tags, applying whitespace control as Jinja's lexer does
// with trim_blocks and lstrip_blocks.
class Lexer {
 public:
  explicit Lexer(const std::string& src) : src_(src) {}
  Result<std::vector<Token>> Run();

 private:
  Status Error(size_t pos, const std::string& msg) const {
    return Status::InvalidArgument(Where(src_, pos) + ": " + msg);
  }
  bool IsTagStart(size_t pos) const {
    return pos + 1 < src_.size() && std::string_view("{%#").find(src_[pos + 1]) != std::string_view::npos;
  }
  Result<size_t> Tag(size_t open, size_t pos, bool block, char* end_sign);
  Result<size_t> Number(size_t pos);
  Result<size_t> String(size_t pos);

  const std::string& src_;
  std::vector<Token> tokens_;
};

Result<std::vector<Token>> Lexer::Run() {
  size_t pos = 0;
  bool line_start = true;  // whether the text from `pos` starts a line (the first, or after a tag's newline)
  while (pos < src_.size()) {
    size_t tag = src_.find('{', pos);
    while (tag != std::string::npos && !IsTagStart(tag)) tag = src_.find('{', tag + 1);
    std::string text = src_.substr(pos, tag == std::string::npos ? std::string::npos : tag - pos);
    if (tag == std::string::npos) {
      tokens_.push_back({T::kText, std::move(text), pos});
      break;
    }
    const char type = src_[tag + 1];
    const char after = tag + 2 < src_.size() ? src_[tag + 2] : 0;
    const char sign = after == '-' || after == '+' ? after : 0;
    if (sign == '-') {  // {%- strips all whitespace before the tag
      while (!text.empty() && IsSpace(text.back())) text.pop_back();
    } else if (sign != '+' && type != '{') {
      // lstrip_blocks: whitespace between the start of a line and a block or comment tag goes.
      const size_t newline = text.rfind('\n');
      const size_t line = newline == std::string::npos ? 0 : newline + 1;
      const bool blank = text.find_first_not_of(" \t\r\f\v", line) == std::string::npos;
      if ((line > 0 || line_start) && blank) text.resize(line);
    }
    if (!text.empty()) tokens_.push_back({T::kText, std::move(text), pos});
    pos = tag + (sign != 0 ? 3 : 2);
    char end_sign = 0;
    if (type == '#') {
      const size_t close = src_.find("#}", pos);
      if (close == std::string::npos) return Error(tag, "unclosed comment: missing '#}'");
      if (close > pos && (src_[close - 1] == '-' || src_[close - 1] == '+')) end_sign = src_[close - 1];
      pos = close + 2;
    } else {
      tokens_.push_back({type == '{' ? T::kVarBegin : T::kBlockBegin, src_.substr(tag, 2), tag});
      NAMM_ASSIGN_OR_RETURN(pos, Tag(tag, pos, type == '%', &end_sign));
    }
    // -%} strips all whitespace after the tag; trim_blocks drops the newline right after a block or comment.
    if (end_sign == '-') {
      while (pos < src_.size() && IsSpace(src_[pos])) ++pos;
    } else if (end_sign != '+' && type != '{' && pos < src_.size() && src_[pos] == '\n') {
      ++pos;
    }
    line_start = src_[pos - 1] == '\n';
  }
  tokens_.push_back({T::kEnd, "", src_.size()});
  return std::move(tokens_);
}

// Lexes the inside of a {{ }} (block false) or {% %} tag from `pos` through its closing delimiter; returns
// the position after it and, in *end_sign, the '-' or '+' written before the delimiter (0 for none).
Result<size_t> Lexer::Tag(size_t open, size_t pos, bool block, char* end_sign) {
  static constexpr std::string_view kOperators[] = {"//", "==", "!=", "<=", ">=", "+", "-", "*",
                                                    "/",  "%",  "~",  "<",  ">",  "=", "(", ")",
                                                    "[",  "]",  "{",  "}",  ".",  ",", ":", "|"};
  const std::string close = block ? "%}" : "}}";
  std::string brackets;  // the open ( [ {: inside them a closing delimiter is operators, as in Jinja
  while (true) {
    while (pos < src_.size() && IsSpace(src_[pos])) ++pos;
    if (pos == src_.size()) return Error(open, "unclosed tag: missing '" + close + "'");
    const char c = src_[pos];
    if (brackets.empty()) {
      const bool signed_close = (c == '-' || (c == '+' && block)) && src_.compare(pos + 1, 2, close) == 0;
      if (signed_close || src_.compare(pos, 2, close) == 0) {
        *end_sign = signed_close ? c : 0;
        tokens_.push_back({block ? T::kBlockEnd : T::kVarEnd, close, pos});
        return pos + (signed_close ? 3 : 2);
      }
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t end = pos + 1;
      while (end < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[end])) || src_[end] == '_')) {
        ++end;
      }
      tokens_.push_back({T::kName, src_.substr(pos, end - pos), pos});
      pos = end;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      NAMM_ASSIGN_OR_RETURN(pos, Number(pos));
    } else if (c == '\'' || c == '"') {
      NAMM_ASSIGN_OR_RETURN(pos, String(pos));
    } else {
      const auto op = std::find_if(std::begin(kOperators), std::end(kOperators),
                                   [&](std::string_view o) { return src_.compare(pos, o.size(), o) == 0; });
      if (op == std::end(kOperators)) return Error(pos, "unexpected character '" + std::string(1, c) + "'");
      const std::string_view opens = "([{", closes = ")]}";
      if (opens.find(c) != std::string_view::npos) {
        brackets += c;
      } else if (const size_t k = closes.find(c); k != std::string_view::npos) {
        if (brackets.empty() || brackets.back() != opens[k]) {
          return Error(pos, "unexpected '" + std::string(1, c) + "'");
        }
        brackets.pop_back();
      }
      tokens_.push_back({T::kOp, std::string(*op), pos});
      pos += op->size();
    }
  }
}

Result<size_t> Lexer::Number(size_t pos) {
  const auto digits = [&](size_t k) {
    while (k < src_.size() && std::isdigit(static_cast<unsigned char>(src_[k]))) ++k;
    return k;
  };
  size_t end = digits(pos);
  bool is_float = false;
  if (pos == 0 || src_[pos - 1] != '.') {  // after a dot, as in x.0.1, numbers are subscripts, not floats
    if (end + 1 < src_.size() && src_[end] == '.' && digits(end + 1) > end + 1) {
      end = digits(end + 1);
      is_float = true;
    }
    if (end < src_.size() && (src_[end] == 'e' || src_[end] == 'E')) {
      size_t k = end + 1;
      if (k < src_.size() && (src_[k] == '+' || src_[k] == '-')) ++k;
      if (k < src_.size() && std::isdigit(static_cast<unsigned char>(src_[k]))) {
        end = digits(k);
        is_float = true;
      }
    }
  }
  Token token{is_float ? T::kFloat : T::kInt, src_.substr(pos, end - pos), pos};
  errno = 0;
  if (is_float) {
    token.f = std::strtod(token.text.c_str(), nullptr);
  } else {
    token.i = std::strtoll(token.text.c_str(), nullptr, 10);
  }
  if (errno == ERANGE) return Error(pos, "number out of range: " + token.text);
  tokens_.push_back(std::move(token));
  return end;
}

// A quoted string with Python's escapes (\n \t \r \\ \' \" \b \f \v \a \xHH \uHHHH \UHHHHHHHH and
// backslash-newline); other backslashes stay as written, as in Python.
Result<size_t> Lexer::String(size_t pos) {
  const char quote = src_[pos];
  std::string value;
  size_t k = pos + 1;
  for (; k < src_.size() && src_[k] != quote; ++k) {
    if (src_[k] != '\\' || k + 1 == src_.size()) {
      value += src_[k];
      continue;
    }
    const char e = src_[++k];
    switch (e) {
      case 'n': value += '\n'; break;
      case 't': value += '\t'; break;
      case 'r': value += '\r'; break;
      case 'b': value += '\b'; break;
      case 'f': value += '\f'; break;
      case 'v': value += '\v'; break;
      case 'a': value += '\a'; break;
      case '\\':
      case '\'':
      case '"': value += e; break;
      case '\n': break;  // a backslash-newline continues the line
      case 'x':
      case 'u':
      case 'U': {
        const size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        const std::string hex = src_.substr(k + 1, n);
        if (hex.size() != n || hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) {
          return Error(k - 1, std::string("invalid \\") + e + " escape: expected " + std::to_string(n) +
                                  " hex digits");
        }
        const unsigned long cp = std::strtoul(hex.c_str(), nullptr, 16);
        if (cp > 0x10FFFF) return Error(k - 1, "invalid \\U escape: beyond U+10FFFF");
        value += utf8_encode(static_cast<uint32_t>(cp));
        k += n;
        break;
      }
      default:
        value += '\\';
        value += e;
    }
  }
  if (k >= src_.size()) return Error(pos, "unclosed string");
  tokens_.push_back({T::kString, std::move(value), pos});
  return k + 1;
}

// ---- Syntax tree ------------------------------------------------------------------------------------------

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral, kName, kList, kDict, kAttr, kItem, kSlice, kCall, kFilter, kTest,
    kUnary, kNot, kBinary, kCompare, kAnd, kOr, kCond,
  };
  Kind kind;
  size_t pos = 0;
  std::string name;  // kName, kAttr: the name; kFilter, kTest: which; kUnary, kBinary: the operator
  Value value;       // kLiteral
  // Operands in source order: kList the items; kDict keys and values alternating; kAttr the object; kItem the
  // object and the key; kSlice the object, start, stop, step (each may be null); kCall the callee then the
  // arguments; kFilter the value then the arguments; kCompare the compared values; kCond the value, the
  // condition and the else value (may be null); the others their operands.
  std::vector<ExprPtr> args;
  std::vector<std::string> keywords;  // kCall, kFilter: names of the last keywords.size() arguments
  std::vector<std::string> ops;       // kCompare: the operator between args[k] and args[k + 1]
  bool negated = false;               // kTest: `is not`
  int depth = 1;
};
using E = Expr::Kind;

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum class Kind { kText, kOutput, kIf, kFor, kSet };
  Kind kind;
  size_t pos = 0;
  std::string text;                // kText: the text; kSet: the variable
  std::string attr;                // kSet of a namespace attribute: the attribute
  std::vector<std::string> names;  // kFor: the loop variables
  std::vector<ExprPtr> exprs;      // kOutput, kSet: the value; kIf: conditions; kFor: iterable, filter/null
  std::vector<Body> bodies;        // kIf: one per condition, then the else if any; kFor: the body
};
using N = Node::Kind;

// ---- Parser -----------------------------------------------------------------------------------------------

// Counts nested parser calls; a guard that is not ok() has found the template nested too deeply.
class DepthGuard {
 public:
  explicit DepthGuard(int& depth) : depth_(++depth) {}
  ~DepthGuard() { --depth_; }
  DepthGuard(const DepthGuard&) = delete;
  DepthGuard& operator=(const DepthGuard&) = delete;
  bool ok() const { return depth_ <= kMaxNesting; }

 private:
  int& depth_;
};

template <typename... Kids>
std::vector<ExprPtr> Operands(Kids... kids) {
  std::vector<ExprPtr> out;
  (out.push_back(std::move(kids)), ...);
  return out;
}

class Parser {
 public:
  Parser(const std::string& src, std::vector<Token> tokens) : src_(src), tokens_(std::move(tokens)) {}
  Result<Body> Run() {
    NAMM_ASSIGN_OR_RETURN(Body body, ParseBody({}, nullptr));
    NAMM_RETURN_IF_ERROR(CheckNames(body, false));
    return body;
  }

 private:
  // Parses nodes up to a block tag named in `ends` ("{% name" is consumed and *end set to the name), or, with
  // no `ends`, to the end of the template. `opener` is the tag name of the enclosing block, for errors.
  Result<Body> ParseBody(const std::vector<std::string>& ends, const Token* opener,
                         std::string* end = nullptr);
  Status ParseStatement(Body& body);
  Result<std::unique_ptr<Node>> ParseIf(const Token& tag);
  Result<std::unique_ptr<Node>> ParseFor(const Token& tag);
  Result<std::unique_ptr<Node>> ParseSet(const Token& tag);

  // Expressions, loosest-binding first, as in Jinja's parser.
  Result<ExprPtr> ParseExpression(bool allow_if = true);
  Result<ExprPtr> ParseLogical(bool is_or);
  Result<ExprPtr> ParseNot();
  Result<ExprPtr> ParseCompare();
  Result<ExprPtr> ParseArithmetic(int level);
  Result<ExprPtr> ParseUnary(bool with_filters);
  Result<ExprPtr> ParsePrimary();
  Result<ExprPtr> ParseSubscript(ExprPtr object);
  Status ParseArguments(std::vector<ExprPtr>& args, std::vector<std::string>& keywords);
  Result<ExprPtr> Make(E kind, size_t pos, std::vector<ExprPtr> args, std::string name = {});
  Status CheckNames(const Body& body, bool conditional) const;
  Status CheckNames(const Expr& e, bool conditional) const;

  const Token& Peek(size_t ahead = 0) const { return tokens_[std::min(next_ + ahead, tokens_.size() - 1)]; }
  const Token& Next() {
    const Token& token = Peek();
    next_ = std::min(next_ + 1, tokens_.size() - 1);
    return token;
  }
  bool IsOp(std::string_view op, size_t ahead = 0) const {
    return Peek(ahead).kind == T::kOp && Peek(ahead).text == op;
  }
  bool IsName(std::string_view name, size_t ahead = 0) const {
    return Peek(ahead).kind == T::kName && Peek(ahead).text == name;
  }
  bool Accept(std::string_view op) {
    if (!IsOp(op)) return false;
    Next();
    return true;
  }
  bool AcceptName(std::string_view name) {
    if (!IsName(name)) return false;
    Next();
    return true;
  }
  Status Expect(std::string_view op);
  Status ExpectEnd(T kind);
  Result<std::string> ExpectName(const char* what);
  static std::string Describe(const Token& token);
  Status Error(size_t pos, const std::string& msg) const {
    return Status::InvalidArgument(Where(src_, pos) + ": " + msg);
  }
  Status TooDeep() const { return Error(Peek().pos, "the template nests more than 100 levels deep"); }
  std::unique_ptr<Node> NewNode(N kind, size_t pos) const {
    auto node = std::make_unique<Node>();
    node->kind = kind;
    node->pos = pos;
    return node;
  }

  const std::string& src_;
  const std::vector<Token> tokens_;
  size_t next_ = 0;
  int depth_ = 0;
};

std::string Parser::Describe(const Token& token) {
  switch (token.kind) {
    case T::kText: return "template text";
    case T::kString: return "a string";
    case T::kInt:
    case T::kFloat: return "a number";
    case T::kEnd: return "the end of the template";
    default: return "'" + token.text + "'";
  }
}

Status Parser::Expect(std::string_view op) {
  if (Accept(op)) return Status::Ok();
  return Error(Peek().pos, "expected '" + std::string(op) + "', got " + Describe(Peek()));
}

Status Parser::ExpectEnd(T kind) {
  if (Peek().kind == kind) {
    Next();
    return Status::Ok();
  }
  return Error(Peek().pos, std::string("expected '") + (kind == T::kVarEnd ? "}}" : "%}") + "', got " +
                               Describe(Peek()));
}

Result<std::string> Parser::ExpectName(const char* what) {
  if (Peek().kind != T::kName) {
    return Error(Peek().pos, std::string("expected ") + what + ", got " + Describe(Peek()));
  }
  return Next().text;
}

Result<ExprPtr> Parser::Make(E kind, size_t pos, std::vector<ExprPtr> args, std::string name) {
  auto e = std::make_unique<Expr>();
  e->kind = kind;
  e->pos = pos;
  e->name = std::move(name);
  e->args = std::move(args);
  for (const ExprPtr& arg : e->args) {
    if (arg) e->depth = std::max(e->depth, arg->depth + 1);
  }
  // Evaluation recurses over the tree: bound its depth, not just the parser's recursion.
  if (e->depth > kMaxNesting) return Error(pos, "expression nested more than 100 levels deep");
  return e;
}

// Jinja reports an unknown filter or test when compiling, except inside an if statement or an inline if
// (outside any loop nested there): there only when it runs, so that a template can name one in a branch it
// never takes.
Status Parser::CheckNames(const Body& body, bool conditional) const {
  for (const auto& node : body) {
    for (const ExprPtr& e : node->exprs) {
      if (e) NAMM_RETURN_IF_ERROR(CheckNames(*e, conditional || node->kind == N::kIf));
    }
    for (const Body& inner : node->bodies) {  // an if's or a loop's: a loop starts afresh, as in Jinja
      NAMM_RETURN_IF_ERROR(CheckNames(inner, node->kind == N::kIf));
    }
  }
  return Status::Ok();
}

Status Parser::CheckNames(const Expr& e, bool conditional) const {
  if (!conditional && e.kind == E::kFilter && FindFilter(e.name) == nullptr) {
    return Error(e.pos, "unknown filter '" + e.name + "'");
  }
  if (!conditional && e.kind == E::kTest && FindTest(e.name) == nullptr) {
    return Error(e.pos, "unknown test '" + e.name + "'");
  }
  for (const ExprPtr& arg : e.args) {
    if (arg) NAMM_RETURN_IF_ERROR(CheckNames(*arg, conditional || e.kind == E::kCond));
  }
  return Status::Ok();
}

Result<Body> Parser::ParseBody(const std::vector<std::string>& ends, const Token* opener, std::string* end) {
  static constexpr std::string_view kInnerTags[] = {"elif", "else", "endif", "endfor", "endgeneration"};
  const DepthGuard guard(depth_);
  if (!guard.ok()) return TooDeep();
  const auto tag_list = [&] {
    std::string out;
    for (size_t k = 0; k < ends.size(); ++k) {
      out += (k == 0 ? "" : k + 1 == ends.size() ? " or " : ", ") + ("{% " + ends[k] + " %}");
    }
    return out;
  };
  Body body;
  while (true) {
    const Token& token = Peek();
    if (token.kind == T::kEnd) {
      if (ends.empty()) return body;
      return Error(token.pos, "unexpected end of template: expected " + tag_list() + " to close the {% " +
                                  opener->text + " %} on line " + std::to_string(LineOf(src_, opener->pos)));
    }
    if (token.kind == T::kText) {
      auto node = NewNode(N::kText, token.pos);
      node->text = Next().text;
      body.push_back(std::move(node));
    } else if (token.kind == T::kVarBegin) {
      auto node = NewNode(N::kOutput, Next().pos);
      NAMM_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression());
      node->exprs.push_back(std::move(value));
      NAMM_RETURN_IF_ERROR(ExpectEnd(T::kVarEnd));
      body.push_back(std::move(node));
    } else {  // a block tag: the lexer makes nothing else outside tags
      const Token& name = Peek(1);
      if (name.kind == T::kName && std::find(ends.begin(), ends.end(), name.text) != ends.end()) {
        Next();
        Next();
        if (end != nullptr) *end = name.text;
        return body;
      }
      const bool inner_tag =
          std::find(std::begin(kInnerTags), std::end(kInnerTags), name.text) != std::end(kInnerTags);
      if (name.kind == T::kName && inner_tag) {
        return Error(name.pos,
                     "unexpected {% " + name.text + " %}" + (ends.empty() ? "" : ": expected " + tag_list()));
      }
      NAMM_RETURN_IF_ERROR(ParseStatement(body));
    }
  }
}

Status Parser::ParseStatement(Body& body) {
  Next();  // {%
  const Token& tag = Next();
  std::unique_ptr<Node> node;
  if (tag.kind != T::kName) return Error(tag.pos, "expected a tag name, got " + Describe(tag));
  if (tag.text == "if") {
    NAMM_ASSIGN_OR_RETURN(node, ParseIf(tag));
  } else if (tag.text == "for") {
    NAMM_ASSIGN_OR_RETURN(node, ParseFor(tag));
  } else if (tag.text == "set") {
    NAMM_ASSIGN_OR_RETURN(node, ParseSet(tag));
  } else if (tag.text == "generation") {
    // transformers' marker of assistant text (for its assistant-token mask): the content renders as is.
    NAMM_RETURN_IF_ERROR(ExpectEnd(T::kBlockEnd));
    NAMM_ASSIGN_OR_RETURN(Body inner, ParseBody({"endgeneration"}, &tag));
    NAMM_RETURN_IF_ERROR(ExpectEnd(T::kBlockEnd));
    for (auto& inner_node : inner) body.push_back(std::move(inner_node));
    return Status::Ok();
  } else {
    return Error(tag.pos, "unknown tag '" + tag.text + "'");
  }
  body.push_back(std::move(node));
  return Status::Ok();
}

Result<std::unique_ptr<Node>> Parser::ParseIf(const Token& tag) {
  auto node = NewNode(N::kIf, tag.pos);
  std::string end = "elif";
  while (end == "elif") {
    // As in Jinja, a condition is no inline if: {% if a if b else c %} is an error.
    NAMM_ASSIGN_OR_RETURN(ExprPtr condition, ParseExpression(/*allow_if=*/false));
    node->exprs.push_back(std::move(condition));
    NAMM_RETURN_IF_ERROR(ExpectEnd(T::kBlockEnd));
    NAMM_ASSIGN_OR_RETURN(Body body, ParseBody({"elif", "else", "endif"}, &tag, &end));
    node->bodies.push_back(std::move(body));
  }
  if (end == "else") {
    NAMM_RETURN_IF_ERROR(ExpectEnd(T::kBlockEnd));
    NAMM_ASSIGN_OR_RETURN(Body body, ParseBody({"endif"}, &tag));
    node->bodies.push_back(std::move(body));
  }
  NAMM_RETURN_IF_ERROR(ExpectEnd(T::kBlockEnd));
  return node;
}

Result<std::unique_ptr<Node>> Parser::ParseFor(const Token& tag) {
  auto node = NewNode(N::kFor, tag.pos);
  do {
    NAMM_ASSIGN_OR_RETURN(std::string name, ExpectName("a loop variable"));
    node->names.push_back(std::move(name));
  } while (Accept(","));
  if (!AcceptName("in")) return Error(Peek().pos, "expected 'in', got " + Describe(Peek()));
  // Without inline ifs: in `for x in xs if cond`, the if filters the loop.
  NAMM_ASSIGN_OR_RETURN(ExprPtr iterable, ParseExpression(/*allow_if=*/false));
  node->exprs.push_back(std::move(iterable));
  ExprPtr filter;
  if (AcceptName("if")) {
    NAMM_ASSIGN_OR_RETURN(filter, ParseExpression());
  }
  node->exprs.push_back(std::move(filter));
  NAMM_RETURN_IF_ERROR(ExpectEnd(T::kBlockEnd));
  NAMM_ASSIGN_OR_RETURN(Body body, ParseBody({"endfor"}, &tag));
  node->bodies.push_back(std::move(body));
  NAMM_RETURN_IF_ERROR(ExpectEnd(T::kBlockEnd));
  return node;
}

Result<std::unique_ptr<Node>> Parser::ParseSet(const Token& tag) {
  auto node = NewNode(N::kSet, tag.pos);
  NAMM_ASSIGN_OR_RETURN(node->text, ExpectName("a variable name"));
  if (Accept(".")) {
    NAMM_ASSIGN_OR_RETURN(node->attr, ExpectName("an attribute name"));
  }
  NAMM_RETURN_IF_ERROR(Expect("="));
  NAMM_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression());
  node->exprs.push_back(std::move(value));
  NAMM_RETURN_IF_ERROR(ExpectEnd(T::kBlockEnd));
  return node;
}

Result<ExprPtr> Parser::ParseExpression(bool allow_if) {
  const DepthGuard guard(depth_);
  if (!guard.ok()) return TooDeep();
  NAMM_ASSIGN_OR_RETURN(ExprPtr e, ParseLogical(true));
  while (allow_if && IsName("if")) {  // value if condition [else other]
    const size_t pos = Next().pos;
    NAMM_ASSIGN_OR_RETURN(ExprPtr condition, ParseLogical(true));
    ExprPtr otherwise;
    if (AcceptName("else")) {
      NAMM_ASSIGN_OR_RETURN(otherwise, ParseExpression());
    }
    NAMM_ASSIGN_OR_RETURN(
        e, Make(E::kCond, pos, Operands(std::move(e), std::move(condition), std::move(otherwise))));
  }
  return e;
}

// `or` (is_or) over `and` over `not`.
Result<ExprPtr> Parser::ParseLogical(bool is_or) {
  const auto operand = [&] { return is_or ? ParseLogical(false) : ParseNot(); };
  NAMM_ASSIGN_OR_RETURN(ExprPtr e, operand());
  while (IsName(is_or ? "or" : "and")) {
    const size_t pos = Next().pos;
    NAMM_ASSIGN_OR_RETURN(ExprPtr right, operand());
    NAMM_ASSIGN_OR_RETURN(e, Make(is_or ? E::kOr : E::kAnd, pos, Operands(std::move(e), std::move(right))));
  }
  return e;
}

Result<ExprPtr> Parser::ParseNot() {
  if (!IsName("not")) return ParseCompare();
  const DepthGuard guard(depth_);
  if (!guard.ok()) return TooDeep();
  const size_t pos = Next().pos;
  NAMM_ASSIGN_OR_RETURN(ExprPtr operand, ParseNot());
  return Make(E::kNot, pos, Operands(std::move(operand)));
}

Result<ExprPtr> Parser::ParseCompare() {
  static constexpr std::string_view kComparisons[] = {"==", "!=", "<", "<=", ">", ">="};
  NAMM_ASSIGN_OR_RETURN(ExprPtr first, ParseArithmetic(0));
  std::vector<ExprPtr> operands;
  std::vector<std::string> ops;
  const size_t pos = Peek().pos;
  while (true) {
    if (Peek().kind == T::kOp &&
        std::find(std::begin(kComparisons), std::end(kComparisons), Peek().text) != std::end(kComparisons)) {
      ops.push_back(Next().text);
    } else if (AcceptName("in")) {
      ops.push_back("in");
    } else if (IsName("not") && IsName("in", 1)) {
      Next();
      Next();
      ops.push_back("not in");
    } else {
      break;
    }
    NAMM_ASSIGN_OR_RETURN(ExprPtr right, ParseArithmetic(0));
    operands.push_back(std::move(right));
  }
  if (ops.empty()) return first;
  operands.insert(operands.begin(), std::move(first));
  NAMM_ASSIGN_OR_RETURN(ExprPtr e, Make(E::kCompare, pos, std::move(operands)));
  e->ops = std::move(ops);
  return e;
}

// Levels 0, 1, 2: + and -, then ~, then * / // %.
Result<ExprPtr> Parser::ParseArithmetic(int level) {
  static constexpr std::string_view kLevels[3][4] = {{"+", "-"}, {"~"}, {"*", "/", "//", "%"}};
  const auto operand = [&] { return level < 2 ? ParseArithmetic(level + 1) : ParseUnary(true); };
  NAMM_ASSIGN_OR_RETURN(ExprPtr e, operand());
  const auto& ops = kLevels[level];
  while (Peek().kind == T::kOp && std::find(std::begin(ops), std::end(ops), Peek().text) != std::end(ops)) {
    const Token& op = Next();
    NAMM_ASSIGN_OR_RETURN(ExprPtr right, operand());
    NAMM_ASSIGN_OR_RETURN(e, Make(E::kBinary, op.pos, Operands(std::move(e), std::move(right)), op.text));
  }
  return e;
}

// A primary with unary signs, postfixes (.attr, [key], (args)) and, with_filters, filters and tests. As in
// Jinja, `-x | f` filters -x, while the operand of a sign takes no filters.
Result<ExprPtr> Parser::ParseUnary(bool with_filters) {
  const DepthGuard guard(depth_);
  if (!guard.ok()) return TooDeep();
  ExprPtr e;
  if (IsOp("-") || IsOp("+")) {
    const Token& op = Next();
    NAMM_ASSIGN_OR_RETURN(ExprPtr operand, ParseUnary(false));
    NAMM_ASSIGN_OR_RETURN(e, Make(E::kUnary, op.pos, Operands(std::move(operand)), op.text));
  } else {
    NAMM_ASSIGN_OR_RETURN(e, ParsePrimary());
  }
  // Postfixes, then (with_filters) filters and tests, which only calls may follow: x | f[0] is an error.
  for (bool filters = false; true;) {
    if (!filters && (IsOp(".") || IsOp("["))) {
      NAMM_ASSIGN_OR_RETURN(e, ParseSubscript(std::move(e)));
    } else if (IsOp("(")) {
      const size_t pos = e->pos;  // errors point at the callee
      std::vector<ExprPtr> args = Operands(std::move(e));
      std::vector<std::string> keywords;
      NAMM_RETURN_IF_ERROR(ParseArguments(args, keywords));
      NAMM_ASSIGN_OR_RETURN(e, Make(E::kCall, pos, std::move(args)));
      e->keywords = std::move(keywords);
    } else if (with_filters && IsOp("|")) {
      filters = true;
      Next();
      const size_t name_pos = Peek().pos;
      NAMM_ASSIGN_OR_RETURN(std::string name, ExpectName("a filter name"));
      std::vector<ExprPtr> args = Operands(std::move(e));
      std::vector<std::string> keywords;
      if (IsOp("(")) NAMM_RETURN_IF_ERROR(ParseArguments(args, keywords));
      NAMM_ASSIGN_OR_RETURN(e, Make(E::kFilter, name_pos, std::move(args), name));
      e->keywords = std::move(keywords);
    } else if (with_filters && IsName("is")) {
      filters = true;
      Next();
      const bool negated = AcceptName("not");
      const size_t name_pos = Peek().pos;
      NAMM_ASSIGN_OR_RETURN(std::string name, ExpectName("a test name"));
      const TestDef* test = FindTest(name);
      std::vector<ExprPtr> args = Operands(std::move(e));
      if (test != nullptr && test->takes_arg) {  // `is eq 1` or `is eq(1)`
        NAMM_ASSIGN_OR_RETURN(ExprPtr arg, ParseUnary(false));
        args.push_back(std::move(arg));
      }
      NAMM_ASSIGN_OR_RETURN(e, Make(E::kTest, name_pos, std::move(args), name));
      e->negated = negated;
    } else {
      return e;
    }
  }
}

Result<ExprPtr> Parser::ParseSubscript(ExprPtr object) {
  const Token& open = Next();
  if (open.text == ".") {
    const Token& key = Next();
    if (key.kind == T::kName) return Make(E::kAttr, open.pos, Operands(std::move(object)), key.text);
    if (key.kind != T::kInt) {
      return Error(key.pos, "expected an attribute name after '.', got " + Describe(key));
    }
    ExprPtr index = std::make_unique<Expr>();  // x.0 is x[0]
    index->kind = E::kLiteral;
    index->pos = key.pos;
    index->value = MakeInt(key.i);
    return Make(E::kItem, open.pos, Operands(std::move(object), std::move(index)));
  }
  ExprPtr start, stop, step;
  if (!IsOp(":")) {
    NAMM_ASSIGN_OR_RETURN(start, ParseExpression());
  }
  if (!Accept(":")) {
    NAMM_RETURN_IF_ERROR(Expect("]"));
    return Make(E::kItem, open.pos, Operands(std::move(object), std::move(start)));
  }
  if (!IsOp("]") && !IsOp(":")) {
    NAMM_ASSIGN_OR_RETURN(stop, ParseExpression());
  }
  if (Accept(":") && !IsOp("]")) {
    NAMM_ASSIGN_OR_RETURN(step, ParseExpression());
  }
  NAMM_RETURN_IF_ERROR(Expect("]"));
  return Make(E::kSlice, open.pos,
              Operands(std::move(object), std::move(start), std::move(stop), std::move(step)));
}

// "(a, b, key=c)": positional arguments appended to `args`, then keyword ones, whose names go to `keywords`.
Status Parser::ParseArguments(std::vector<ExprPtr>& args, std::vector<std::string>& keywords) {
  NAMM_RETURN_IF_ERROR(Expect("("));
  while (!Accept(")")) {
    if (Peek().kind == T::kName && IsOp("=", 1)) {
      keywords.push_back(Next().text);
      Next();
    } else if (!keywords.empty()) {
      return Error(Peek().pos, "positional argument after keyword arguments");
    }
    NAMM_ASSIGN_OR_RETURN(ExprPtr arg, ParseExpression());
    args.push_back(std::move(arg));
    if (!IsOp(")")) NAMM_RETURN_IF_ERROR(Expect(","));
  }
  return Status::Ok();
}

Result<ExprPtr> Parser::ParsePrimary() {
  const Token& token = Next();
  const auto literal = [&](Value value) -> Result<ExprPtr> {
    NAMM_ASSIGN_OR_RETURN(ExprPtr e, Make(E::kLiteral, token.pos, {}));
    e->value = std::move(value);
    return e;
  };
  if (token.kind == T::kName) {
    if (token.text == "true" || token.text == "True") return literal(MakeBool(true));
    if (token.text == "false" || token.text == "False") return literal(MakeBool(false));
    if (token.text == "none" || token.text == "None") return literal(MakeNone());
    return Make(E::kName, token.pos, {}, token.text);
  }
  if (token.kind == T::kString) {
    std::string s = token.text;
    while (Peek().kind == T::kString) s += Next().text;  // adjacent literals concatenate, as in Python
    return literal(MakeString(std::move(s)));
  }
  if (token.kind == T::kInt) return literal(MakeInt(token.i));
  if (token.kind == T::kFloat) return literal(MakeFloat(token.f));
  if (token.kind == T::kOp && token.text == "(") {
    NAMM_ASSIGN_OR_RETURN(ExprPtr e, ParseExpression());
    if (IsOp(",")) return Error(Peek().pos, "tuples are not supported: use a list [...]");
    NAMM_RETURN_IF_ERROR(Expect(")"));
    return e;
  }
  if (token.kind == T::kOp && (token.text == "[" || token.text == "{")) {
    const bool is_list = token.text == "[";
    const std::string_view close = is_list ? "]" : "}";
    std::vector<ExprPtr> items;
    while (!Accept(close)) {
      NAMM_ASSIGN_OR_RETURN(ExprPtr item, ParseExpression());
      items.push_back(std::move(item));
      if (!is_list) {
        NAMM_RETURN_IF_ERROR(Expect(":"));
        NAMM_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression());
        items.push_back(std::move(value));
      }
      if (!IsOp(close)) NAMM_RETURN_IF_ERROR(Expect(","));
    }
    return Make(is_list ? E::kList : E::kDict, token.pos, std::move(items));
  }
  return Error(token.pos, "expected an expression, got " + Describe(token));
}

// ---- Evaluation -------------------------------------------------------------------------------------------

struct Scope {
  const Scope* parent = nullptr;
  std::unordered_map<std::string, Value> vars;

  const Value* Find(const std::string& name) const {
    for (const Scope* scope = this; scope != nullptr; scope = scope->parent) {
      const auto it = scope->vars.find(name);
      if (it != scope->vars.end()) return &it->second;
    }
    return nullptr;
  }
};

// Runs a parsed template. One Renderer per render: it counts the render's work against the limits.
class Renderer {
 public:
  explicit Renderer(const std::string& src) : src_(src) {}
  Status Exec(const Body& body, Scope& scope, std::string& out);

 private:
  Status ExecFor(const Node& node, Scope& scope, std::string& out);
  Result<Value> Eval(const Expr& e, Scope& scope);
  Result<Value> EvalNode(const Expr& e, Scope& scope);
  Result<Value> EvalContainer(const Expr& e, Scope& scope);
  Result<Value> EvalCall(const Expr& e, Scope& scope);
  Status EvalArguments(const Expr& e, Scope& scope, List& args, Dict& kwargs);
  Result<Value> CallBuiltin(const std::string& name, const List& args, const Dict& kwargs, size_t pos);
  Status CheckStorable(const Value& v, size_t pos) const;
  Status Charge(uint64_t cost, size_t pos);
  Status Append(const std::string& text, size_t pos, std::string& out) const {
    if (out.size() + text.size() > kMaxStringBytes) return Error(pos, "the rendered text exceeds 64 MiB");
    out += text;
    return Status::Ok();
  }

  Status Error(size_t pos, const std::string& msg) const {
    return Status::InvalidArgument(Where(src_, pos) + ": " + msg);
  }
  // An operation's error, placed at `pos` in the template.
  Status At(size_t pos, const Status& status) const {
    return status.ok() ? status : Error(pos, status.message());
  }
  template <typename V>
  Result<V> At(size_t pos, Result<V> result) const {
    if (result.ok()) return result;
    return At(pos, result.status());
  }

  const std::string& src_;
  uint64_t work_ = 0;
  size_t iterations_ = 0;
};

Status Renderer::Exec(const Body& body, Scope& scope, std::string& out) {
  for (const auto& node : body) {
    switch (node->kind) {
      case N::kText: NAMM_RETURN_IF_ERROR(Append(node->text, node->pos, out)); break;
      case N::kOutput: {
        NAMM_ASSIGN_OR_RETURN(const Value value, Eval(*node->exprs[0], scope));
        NAMM_RETURN_IF_ERROR(Charge(Expanded(value), node->pos));
        NAMM_RETURN_IF_ERROR(Append(ToStr(value), node->pos, out));
        break;
      }
      case N::kIf: {
        size_t branch = 0;
        for (; branch < node->exprs.size(); ++branch) {
          NAMM_ASSIGN_OR_RETURN(const Value condition, Eval(*node->exprs[branch], scope));
          if (Truthy(condition)) break;
        }
        if (branch < node->bodies.size()) NAMM_RETURN_IF_ERROR(Exec(node->bodies[branch], scope, out));
        break;
      }
      case N::kFor: NAMM_RETURN_IF_ERROR(ExecFor(*node, scope, out)); break;
      case N::kSet: {
        NAMM_ASSIGN_OR_RETURN(Value value, Eval(*node->exprs[0], scope));
        if (node->attr.empty()) {
          scope.vars[node->text] = std::move(value);
          break;
        }
        const Value* ns = scope.Find(node->text);
        if (ns == nullptr || ns->kind != K::kNamespace) {
          return Error(node->pos, "cannot set " + node->text + "." + node->attr + ": '" + node->text +
                                      "' is not a namespace");
        }
        NAMM_RETURN_IF_ERROR(CheckStorable(value, node->exprs[0]->pos));
        SetKey(*ns->dict, node->attr, std::move(value));  // namespaces are shared: every holder sees this
        break;
      }
    }
  }
  return Status::Ok();
}

Status Renderer::ExecFor(const Node& node, Scope& scope, std::string& out) {
  NAMM_ASSIGN_OR_RETURN(const Value iterable, Eval(*node.exprs[0], scope));
  NAMM_ASSIGN_OR_RETURN(List items, At(node.exprs[0]->pos, Iterate(iterable)));
  // Each iteration runs in a scope of its own, as in Jinja: what the body sets is gone by the next iteration.
  const auto bind = [&](const Value& item, Scope& inner) -> Status {
    if (++iterations_ > kMaxItems) return Error(node.pos, "more than 1048576 loop iterations");
    if (node.names.size() == 1) {
      inner.vars[node.names[0]] = item;
      return Status::Ok();
    }
    if (item.kind != K::kList || item.list->size() != node.names.size()) {
      const std::string what = item.kind == K::kList ? std::to_string(item.list->size()) + " values"
                                                     : "a '" + TypeName(item) + "'";
      return Error(node.pos, "cannot unpack " + what + " into " + std::to_string(node.names.size()) +
                                 " loop variables");
    }
    for (size_t k = 0; k < node.names.size(); ++k) inner.vars[node.names[k]] = (*item.list)[k];
    return Status::Ok();
  };
  // `for x in xs if cond`: filtered first, so that loop.index and loop.length count the kept items only.
  if (node.exprs[1]) {
    List kept;
    for (const Value& item : items) {
      Scope inner{&scope, {}};
      NAMM_RETURN_IF_ERROR(bind(item, inner));
      NAMM_ASSIGN_OR_RETURN(const Value keep, Eval(*node.exprs[1], inner));
      if (Truthy(keep)) kept.push_back(item);
    }
    items = std::move(kept);
  }
  const int64_t n = static_cast<int64_t>(items.size());
  for (int64_t k = 0; k < n; ++k) {
    Scope inner{&scope, {}};
    NAMM_RETURN_IF_ERROR(bind(items[static_cast<size_t>(k)], inner));
    inner.vars["loop"] = MakeDict({{"index", MakeInt(k + 1)},
                                   {"index0", MakeInt(k)},
                                   {"revindex", MakeInt(n - k)},
                                   {"revindex0", MakeInt(n - k - 1)},
                                   {"first", MakeBool(k == 0)},
                                   {"last", MakeBool(k == n - 1)},
                                   {"length", MakeInt(n)}});
    NAMM_RETURN_IF_ERROR(Exec(node.bodies[0], inner, out));
  }
  return Status::Ok();
}

// Roughly what computing or copying `v` costs: a string's bytes; a list's or dict's entries and their
// strings' bytes (copying one copies its strings, not its inner lists and dicts, which are shared).
uint64_t Cost(const Value& v) {
  const auto string_bytes = [](const Value& item) { return item.kind == K::kString ? item.s.size() : 0; };
  uint64_t cost = 1;
  if (v.kind == K::kString) cost += v.s.size();
  if (v.kind == K::kList) {
    for (const Value& item : *v.list) cost += 1 + string_bytes(item);
  }
  if (v.kind == K::kDict) {
    for (const auto& [key, item] : *v.dict) cost += 1 + key.size() + string_bytes(item);
  }
  return cost;
}

// Charging every value computed by its cost, and every walk over a whole value (printing, comparing,
// searching it) by its expanded size, bounds a render's time, whatever its loops, strings and shared values.
Status Renderer::Charge(uint64_t cost, size_t pos) {
  work_ = SaturatingAdd(work_, cost);
  if (work_ > kMaxWork) {
    return Error(pos, "the template does too much work: the values it computed add up to more than 1 GiB");
  }
  return Status::Ok();
}

Result<Value> Renderer::Eval(const Expr& e, Scope& scope) {
  NAMM_ASSIGN_OR_RETURN(Value v, EvalNode(e, scope));
  if (Expanded(v) > kMaxExpanded) {
    return Error(e.pos,
                 "the template built a value of more than 64 Mi items and string bytes (counting an item "
                 "each time it appears)");
  }
  NAMM_RETURN_IF_ERROR(Charge(Cost(v), e.pos));
  return v;
}

Result<Value> Renderer::EvalNode(const Expr& e, Scope& scope) {
  switch (e.kind) {
    case E::kLiteral: return e.value;
    case E::kName: {
      const Value* v = scope.Find(e.name);
      return v != nullptr ? *v : MakeUndefined(e.name);
    }
    case E::kList:
    case E::kDict: return EvalContainer(e, scope);
    case E::kAttr: {
      NAMM_ASSIGN_OR_RETURN(const Value object, Eval(*e.args[0], scope));
      return GetAttr(object, e.name);
    }
    case E::kItem: {
      NAMM_ASSIGN_OR_RETURN(const Value object, Eval(*e.args[0], scope));
      NAMM_ASSIGN_OR_RETURN(const Value key, Eval(*e.args[1], scope));
      return GetItem(object, key);
    }
    case E::kSlice: {
      Value parts[4];  // the object, then start, stop and step (undefined when omitted)
      for (size_t k = 0; k < 4; ++k) {
        if (e.args[k]) {
          NAMM_ASSIGN_OR_RETURN(parts[k], Eval(*e.args[k], scope));
        }
      }
      return At(e.pos, Slice(parts[0], parts[1], parts[2], parts[3]));
    }
    case E::kCall: return EvalCall(e, scope);
    case E::kFilter: {
      const FilterDef* found = FindFilter(e.name);
      if (found == nullptr) return Error(e.pos, "unknown filter '" + e.name + "'");
      const FilterDef& filter = *found;
      NAMM_ASSIGN_OR_RETURN(const Value v, Eval(*e.args[0], scope));
      List args;
      Dict kwargs;
      NAMM_RETURN_IF_ERROR(EvalArguments(e, scope, args, kwargs));
      std::vector<std::string_view> params;
      for (const std::string_view param : filter.params) {
        if (!param.empty()) params.push_back(param);
      }
      NAMM_ASSIGN_OR_RETURN(const Bound bound,
                            At(e.pos, Bind(e.name, args, kwargs, params, filter.required)));
      if (filter.walks) NAMM_RETURN_IF_ERROR(Charge(Expanded(v), e.pos));
      return At(e.pos, filter.apply(v, bound));
    }
    case E::kTest: {
      const TestDef* test = FindTest(e.name);
      if (test == nullptr) return Error(e.pos, "unknown test '" + e.name + "'");
      NAMM_ASSIGN_OR_RETURN(const Value v, Eval(*e.args[0], scope));
      Value arg;
      if (e.args.size() > 1) {
        NAMM_ASSIGN_OR_RETURN(arg, Eval(*e.args[1], scope));
        NAMM_RETURN_IF_ERROR(Charge(Expanded(v) + Expanded(arg), e.pos));  // eq / ne compare them in full
      }
      return MakeBool(test->test(v, arg) != e.negated);
    }
    case E::kUnary: {
      NAMM_ASSIGN_OR_RETURN(const Value v, Eval(*e.args[0], scope));
      return At(e.pos, Negate(e.name, v));
    }
    case E::kNot: {
      NAMM_ASSIGN_OR_RETURN(const Value v, Eval(*e.args[0], scope));
      return MakeBool(!Truthy(v));
    }
    case E::kBinary: {
      NAMM_ASSIGN_OR_RETURN(const Value a, Eval(*e.args[0], scope));
      NAMM_ASSIGN_OR_RETURN(const Value b, Eval(*e.args[1], scope));
      return At(e.pos, Arithmetic(e.name, a, b));
    }
    case E::kCompare: {  // chained as in Python: a < b < c is a < b and b < c
      NAMM_ASSIGN_OR_RETURN(Value left, Eval(*e.args[0], scope));
      for (size_t k = 0; k < e.ops.size(); ++k) {
        NAMM_ASSIGN_OR_RETURN(Value right, Eval(*e.args[k + 1], scope));
        NAMM_RETURN_IF_ERROR(Charge(Expanded(left) + Expanded(right), e.pos));
        NAMM_ASSIGN_OR_RETURN(const bool holds, At(e.pos, Compare(e.ops[k], left, right)));
        if (!holds) return MakeBool(false);
        left = std::move(right);
      }
      return MakeBool(true);
    }
    case E::kAnd:
    case E::kOr: {  // the deciding operand itself, as in Python
      NAMM_ASSIGN_OR_RETURN(Value left, Eval(*e.args[0], scope));
      if (Truthy(left) == (e.kind == E::kOr)) return left;
      return Eval(*e.args[1], scope);
    }
    case E::kCond: {
      NAMM_ASSIGN_OR_RETURN(const Value condition, Eval(*e.args[1], scope));
      if (Truthy(condition)) return Eval(*e.args[0], scope);
      if (e.args[2]) return Eval(*e.args[2], scope);
      return MakeUndefined();
    }
  }
  return Status::Internal("unknown expression kind");
}

// What may go into a list, dict or namespace: no namespace (so no namespace can ever contain itself), and
// values nested within the limit.
Status Renderer::CheckStorable(const Value& v, size_t pos) const {
  if (v.kind == K::kNamespace) return Error(pos, "a namespace cannot be stored in a list, dict or namespace");
  if (v.depth >= kMaxNesting) return Error(pos, "values nested more than 100 levels deep");
  return Status::Ok();
}

Result<Value> Renderer::EvalContainer(const Expr& e, Scope& scope) {
  List items;
  Dict entries;
  std::string key;
  for (size_t k = 0; k < e.args.size(); ++k) {
    NAMM_ASSIGN_OR_RETURN(Value v, Eval(*e.args[k], scope));
    if (e.kind == E::kDict && k % 2 == 0) {  // a key; its value follows
      if (v.kind != K::kString) return Error(e.args[k]->pos, "dict keys must be strings, not " + TypeName(v));
      key = std::move(v.s);
      continue;
    }
    NAMM_RETURN_IF_ERROR(CheckStorable(v, e.args[k]->pos));
    if (e.kind == E::kList) {
      items.push_back(std::move(v));
    } else {
      SetKey(entries, key, std::move(v));
    }
  }
  return e.kind == E::kList ? MakeList(std::move(items)) : MakeDict(std::move(entries));
}

Status Renderer::EvalArguments(const Expr& e, Scope& scope, List& args, Dict& kwargs) {
  const size_t positional = e.args.size() - e.keywords.size();
  for (size_t k = 1; k < e.args.size(); ++k) {
    NAMM_ASSIGN_OR_RETURN(Value v, Eval(*e.args[k], scope));
    if (k < positional) {
      args.push_back(std::move(v));
    } else {
      kwargs.emplace_back(e.keywords[k - positional], std::move(v));
    }
  }
  return Status::Ok();
}

Result<Value> Renderer::EvalCall(const Expr& e, Scope& scope) {
  const Expr& callee = *e.args[0];
  Value fn, self;
  const bool method = callee.kind == E::kAttr;
  if (method) {
    NAMM_ASSIGN_OR_RETURN(self, Eval(*callee.args[0], scope));
  } else {
    NAMM_ASSIGN_OR_RETURN(fn, Eval(callee, scope));
  }
  List args;
  Dict kwargs;
  NAMM_RETURN_IF_ERROR(EvalArguments(e, scope, args, kwargs));
  if (method) {
    if (self.kind == K::kString || self.kind == K::kDict) {
      return At(e.pos, CallMethod(self, callee.name, args, kwargs));
    }
    fn = GetAttr(self, callee.name);
  }
  if (fn.kind == K::kUndefined) return Error(e.pos, "'" + fn.s + "' is undefined");
  if (fn.kind != K::kCallable) return Error(e.pos, "'" + TypeName(fn) + "' object is not callable");
  return CallBuiltin(fn.s, args, kwargs, e.pos);
}

Result<Value> Renderer::CallBuiltin(const std::string& name, const List& args, const Dict& kwargs,
                                    size_t pos) {
  if (name == "raise_exception") {
    NAMM_ASSIGN_OR_RETURN(const Bound p, At(pos, Bind(name, args, kwargs, {"message"}, 1)));
    return Status::InvalidArgument("chat template: " + ToStr(*p[0]));  // the template's words, unadorned
  }
  if (name == "namespace") {
    if (!args.empty()) return Error(pos, "namespace() takes keyword arguments only");
    Dict attrs;
    for (const auto& [key, value] : kwargs) {
      NAMM_RETURN_IF_ERROR(CheckStorable(value, pos));
      SetKey(attrs, key, value);
    }
    return MakeDict(std::move(attrs), K::kNamespace);
  }
  // range(stop) or range(start, stop[, step]), as in Python.
  NAMM_ASSIGN_OR_RETURN(const Bound p, At(pos, Bind(name, args, kwargs, {"start", "stop", "step"}, 1)));
  for (const Value* v : p) {
    if (v != nullptr && !IsInteger(*v)) return Error(pos, "range() takes integers, not " + TypeName(*v));
  }
  const int64_t start = p[1] != nullptr ? AsInt(*p[0]) : 0;
  const int64_t stop = AsInt(p[1] != nullptr ? *p[1] : *p[0]);
  const int64_t step = p[2] != nullptr ? AsInt(*p[2]) : 1;
  if (step == 0) return Error(pos, "range() step must not be zero");
  const uint64_t count = StepCount(start, stop, step);
  if (count > kMaxItems) return Error(pos, "range() of more than 1048576 numbers");
  List items;
  for (uint64_t k = 0; k < count; ++k) {  // unsigned: no overflow on the way to a representable result
    const uint64_t value = static_cast<uint64_t>(start) + k * static_cast<uint64_t>(step);
    items.push_back(MakeInt(static_cast<int64_t>(value)));
  }
  return MakeList(std::move(items));
}

// tokenizer_config.json's chat_template: a string, or named templates of which apply_chat_template uses
// "default".
Result<std::string> TemplateFromConfig(const Json& config, const std::string& path) {
  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) {
    return Status::NotFound(path + ": no chat_template (a base model rather than a chat model?)");
  }
  if (it->is_string()) return it->get<std::string>();
  if (!it->is_array()) {
    return Status::Corruption(path + ": chat_template must be a string or a list of templates");
  }
  std::string names;
  for (const Json& entry : *it) {
    const auto name = entry.is_object() ? entry.find("name") : entry.end();
    const auto source = entry.is_object() ? entry.find("template") : entry.end();
    if (name == entry.end() || !name->is_string() || source == entry.end() || !source->is_string()) {
      return Status::Corruption(path + ": chat_template entries must be {\"name\": ..., \"template\": ...}");
    }
    if (*name == "default") return source->get<std::string>();
    names += (names.empty() ? "" : ", ") + name->get<std::string>();
  }
  return Status::NotFound(path + ": chat_template has no template named \"default\" (only: " + names + ")");
}

// The special tokens in tokenizer_config.json or special_tokens_map.json (each a string or an object with
// "content"; null unsets one) into `variables`, as transformers passes them to templates.
Status ReadSpecialTokens(const Json& file, const std::string& path, OrderedJson& variables) {
  for (const char* name :
       {"bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"}) {
    const auto token = file.find(name);
    if (token == file.end()) continue;
    const auto content = token->is_object() ? token->find("content") : token->end();
    if (token->is_null()) {
      variables.erase(name);
    } else if (token->is_string()) {
      variables[name] = token->get<std::string>();
    } else if (content != token->end() && content->is_string()) {
      variables[name] = content->get<std::string>();
    } else {
      return Status::Corruption(path + ": " + name +
                                " must be a string or an object with a string \"content\"");
    }
  }
  return Status::Ok();
}

Result<Json> ReadJsonObject(const std::string& path) {
  NAMM_ASSIGN_OR_RETURN(const std::string text, read_file(path));
  NAMM_ASSIGN_OR_RETURN(Json json, parse_json_bounded(text, path));
  if (!json.is_object()) return Status::Corruption(path + ": not a JSON object");
  return json;
}

}  // namespace

struct ChatTemplate::Program {
  std::string source;  // normalized, as positions in errors refer to it
  Body body;
};

Result<ChatTemplate> ChatTemplate::Parse(const std::string& source) {
  auto program = std::make_shared<Program>();
  program->source = Normalize(source);
  NAMM_ASSIGN_OR_RETURN(std::vector<Token> tokens, Lexer(program->source).Run());
  NAMM_ASSIGN_OR_RETURN(program->body, Parser(program->source, std::move(tokens)).Run());
  return ChatTemplate(std::move(program));
}

Result<std::string> ChatTemplate::Render(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                         const OrderedJson& variables) const {
  if (!variables.is_object() && !variables.is_null()) {
    return Status::InvalidArgument("chat template variables must be a JSON object");
  }
  Scope globals;
  for (const char* builtin : {"raise_exception", "namespace", "range"}) {
    globals.vars[builtin] = MakeCallable(builtin);
  }
  // transformers passes these to every template, as None when the caller has none.
  globals.vars["tools"] = MakeNone();
  globals.vars["documents"] = MakeNone();
  for (auto it = variables.begin(); variables.is_object() && it != variables.end(); ++it) {
    if (it.key() == "messages" || it.key() == "add_generation_prompt") {
      return Status::InvalidArgument("chat template variables must not set '" + it.key() +
                                     "': it is an argument");
    }
    NAMM_ASSIGN_OR_RETURN(globals.vars[it.key()], FromJson(it.value(), 0));
  }
  List list;
  for (const ChatMessage& message : messages) {
    list.push_back(MakeDict({{"role", MakeString(message.role)}, {"content", MakeString(message.content)}}));
  }
  globals.vars["messages"] = MakeList(std::move(list));
  globals.vars["add_generation_prompt"] = MakeBool(add_generation_prompt);
  std::string out;
  NAMM_RETURN_IF_ERROR(Renderer(program_->source).Exec(program_->body, globals, out));
  return out;
}

Result<LoadedChatTemplate> load_chat_template(const std::string& model_or_tokenizer_dir) {
  const std::string& dir = model_or_tokenizer_dir;
  const std::string config_path = dir + "/tokenizer_config.json", jinja_path = dir + "/chat_template.jinja";
  const std::string map_path = dir + "/special_tokens_map.json";
  const bool has_jinja = path_exists(jinja_path);
  Json config = Json::object();
  if (path_exists(config_path)) {
    NAMM_ASSIGN_OR_RETURN(config, ReadJsonObject(config_path));
  } else if (!has_jinja) {
    return Status::NotFound(dir + ": no tokenizer_config.json or chat_template.jinja, so no chat template");
  }
  // As in transformers, a chat_template.jinja file wins over the config's chat_template.
  const std::string& source_path = has_jinja ? jinja_path : config_path;
  NAMM_ASSIGN_OR_RETURN(const std::string source,
                        has_jinja ? read_file(jinja_path) : TemplateFromConfig(config, config_path));
  auto parsed = ChatTemplate::Parse(source);
  if (!parsed.ok()) return parsed.status().WithContext(source_path);
  // transformers reads the special tokens from the config, then lets special_tokens_map.json override them.
  OrderedJson variables = OrderedJson::object();
  NAMM_RETURN_IF_ERROR(ReadSpecialTokens(config, config_path, variables));
  if (path_exists(map_path)) {
    NAMM_ASSIGN_OR_RETURN(const Json map, ReadJsonObject(map_path));
    NAMM_RETURN_IF_ERROR(ReadSpecialTokens(map, map_path, variables));
  }
  return LoadedChatTemplate{std::move(parsed).value(), std::move(variables)};
}

}  // namespace namm::worker
