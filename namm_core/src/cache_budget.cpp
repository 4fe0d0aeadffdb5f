#include "namm/cache_budget.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace namm {

Result<CacheBudget> CacheBudget::Tokens(int64_t tokens) {
  if (tokens <= 0)
    return Status::InvalidArgument("a cache budget needs budget > 0, got " + std::to_string(tokens));
  return CacheBudget(tokens, 0);
}

Result<CacheBudget> CacheBudget::Ratio(double ratio) {
  if (!(ratio > 0 && ratio <= 1)) {
    return Status::InvalidArgument("a cache ratio must be in (0, 1], got " + std::to_string(ratio));
  }
  return CacheBudget(0, ratio);
}

Result<CacheBudget> CacheBudget::FromSpec(const OptionSpec& spec) {
  const bool has_budget = spec.options.count("budget") > 0, has_ratio = spec.options.count("ratio") > 0;
  if (has_budget == has_ratio) {
    return Status::InvalidArgument(
        "'" + spec.ToString() + "': " + spec.name +
        " needs exactly one of budget=N (tokens per KV head) or ratio=R (share of the prompt)");
  }
  Result<CacheBudget> budget = [&]() -> Result<CacheBudget> {
    if (has_budget) {
      NAMM_ASSIGN_OR_RETURN(int64_t tokens, spec.GetInt("budget", 0));
      return Tokens(tokens);
    }
    NAMM_ASSIGN_OR_RETURN(double ratio, spec.GetDouble("ratio", 0));
    return Ratio(ratio);
  }();
  if (!budget.ok()) return budget.status().WithContext("'" + spec.ToString() + "'");
  return budget;
}

int64_t CacheBudget::Resolve(int64_t prompt_tokens) const {
  if (!is_ratio()) return tokens_;
  return std::max<int64_t>(
      1, static_cast<int64_t>(std::ceil(ratio_ * static_cast<double>(prompt_tokens) - 1e-9)));
}

std::string CacheBudget::ToString() const {
  if (!is_ratio()) return "budget=" + std::to_string(tokens_);
  std::ostringstream out;
  out << "ratio=" << ratio_;
  return out.str();
}

}  // namespace namm
