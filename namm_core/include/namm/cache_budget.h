// How many tokens per KV head a cache keeps: a number of tokens ("budget=N"), or a share of the prompt
// ("ratio=R", resolved when a sequence begins), so that one setting means the same relative cache on prompts of
// every length. Torch-free: the fixed-budget baselines, a NAMM's budget knob and task variants
// (namm/tasks/task_variant.h) share it.
#pragma once

#include <cstdint>
#include <string>

#include "namm/option_spec.h"
#include "namm/status.h"

namespace namm {

class CacheBudget {
 public:
  static Result<CacheBudget> Tokens(int64_t tokens);  // > 0
  static Result<CacheBudget> Ratio(double ratio);     // in (0, 1]
  // From a policy spec's "budget" or "ratio" key (exactly one of them); errors name the spec.
  static Result<CacheBudget> FromSpec(const OptionSpec& spec);

  // Tokens kept for a prompt of `prompt_tokens`: the fixed number, or ceil(ratio x prompt_tokens), at
  // least 1.
  int64_t Resolve(int64_t prompt_tokens) const;
  bool is_ratio() const { return ratio_ > 0; }
  // "budget=256" or "ratio=0.5", as in a policy spec.
  std::string ToString() const;

 private:
  CacheBudget(int64_t tokens, double ratio) : tokens_(tokens), ratio_(ratio) {}
  int64_t tokens_;
  double ratio_;
};

}  // namespace namm
