#include "namm/worker/policy_spec.h"

#include "namm/h2o_policy.h"
#include "namm/l2_policy.h"
#include "namm/namm_file.h"
#include "namm/namm_policy.h"
#include "namm/option_spec.h"

namespace namm::worker {

Result<std::unique_ptr<MemoryPolicy>> make_baseline_policy(const std::string& text) {
  NAMM_ASSIGN_OR_RETURN(OptionSpec spec, parse_option_spec(text));
  if (spec.name == "full") {
    NAMM_RETURN_IF_ERROR(spec.CheckKeys({}));
    return std::unique_ptr<MemoryPolicy>(new FullCachePolicy());
  }
  if (spec.name == "h2o") {
    NAMM_RETURN_IF_ERROR(spec.CheckKeys({"budget", "recent"}));
    if (!spec.options.count("budget")) return Status::InvalidArgument("'" + text + "': h2o needs budget=N");
    NAMM_ASSIGN_OR_RETURN(int64_t budget, spec.GetInt("budget", 0));
    NAMM_ASSIGN_OR_RETURN(int64_t recent, spec.GetInt("recent", budget / 2));
    NAMM_ASSIGN_OR_RETURN(std::unique_ptr<H2OPolicy> policy, H2OPolicy::Create(budget, recent));
    return std::unique_ptr<MemoryPolicy>(std::move(policy));
  }
  if (spec.name == "l2") {
    NAMM_RETURN_IF_ERROR(spec.CheckKeys({"budget"}));
    if (!spec.options.count("budget")) return Status::InvalidArgument("'" + text + "': l2 needs budget=N");
    NAMM_ASSIGN_OR_RETURN(int64_t budget, spec.GetInt("budget", 0));
    NAMM_ASSIGN_OR_RETURN(std::unique_ptr<L2Policy> policy, L2Policy::Create(budget));
    return std::unique_ptr<MemoryPolicy>(std::move(policy));
  }
  return Status::InvalidArgument("unknown policy '" + spec.name + "' (known: full, h2o:budget=N, l2:budget=N)");
}

Result<std::unique_ptr<MemoryPolicy>> make_namm_policy(const std::string& path, at::Device device) {
  NAMM_ASSIGN_OR_RETURN(NammModel model, read_namm_file(path));
  NAMM_ASSIGN_OR_RETURN(std::unique_ptr<NammPolicy> policy, NammPolicy::Create(model, device));
  return std::unique_ptr<MemoryPolicy>(std::move(policy));
}

}  // namespace namm::worker
