#include "namm/selection_config.h"

#include "namm/option_spec.h"

namespace namm {

const char* selection_kind_name(SelectionKind kind) {
  switch (kind) {
    case SelectionKind::kBinary: return "binary";
    case SelectionKind::kTopK: return "topk";
    case SelectionKind::kDynamic: return "dynamic";
  }
  return "?";
}

int64_t selection_param_count(const SelectionConfig& config) {
  return config.kind == SelectionKind::kDynamic ? 1 : 0;
}

Result<SelectionConfig> parse_selection_spec(const std::string& text) {
  NAMM_ASSIGN_OR_RETURN(OptionSpec spec, parse_option_spec(text));
  SelectionConfig config;
  if (spec.name == "binary") {
    NAMM_RETURN_IF_ERROR(spec.CheckKeys({}));
    config.kind = SelectionKind::kBinary;
  } else if (spec.name == "topk") {
    NAMM_RETURN_IF_ERROR(spec.CheckKeys({"budget"}));
    config.kind = SelectionKind::kTopK;
    NAMM_ASSIGN_OR_RETURN(config.budget, spec.GetInt("budget", 0));
    if (config.budget <= 0) return Status::InvalidArgument("'" + text + "': topk needs budget=N with N > 0");
  } else if (spec.name == "dynamic") {
    NAMM_RETURN_IF_ERROR(spec.CheckKeys({"cap", "init"}));
    config.kind = SelectionKind::kDynamic;
    NAMM_ASSIGN_OR_RETURN(config.budget, spec.GetInt("cap", 0));
    NAMM_ASSIGN_OR_RETURN(config.initial_log_threshold, spec.GetDouble("init", config.initial_log_threshold));
  } else {
    return Status::InvalidArgument("unknown selection '" + spec.name + "' (known: binary, topk, dynamic)");
  }
  return config;
}

}  // namespace namm
