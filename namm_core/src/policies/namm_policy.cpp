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
  if (from_history_) return {{kEmaState, {kStftBins}, at::kFloat}};
  return {{kSamplesState, {kStftWindow}, at::kFloat}, {kEmaState, {kStftBins}, at::kFloat}};
}

int64_t NammPolicy::query_history() const { return from_history_ && FeaturesNeeded() ? kStftWindow - 1 : 0; }

bool NammPolicy::FeaturesNeeded() const {
  return !constant_score_ || tracing_ || normalizer_.state() == NormState::kCollecting;
}

Status NammPolicy::Observe(int layer, const at::Tensor& attention, int64_t first_query,
                          LayerKVCache& cache) {
  NAMM_RETURN_IF_ERROR(validate_observed_attention(attention, first_query, cache));
  if (!FeaturesNeeded()) {
    observe_skipped_ = true;
    return Status::Ok();
  }
  return internal::catch_torch_errors("NAMM observe", [&] {
    if (from_history_) {
      ObserveFromHistory(attention, layer, first_query, cache);
    } else {
      consume_attention(attention, architecture_.attention_precision, first_query,
                        {cache.state(kSamplesState), cache.state(kEmaState)});
    }
    return Status::Ok();
  });
}

void NammPolicy::ObserveFromHistory(const at::Tensor& attention, int layer, int64_t first_query,
                                    LayerKVCache& cache) {
  const int64_t kv_heads = cache.kv_heads(), n = cache.size(), rows = attention.size(1);
  const AttentionPrecision precision = architecture_.attention_precision;
  // Every hop end e (query index = 15 mod 16) among the rows completes the frame of queries e - 31 .. e; the
  // frames ending here need the queries from the first one's start to the last hop end.
  const int64_t first_end = first_query + (kStftHop - 1 - first_query % kStftHop);
  const bool frames_end_here = first_end < first_query + rows;
  const bool valid = remembered_.ValidFor(layer, cache);
  // The forward pass's last block (its newest query is the newest token) leaves nothing for a later block: if it
  // ends no frame either (most decode steps), there is nothing to do.
  const bool last_block = first_query + rows == cache.tokens_seen();
  if (!frames_end_here && last_block) return;
  const int64_t start = std::min(first_end - (kStftWindow - 1), first_query);
  const int64_t earlier = frames_end_here ? first_query - start : 0;
  // Query-major samples [kv, earlier + rows, n]: zeros before the sequence, earlier queries, then these rows.
  const at::Tensor samples = at::empty({kv_heads, earlier + rows, n}, cache.state(kEmaState).options());
  if (earlier > 0) {
    const int64_t zeros = std::max<int64_t>(0, -start);
    if (zeros > 0) samples.narrow(1, 0, zeros).zero_();
    if (earlier > zeros) samples.narrow(1, zeros, earlier - zeros).copy_(EarlierRows(layer, cache, start + zeros, first_query));
  }
  const at::Tensor own = samples.narrow(1, earlier, rows);
  gqa_mean_into(attention, precision, own);
  if (frames_end_here) {
    const int64_t last_end = first_end + (first_query + rows - 1 - first_end) / kStftHop * kStftHop;
    fold_frames(samples.narrow(1, 0, last_end + 1 - start), cache.state(kEmaState));
  }
  // What later blocks of this forward pass may need: the 31 newest rows of this layer.
  if (last_block) return;
  if (!valid) remembered_ = RememberedRows{layer, cache.tokens_seen(), n, {}};
  const int64_t kept = std::min<int64_t>(rows, kStftWindow - 1);
  remembered_.blocks.emplace_back(first_query + rows - kept, own.narrow(1, rows - kept, kept).clone());
  while (remembered_.blocks.size() > 1 &&
         remembered_.blocks[1].first <= first_query + rows - (kStftWindow - 1)) {
    remembered_.blocks.erase(remembered_.blocks.begin());
  }
}

at::Tensor NammPolicy::EarlierRows(int layer, const LayerKVCache& cache, int64_t from, int64_t to) const {
  std::vector<at::Tensor> parts;
  int64_t next = from;
  const bool valid = remembered_.ValidFor(layer, cache);
  // The remembered blocks are contiguous and end at `to`; rows before the first of them are computed again.
  const int64_t remembered_from = valid && !remembered_.blocks.empty() ? remembered_.blocks.front().first : to;
  if (next < remembered_from) {
    const int64_t upto = std::min(to, remembered_from);
    at::Tensor rows = at::empty({cache.kv_heads(), upto - next, cache.size()}, cache.state(kEmaState).options());
    // A few queries at a time, so that their probabilities ([q_heads, piece, n]) stay as small as the engine's
    // attention blocks.
    const int64_t heads = cache.query_history().heads();
    const int64_t piece = std::max<int64_t>(1, kAttentionBlockElements / std::max<int64_t>(1, heads * cache.size()));
    for (int64_t q = next; q < upto; q += piece) {
      const int64_t len = std::min(piece, upto - q);
      const Status computed = cache.query_history().GqaMeanAttention(cache, q, q + len, architecture_.attention_precision,
                                                                      rows.narrow(1, q - next, len));
      TORCH_CHECK(computed.ok(), "NAMM observe: ", computed.message(),
                  " (the engine must record the queries: MemoryPolicy::query_history())");
    }
    parts.push_back(rows);
    next = upto;
  }
  for (const auto& [first, block] : remembered_.blocks) {
    if (!valid || next >= to) break;
    const int64_t last = first + block.size(1);
    if (last <= next) continue;
    parts.push_back(block.narrow(1, next - first, std::min(to, last) - next));
    next = std::min(to, last);
  }
  TORCH_CHECK(next == to, "NAMM observe: rows ", next, "..", to - 1, " are neither remembered nor recorded");
  return parts.size() == 1 ? parts.front() : at::cat(parts, 1);
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
