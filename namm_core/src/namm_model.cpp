#include "namm/namm_model.h"

#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>

#include "namm/json_util.h"

namespace namm {

namespace {

const char* precision_name(AttentionPrecision p) { return p == AttentionPrecision::kBf16 ? "bf16" : "f32"; }

// The feature constants this build computes with; files must agree.
nlohmann::ordered_json FeatureConstants() {
  return {{"stft_window", kStftWindow},
          {"stft_hop", kStftHop},
          {"ema_coefficient", kEmaCoefficientPerQuery},
          {"recency_dims", kRecencyDims},
          {"recency_max_frequency", kRecencyMaxFrequency}};
}

template <typename T>
Status Get(const nlohmann::json& object, const char* key, T* out, bool required) {
  auto it = object.find(key);
  if (it == object.end()) {
    return required ? Status::Corruption(std::string("architecture: missing field '") + key + "'") : Status::Ok();
  }
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    if (!it->is_number_integer()) {
      return Status::Corruption(std::string("architecture: field '") + key + "' must be an integer, not " +
                                json_summary(*it));
    }
  }
  try {
    *out = it->get<T>();
  } catch (const nlohmann::json::exception&) {
    return Status::Corruption(std::string("architecture: field '") + key +
                              "' has the wrong type: " + json_summary(*it));
  }
  return Status::Ok();
}

}  // namespace

int64_t NammArchitecture::param_count() const {
  return scorer_param_count(scorer) + selection_param_count(selection) + (budget_input ? kFeatureDim : 0);
}

Status NammArchitecture::Validate() const {
  NAMM_RETURN_IF_ERROR(validate_scorer_config(scorer));
  switch (selection.kind) {
    case SelectionKind::kBinary:
      if (selection.budget != 0) return Status::InvalidArgument("binary selection takes no budget");
      break;
    case SelectionKind::kTopK:
      if (selection.budget <= 0) return Status::InvalidArgument("top-k selection needs a budget > 0");
      break;
    case SelectionKind::kDynamic:
      if (selection.budget < 0) return Status::InvalidArgument("dynamic selection's cap must be >= 0");
      if (!std::isfinite(selection.initial_log_threshold)) {
        return Status::InvalidArgument("dynamic selection's initial log-threshold must be finite");
      }
      break;
  }
  return Status::Ok();
}

std::string NammArchitecture::ToJson() const {
  nlohmann::ordered_json j;
  j["scorer"] = {{"kind", scorer_kind_name(scorer.kind)},
                 {"hidden", scorer.hidden},
                 {"attention_bias", scorer.attention_bias},
                 {"mlp_bias", scorer.mlp_bias}};
  nlohmann::ordered_json sel = {{"kind", selection_kind_name(selection.kind)}};
  if (selection.kind != SelectionKind::kBinary) sel["budget"] = selection.budget;
  if (selection.kind == SelectionKind::kDynamic) sel["initial_log_threshold"] = selection.initial_log_threshold;
  j["selection"] = sel;
  if (budget_input) j["budget_input"] = true;  // only when set: files without it read as before
  j["features"] = FeatureConstants();
  j["features"]["attention_precision"] = precision_name(attention_precision);
  j["param_count"] = param_count();
  return j.dump();
}

Result<NammArchitecture> NammArchitecture::FromJson(const std::string& text) {
  NAMM_ASSIGN_OR_RETURN(const nlohmann::json j, parse_json_bounded(text, "architecture"));
  if (!j.is_object() || !j.contains("scorer") || !j["scorer"].is_object() || !j.contains("selection") ||
      !j["selection"].is_object()) {
    return Status::Corruption("architecture must be an object with 'scorer' and 'selection' objects");
  }
  NammArchitecture arch;
  std::string kind;
  NAMM_RETURN_IF_ERROR(Get(j["scorer"], "kind", &kind, true));
  if (kind == "bam") {
    arch.scorer = default_scorer_config(ScorerKind::kBam);
  } else if (kind == "mlp") {
    arch.scorer = default_scorer_config(ScorerKind::kMlp);
  } else {
    return Status::Corruption("unknown scorer kind '" + kind + "' (known: bam, mlp)");
  }
  NAMM_RETURN_IF_ERROR(Get(j["scorer"], "hidden", &arch.scorer.hidden, true));
  NAMM_RETURN_IF_ERROR(Get(j["scorer"], "attention_bias", &arch.scorer.attention_bias, true));
  NAMM_RETURN_IF_ERROR(Get(j["scorer"], "mlp_bias", &arch.scorer.mlp_bias, true));

  NAMM_RETURN_IF_ERROR(Get(j["selection"], "kind", &kind, true));
  if (kind == "binary") {
    arch.selection.kind = SelectionKind::kBinary;
  } else if (kind == "topk") {
    arch.selection.kind = SelectionKind::kTopK;
  } else if (kind == "dynamic") {
    arch.selection.kind = SelectionKind::kDynamic;
  } else {
    return Status::Corruption("unknown selection kind '" + kind + "' (known: binary, topk, dynamic)");
  }
  NAMM_RETURN_IF_ERROR(Get(j["selection"], "budget", &arch.selection.budget, false));
  NAMM_RETURN_IF_ERROR(Get(j["selection"], "initial_log_threshold", &arch.selection.initial_log_threshold, false));
  NAMM_RETURN_IF_ERROR(Get(j, "budget_input", &arch.budget_input, false));

  if (j.contains("features")) {
    const auto& features = j["features"];
    if (!features.is_object()) return Status::Corruption("architecture: 'features' must be an object");
    const nlohmann::ordered_json constants = FeatureConstants();
    for (const auto& [key, value] : constants.items()) {
      if (features.contains(key) &&
          !(features[key].is_number() && features[key].get<double>() == value.get<double>())) {
        return Status::Unimplemented("architecture uses " + key + " = " + json_summary(features[key]) +
                                     "; this build supports only " + value.dump());
      }
    }
    std::string precision = "bf16";
    NAMM_RETURN_IF_ERROR(Get(features, "attention_precision", &precision, false));
    if (precision == "bf16") {
      arch.attention_precision = AttentionPrecision::kBf16;
    } else if (precision == "f32") {
      arch.attention_precision = AttentionPrecision::kF32;
    } else {
      return Status::Corruption("unknown attention_precision '" + precision + "' (known: bf16, f32)");
    }
  }
  Status valid = arch.Validate();
  if (!valid.ok()) return Status::Corruption("architecture: " + valid.message());
  if (j.contains("param_count") && j["param_count"] != arch.param_count()) {
    return Status::Corruption("architecture declares " + json_summary(j["param_count"]) +
                              " parameters but describes " + std::to_string(arch.param_count()));
  }
  return arch;
}

std::string NammArchitecture::Describe() const {
  std::ostringstream out;
  out << scorer_kind_name(scorer.kind) << "(hidden=" << scorer.hidden;
  if (scorer.kind == ScorerKind::kBam) out << (scorer.attention_bias ? ", attention bias" : ", no attention bias");
  out << (scorer.mlp_bias ? ", mlp bias" : ", no mlp bias") << ") + " << selection_kind_name(selection.kind)
      << " selection";
  if (selection.kind == SelectionKind::kTopK) out << " (budget " << selection.budget << ")";
  if (selection.kind == SelectionKind::kDynamic && selection.budget > 0) out << " (cap " << selection.budget << ")";
  out << ", " << precision_name(attention_precision) << " attention";
  if (budget_input) out << ", budget input";
  return out.str();
}

Status NammModel::Validate() const {
  NAMM_RETURN_IF_ERROR(architecture.Validate());
  const int64_t expected = architecture.param_count();
  if (static_cast<int64_t>(params.size()) != expected) {
    return Status::InvalidArgument("the architecture " + architecture.Describe() + " has " + std::to_string(expected) +
                                   " parameters, got " + std::to_string(params.size()));
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!std::isfinite(params[i])) return Status::InvalidArgument("parameter " + std::to_string(i) + " is not finite");
  }
  if (norm_stats.count < 0) return Status::InvalidArgument("normalization count is negative");
  for (std::size_t f = 0; f < norm_stats.mean.size(); ++f) {
    if (!std::isfinite(norm_stats.mean[f]) || !std::isfinite(norm_stats.var[f]) || norm_stats.var[f] < 0) {
      return Status::InvalidArgument("normalization statistics of bin " + std::to_string(f) +
                                     " are not finite or have a negative variance");
    }
  }
  for (const auto& [key, value] : metadata) {
    if (key.rfind("namm.", 0) == 0) return Status::InvalidArgument("metadata key '" + key + "' is reserved");
  }
  return Status::Ok();
}

std::vector<float> initial_params(const NammArchitecture& architecture) {
  std::vector<float> params(static_cast<std::size_t>(architecture.param_count()), 0.0f);
  if (architecture.selection.kind == SelectionKind::kDynamic) {
    params[static_cast<std::size_t>(scorer_param_count(architecture.scorer))] =  // the selection's, after the scorer's
        static_cast<float>(architecture.selection.initial_log_threshold);
  }
  return params;
}

}  // namespace namm
