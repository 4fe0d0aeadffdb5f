#include "namm/tasks/jieba.h"

#include <unicode/uchar.h>

#include <array>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "namm/file_util.h"
#include "namm/tasks/python_text.h"

namespace namm::tasks {

namespace {

constexpr double kMinFloat = -3.14e100;
constexpr const char* kDebianJiebaDir = "/usr/lib/python3/dist-packages/jieba";
constexpr char kStates[4] = {'B', 'E', 'M', 'S'};  // in character order, for Python's tuple comparisons
enum State { kB = 0, kE = 1, kM = 2, kS = 3 };
// The states that may precede each state (jieba's PrevStatus).
const std::array<std::array<State, 2>, 4> kPrevious = {{{kE, kS}, {kB, kM}, {kM, kB}, {kS, kE}}};

bool IsJiebaRunChar(char32_t c) {  // re_han_default: [\u4E00-\u9FD5a-zA-Z0-9+#&\._%\-]
  return (c >= 0x4E00 && c <= 0x9FD5) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
         (c >= '0' && c <= '9') || c == '+' || c == '#' || c == '&' || c == '.' || c == '_' || c == '%' || c == '-';
}

bool IsHan(char32_t c) { return c >= 0x4E00 && c <= 0x9FD5; }
bool IsAsciiAlnum(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }
bool IsDecimal(char32_t c) { return u_charType(static_cast<UChar32>(c)) == U_DECIMAL_DIGIT_NUMBER; }

// A Python dict literal of the form in jieba's prob_*.py files: {'B': -0.26, ...} or {'B': {'\u4e00': -3.6,
// ...}, ...}. Keys are quoted strings with \uXXXX escapes; values numbers or nested dicts.
class DictParser {
 public:
  explicit DictParser(const std::string& text) : text_(text) {}

  // Positions the parser after "P=".
  bool Start() {
    pos_ = text_.find("P=");
    if (pos_ == std::string::npos) return false;
    pos_ += 2;
    return true;
  }
  bool Eat(char c) {
    Skip();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool Peek(char c) {
    Skip();
    return pos_ < text_.size() && text_[pos_] == c;
  }
  bool Key(std::u32string* out) {
    Skip();
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) return false;
    const char quote = text_[pos_++];
    out->clear();
    while (pos_ < text_.size() && text_[pos_] != quote) {
      if (text_[pos_] == '\\' && pos_ + 1 < text_.size()) {
        const char kind = text_[pos_ + 1];
        if (kind == 'u' || kind == 'U') {
          const std::size_t digits = kind == 'u' ? 4 : 8;
          out->push_back(static_cast<char32_t>(std::stoul(text_.substr(pos_ + 2, digits), nullptr, 16)));
          pos_ += 2 + digits;
        } else {
          out->push_back(static_cast<char32_t>(kind));
          pos_ += 2;
        }
      } else {
        const int n = (static_cast<unsigned char>(text_[pos_]) & 0x80) == 0 ? 1 : 0;
        if (n == 1) {
          out->push_back(static_cast<unsigned char>(text_[pos_++]));
        } else {  // a literal UTF-8 character
          std::size_t end = pos_ + 1;
          while (end < text_.size() && (static_cast<unsigned char>(text_[end]) & 0xC0) == 0x80) ++end;
          const std::u32string c = to_u32(text_.substr(pos_, end - pos_));
          out->append(c);
          pos_ = end;
        }
      }
    }
    if (pos_ >= text_.size()) return false;
    ++pos_;
    return true;
  }
  bool Number(double* out) {
    Skip();
    const char* begin = text_.c_str() + pos_;
    char* end = nullptr;
    *out = std::strtod(begin, &end);
    if (end == begin) return false;
    pos_ += static_cast<std::size_t>(end - begin);
    return true;
  }

 private:
  void Skip() {
    while (pos_ < text_.size() && (std::isspace(static_cast<unsigned char>(text_[pos_])))) ++pos_;
  }
  const std::string& text_;
  std::size_t pos_ = 0;
};

int StateIndex(const std::u32string& key) {
  if (key.size() != 1) return -1;
  for (int s = 0; s < 4; ++s) {
    if (static_cast<char32_t>(kStates[s]) == key[0]) return s;
  }
  return -1;
}

}  // namespace

struct Jieba::Data {
  std::unordered_map<std::u32string, int64_t> freq;  // words and their prefixes (0)
  double log_total = 0;
  std::array<double, 4> start{};
  std::array<std::array<double, 4>, 4> trans{};  // kMinFloat where jieba's table has no entry
  std::array<std::unordered_map<char32_t, double>, 4> emit;

  int64_t Freq(const std::u32string& word) const {
    auto it = freq.find(word);
    return it == freq.end() ? -1 : it->second;  // -1: absent
  }

  // The HMM segmentation of a run of Han characters (finalseg.__cut).
  void HmmCut(const std::u32string& s, std::vector<std::string>* out) const {
    const std::size_t n = s.size();
    auto emit_p = [&](int state, char32_t c) {
      auto it = emit[static_cast<std::size_t>(state)].find(c);
      return it == emit[static_cast<std::size_t>(state)].end() ? kMinFloat : it->second;
    };
    std::vector<std::array<double, 4>> v(n);
    std::vector<std::array<int, 4>> from(n);
    for (int y = 0; y < 4; ++y) v[0][static_cast<std::size_t>(y)] = start[static_cast<std::size_t>(y)] + emit_p(y, s[0]);
    for (std::size_t t = 1; t < n; ++t) {
      for (int y = 0; y < 4; ++y) {
        const double em = emit_p(y, s[t]);
        double best = 0;
        int best_state = -1;
        for (State y0 : kPrevious[static_cast<std::size_t>(y)]) {
          const double p = v[t - 1][y0] + trans[y0][static_cast<std::size_t>(y)] + em;
          // Python's max over (prob, state) tuples: ties go to the larger state letter.
          if (best_state < 0 || p > best || (p == best && y0 > best_state)) {
            best = p;
            best_state = y0;
          }
        }
        v[t][static_cast<std::size_t>(y)] = best;
        from[t][static_cast<std::size_t>(y)] = best_state;
      }
    }
    const double e = v[n - 1][kE], last_s = v[n - 1][kS];
    int state = (last_s > e || last_s == e) ? kS : kE;  // max((prob, y) for y in 'ES'): ties to 'S'
    std::vector<int> path(n);
    for (std::size_t t = n; t-- > 0;) {
      path[t] = state;
      if (t > 0) state = from[t][static_cast<std::size_t>(state)];
    }
    std::size_t begin = 0, next = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (path[i] == kB) {
        begin = i;
      } else if (path[i] == kE) {
        out->push_back(to_utf8(s.substr(begin, i + 1 - begin)));
        next = i + 1;
      } else if (path[i] == kS) {
        out->push_back(to_utf8(std::u32string(1, s[i])));
        next = i + 1;
      }
    }
    if (next < n) out->push_back(to_utf8(s.substr(next)));
  }

  // finalseg.cut: Han runs through the HMM, [a-zA-Z0-9]+(\.\d+)?%? runs and the rest as they are.
  void FinalSegCut(const std::u32string& s, std::vector<std::string>* out) const {
    std::size_t i = 0;
    while (i < s.size()) {
      std::size_t j = i;
      if (IsHan(s[i])) {
        while (j < s.size() && IsHan(s[j])) ++j;
        HmmCut(s.substr(i, j - i), out);
        i = j;
        continue;
      }
      while (j < s.size() && !IsHan(s[j])) ++j;
      // Non-Han block: split around the re_skip matches, yielding every non-empty piece.
      const std::u32string block = s.substr(i, j - i);
      std::size_t k = 0, gap = 0;
      while (k < block.size()) {
        if (!IsAsciiAlnum(block[k])) {
          ++k;
          continue;
        }
        std::size_t end = k;
        while (end < block.size() && IsAsciiAlnum(block[end])) ++end;
        if (end + 1 < block.size() && block[end] == '.' && IsDecimal(block[end + 1])) {
          end += 1;
          while (end < block.size() && IsDecimal(block[end])) ++end;
        }
        if (end < block.size() && block[end] == '%') ++end;
        if (k > gap) out->push_back(to_utf8(block.substr(gap, k - gap)));
        out->push_back(to_utf8(block.substr(k, end - k)));
        k = gap = end;
      }
      if (gap < block.size()) out->push_back(to_utf8(block.substr(gap)));
      i = j;
    }
  }

  // __cut_DAG on one run of jieba characters.
  void CutRun(const std::u32string& s, std::vector<std::string>* out) const {
    const std::size_t n = s.size();
    // DAG: for each start k, the ends i such that s[k..i] is a word with non-zero frequency.
    std::vector<std::vector<std::size_t>> dag(n);
    for (std::size_t k = 0; k < n; ++k) {
      std::size_t i = k;
      std::u32string frag(1, s[k]);
      int64_t f;
      while (i < n && (f = Freq(frag)) >= 0) {
        if (f > 0) dag[k].push_back(i);
        ++i;
        if (i < n) frag.push_back(s[i]);
      }
      if (dag[k].empty()) dag[k].push_back(k);
    }
    // Route: maximum of log(freq or 1) - log_total + route[x + 1], ties to the larger x (Python tuples).
    std::vector<std::pair<double, std::size_t>> route(n + 1, {0.0, 0});
    for (std::size_t idx = n; idx-- > 0;) {
      bool first = true;
      std::pair<double, std::size_t> best{0.0, 0};
      for (std::size_t x : dag[idx]) {
        const int64_t f = Freq(s.substr(idx, x + 1 - idx));
        const double score = std::log(static_cast<double>(f > 0 ? f : 1)) - log_total + route[x + 1].first;
        const std::pair<double, std::size_t> candidate{score, x};
        if (first || candidate > best) best = candidate;
        first = false;
      }
      route[idx] = best;
    }
    std::u32string buf;
    auto flush = [&] {
      if (buf.empty()) return;
      if (buf.size() == 1) {
        out->push_back(to_utf8(buf));
      } else if (Freq(buf) <= 0) {  // `not FREQ.get(buf)`: absent or frequency 0
        FinalSegCut(buf, out);
      } else {
        for (char32_t c : buf) out->push_back(to_utf8(c));
      }
      buf.clear();
    };
    for (std::size_t x = 0; x < n;) {
      const std::size_t y = route[x].second + 1;
      if (y - x == 1) {
        buf.push_back(s[x]);
      } else {
        flush();
        out->push_back(to_utf8(s.substr(x, y - x)));
      }
      x = y;
    }
    flush();
  }
};

Jieba::Jieba(std::unique_ptr<Data> data) : data_(std::move(data)) {}
Jieba::~Jieba() = default;

Result<std::shared_ptr<const Jieba>> Jieba::Load(const std::string& dir) {
  auto data = std::make_unique<Data>();
  const std::string dict_path = dir + "/dict.txt";
  std::ifstream dict(dict_path);
  if (!dict) {
    return Status::NotFound(dict_path + ": jieba's dictionary is missing (install python3-jieba, or set "
                            "NAMM_JIEBA_DIR to a jieba package directory)");
  }
  int64_t total = 0;
  std::string line;
  for (int64_t lineno = 1; std::getline(dict, line); ++lineno) {
    // line.strip(), then the first two space-separated fields.
    const auto first = line.find_first_not_of(" \t\r\n");
    if (first == std::string::npos) {
      return Status::Corruption(dict_path + ": invalid dictionary entry at line " + std::to_string(lineno));
    }
    line = line.substr(first, line.find_last_not_of(" \t\r\n") - first + 1);
    const auto space = line.find(' ');
    if (space == std::string::npos) {
      return Status::Corruption(dict_path + ": invalid dictionary entry at line " + std::to_string(lineno));
    }
    const auto space2 = line.find(' ', space + 1);
    const std::u32string word = to_u32(line.substr(0, space));
    int64_t freq = 0;
    try {
      freq = std::stoll(line.substr(space + 1, space2 == std::string::npos ? std::string::npos : space2 - space - 1));
    } catch (const std::exception&) {
      return Status::Corruption(dict_path + ": invalid frequency at line " + std::to_string(lineno));
    }
    data->freq[word] = freq;
    total += freq;
    for (std::size_t ch = 1; ch < word.size(); ++ch) data->freq.emplace(word.substr(0, ch), 0);
  }
  data->log_total = std::log(static_cast<double>(total));

  for (auto& row : data->trans) row.fill(kMinFloat);
  for (const char* name : {"prob_start", "prob_trans", "prob_emit"}) {
    const std::string path = dir + "/finalseg/" + name + ".py";
    NAMM_ASSIGN_OR_RETURN(std::string text, read_file(path));
    DictParser p(text);
    auto bad = [&] { return Status::Corruption(path + ": not a jieba probability table"); };
    if (!p.Start() || !p.Eat('{')) return bad();
    std::u32string key;
    while (!p.Eat('}')) {
      if (!p.Key(&key) || !p.Eat(':')) return bad();
      const int state = StateIndex(key);
      if (state < 0) return bad();
      if (std::string(name) == "prob_start") {
        double value;
        if (!p.Number(&value)) return bad();
        data->start[static_cast<std::size_t>(state)] = value;
      } else {
        if (!p.Eat('{')) return bad();
        while (!p.Eat('}')) {
          std::u32string inner;
          double value;
          if (!p.Key(&inner) || !p.Eat(':') || !p.Number(&value)) return bad();
          if (std::string(name) == "prob_trans") {
            const int to = StateIndex(inner);
            if (to < 0) return bad();
            data->trans[static_cast<std::size_t>(state)][static_cast<std::size_t>(to)] = value;
          } else {
            if (inner.size() != 1) return bad();
            data->emit[static_cast<std::size_t>(state)][inner[0]] = value;
          }
          p.Eat(',');
        }
      }
      p.Eat(',');
    }
  }
  return std::shared_ptr<const Jieba>(new Jieba(std::move(data)));
}

Result<std::shared_ptr<const Jieba>> Jieba::Default() {
  static std::once_flag once;
  static Result<std::shared_ptr<const Jieba>> instance = Status::Internal("not loaded");
  std::call_once(once, [] {
    const char* env = std::getenv("NAMM_JIEBA_DIR");
    instance = Load(env != nullptr && *env != '\0' ? env : kDebianJiebaDir);
  });
  return instance;
}

std::vector<std::string> Jieba::Cut(const std::string& text) const {
  const std::u32string s = to_u32(text);
  std::vector<std::string> out;
  for (std::size_t i = 0; i < s.size();) {
    std::size_t j = i;
    if (IsJiebaRunChar(s[i])) {
      while (j < s.size() && IsJiebaRunChar(s[j])) ++j;
      data_->CutRun(s.substr(i, j - i), &out);
    } else {
      while (j < s.size() && !IsJiebaRunChar(s[j])) ++j;
      // re_skip_default "(\r\n|\s)": separators are kept whole; every other character is its own token.
      for (std::size_t k = i; k < j;) {
        if (s[k] == '\r' && k + 1 < j && s[k + 1] == '\n') {
          out.push_back("\r\n");
          k += 2;
        } else {
          out.push_back(to_utf8(s[k]));
          ++k;
        }
      }
    }
    i = j;
  }
  return out;
}

}  // namespace namm::tasks
