#include "namm/tasks/sequence_matcher.h"

#include <cmath>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "namm/tasks/python_text.h"

namespace namm::tasks {

namespace {

struct Match {
  std::size_t a, b, size;
};

class Matcher {
 public:
  Matcher(const std::u32string& a, const std::u32string& b) : a_(a), b_(b) {
    for (std::size_t j = 0; j < b.size(); ++j) b2j_[b[j]].push_back(j);
    if (b.size() >= 200) {  // autojunk: drop popular elements from the index (they are not junk)
      const std::size_t ntest = b.size() / 100 + 1;
      for (auto it = b2j_.begin(); it != b2j_.end();) {
        it = it->second.size() > ntest ? b2j_.erase(it) : std::next(it);
      }
    }
  }

  // difflib's find_longest_match (no junk elements: isjunk is None).
  Match FindLongestMatch(std::size_t alo, std::size_t ahi, std::size_t blo, std::size_t bhi) const {
    std::size_t besti = alo, bestj = blo, bestsize = 0;
    std::unordered_map<std::size_t, std::size_t> j2len, next;
    static const std::vector<std::size_t> kNothing;
    for (std::size_t i = alo; i < ahi; ++i) {
      next.clear();
      auto found = b2j_.find(a_[i]);
      for (std::size_t j : found == b2j_.end() ? kNothing : found->second) {
        if (j < blo) continue;
        if (j >= bhi) break;
        auto prev = j > 0 ? j2len.find(j - 1) : j2len.end();
        const std::size_t k = next[j] = (prev == j2len.end() ? 0 : prev->second) + 1;
        if (k > bestsize) {
          besti = i - k + 1;
          bestj = j - k + 1;
          bestsize = k;
        }
      }
      std::swap(j2len, next);
    }
    // Extend with equal elements on both sides (popular elements included: nothing is junk).
    while (besti > alo && bestj > blo && a_[besti - 1] == b_[bestj - 1]) {
      --besti;
      --bestj;
      ++bestsize;
    }
    while (besti + bestsize < ahi && bestj + bestsize < bhi && a_[besti + bestsize] == b_[bestj + bestsize]) ++bestsize;
    return {besti, bestj, bestsize};
  }

  std::size_t MatchedElements() const {
    std::size_t total = 0;
    std::vector<std::tuple<std::size_t, std::size_t, std::size_t, std::size_t>> queue = {{0, a_.size(), 0, b_.size()}};
    while (!queue.empty()) {
      const auto [alo, ahi, blo, bhi] = queue.back();
      queue.pop_back();
      const Match m = FindLongestMatch(alo, ahi, blo, bhi);
      if (m.size == 0) continue;
      total += m.size;
      if (alo < m.a && blo < m.b) queue.emplace_back(alo, m.a, blo, m.b);
      if (m.a + m.size < ahi && m.b + m.size < bhi) queue.emplace_back(m.a + m.size, ahi, m.b + m.size, bhi);
    }
    return total;
  }

 private:
  const std::u32string& a_;
  const std::u32string& b_;
  std::unordered_map<char32_t, std::vector<std::size_t>> b2j_;
};

}  // namespace

double sequence_matcher_ratio(const std::u32string& a, const std::u32string& b) {
  const std::size_t length = a.size() + b.size();
  if (length == 0) return 1.0;
  return 2.0 * static_cast<double>(Matcher(a, b).MatchedElements()) / static_cast<double>(length);
}

int fuzz_ratio(const std::string& a, const std::string& b) {
  if (a == b) return 100;
  if (a.empty() || b.empty()) return 0;
  const double value = 100.0 * sequence_matcher_ratio(to_u32(a), to_u32(b));
  return static_cast<int>(std::nearbyint(value));  // round half to even, like Python's round()
}

}  // namespace namm::tasks
