#include "namm/selection_config.h"

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

}  // namespace namm
