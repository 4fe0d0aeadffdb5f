// Builds a memory policy from its spec string, as `--policy` and `eval --policies` take it:
//   full
//   h2o:budget=N|ratio=R[,recent=N]        heavy hitters + a recent window (recent: half the budget by default)
//   l2:budget=N|ratio=R                    lowest key norms
//   streaming:budget=N|ratio=R[,sinks=4]   StreamingLLM: attention sinks + a recent window
//   tova:budget=N|ratio=R                  attention of the latest query
//   snapkv:budget=N|ratio=R[,window=32,kernel=7]   prompt compression at the end of prefill
//   fastgen:budget=N|ratio=R[,recovery=0.95,window=32][,heads=own]   per-head profiles at the end of prefill
//                                          (heads=own: each KV head keeps its own count, not the layer's largest)
//   namm:FILE.safetensors[,budget=N|,ratio=R|,threshold=T][,prompt=keep][,heads=own]   a NAMM file; with a
//                                          knob, each KV head keeps its N (or R of the prompt) best-scored tokens,
//                                          or those scoring >= T (not 0); prompt=keep: no eviction before the
//                                          prompt's end; heads=own: each KV head keeps its own count, not the
//                                          layer's largest (a ragged cache)
//   oracle                                 evaluation ceiling: evicts a synthetic row's marked interruption
// budget = tokens kept per KV head; ratio = that number as a share of each prompt.
#pragma once

#include <c10/core/Device.h>
#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "namm/namm_model.h"
#include "namm/policies/memory_policy.h"
#include "namm/policies/namm_policy.h"
#include "namm/status.h"
#include "namm/worker/tokenizer.h"

namespace namm::worker {

// Token classes for FastGen: special tokens (dropped when decoding with skip_special_tokens) and punctuation
// (tokens whose text, without surrounding whitespace, is nothing but punctuation).
struct TokenClasses {
  std::vector<int64_t> special, punctuation;
};
TokenClasses classify_tokens(const Tokenizer& tokenizer);

// What some policies need besides their spec.
struct PolicyContext {
  at::Device device = at::kCPU;          // where a NAMM's parameters go
  const Tokenizer* tokenizer = nullptr;  // FastGen's token classes (special tokens, punctuation)
  // The row being run: the oracle evicts its "evict_spans" ([[begin, end], ...] absolute token positions).
  const nlohmann::json* row = nullptr;
};

// Builds policies for one sequence each, keeping what is costly to derive (FastGen's token classes, NAMM files)
// from one policy to the next. Not thread-safe.
class PolicyFactory {
 public:
  // `tokenizer` (may be null when no FastGen policy is made) must outlive the factory.
  PolicyFactory(at::Device device, const Tokenizer* tokenizer) : device_(device), tokenizer_(tokenizer) {}
  Result<std::unique_ptr<MemoryPolicy>> Make(const std::string& spec, const nlohmann::json* row = nullptr);

 private:
  at::Device device_;
  const Tokenizer* tokenizer_;
  std::optional<TokenClasses> classes_;
  std::map<std::string, NammModel> namm_models_;
};

// "namm:FILE[,budget=N|,ratio=R|,threshold=T][,prompt=keep|evict][,heads=own|equal]" split: the file (which may
// hold ':' and ',') and the options.
struct NammSpec {
  std::string path;
  NammPolicy::SelectionKnob knob;
  std::string setting;  // "budget=N", "ratio=R", "threshold=T" as given, or ""
  bool keep_prompt = false;  // prompt=keep (NammPolicy::set_keep_prompt)
  bool own_head_counts = false;  // heads=own (NammPolicy::set_own_head_counts)
  // The spec again, options in a fixed order: "namm:FILE[,SETTING][,prompt=keep][,heads=own]".
  std::string ToString() const;
};
Result<NammSpec> parse_namm_spec(const std::string& spec);
// Whether the policy's caches hold the whole prompt until its end: a NAMM with prompt=keep, SnapKV and FastGen
// (they compress the prompt once, at its end). False for anything else, or a spec that does not parse.
bool policy_keeps_prompt(const std::string& spec);

// One policy, without a factory's caching.
Result<std::unique_ptr<MemoryPolicy>> make_policy(const std::string& spec, const PolicyContext& context);

// The spec's family ("h2o" for "h2o:budget=256", "namm" for "namm:F"), after checking that it parses.
Result<std::string> policy_family(const std::string& spec);
// Whether the family takes budget=/ratio= (the fixed-budget baselines).
bool is_budgeted_family(const std::string& family);
// The most tokens per KV head the policy's cache holds at once over a prompt of `prompt_tokens` and up to
// `new_tokens` generated ones, when it adds up to `step` tokens (a prefill chunk, a memory-update interval)
// between evictions; never more than prompt + new tokens, which is what nothing bounds (full, oracle, a NAMM
// without a knob, FastGen: a head whose attention needs it keeps every token). A budget= or ratio= holds its
// tokens plus a step; a policy that keeps the prompt (policy_keeps_prompt) holds at least the prompt; SnapKV
// keeps every token after it. What namm-api admits a request at.
Result<int64_t> policy_peak_tokens(const std::string& spec, int64_t prompt_tokens, int64_t new_tokens, int64_t step);
// The spec with its budget replaced, e.g. ("h2o:recent=8", "ratio=0.5") -> "h2o:ratio=0.5,recent=8",
// ("namm:f.safetensors", "budget=32") -> "namm:f.safetensors,budget=32". A NAMM's prompt= and heads= are added
// to its flags, and a setting of those alone keeps its budget ("namm:f,budget=8" + "heads=own").
Result<std::string> with_cache_setting(const std::string& spec, const std::string& setting);

}  // namespace namm::worker
