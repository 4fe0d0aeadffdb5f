#include "namm/policies/fastgen_policy.h"

#include <algorithm>
#include <limits>

#include "aten.h"
#include "namm/selection.h"
#include "namm/stft_features.h"
#include "torch_status.h"

namespace namm {

namespace {
constexpr const char* kAttentionState = "fastgen.attention";
constexpr const char* kWindowState = "fastgen.window";
constexpr const char* kNearState = "fastgen.near";
constexpr int64_t kPolicies = 5;

// ids [kv_heads, n] -> whether each is one of `members`.
at::Tensor IsOneOf(const at::Tensor& ids, const std::vector<int64_t>& members) {
  if (members.empty()) return at::zeros(ids.sizes(), ids.options().dtype(at::kBool));
  const at::Tensor set = at::tensor(members, ids.options());
  return at::isin(ids, set);
}
// The locality part's size: half the budget (the frequency part takes the other half), within the prompt.
int64_t LocalTokens(int64_t budget, int64_t prompt) { return std::min(budget - budget / 2, prompt); }
}  // namespace

Result<std::unique_ptr<FastGenPolicy>> FastGenPolicy::Create(CacheBudget budget, FastGenOptions options) {
  if (!(options.recovery > 0 && options.recovery <= 1)) {
    return Status::InvalidArgument("FastGen needs a recovery ratio in (0, 1], got " +
                                   std::to_string(options.recovery));
  }
  if (options.window <= 0)
    return Status::InvalidArgument("FastGen needs window > 0, got " + std::to_string(options.window));
  return std::unique_ptr<FastGenPolicy>(new FastGenPolicy(budget, std::move(options)));
}

std::string FastGenPolicy::name() const {
  return "fastgen(" + budget().ToString() + ", recovery=" + std::to_string(options_.recovery).substr(0, 4) +
         ", window=" + std::to_string(options_.window) + (options_.own_head_counts ? ", heads=own" : "") + ")";
}

std::vector<TokenStateSpec> FastGenPolicy::token_state() const {
  return {{kAttentionState, {}, at::kFloat}, {kWindowState, {}, at::kFloat}, {kNearState, {}, at::kFloat}};
}

Status FastGenPolicy::BeginSequence(const SequenceInfo& info) {
  NAMM_RETURN_IF_ERROR(BudgetedPolicy::BeginSequence(info));
  prompt_ids_ = info.prompt_ids;
  profiles_.clear();
  return Status::Ok();
}

Status FastGenPolicy::Observe(int /*layer*/, const at::Tensor& attention, int64_t first_query,
                             LayerKVCache& cache) {
  NAMM_RETURN_IF_ERROR(validate_observed_attention(attention, first_query, cache));
  const auto prompt = static_cast<int64_t>(prompt_ids_.size());
  if (prompt == 0) return Status::FailedPrecondition("FastGen needs BeginSequence() before Observe()");
  NAMM_ASSIGN_OR_RETURN(const int64_t budget, budget_tokens());
  const int64_t local = LocalTokens(budget, prompt);
  return internal::catch_torch_errors("FastGen observe", [&] {
    const at::Tensor mean = gqa_mean(attention, cache.kv_heads(), AttentionPrecision::kF32);  // [kv, n_q, n]
    cache.state(kAttentionState).add_(mean.sum(1));
    const auto [begin, end] = prompt_window_rows(attention, first_query, prompt, options_.window);
    if (begin >= end) return Status::Ok();
    const at::Tensor window = mean.narrow(1, begin, end - begin);  // [kv, rows, n]
    cache.state(kWindowState).add_(window.sum(1));
    // C_local as the paper profiles it: each query's own `local` most recent tokens (a relative distance), not
    // the prompt's last ones, which a query 20 tokens before the prompt's end hardly attends to.
    const at::Tensor query_positions =
        at::arange(first_query + begin, first_query + end, cache.positions().options()).view({1, -1, 1});
    const at::Tensor distance = query_positions - cache.positions().unsqueeze(1);  // [kv, rows, n]
    const at::Tensor near = distance.ge(0).logical_and_(distance.lt(local));
    cache.state(kNearState).add_((window * near.to(at::kFloat)).sum(1));
    return Status::Ok();
  });
}

Result<at::Tensor> FastGenPolicy::Select(int /*layer*/, LayerKVCache& cache) {
  return all_token_indices(cache);
}

Result<std::optional<at::Tensor>> FastGenPolicy::EndPrefill(int layer, LayerKVCache& cache) {
  NAMM_ASSIGN_OR_RETURN(int64_t budget, budget_tokens());
  const int64_t n = cache.size(), kv_heads = cache.kv_heads();
  if (layer < 0) return Status::InvalidArgument("FastGen: negative layer index");
  if (static_cast<int64_t>(profiles_.size()) <= layer) profiles_.resize(static_cast<std::size_t>(layer) + 1);
  std::vector<int64_t>& profile = profiles_[static_cast<std::size_t>(layer)];
  if (n <= budget) {  // the budget holds the whole prompt: nothing to compress, as for every budgeted policy
    profile.assign(static_cast<std::size_t>(kv_heads), kPolicies);
    return std::optional<at::Tensor>();
  }
  const auto prompt = static_cast<int64_t>(prompt_ids_.size());
  return internal::catch_torch_errors("FastGen end of prefill", [&]() -> Result<std::optional<at::Tensor>> {
    const at::Tensor positions = cache.positions();
    if (n > 0 && positions.max().item<int64_t>() >= prompt) {
      return Status::FailedPrecondition(
          "FastGen: the cache holds tokens beyond the prompt at the end of prefill");
    }
    const at::Tensor ids = at::tensor(prompt_ids_, positions.options()).index({positions});  // [kv, n]
    const at::Tensor accumulated = cache.state(kAttentionState);
    const at::Tensor window = cache.state(kWindowState);
    const at::Tensor newest = at::zeros({kv_heads, n}, positions.options().dtype(at::kBool));
    newest.narrow(1, n - 1, 1).fill_(true);

    // The nested policies' masks, [kPolicies, kv, n].
    const at::Tensor special = IsOneOf(ids, options_.special_ids).logical_or_(newest);
    const at::Tensor with_punctuation = IsOneOf(ids, options_.punctuation_ids).logical_or_(special);
    const int64_t frequent = std::min(budget / 2, n), local = std::min(LocalTokens(budget, prompt), n);
    at::Tensor with_frequent = with_punctuation.clone();
    if (frequent > 0) {
      const at::Tensor others =
          accumulated.masked_fill(with_punctuation, -std::numeric_limits<float>::infinity());
      // Ties to the more recent token, as every policy breaks them (topk's order among ties is the device's).
      const at::Tensor top = keep_top_k_per_head(others, frequent);
      with_frequent.scatter_(1, top, true);  // with fewer others than `frequent`, -inf picks are already kept
    }
    at::Tensor with_local = with_frequent.clone();
    with_local.narrow(1, n - local, local).fill_(true);
    const at::Tensor full = at::ones_like(newest);
    const at::Tensor masks = at::stack({special, with_punctuation, with_frequent, with_local, full});

    // Recovered attention of each policy, and each head's cheapest policy that recovers enough.
    const at::Tensor total = window.sum(1).clamp_min(std::numeric_limits<float>::min());  // [kv]
    at::Tensor recovered = (masks.to(at::kFloat) * window.unsqueeze(0)).sum(2) / total;  // [kPolicies, kv]
    // Policy 4 recovers what the smaller ones do plus, of the rest, what each query gives its own recent tokens.
    const at::Tensor near_rest = (cache.state(kNearState) * with_frequent.logical_not().to(at::kFloat)).sum(1);
    recovered.select(0, 3).copy_(recovered.select(0, 2) + near_rest / total);
    at::Tensor enough = recovered.ge(options_.recovery);
    enough.select(0, kPolicies - 1).fill_(true);
    const at::Tensor chosen = enough.to(at::kLong).argmax(0);  // first policy that recovers enough, [kv]
    const at::Tensor keep =
        masks.gather(0, chosen.view({1, kv_heads, 1}).expand({1, kv_heads, n})).squeeze(0);

    const at::Tensor chosen_cpu = chosen.cpu();
    profile.assign(chosen_cpu.data_ptr<int64_t>(), chosen_cpu.data_ptr<int64_t>() + kv_heads);
    for (int64_t& p : profile) ++p;

    const int64_t k = keep.sum(1).max().item<int64_t>();
    if (options_.own_head_counts) {  // each head its own, the rest of its row -1 (vacant)
      const at::Tensor mask = keep.to(at::kCPU).contiguous();
      if (mask.all().item<bool>()) return std::optional<at::Tensor>();
      at::Tensor rows = at::full({kv_heads, k}, -1, at::TensorOptions().dtype(at::kLong).device(at::kCPU));
      const bool* kept = mask.data_ptr<bool>();
      int64_t* row = rows.data_ptr<int64_t>();
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::vector<int64_t> own;
        for (int64_t i = 0; i < n; ++i) {
          if (kept[h * n + i]) own.push_back(i);
        }
        std::copy(own.begin(), own.end(), row + h * k + (k - static_cast<int64_t>(own.size())));
      }
      return std::optional<at::Tensor>(rows);
    }
    // A rectangular cache: every head keeps the layer's largest count, padding with its most-attended others.
    if (k == n) return std::optional<at::Tensor>();
    const at::Tensor ranking = accumulated.masked_fill(keep, std::numeric_limits<float>::max());
    return std::optional<at::Tensor>(keep_top_k_per_head(ranking, k));
  });
}

std::vector<int64_t> FastGenPolicy::profile(int layer) const {
  if (layer < 0 || layer >= static_cast<int>(profiles_.size())) return {};
  return profiles_[static_cast<std::size_t>(layer)];
}

}  // namespace namm
