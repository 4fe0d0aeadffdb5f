// Token-selection configurations (spec §5), without the tensor code that applies them.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "namm/status.h"

namespace namm {

enum class SelectionKind {
  kBinary,   // keep s >= threshold (0: the paper's NAMM)
  kTopK,     // keep the `budget` best tokens per head once the cache exceeds it
  kDynamic,  // keep s >= exp(theta) with theta a learned parameter, optionally capped at `budget`
};

struct SelectionConfig {
  SelectionKind kind = SelectionKind::kBinary;
  // kTopK: tokens kept per head (> 0). kDynamic: cap on tokens kept per head (0 = no cap). kBinary: unused (0).
  int64_t budget = 0;
  // kDynamic: initial value of the learned log-threshold theta (the reference initializes exp(theta) = 1/2048).
  double initial_log_threshold = std::log(1.0 / 2048.0);
  // kBinary: the keep threshold. 0 in files and the reference; a deployment moves it (namm:FILE,threshold=T).
  float threshold = 0.0f;
};

const char* selection_kind_name(SelectionKind kind);  // "binary" | "topk" | "dynamic"

// Number of learned parameters the selection adds after the scorer's (1 for kDynamic, else 0).
int64_t selection_param_count(const SelectionConfig& config);

// Parses "binary", "topk:budget=N" or "dynamic[:cap=N,init=T]" (the --selection syntax of namm-tool init and
// of run specs).
Result<SelectionConfig> parse_selection_spec(const std::string& text);

}  // namespace namm
