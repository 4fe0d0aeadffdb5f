#include "namm/worker/llama_config.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>

#include "namm/json_util.h"
#include "namm/option_spec.h"

namespace namm::worker {

namespace {

// Positions a config may name (trained or stretched by RoPE scaling): 2^31, past any context a cache could hold.
constexpr int64_t kMaxPositions = int64_t{1} << 31;

std::string Num(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

// Reads an integer or list-of-integers field (bos/eos ids come in both forms).
std::vector<int64_t> IdList(const nlohmann::json& j) {
  std::vector<int64_t> ids;
  if (j.is_number_integer()) ids.push_back(j.get<int64_t>());
  if (j.is_array()) {
    for (const auto& v : j) {
      if (v.is_number_integer()) ids.push_back(v.get<int64_t>());
    }
  }
  return ids;
}

}  // namespace

Status RopeScaling::Validate() const {
  auto bad = [&](const std::string& what) { return Status::InvalidArgument("RoPE scaling " + ToString() + ": " + what); };
  if (kind == Kind::kNone) return Status::Ok();
  if (original_max_position_embeddings > kMaxPositions) {
    return bad("original_max_position_embeddings must be at most " + std::to_string(kMaxPositions));
  }
  if (!(factor >= 1.0) || !std::isfinite(factor)) return bad("factor must be >= 1");
  if (kind == Kind::kNtk && !(alpha > 0.0 && std::isfinite(alpha))) return bad("alpha must be > 0");
  if (kind == Kind::kLlama3) {
    if (!(high_freq_factor > low_freq_factor) || low_freq_factor <= 0) {
      return bad("needs 0 < low_freq_factor < high_freq_factor");
    }
    if (original_max_position_embeddings <= 0) return bad("needs original_max_position_embeddings > 0");
  }
  if (kind == Kind::kYarn) {
    if (!(beta_fast > beta_slow) || !(beta_slow > 0)) return bad("needs 0 < beta_slow < beta_fast");
    if (!(attention_factor >= 0) || !std::isfinite(attention_factor)) return bad("attention_factor must be >= 0");
    if (original_max_position_embeddings < 0) return bad("original_max_position_embeddings must be >= 0");
  }
  return Status::Ok();
}

double RopeScaling::yarn_attention_factor() const {
  if (kind != Kind::kYarn) return 1.0;
  return attention_factor > 0 ? attention_factor : 0.1 * std::log(factor) + 1.0;
}

std::string RopeScaling::ToString() const {
  switch (kind) {
    case Kind::kNone: return "none";
    case Kind::kNtk: return "ntk:factor=" + Num(factor) + ",alpha=" + Num(alpha);
    case Kind::kLinear: return "linear:factor=" + Num(factor);
    case Kind::kLlama3:
      return "llama3:factor=" + Num(factor) + ",low_freq_factor=" + Num(low_freq_factor) +
             ",high_freq_factor=" + Num(high_freq_factor) +
             ",original_max_position_embeddings=" + std::to_string(original_max_position_embeddings);
    case Kind::kYarn:
      return "yarn:factor=" + Num(factor) + ",original_max_position_embeddings=" +
             std::to_string(original_max_position_embeddings) + ",beta_fast=" + Num(beta_fast) + ",beta_slow=" +
             Num(beta_slow) + ",attention_factor=" + Num(yarn_attention_factor()) +
             (truncate ? "" : ",truncate=0");
    case Kind::kDynamic: return "dynamic:factor=" + Num(factor);
  }
  return "?";
}

Result<RopeScaling> RopeScaling::Parse(const std::string& text) {
  NAMM_ASSIGN_OR_RETURN(OptionSpec spec, parse_option_spec(text));
  RopeScaling s;
  if (spec.name == "none") {
    NAMM_RETURN_IF_ERROR(spec.CheckKeys({}));
    return s;
  }
  if (spec.name == "ntk") {
    NAMM_RETURN_IF_ERROR(spec.CheckKeys({"factor", "alpha"}));
    s.kind = Kind::kNtk;
    NAMM_ASSIGN_OR_RETURN(s.alpha, spec.GetDouble("alpha", 1.0));
  } else if (spec.name == "linear") {
    NAMM_RETURN_IF_ERROR(spec.CheckKeys({"factor"}));
    s.kind = Kind::kLinear;
  } else if (spec.name == "llama3") {
    NAMM_RETURN_IF_ERROR(
        spec.CheckKeys({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}));
    s.kind = Kind::kLlama3;
    NAMM_ASSIGN_OR_RETURN(s.low_freq_factor, spec.GetDouble("low_freq_factor", 1.0));
    NAMM_ASSIGN_OR_RETURN(s.high_freq_factor, spec.GetDouble("high_freq_factor", 4.0));
    NAMM_ASSIGN_OR_RETURN(s.original_max_position_embeddings,
                          spec.GetInt("original_max_position_embeddings", 8192));
  } else if (spec.name == "yarn") {
    NAMM_RETURN_IF_ERROR(spec.CheckKeys(
        {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "truncate"}));
    s.kind = Kind::kYarn;
    NAMM_ASSIGN_OR_RETURN(s.original_max_position_embeddings, spec.GetInt("original_max_position_embeddings", 0));
    NAMM_ASSIGN_OR_RETURN(s.beta_fast, spec.GetDouble("beta_fast", 32.0));
    NAMM_ASSIGN_OR_RETURN(s.beta_slow, spec.GetDouble("beta_slow", 1.0));
    NAMM_ASSIGN_OR_RETURN(s.attention_factor, spec.GetDouble("attention_factor", 0.0));
    NAMM_ASSIGN_OR_RETURN(int64_t truncate, spec.GetInt("truncate", 1));
    s.truncate = truncate != 0;
  } else if (spec.name == "dynamic") {
    NAMM_RETURN_IF_ERROR(spec.CheckKeys({"factor"}));
    s.kind = Kind::kDynamic;
  } else {
    return Status::InvalidArgument("unknown RoPE scaling '" + spec.name +
                                   "' (known: none, ntk, linear, llama3, yarn, dynamic)");
  }
  if (!spec.options.count("factor")) return Status::InvalidArgument("'" + text + "': factor=F is required");
  NAMM_ASSIGN_OR_RETURN(s.factor, spec.GetDouble("factor", 1.0));
  NAMM_RETURN_IF_ERROR(s.Validate());
  return s;
}

Status LlamaConfig::Validate() const {
  auto bad = [&](const std::string& what) { return Status::InvalidArgument("model config: " + what); };
  if (dim <= 0 || hidden_dim <= 0 || n_layers <= 0 || n_heads <= 0 || n_kv_heads <= 0 || vocab_size <= 0 ||
      head_dim <= 0) {
    return bad("dimensions must be positive (" + Describe() + ")");
  }
  if (n_heads % n_kv_heads != 0) {
    return bad(std::to_string(n_heads) + " query heads are not a multiple of " + std::to_string(n_kv_heads) +
               " KV heads");
  }
  // Far above any Llama-family model (Llama 3 405B: 126 layers, dim 16384, ffn 53248, vocab 128256), so that a
  // config's numbers cannot make the loader allocate, loop or multiply past what its files could hold (issue 35).
  constexpr int64_t kMaxLayers = 4096, kMaxDim = int64_t{1} << 20, kMaxHidden = int64_t{1} << 22, kMaxHeads = 4096,
                    kMaxVocab = int64_t{1} << 24;
  if (n_layers > kMaxLayers || dim > kMaxDim || hidden_dim > kMaxHidden || n_heads > kMaxHeads || head_dim > kMaxDim ||
      vocab_size > kMaxVocab) {
    return bad("dimensions over the limits of " + std::to_string(kMaxLayers) + " layers, dim and head_dim " +
               std::to_string(kMaxDim) + ", ffn " + std::to_string(kMaxHidden) + ", " + std::to_string(kMaxHeads) +
               " heads, vocab " + std::to_string(kMaxVocab) + " (" + Describe() + ")");
  }
  if (head_dim % 2 != 0) return bad("head_dim must be even for RoPE, got " + std::to_string(head_dim));
  if (!(norm_eps > 0) || !(rope_theta > 0)) return bad("rms_norm_eps and rope_theta must be positive");
  if (max_position_embeddings <= 0 || max_position_embeddings > kMaxPositions) {
    return bad("max_position_embeddings must be in 1.." + std::to_string(kMaxPositions) + ", got " +
               std::to_string(max_position_embeddings));
  }
  if (sliding_window < 0 || first_sliding_layer < 0) return bad("sliding_window and max_window_layers must be >= 0");
  NAMM_RETURN_IF_ERROR(rope_scaling.Validate());
  const double trained = static_cast<double>(std::max(max_position_embeddings, rope_scaling.original_max_position_embeddings));
  if (trained * rope_scaling.factor > static_cast<double>(kMaxPositions)) {
    return bad("RoPE scaling " + rope_scaling.ToString() + " stretches the context past " + std::to_string(kMaxPositions) +
               " positions");
  }
  return Status::Ok();
}

int64_t LlamaConfig::context_length() const {
  switch (rope_scaling.kind) {
    case RopeScaling::Kind::kNtk:
    case RopeScaling::Kind::kLinear:
    case RopeScaling::Kind::kDynamic:
      return static_cast<int64_t>(std::floor(static_cast<double>(max_position_embeddings) * rope_scaling.factor));
    case RopeScaling::Kind::kYarn: {
      // Qwen2.5 states the trained length as max_position_embeddings; other configs state the extended one.
      const double trained = static_cast<double>(rope_scaling.original_max_position_embeddings > 0
                                                     ? rope_scaling.original_max_position_embeddings
                                                     : max_position_embeddings);
      return std::max(max_position_embeddings, static_cast<int64_t>(std::floor(trained * rope_scaling.factor)));
    }
    default:
      return max_position_embeddings;
  }
}

std::string LlamaConfig::Describe() const {
  std::ostringstream out;
  out << architecture << " " << n_layers << " layers, dim " << dim << ", " << n_heads << "/" << n_kv_heads
      << " heads of " << head_dim << ", ffn " << hidden_dim << ", vocab " << vocab_size << ", rope theta "
      << rope_theta << " " << rope_scaling.ToString() << ", context " << context_length();
  if (sliding_window > 0) out << ", sliding window " << sliding_window << " from layer " << first_sliding_layer;
  if (qkv_bias) out << ", qkv bias";
  if (qk_norm) out << ", q/k norm";
  return out.str();
}

namespace {

// The Hugging Face families one forward pass serves, and what sets each apart.
struct HfFamily {
  const char* architecture;
  const char* model_type;
  bool qkv_bias;       // biases on q/k/v whatever attention_bias says
  bool qk_norm;        // per-head RMSNorm of queries and keys
  bool window_switch;  // sliding_window applies only with use_sliding_window, from max_window_layers on
};
constexpr HfFamily kFamilies[] = {
    {"LlamaForCausalLM", "llama", false, false, false},
    {"MistralForCausalLM", "mistral", false, false, false},
    {"Qwen2ForCausalLM", "qwen2", true, false, true},
    {"Qwen3ForCausalLM", "qwen3", false, true, true},
};

std::string SupportedFamilies() {
  std::string list;
  for (const HfFamily& f : kFamilies) list += std::string(list.empty() ? "" : ", ") + f.architecture + " (" + f.model_type + ")";
  return list;
}

Result<LlamaConfig> ParseHfConfig(const std::string& json_text, const std::string& source) {
  auto bad = [&](const std::string& what) { return Status::InvalidArgument(source + ": " + what); };
  NAMM_ASSIGN_OR_RETURN(const nlohmann::json j, parse_json_bounded(json_text, source));
  if (!j.is_object()) return bad("not a JSON object");
  LlamaConfig c;
  // The family: architectures[0], else model_type (some exports leave architectures out).
  const std::string model_type = j.contains("model_type") && j["model_type"].is_string() ? j["model_type"].get<std::string>() : "";
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
      j["architectures"][0].is_string()) {
    c.architecture = j["architectures"][0].get<std::string>();
  } else if (!model_type.empty()) {
    const auto known = std::find_if(std::begin(kFamilies), std::end(kFamilies),
                                    [&](const HfFamily& f) { return model_type == f.model_type; });
    c.architecture = known != std::end(kFamilies) ? known->architecture : "model_type '" + model_type + "'";
  } else {
    return bad("names no architecture (neither 'architectures' nor 'model_type')");
  }
  const auto family = std::find_if(std::begin(kFamilies), std::end(kFamilies),
                                   [&](const HfFamily& f) { return c.architecture == f.architecture; });
  if (family == std::end(kFamilies)) {
    return Status::Unimplemented(source + ": architecture " + c.architecture + " is not supported (supported: " +
                                 SupportedFamilies() + ")");
  }
  auto integer = [&](const char* key, int64_t* out, bool required) -> Status {
    if (!j.contains(key) || j[key].is_null()) return required ? bad(std::string("missing '") + key + "'") : Status::Ok();
    if (!j[key].is_number_integer()) return bad(std::string("'") + key + "' must be an integer");
    *out = j[key].get<int64_t>();
    return Status::Ok();
  };
  auto number = [&](const char* key, double* out) -> Status {
    if (!j.contains(key) || j[key].is_null()) return Status::Ok();
    if (!j[key].is_number()) return bad(std::string("'") + key + "' must be a number");
    *out = j[key].get<double>();
    return Status::Ok();
  };
  NAMM_RETURN_IF_ERROR(integer("hidden_size", &c.dim, true));
  NAMM_RETURN_IF_ERROR(integer("intermediate_size", &c.hidden_dim, true));
  NAMM_RETURN_IF_ERROR(integer("num_hidden_layers", &c.n_layers, true));
  NAMM_RETURN_IF_ERROR(integer("num_attention_heads", &c.n_heads, true));
  c.n_kv_heads = c.n_heads;
  NAMM_RETURN_IF_ERROR(integer("num_key_value_heads", &c.n_kv_heads, false));
  NAMM_RETURN_IF_ERROR(integer("vocab_size", &c.vocab_size, true));
  NAMM_RETURN_IF_ERROR(integer("max_position_embeddings", &c.max_position_embeddings, true));
  if (c.n_heads > 0) c.head_dim = c.dim / c.n_heads;
  NAMM_RETURN_IF_ERROR(integer("head_dim", &c.head_dim, false));
  c.norm_eps = 1e-6;  // transformers' default for every family here (llama2.c's loader sets its own 1e-5)
  NAMM_RETURN_IF_ERROR(number("rms_norm_eps", &c.norm_eps));
  NAMM_RETURN_IF_ERROR(number("rope_theta", &c.rope_theta));
  // Every family's MLP is SwiGLU; a config naming another activation (ReLU-fied Llamas exist) is refused rather
  // than run with the wrong one.
  if (j.contains("hidden_act") && !j["hidden_act"].is_null() && j["hidden_act"] != "silu" && j["hidden_act"] != "swish") {
    return Status::Unimplemented(source + ": hidden_act " + j["hidden_act"].dump() +
                                 " is not supported (only silu, or its alias swish)");
  }
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  const bool attention_bias = j.value("attention_bias", false);
  c.qkv_bias = attention_bias || family->qkv_bias;
  c.o_bias = attention_bias;
  c.mlp_bias = j.value("mlp_bias", false);
  c.qk_norm = family->qk_norm;
  if (j.contains("bos_token_id")) c.bos_token_ids = IdList(j["bos_token_id"]);
  if (j.contains("eos_token_id")) c.eos_token_ids = IdList(j["eos_token_id"]);
  // Mistral windows every layer when sliding_window is set; Qwen keeps sliding_window in every config and
  // windows only when use_sliding_window is true, and then only the layers from max_window_layers on.
  const bool windowed = family->window_switch ? j.value("use_sliding_window", false) : true;
  // Absent keys take transformers' defaults: Mistral's and Qwen's windows are 4,096 positions, Qwen's from
  // layer 28 on (Llama has none).
  const bool has_window = family->model_type != std::string("llama");
  if (has_window && windowed && !j.contains("sliding_window")) c.sliding_window = 4096;
  if (windowed && j.contains("sliding_window") && !j["sliding_window"].is_null()) {
    NAMM_RETURN_IF_ERROR(integer("sliding_window", &c.sliding_window, false));
    if (c.sliding_window <= 0) return bad("'sliding_window' must be positive or null");
  }
  if (c.sliding_window > 0 && family->window_switch) {
    c.first_sliding_layer = 28;
    NAMM_RETURN_IF_ERROR(integer("max_window_layers", &c.first_sliding_layer, false));
  }
  // RoPE's settings: transformers v5 writes them as one `rope_parameters` object (theta and scaling together)
  // and drops the top-level `rope_theta` and `rope_scaling`; earlier versions wrote those two. Where both
  // forms are present, `rope_parameters` is what transformers reads.
  const nlohmann::json* rope = nullptr;
  std::string rope_key = "rope_scaling";
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    rope_key = "rope_parameters";
    rope = &j["rope_parameters"];
    if (!rope->is_object()) return bad("'rope_parameters' must be an object or null");
    if (!rope->contains("rope_type") && !rope->contains("rope_theta") && !rope->empty() && rope->begin()->is_object()) {
      return Status::Unimplemented(source + ": rope_parameters per layer type (" + rope->begin().key() +
                                   ", ...) are not supported");
    }
    if (rope->contains("rope_theta") && !(*rope)["rope_theta"].is_null()) {
      if (!(*rope)["rope_theta"].is_number()) return bad("'rope_parameters.rope_theta' must be a number");
      c.rope_theta = (*rope)["rope_theta"].get<double>();
    }
  } else if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    rope = &j["rope_scaling"];
    if (!rope->is_object()) return bad("'rope_scaling' must be an object or null");
  }
  if (rope != nullptr) {
    const auto& r = *rope;
    std::string type = r.value("rope_type", r.value("type", std::string("default")));
    // The reference passes {type: dynamic, override: ntk, factor, alpha}, which it runs as static NTK.
    if (type == "dynamic" && r.value("override", std::string()) == "ntk") type = "ntk";
    // A number the config gives, or `fallback` when it gives none; a value that is not a number is refused (a
    // factor written as a string would otherwise scale nothing).
    auto get = [&](const char* key, double fallback) -> Result<double> {
      if (!r.contains(key) || r[key].is_null()) return fallback;
      if (!r[key].is_number()) return bad(rope_key + "." + key + " must be a number, got " + r[key].dump());
      return r[key].get<double>();
    };
    // A position count as an integer, refused beyond kMaxPositions before the conversion (a double past int64's
    // range has no defined conversion).
    auto positions = [&](const char* key) -> Result<int64_t> {
      NAMM_ASSIGN_OR_RETURN(const double v, get(key, 0));
      if (!(v >= 0 && v <= static_cast<double>(kMaxPositions))) {
        return bad(rope_key + "." + key + " must be in 0.." + std::to_string(kMaxPositions));
      }
      return static_cast<int64_t>(v);
    };
    RopeScaling& s = c.rope_scaling;
    if (type == "default") {
      s.kind = RopeScaling::Kind::kNone;
    } else if (type == "ntk") {
      s.kind = RopeScaling::Kind::kNtk;
      NAMM_ASSIGN_OR_RETURN(s.alpha, get("alpha", 1.0));
    } else if (type == "linear") {
      s.kind = RopeScaling::Kind::kLinear;
    } else if (type == "dynamic") {
      s.kind = RopeScaling::Kind::kDynamic;
    } else if (type == "llama3") {
      s.kind = RopeScaling::Kind::kLlama3;
      NAMM_ASSIGN_OR_RETURN(s.low_freq_factor, get("low_freq_factor", 1.0));
      NAMM_ASSIGN_OR_RETURN(s.high_freq_factor, get("high_freq_factor", 4.0));
      NAMM_ASSIGN_OR_RETURN(s.original_max_position_embeddings, positions("original_max_position_embeddings"));
    } else if (type == "yarn") {
      s.kind = RopeScaling::Kind::kYarn;
      for (const char* key : {"mscale", "mscale_all_dim"}) {
        if (r.contains(key) && !r[key].is_null()) {
          return Status::Unimplemented(source + ": yarn's '" + key + "' (DeepSeek's attention scaling) is not supported");
        }
      }
      NAMM_ASSIGN_OR_RETURN(s.original_max_position_embeddings, positions("original_max_position_embeddings"));
      NAMM_ASSIGN_OR_RETURN(s.beta_fast, get("beta_fast", 32.0));
      NAMM_ASSIGN_OR_RETURN(s.beta_slow, get("beta_slow", 1.0));
      NAMM_ASSIGN_OR_RETURN(s.attention_factor, get("attention_factor", 0.0));
      s.truncate = r.value("truncate", true);
    } else {
      return Status::Unimplemented(source + ": " + rope_key + " type '" + type +
                                   "' is not supported (supported: default, linear, ntk, dynamic, llama3, yarn)");
    }
    // Every scaling namm runs names its factor (transformers refuses a config without one).
    if (s.kind != RopeScaling::Kind::kNone) {
      if (!r.contains("factor") || r["factor"].is_null()) return bad(rope_key + " of type '" + type + "' needs a factor");
      NAMM_ASSIGN_OR_RETURN(s.factor, get("factor", 1.0));
    }
  }
  Status valid = c.Validate();
  if (!valid.ok()) return valid.WithContext(source);
  return c;
}

}  // namespace

Result<LlamaConfig> parse_hf_config(const std::string& json_text, const std::string& source) {
  try {
    return ParseHfConfig(json_text, source);
  } catch (const nlohmann::json::exception& e) {  // a field of the wrong JSON type
    return Status::InvalidArgument(source + ": malformed config: " + e.what());
  }
}

}  // namespace namm::worker
