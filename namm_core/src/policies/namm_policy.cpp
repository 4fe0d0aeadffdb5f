#include "namm/policies/namm_policy.h"

#include "aten.h"
#include "namm/recency_embedding.h"
#include "namm/selection.h"
#include "namm/stft_features.h"
#include "torch_status.h"

namespace namm {

namespace {
constexpr const char* kSamplesState = "namm.samples";
constexpr const char* kEmaState = "namm.ema";
}  // namespace

Result<std::unique_ptr<NammPolicy>> NammPolicy::Create(const NammModel& model, at::Device device) {
  NAMM_RETURN_IF_ERROR(model.Validate());
  return internal::catch_torch_errors("creating the NAMM policy", [&]() -> Result<std::unique_ptr<NammPolicy>> {
    const int64_t n = static_cast<int64_t>(model.params.size());
    at::Tensor params = at::empty({n}, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
    std::copy(model.params.begin(), model.params.end(), params.data_ptr<float>());
    params = params.to(device);
    const int64_t scorer_n = scorer_param_count(model.architecture.scorer);
    NAMM_ASSIGN_OR_RETURN(std::unique_ptr<Scorer> scorer,
                          make_scorer(model.architecture.scorer, params.narrow(0, 0, scorer_n)));
    at::Tensor selection_params = params.narrow(0, scorer_n, n - scorer_n).cpu();
    return std::unique_ptr<NammPolicy>(new NammPolicy(model, std::move(scorer), selection_params));
  });
}

NammPolicy::NammPolicy(const NammModel& model, std::unique_ptr<Scorer> scorer, at::Tensor selection_params)
    : architecture_(model.architecture),
      scorer_(std::move(scorer)),
      constant_score_(constant_score(model.architecture.scorer, model.params)),
      selection_params_(std::move(selection_params)),
      normalizer_(model.norm_state, model.norm_stats) {}

std::string NammPolicy::name() const {
  return "namm(" + architecture_.Describe() + ", " + std::to_string(architecture_.param_count()) + " params)";
}

std::vector<TokenStateSpec> NammPolicy::token_state() const {
  if (!FeaturesNeeded()) return {};
  return {{kSamplesState, {kStftWindow}, at::kFloat}, {kEmaState, {kStftBins}, at::kFloat}};
}

bool NammPolicy::FeaturesNeeded() const {
  return !constant_score_ || tracing_ || normalizer_.state() == NormState::kCollecting;
}

Status NammPolicy::Observe(int /*layer*/, const at::Tensor& attention, int64_t first_query,
                          LayerKVCache& cache) {
  NAMM_RETURN_IF_ERROR(validate_observed_attention(attention, first_query, cache));
  if (!FeaturesNeeded()) {
    observe_skipped_ = true;
    return Status::Ok();
  }
  return internal::catch_torch_errors("NAMM observe", [&] {
    consume_attention(attention, architecture_.attention_precision, first_query,
                      {cache.state(kSamplesState), cache.state(kEmaState)});
    return Status::Ok();
  });
}

Result<at::Tensor> NammPolicy::Select(int /*layer*/, LayerKVCache& cache) {
  if (cache.tokens_seen() % kStftHop != 0) {
    return Status::FailedPrecondition("a NAMM update needs a sequence length that is a multiple of " +
                                      std::to_string(kStftHop) + " (complete spectrogram frames), got " +
                                      std::to_string(cache.tokens_seen()));
  }
  if (cache.size() == 0) return Status::FailedPrecondition("a NAMM update needs at least one cached token");
  if (tracing_ && observe_skipped_) {
    return Status::FailedPrecondition("tracing was enabled after Observe calls it would have needed");
  }
  return internal::catch_torch_errors("NAMM select", [&]() -> Result<at::Tensor> {
    if (constant_score_ && !tracing_) {
      if (normalizer_.state() == NormState::kCollecting) normalizer_.Normalize(cache.state(kEmaState));
      const at::Tensor scores = at::full({cache.kv_heads(), cache.size()}, *constant_score_,
                                         cache.positions().options().dtype(at::kFloat));
      return select_tokens(scores, architecture_.selection, selection_params_);
    }
    const at::Tensor normalized = normalizer_.Normalize(cache.state(kEmaState));
    const at::Tensor features = at::cat({recency_embedding(cache.positions()), normalized}, 2);
    const at::Tensor scores = scorer_->Score(features);
    at::Tensor keep = select_tokens(scores, architecture_.selection, selection_params_);
    if (tracing_) trace_ = {features, scores, keep};
    return keep;
  });
}

}  // namespace namm
