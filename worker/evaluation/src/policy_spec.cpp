#include "namm/worker/policy_spec.h"

#include <algorithm>

#include "namm/namm_file.h"
#include "namm/option_spec.h"
#include "namm/policies/cache_budget.h"
#include "namm/policies/fastgen_policy.h"
#include "namm/policies/full_cache_policy.h"
#include "namm/policies/h2o_policy.h"
#include "namm/policies/l2_policy.h"
#include "namm/policies/namm_policy.h"
#include "namm/policies/oracle_policy.h"
#include "namm/policies/snapkv_policy.h"
#include "namm/policies/streaming_llm_policy.h"
#include "namm/policies/tova_policy.h"
#include "namm/tasks/python_text.h"

namespace namm::worker {

namespace {

constexpr const char* kKnown =
    "full, h2o:budget=N|ratio=R[,recent=N], l2:budget=N|ratio=R[,skip_layers=L], streaming:budget=N|ratio=R[,sinks=S], "
    "tova:budget=N|ratio=R, snapkv:budget=N|ratio=R[,window=W,kernel=K], "
    "fastgen:budget=N|ratio=R[,recovery=T,window=W], namm:FILE.safetensors, oracle";

template <typename P>
Result<std::unique_ptr<MemoryPolicy>> Upcast(Result<std::unique_ptr<P>> policy) {
  if (!policy.ok()) return policy.status();
  return std::unique_ptr<MemoryPolicy>(std::move(*policy));
}

Result<std::unique_ptr<MemoryPolicy>> MakeOracle(const nlohmann::json* row) {
  if (row == nullptr || !row->contains("evict_spans")) {
    return Status::InvalidArgument("the oracle policy needs rows that mark what to evict ('evict_spans', as the "
                                   "syn/interruption rows do)");
  }
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const auto& span : (*row)["evict_spans"]) {
    if (!span.is_array() || span.size() != 2 || !span[0].is_number_integer() || !span[1].is_number_integer()) {
      return Status::InvalidArgument("'evict_spans' must be a list of [begin, end] integer pairs");
    }
    spans.emplace_back(span[0].get<int64_t>(), span[1].get<int64_t>());
  }
  return Upcast(OraclePolicy::Create(std::move(spans)));
}

// A NAMM's or FastGen's heads= (own | equal): whether each KV head keeps its own count (a ragged cache).
Result<bool> ParseHeads(const std::string& value) {
  if (value != "own" && value != "equal") {
    return Status::InvalidArgument("heads= takes own (each KV head keeps its own count of tokens) or equal (every "
                                   "head of a layer keeps the largest count, the default), got '" + value + "'");
  }
  return value == "own";
}

// Ragged caches gather on the host.
Status OwnHeadsOn(at::Device device, bool own) {
  if (!own || device.is_cpu()) return Status::Ok();
  return Status::InvalidArgument("heads=own (a ragged KV cache) runs on the CPU, not " + device.str());
}

}  // namespace

Result<std::unique_ptr<MemoryPolicy>> make_policy(const std::string& spec, const PolicyContext& context) {
  return PolicyFactory(context.device, context.tokenizer).Make(spec, context.row);
}

Result<std::unique_ptr<MemoryPolicy>> PolicyFactory::Make(const std::string& text, const nlohmann::json* row) {
  // A NAMM file's path may contain ':', so it is not parsed as options.
  if (text.rfind("namm:", 0) == 0) {
    NAMM_ASSIGN_OR_RETURN(NammSpec namm_spec, parse_namm_spec(text));
    auto it = namm_models_.find(namm_spec.path);
    if (it == namm_models_.end()) {
      NAMM_ASSIGN_OR_RETURN(NammModel model, read_namm_file(namm_spec.path));
      it = namm_models_.emplace(namm_spec.path, std::move(model)).first;
    }
    NAMM_ASSIGN_OR_RETURN(std::unique_ptr<NammPolicy> namm, NammPolicy::Create(it->second, device_));
    namm->set_observe_from_query_history(true);  // the engine records each layer's queries
    if (!namm_spec.setting.empty()) {
      NAMM_RETURN_IF_ERROR(namm->set_selection_knob(namm_spec.knob).WithContext("policy '" + text + "'"));
    }
    namm->set_keep_prompt(namm_spec.keep_prompt);
    NAMM_RETURN_IF_ERROR(OwnHeadsOn(device_, namm_spec.own_head_counts).WithContext("policy '" + text + "'"));
    namm->set_own_head_counts(namm_spec.own_head_counts);
    return std::unique_ptr<MemoryPolicy>(std::move(namm));
  }
  NAMM_ASSIGN_OR_RETURN(OptionSpec spec, parse_option_spec(text));
  const auto where = [&](const Status& s) { return s.WithContext("policy '" + text + "'"); };
  if (spec.name == "full" || spec.name == "oracle") {
    NAMM_RETURN_IF_ERROR(where(spec.CheckKeys({})));
    if (spec.name == "oracle") return MakeOracle(row);
    return std::unique_ptr<MemoryPolicy>(new FullCachePolicy());
  }
  if (!is_budgeted_family(spec.name)) {
    return Status::InvalidArgument("unknown policy '" + spec.name + "' (known: " + kKnown + ")");
  }
  NAMM_ASSIGN_OR_RETURN(CacheBudget budget, CacheBudget::FromSpec(spec));
  if (spec.name == "h2o") {
    NAMM_RETURN_IF_ERROR(where(spec.CheckKeys({"budget", "ratio", "recent"})));
    std::optional<int64_t> recent;
    if (spec.options.count("recent")) {
      NAMM_ASSIGN_OR_RETURN(int64_t r, spec.GetInt("recent", 0));
      recent = r;
    }
    return Upcast(H2OPolicy::Create(budget, recent));
  }
  if (spec.name == "l2") {
    NAMM_RETURN_IF_ERROR(where(spec.CheckKeys({"budget", "ratio", "skip_layers"})));
    NAMM_ASSIGN_OR_RETURN(int64_t skip_layers, spec.GetInt("skip_layers", 0));
    Result<std::unique_ptr<L2Policy>> l2 = L2Policy::Create(budget, skip_layers);
    if (!l2.ok()) return where(l2.status());
    return Upcast(std::move(l2));
  }
  if (spec.name == "streaming") {
    NAMM_RETURN_IF_ERROR(where(spec.CheckKeys({"budget", "ratio", "sinks"})));
    NAMM_ASSIGN_OR_RETURN(int64_t sinks, spec.GetInt("sinks", 4));
    return Upcast(StreamingLlmPolicy::Create(budget, sinks));
  }
  if (spec.name == "tova") {
    NAMM_RETURN_IF_ERROR(where(spec.CheckKeys({"budget", "ratio"})));
    return Upcast(TovaPolicy::Create(budget));
  }
  if (spec.name == "snapkv") {
    NAMM_RETURN_IF_ERROR(where(spec.CheckKeys({"budget", "ratio", "window", "kernel"})));
    NAMM_ASSIGN_OR_RETURN(int64_t window, spec.GetInt("window", 32));
    NAMM_ASSIGN_OR_RETURN(int64_t kernel, spec.GetInt("kernel", 7));
    return Upcast(SnapKvPolicy::Create(budget, window, kernel));
  }
  // fastgen
  NAMM_RETURN_IF_ERROR(where(spec.CheckKeys({"budget", "ratio", "recovery", "window", "heads"})));
  if (tokenizer_ == nullptr) return Status::InvalidArgument("fastgen needs the tokenizer (token classes)");
  FastGenOptions options;
  if (const auto heads = spec.options.find("heads"); heads != spec.options.end()) {
    const Result<bool> own = ParseHeads(heads->second);
    if (!own.ok()) return where(own.status());
    options.own_head_counts = *own;
    NAMM_RETURN_IF_ERROR(where(OwnHeadsOn(device_, options.own_head_counts)));
  }
  NAMM_ASSIGN_OR_RETURN(options.recovery, spec.GetDouble("recovery", options.recovery));
  NAMM_ASSIGN_OR_RETURN(options.window, spec.GetInt("window", options.window));
  if (!classes_) classes_ = classify_tokens(*tokenizer_);
  options.special_ids = classes_->special;
  options.punctuation_ids = classes_->punctuation;
  return Upcast(FastGenPolicy::Create(budget, std::move(options)));
}

Result<std::string> policy_family(const std::string& text) {
  if (text.rfind("namm:", 0) == 0) {
    NAMM_RETURN_IF_ERROR(parse_namm_spec(text).status());
    return std::string("namm");
  }
  NAMM_ASSIGN_OR_RETURN(OptionSpec spec, parse_option_spec(text));
  if (spec.name == "full" || spec.name == "oracle" || is_budgeted_family(spec.name)) return spec.name;
  return Status::InvalidArgument("unknown policy '" + spec.name + "' (known: " + kKnown + ")");
}

Result<NammSpec> parse_namm_spec(const std::string& text) {
  if (text.rfind("namm:", 0) != 0) return Status::InvalidArgument("'" + text + "' is not a NAMM spec (namm:FILE)");
  NammSpec out;
  // The options start at the first ",budget=" / ",ratio=" / ",threshold=" / ",prompt=" / ",heads=": a file name
  // holding one of those is not supported.
  std::size_t first = std::string::npos;
  for (const char* key : {",budget=", ",ratio=", ",threshold=", ",prompt=", ",heads="}) {
    first = std::min(first, text.find(key, 5));
  }
  out.path = text.substr(5, first == std::string::npos ? std::string::npos : first - 5);
  if (out.path.empty()) return Status::InvalidArgument("'namm:' needs a file: namm:FILE.safetensors");
  if (first == std::string::npos) return out;
  const auto where = [&](const Status& s) { return s.WithContext("policy '" + text + "'"); };
  Result<OptionSpec> parsed = parse_option_spec("namm:" + text.substr(first + 1));
  if (!parsed.ok()) return where(parsed.status());
  OptionSpec& options = *parsed;
  NAMM_RETURN_IF_ERROR(where(options.CheckKeys({"budget", "ratio", "threshold", "prompt", "heads"})));
  if (const auto heads = options.options.find("heads"); heads != options.options.end()) {
    const Result<bool> own = ParseHeads(heads->second);
    if (!own.ok()) return where(own.status());
    out.own_head_counts = *own;
    options.options.erase(heads);
  }
  if (const auto prompt = options.options.find("prompt"); prompt != options.options.end()) {
    if (prompt->second != "keep" && prompt->second != "evict") {
      return where(Status::InvalidArgument("prompt= takes keep (no eviction before the prompt's end) or evict "
                                           "(at every update, the default), got '" + prompt->second + "'"));
    }
    out.keep_prompt = prompt->second == "keep";
    options.options.erase(prompt);
  }
  if (options.options.empty()) return out;
  if (options.options.size() != 1) {
    return where(Status::InvalidArgument("a NAMM takes one of budget=, ratio= or threshold=, got '" +
                                         text.substr(first + 1) + "'"));
  }
  const std::string key = options.options.begin()->first;
  out.setting = key + "=" + options.options.begin()->second;
  if (key == "budget") {
    const Result<int64_t> budget = options.GetInt(key, 0);
    if (!budget.ok()) return where(budget.status());
    out.knob.budget = *budget;
  } else {
    const Result<double> value = options.GetDouble(key, 0);
    if (!value.ok()) return where(value.status());
    (key == "ratio" ? out.knob.ratio : out.knob.threshold) = *value;
  }
  return out;
}

bool policy_keeps_prompt(const std::string& spec) {
  if (spec.rfind("namm:", 0) != 0) {
    const Result<std::string> family = policy_family(spec);
    return family.ok() && (*family == "snapkv" || *family == "fastgen");
  }
  const Result<NammSpec> namm = parse_namm_spec(spec);
  return namm.ok() && namm->keep_prompt;
}

std::string NammSpec::ToString() const {
  std::string text = "namm:" + path;
  if (!setting.empty()) text += "," + setting;
  if (keep_prompt) text += ",prompt=keep";
  if (own_head_counts) text += ",heads=own";
  return text;
}

Result<int64_t> policy_peak_tokens(const std::string& text, int64_t prompt_tokens, int64_t new_tokens, int64_t step) {
  const int64_t whole = prompt_tokens + new_tokens;
  std::optional<CacheBudget> budget;
  bool keeps_prompt = false, snapkv = false;  // (FastGen, which keeps the prompt too, has no bound: whole)
  if (text.rfind("namm:", 0) == 0) {
    NAMM_ASSIGN_OR_RETURN(const NammSpec namm, parse_namm_spec(text));
    keeps_prompt = namm.keep_prompt;
    if (namm.knob.budget || namm.knob.ratio) {
      NAMM_ASSIGN_OR_RETURN(budget, namm.knob.budget ? CacheBudget::Tokens(*namm.knob.budget)
                                                     : CacheBudget::Ratio(*namm.knob.ratio));
    }
  } else {
    NAMM_ASSIGN_OR_RETURN(const std::string family, policy_family(text));
    snapkv = family == "snapkv";
    if (is_budgeted_family(family) && family != "fastgen") {
      NAMM_ASSIGN_OR_RETURN(OptionSpec spec, parse_option_spec(text));
      NAMM_ASSIGN_OR_RETURN(budget, CacheBudget::FromSpec(spec));
      if (family == "l2") {  // its uncompressed first layers hold every token
        NAMM_ASSIGN_OR_RETURN(const int64_t skip_layers, spec.GetInt("skip_layers", 0));
        if (skip_layers > 0) return whole;
      }
    }
  }
  if (!budget) return whole;
  // Compared before any sum: budget=2^63-1 is a request's to give.
  const int64_t tokens = budget->Resolve(prompt_tokens);
  if (tokens >= whole) return whole;
  // SnapKV: the prompt until its end, then its budget and every new token.
  if (snapkv) return std::min(whole, std::max(prompt_tokens, tokens + new_tokens));
  const int64_t held = keeps_prompt ? std::max(tokens, prompt_tokens) : tokens;
  return step >= whole - held ? whole : held + step;
}

bool is_budgeted_family(const std::string& family) {
  return family == "h2o" || family == "l2" || family == "streaming" || family == "tova" || family == "snapkv" ||
         family == "fastgen";
}

Result<std::string> with_cache_setting(const std::string& text, const std::string& setting) {
  if (text.rfind("namm:", 0) == 0) {
    // The setting's keys first: an unknown one would otherwise read as part of the file's name (a client of
    // namm-api made the server open "<its NAMM>,x=/../../etc/hostname").
    NAMM_ASSIGN_OR_RETURN(const OptionSpec named, parse_option_spec("namm:" + setting));
    for (const auto& option : named.options) {
      const std::string& key = option.first;
      if (key != "budget" && key != "ratio" && key != "threshold" && key != "prompt" && key != "heads") {
        return Status::InvalidArgument("unknown option '" + key + "' for namm in the cache setting '" + setting +
                                       "' of '" + text + "' (known: budget, ratio, threshold, prompt, heads)");
      }
    }
    NAMM_ASSIGN_OR_RETURN(const NammSpec namm, parse_namm_spec(text));
    NAMM_ASSIGN_OR_RETURN(NammSpec with, parse_namm_spec("namm:" + namm.path + "," + setting));
    if (with.setting.empty()) {  // only prompt= or heads=: the NAMM's own knob stays
      with.setting = namm.setting;
      with.knob = namm.knob;
    }
    // A flag the setting does not name stays as the spec has it; one it names is the setting's (heads=equal too).
    if (named.options.count("prompt") == 0) with.keep_prompt = namm.keep_prompt;
    if (named.options.count("heads") == 0) with.own_head_counts = namm.own_head_counts;
    return with.ToString();
  }
  NAMM_ASSIGN_OR_RETURN(OptionSpec spec, parse_option_spec(text));
  NAMM_ASSIGN_OR_RETURN(OptionSpec budget, parse_option_spec("x:" + setting));
  spec.options.erase("budget");
  spec.options.erase("ratio");
  for (const auto& [key, value] : budget.options) spec.options[key] = value;
  return spec.ToString();
}

TokenClasses classify_tokens(const Tokenizer& tokenizer) {
  TokenClasses classes;
  for (int64_t id = 0; id < tokenizer.vocab_size(); ++id) {
    const std::string text = tokenizer.Decode({id}, /*skip_special_tokens=*/true);
    if (text.empty()) {
      if (!tokenizer.Decode({id}, /*skip_special_tokens=*/false).empty()) classes.special.push_back(id);
      continue;
    }
    const std::u32string stripped = tasks::py_strip(tasks::to_u32(text));
    const bool punctuation =
        !stripped.empty() && std::all_of(stripped.begin(), stripped.end(), [](char32_t c) {
          return tasks::is_ascii_punctuation(c) || tasks::is_unicode_punctuation(c);
        });
    if (punctuation) classes.punctuation.push_back(id);
  }
  return classes;
}

}  // namespace namm::worker
