#include "namm/policies/namm_policy.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>

#include "aten.h"
#include "cpu_kernels/task_pool.h"
#include "namm/budget_input.h"
#include "namm/recency_embedding.h"
#include "namm/selection.h"
#include "namm/stft_features.h"
#include "namm/tensor_view.h"
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
    const int64_t selection_n = selection_param_count(model.architecture.selection);
    at::Tensor selection_params = params.narrow(0, scorer_n, selection_n).cpu();
    return std::unique_ptr<NammPolicy>(new NammPolicy(model, std::move(scorer), selection_params));
  });
}

NammPolicy::NammPolicy(const NammModel& model, std::unique_ptr<Scorer> scorer, at::Tensor selection_params)
    : architecture_(model.architecture),
      scorer_(std::move(scorer)),
      constant_score_(constant_score(model.architecture.scorer, model.params)),
      selection_params_(std::move(selection_params)),
      normalizer_(model.norm_state, model.norm_stats) {
  if (architecture_.budget_input) budget_embedding_.assign(model.params.end() - kFeatureDim, model.params.end());
}

std::vector<float> NammPolicy::BudgetShift(int64_t n) const {
  const float pressure = budget_pressure(architecture_.selection, n);
  if (!architecture_.budget_input || pressure == 0) return {};
  return budget_shift(pressure, budget_embedding_);
}

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
  const at::TensorOptions options = cache.state(kEmaState).options();  // float32 (token_state)
  constexpr int64_t kStorageFloats = kCarriedRowsMaxBytes / int64_t{sizeof(float)};
  const int64_t count = kv_heads * (earlier + rows) * n;
  at::Tensor samples;
  if (options.device().is_cpu() && count <= kStorageFloats) {
    if (!samples_storage_.defined()) samples_storage_ = at::empty({kStorageFloats}, options);
    samples = narrow_view(samples_storage_, 0, 0, count).view({kv_heads, earlier + rows, n});
  } else {
    samples = at::empty({kv_heads, earlier + rows, n}, options);
  }
  if (earlier > 0) {
    const int64_t zeros = std::max<int64_t>(0, -start);
    if (zeros > 0) samples.narrow(1, 0, zeros).zero_();
    if (earlier > zeros) {
      EarlierRowsInto(layer, cache, start + zeros, first_query, narrow_view(samples, 1, zeros, earlier - zeros));
    }
  }
  const at::Tensor own = narrow_view(samples, 1, earlier, rows);
  gqa_mean_into(attention, precision, own);
  if (frames_end_here) {
    const int64_t last_end = first_end + (first_query + rows - 1 - first_end) / kStftHop * kStftHop;
    fold_frames(narrow_view(samples, 1, 0, last_end + 1 - start), cache.state(kEmaState));
  }
  // What later blocks of this forward pass may need: the 31 newest rows of this layer; after its last block, what
  // the next pass's first frame needs (the queries from its start, 16 + T mod 16 before the next token T), when
  // that is small (kCarriedRowsMaxBytes).
  const int64_t kept = std::min<int64_t>(rows, kStftWindow - 1);
  if (last_block) {
    if (carried_.size() <= static_cast<std::size_t>(layer)) carried_.resize(static_cast<std::size_t>(layer) + 1);
    CarriedRows& carried = carried_[static_cast<std::size_t>(layer)];
    // The replaced rows' storage is reused for the new ones (one allocation per layer, not per pass).
    if (carried.rows.defined() && carried.rows.is_contiguous()) spare_rows_ = carried.rows.view({-1});
    carried = CarriedRows{};
    const int64_t needed = std::min(rows, kStftHop + cache.tokens_seen() % kStftHop);
    if (rows >= kStftHop && own.device().is_cpu() &&
        needed * kv_heads * n * static_cast<int64_t>(sizeof(float)) <= kCarriedRowsMaxBytes) {
      // Into the storage the layer's rows had, when it is large enough (a pass's rows replace the last's).
      at::Tensor storage = std::move(spare_rows_);
      if (!storage.defined() || storage.numel() < kv_heads * needed * n) {
        storage = at::empty({kv_heads * needed * n}, own.options());
      }
      const at::Tensor rows_copy = narrow_view(storage, 0, 0, kv_heads * needed * n).view({kv_heads, needed, n});
      float* dst = rows_copy.data_ptr<float>();
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t q = 0; q < needed; ++q) {
          const float* row = own.data_ptr<float>() + h * own.stride(0) + (rows - needed + q) * own.stride(1);
          std::copy(row, row + n, dst + (h * needed + q) * n);
        }
      }
      carried = CarriedRows{first_query + rows - needed, cache.tokens_seen(), n, rows_copy};
    }
    return;
  }
  if (!valid) remembered_ = RememberedRows{layer, cache.tokens_seen(), n, {}};
  remembered_.blocks.emplace_back(first_query + rows - kept, narrow_view(own, 1, rows - kept, kept).clone());
  while (remembered_.blocks.size() > 1 &&
         remembered_.blocks[1].first <= first_query + rows - (kStftWindow - 1)) {
    remembered_.blocks.erase(remembered_.blocks.begin());
  }
}

void NammPolicy::EarlierRowsInto(int layer, const LayerKVCache& cache, int64_t from, int64_t to,
                                 const at::Tensor& out) const {
  int64_t next = from;
  const bool valid = remembered_.ValidFor(layer, cache);
  // The remembered blocks are contiguous and end at `to`; rows before the first of them are computed again.
  const int64_t remembered_from = valid && !remembered_.blocks.empty() ? remembered_.blocks.front().first : to;
  if (next < remembered_from && CopyCarriedRows(layer, cache, next, std::min(to, remembered_from), out)) {
    next = std::min(to, remembered_from);
  }
  if (next < remembered_from) {
    const int64_t upto = std::min(to, remembered_from);
    // A few queries at a time, so that their probabilities ([q_heads, piece, n]) stay as small as the engine's
    // attention blocks.
    const int64_t heads = cache.query_history().heads();
    const int64_t piece = std::max<int64_t>(1, kAttentionBlockElements / std::max<int64_t>(1, heads * cache.size()));
    for (int64_t q = next; q < upto; q += piece) {
      const int64_t len = std::min(piece, upto - q);
      const Status computed = cache.query_history().GqaMeanAttention(
          cache, q, q + len, architecture_.attention_precision, narrow_view(out, 1, q - from, len));
      TORCH_CHECK(computed.ok(), "NAMM observe: ", computed.message(),
                  " (the engine must record the queries: MemoryPolicy::query_history())");
    }
    next = upto;
  }
  for (const auto& [first, block] : remembered_.blocks) {
    if (!valid || next >= to) break;
    const int64_t last = first + block.size(1);
    if (last <= next) continue;
    const int64_t end = std::min(to, last);
    out.narrow(1, next - from, end - next).copy_(block.narrow(1, next - first, end - next));
    next = end;
  }
  TORCH_CHECK(next == to, "NAMM observe: rows ", next, "..", to - 1, " are neither remembered nor recorded");
}

bool NammPolicy::CopyCarriedRows(int layer, const LayerKVCache& cache, int64_t from, int64_t to,
                                 const at::Tensor& out) const {
  if (static_cast<std::size_t>(layer) >= carried_.size()) return false;
  const CarriedRows& c = carried_[static_cast<std::size_t>(layer)];
  // Since the rows were taken the cache has only grown by the tokens that arrived (a gather by this policy's own
  // Select is applied to them too), and they cover [from, to).
  if (!c.rows.defined() || c.first > from || c.first + c.rows.size(1) < to ||
      cache.size() - c.size != cache.tokens_seen() - c.tokens_seen || cache.size() < c.size) {
    return false;
  }
  // Tokens that arrived since are after these queries: they got nothing. (Host memory, row by row: the tensor
  // operations cost more than the copy at these sizes.)
  const int64_t heads = c.rows.size(0), r = c.rows.size(1), n = cache.size();
  const float* rows = c.rows.data_ptr<float>();
  float* target = out.data_ptr<float>();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t q = from; q < to; ++q) {
      const float* row = rows + (h * r + (q - c.first)) * c.size;
      float* dst = target + h * out.stride(0) + (q - from) * out.stride(1);
      std::copy(row, row + c.size, dst);
      std::fill(dst + c.size, dst + n, 0.0f);
    }
  }
  return true;
}

void NammPolicy::GatherCarriedRows(int layer, const LayerKVCache& cache, const int64_t* keep, int64_t k) {
  if (static_cast<std::size_t>(layer) >= carried_.size()) return;
  CarriedRows& c = carried_[static_cast<std::size_t>(layer)];
  if (!c.rows.defined()) return;
  if (keep == nullptr || c.tokens_seen != cache.tokens_seen() || c.size != cache.size()) {
    c = CarriedRows{};
    return;
  }
  // Column j of head h becomes the kept token keep[h][j], as the cache's own gather does.
  const int64_t heads = c.rows.size(0), r = c.rows.size(1);
  at::Tensor gathered = at::empty({heads, r, k}, c.rows.options());
  const at::Tensor rows = c.rows.contiguous();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t q = 0; q < r; ++q) {
      const float* from = rows.data_ptr<float>() + (h * r + q) * c.size;
      float* to = gathered.data_ptr<float>() + (h * r + q) * k;
      for (int64_t j = 0; j < k; ++j) to[j] = keep[h * k + j] >= 0 ? from[keep[h * k + j]] : 0.0f;  // -1: vacant
    }
  }
  c.rows = gathered;
  c.size = k;
}

Status NammPolicy::BeginSequence(const SequenceInfo& info) {
  carried_.clear();
  remembered_ = RememberedRows{};
  prompt_tokens_ = static_cast<int64_t>(info.prompt_ids.size());
  if (knob_budget_) {
    architecture_.selection.budget = knob_budget_->Resolve(static_cast<int64_t>(info.prompt_ids.size()));
  }
  return Status::Ok();
}

void NammPolicy::set_own_head_counts(bool own) { own_head_counts_ = own; }

int64_t NammPolicy::SelectOnHost(float* scores, const LayerKVCache& cache, std::vector<int64_t>& keep,
                                 std::vector<int64_t>& order) const {
  const SelectionConfig& selection = architecture_.selection;
  const double theta = selection.kind == SelectionKind::kDynamic
                           ? static_cast<double>(selection_params_.data_ptr<float>()[0])
                           : 0.0;
  if (own_head_counts_) {
    return select_own_counts_on_host(scores, cache.kv_heads(), cache.size(), cache.vacant(), selection, theta, keep,
                                     order);
  }
  return select_tokens_on_host(scores, cache.kv_heads(), cache.size(), selection, theta, keep, order);
}

Status NammPolicy::set_selection_knob(const SelectionKnob& knob) {
  const int given = int{knob.budget.has_value()} + int{knob.ratio.has_value()} + int{knob.threshold.has_value()};
  if (given != 1) return Status::InvalidArgument("a NAMM's selection takes one of budget=, ratio= or threshold=");
  SelectionConfig& s = architecture_.selection;
  const bool dynamic = s.kind == SelectionKind::kDynamic;
  knob_budget_.reset();
  if (knob.threshold) {
    if (dynamic) {
      return Status::InvalidArgument("this NAMM learned its threshold (dynamic selection): give it budget= or "
                                     "ratio= instead of threshold=");
    }
    if (!std::isfinite(*knob.threshold)) return Status::InvalidArgument("threshold= must be a finite number");
    s.kind = SelectionKind::kBinary;
    s.budget = 0;
    s.threshold = static_cast<float>(*knob.threshold);
    return Status::Ok();
  }
  NAMM_ASSIGN_OR_RETURN(CacheBudget budget,
                        knob.budget ? CacheBudget::Tokens(*knob.budget) : CacheBudget::Ratio(*knob.ratio));
  set_selection_budget(budget);
  return Status::Ok();
}

void NammPolicy::set_selection_budget(const CacheBudget& budget) {
  SelectionConfig& s = architecture_.selection;
  if (s.kind != SelectionKind::kDynamic) s.kind = SelectionKind::kTopK;
  s.budget = budget.Resolve(0);  // a ratio's is resolved again when a sequence begins
  knob_budget_ = budget;
}

int64_t NammPolicy::state_bytes() const {
  int64_t bytes = 0;
  for (const CarriedRows& c : carried_) bytes += c.rows.defined() ? c.rows.numel() * c.rows.element_size() : 0;
  return bytes;
}

std::string NammPolicy::prefix_key() const {
  std::string key = "namm;";
  key += architecture_.attention_precision == AttentionPrecision::kBf16 ? "bf16;" : "f32;";
  key += from_history_ ? "history;" : "samples;";
  key += FeaturesNeeded() ? "features" : "none";
  if (keep_prompt_) key += ";keep-prompt";
  return key;
}

void NammPolicy::AdoptPrefix(const MemoryPolicy& leader) {
  const auto& namm = static_cast<const NammPolicy&>(leader);  // the keys matched: a NAMM too
  observe_skipped_ = namm.observe_skipped_;
  carried_ = namm.carried_;
  for (CarriedRows& c : carried_) {
    if (c.rows.defined()) c.rows = c.rows.clone();
  }
}

Status NammPolicy::CheckSelect(const LayerKVCache& cache) const {
  // At the prompt's end the features are those of the frames completed so far.
  if (!at_prompt_end_ && cache.tokens_seen() % kStftHop != 0) {
    return Status::FailedPrecondition("a NAMM update needs a sequence length that is a multiple of " +
                                      std::to_string(kStftHop) + " (complete spectrogram frames), got " +
                                      std::to_string(cache.tokens_seen()));
  }
  if (cache.size() == 0) return Status::FailedPrecondition("a NAMM update needs at least one cached token");
  if (tracing_ && observe_skipped_) {
    return Status::FailedPrecondition("tracing was enabled after Observe calls it would have needed");
  }
  return Status::Ok();
}

Result<at::Tensor> NammPolicy::Select(int layer, LayerKVCache& cache) {
  return std::move(SelectTogether({MemoryUpdate{this, layer, &cache}}).front());
}

Result<std::optional<at::Tensor>> NammPolicy::EndPrefill(int layer, LayerKVCache& cache) {
  if (!keep_prompt_) return std::optional<at::Tensor>();
  at_prompt_end_ = true;
  Result<at::Tensor> kept = Select(layer, cache);
  at_prompt_end_ = false;
  if (!kept.ok()) return kept.status();
  return std::optional<at::Tensor>(std::move(kept).value());
}

Result<at::Tensor> NammPolicy::SelectWithTensors(int layer, LayerKVCache& cache) {
  const bool constant = constant_score_ && !tracing_;
  // A ragged gather runs on the host.
  if (own_head_counts_ && !cache.positions().device().is_cpu()) {
    return Status::FailedPrecondition("heads=own: the memory update of a ragged cache runs on the host, not on " +
                                      cache.device().str());
  }
  // Own head counts select on the host, whatever computed the scores.
  const auto select = [&](const at::Tensor& scores) {
    if (!own_head_counts_) return select_tokens(scores, architecture_.selection, selection_params_);
    at::Tensor host = scores.to(at::kCPU, at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
    std::vector<int64_t> keep, order;
    const int64_t k = SelectOnHost(host.data_ptr<float>(), cache, keep, order);
    at::Tensor out = at::empty({cache.kv_heads(), k}, at::TensorOptions().dtype(at::kLong).device(at::kCPU));
    std::copy(keep.begin(), keep.end(), out.data_ptr<int64_t>());
    return out.to(scores.device());
  };
  Result<at::Tensor> keep = internal::catch_torch_errors("NAMM select", [&]() -> Result<at::Tensor> {
    if (constant) {
      if (normalizer_.state() == NormState::kCollecting) normalizer_.Normalize(cache.state(kEmaState), cache.vacant());
      const at::Tensor scores = at::full({cache.kv_heads(), cache.size()}, *constant_score_,
                                         cache.positions().options().dtype(at::kFloat));
      return select(scores);
    }
    const at::Tensor normalized = normalizer_.Normalize(cache.state(kEmaState), cache.vacant());
    at::Tensor features = at::cat({recency_embedding(cache.positions()), normalized}, 2);
    // The budget input's shift for a head of n tokens, added to `rows` [..., n, kFeatureDim].
    const auto shifted = [&](const at::Tensor& rows, int64_t n) {
      std::vector<float> shift = BudgetShift(n);  // read in place until the sum
      if (shift.empty()) return rows;
      const at::Tensor shift_tensor =
          at::from_blob(shift.data(), {kFeatureDim}, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
      return rows + shift_tensor.to(rows.device());
    };
    at::Tensor scores;
    if (!own_head_counts_) {
      features = shifted(features, cache.size());
      scores = scorer_->Score(features);
    } else {  // each head scored over the slots it holds alone, as SelectTogether does; vacant ones never kept
      const int64_t n = cache.size();
      scores = at::full({cache.kv_heads(), n}, -std::numeric_limits<float>::infinity(), features.options());
      for (int64_t h = 0; h < cache.kv_heads(); ++h) {
        const int64_t first = cache.vacant() != nullptr ? cache.vacant()[h] : 0;
        at::Tensor own = features[h].narrow(0, first, n - first);
        own.copy_(shifted(own, n - first));
        scores[h].narrow(0, first, n - first).copy_(scorer_->Score(own.unsqueeze(0))[0]);
      }
    }
    at::Tensor kept = select(scores);
    if (tracing_) trace_ = {features, scores, kept};
    return kept;
  });
  // The carried rows follow the cache (rows are only carried on the host).
  if (!keep.ok() || !keep->device().is_cpu()) {
    GatherCarriedRows(layer, cache, nullptr, 0);
  } else {
    const at::Tensor host = keep->contiguous();
    GatherCarriedRows(layer, cache, host.data_ptr<int64_t>(), host.size(1));
  }
  return keep;
}

// On the host, every (sequence, KV head) of the updates is one task of one parallel pass: its features built
// in place (recency from the table, the EMA normalized), scored by its own NAMM's ScoreOnHost, then each
// sequence's selection. No tensor operation but the result's. The tensor path (SelectWithTensors) takes the
// rest: a device, tracing, a constant scorer.
std::vector<Result<at::Tensor>> NammPolicy::SelectTogether(const std::vector<MemoryUpdate>& updates) {
  struct Item {
    NammPolicy* policy = nullptr;
    int layer = 0;
    LayerKVCache* cache = nullptr;
    int64_t heads = 0, n = 0;
    const int64_t* vacant = nullptr;      // the cache's (own head counts): head h scores slots vacant[h] on
    at::Tensor ema, positions;            // [heads, n, 17] and [heads, n], rows contiguous
    bool affine = false;                  // normalized by mean and scale; else `ema` is already normalized
    std::array<float, kStftBins> mean{}, scale{};
    std::vector<float> scores;            // [heads][n]
    std::vector<float> budget_shift;      // added to every token's features (budget_input.h); empty: none
                                          // (own head counts: computed per head)
  };
  std::vector<Result<at::Tensor>> kept(updates.size(), Result<at::Tensor>(Status::Internal("not selected")));
  std::vector<Item> items;
  std::vector<std::size_t> where, on_device;
  for (std::size_t u = 0; u < updates.size(); ++u) {
    auto* policy = static_cast<NammPolicy*>(updates[u].policy);  // apply_memory_updates groups by class
    LayerKVCache& cache = *updates[u].cache;
    if (policy->ReadingPrompt(cache)) {
      kept[u] = all_token_indices(cache);
      continue;
    }
    if (Status checked = policy->CheckSelect(cache); !checked.ok()) {
      kept[u] = checked;
      continue;
    }
    const bool host = cache.positions().device().is_cpu() && !policy->tracing_ && !policy->constant_score_;
    if (!host) {
      on_device.push_back(u);
      continue;
    }
    Item item;
    item.policy = policy;
    item.layer = updates[u].layer;
    item.cache = &cache;
    item.heads = cache.kv_heads();
    item.n = cache.size();
    item.vacant = cache.vacant();
    item.ema = cache.state(kEmaState);
    item.positions = cache.positions();
    item.affine = policy->normalizer_.FrozenAffine(item.mean, item.scale);
    // Collecting statistics (or frozen without any): the normalizer's own pass, which also gathers them.
    if (!item.affine) item.ema = policy->normalizer_.Normalize(item.ema, item.vacant).contiguous();
    item.scores.resize(static_cast<std::size_t>(item.heads * item.n));
    if (!policy->own_head_counts_) item.budget_shift = policy->BudgetShift(item.n);
    items.push_back(std::move(item));
    where.push_back(u);
  }
  std::vector<int64_t> first_task(items.size() + 1, 0);
  for (std::size_t i = 0; i < items.size(); ++i) first_task[i + 1] = first_task[i] + items[i].heads;
  std::vector<std::string> failures(static_cast<std::size_t>(first_task.back()));  // a task's exception, if any
  // Whether a task's scorer declined (then its item takes the tensor path): one flag per task, as the heads of an
  // item run on different threads.
  std::vector<char> declined(static_cast<std::size_t>(first_task.back()), 0);
  cpu::parallel_tasks(first_task.back(), [&](int64_t begin, int64_t end) {
    std::vector<float> features, workspace;
    for (int64_t task = begin; task < end; ++task) {
      const auto i = static_cast<std::size_t>(std::upper_bound(first_task.begin(), first_task.end(), task) -
                                              first_task.begin() - 1);
      Item& item = items[i];
      const int64_t h = task - first_task[i];
      // A ragged cache's head holds slots [first, item.n): its features and scores are of those alone.
      const int64_t first = item.vacant != nullptr ? item.vacant[h] : 0, n = item.n - first;
      try {
        features.resize(static_cast<std::size_t>(n * kFeatureDim));
        recency_embedding_on_host(item.positions.data_ptr<int64_t>() + h * item.positions.stride(0) + first, n,
                                  features.data(), kFeatureDim);
        const float* ema = item.ema.data_ptr<float>() + h * item.ema.stride(0) + first * item.ema.stride(1);
        for (int64_t j = 0; j < n; ++j) {
          const float* bins = ema + j * item.ema.stride(1);
          float* x = features.data() + j * kFeatureDim + kRecencyDims;
          for (std::size_t f = 0; f < static_cast<std::size_t>(kStftBins); ++f) {
            x[f] = item.affine ? (bins[f] - item.mean[f]) / item.scale[f] : bins[f];
          }
        }
        add_budget_shift(item.policy->own_head_counts_ ? item.policy->BudgetShift(n) : item.budget_shift,
                         features.data(), n, kFeatureDim);
        float* scores = item.scores.data() + h * item.n;
        std::fill(scores, scores + first, -std::numeric_limits<float>::infinity());  // vacant: never kept
        // Declining is a property of the policy (its parameters' device), the same for all of its heads.
        declined[static_cast<std::size_t>(task)] =
            item.policy->scorer_->ScoreOnHost(features.data(), kFeatureDim, n, scores + first, workspace) ? 0 : 1;
      } catch (const std::exception& e) {
        failures[static_cast<std::size_t>(task)] = e.what();
      }
    }
  });
  std::vector<int64_t> keep, order;
  for (std::size_t i = 0; i < items.size(); ++i) {
    Item& item = items[i];
    const auto failed = std::find_if(failures.begin() + first_task[i], failures.begin() + first_task[i + 1],
                                     [](const std::string& f) { return !f.empty(); });
    if (failed != failures.begin() + first_task[i + 1]) {
      kept[where[i]] = Status::Internal("NAMM select: " + *failed);
      continue;
    }
    if (declined[static_cast<std::size_t>(first_task[i])] != 0) {
      kept[where[i]] = item.policy->SelectWithTensors(item.layer, *item.cache);
      continue;
    }
    kept[where[i]] = internal::catch_torch_errors("NAMM select", [&]() -> Result<at::Tensor> {
      const int64_t k = item.policy->SelectOnHost(item.scores.data(), *item.cache, keep, order);
      item.policy->GatherCarriedRows(item.layer, *item.cache, keep.data(), k);
      at::Tensor out = at::empty({item.heads, k}, at::TensorOptions().dtype(at::kLong).device(at::kCPU));
      std::copy(keep.begin(), keep.end(), out.data_ptr<int64_t>());
      return out;
    });
  }
  // On a device, each policy's updates together.
  std::vector<bool> done(updates.size(), false);
  for (std::size_t i : on_device) {
    if (done[i]) continue;
    std::vector<MemoryUpdate> own;
    std::vector<std::size_t> at;
    for (std::size_t j : on_device) {
      if (!done[j] && updates[j].policy == updates[i].policy) {
        done[j] = true;
        own.push_back(updates[j]);
        at.push_back(j);
      }
    }
    std::vector<Result<at::Tensor>> selected = static_cast<NammPolicy*>(updates[i].policy)->SelectOnDevice(own);
    for (std::size_t g = 0; g < at.size(); ++g) kept[at[g]] = std::move(selected[g]);
  }
  return kept;
}

// A sequence's layers reach their memory updates together; on a device, scoring and selecting each alone is some
// fifty small operations (each a kernel launch) and a wait for the device per layer. Here every layer's tokens
// are scored in one pass, each layer's rows left-padded to the longest: a token's score depends on its own
// features and on newer tokens' alone (scorer.h), so the padding, older than every token, changes no real score
// (up to the device's rounding, as libtorch's kernels choose by shape), and select_tokens_padded never keeps it.
std::vector<Result<at::Tensor>> NammPolicy::SelectOnDevice(const std::vector<MemoryUpdate>& updates) {
  std::vector<Result<at::Tensor>> kept;
  kept.reserve(updates.size());
  const LayerKVCache& first = *updates.front().cache;
  bool together = updates.size() > 1 && !tracing_ && !constant_score_ && !own_head_counts_ &&
                  normalizer_.state() != NormState::kCollecting;  // statistics gathered per layer, as they come
  std::vector<int64_t> sizes;
  for (const MemoryUpdate& u : updates) {
    const LayerKVCache& cache = *u.cache;
    together = together && cache.vacant() == nullptr && cache.kv_heads() == first.kv_heads() &&
               cache.device() == first.device() && cache.size() >= 1;
    sizes.push_back(cache.size());
  }
  if (!together) {
    for (const MemoryUpdate& u : updates) kept.push_back(SelectWithTensors(u.layer, *u.cache));
    return kept;
  }
  const auto count = static_cast<int64_t>(updates.size());
  const int64_t heads = first.kv_heads(), n_max = *std::max_element(sizes.begin(), sizes.end());
  Result<std::vector<at::Tensor>> selected = internal::catch_torch_errors(
      "NAMM select", [&]() -> Result<std::vector<at::Tensor>> {
        // Padding: EMA zero and position zero (finite features), before each layer's tokens.
        at::Tensor ema = at::zeros({count, heads, n_max, kStftBins}, first.state(kEmaState).options());
        at::Tensor positions = at::zeros({count, heads, n_max}, first.positions().options());
        std::vector<float> shifts;
        for (int64_t c = 0; c < count; ++c) {
          const LayerKVCache& cache = *updates[static_cast<std::size_t>(c)].cache;
          const int64_t n = sizes[static_cast<std::size_t>(c)];
          ema[c].narrow(1, n_max - n, n).copy_(cache.state(kEmaState));
          positions[c].narrow(1, n_max - n, n).copy_(cache.positions());
          const std::vector<float> shift = BudgetShift(n);
          if (!shift.empty()) {
            shifts.resize(static_cast<std::size_t>(count * kFeatureDim), 0.0f);
            std::copy(shift.begin(), shift.end(), shifts.begin() + c * kFeatureDim);
          }
        }
        at::Tensor features = at::cat({recency_embedding(positions.view({count * heads, n_max})),
                                       normalizer_.Normalize(ema.view({count * heads, n_max, kStftBins}))},
                                      2);
        if (!shifts.empty()) {  // each layer's own budget shift (for its n), in one transfer
          const at::Tensor shift = at::from_blob(shifts.data(), {count, 1, kFeatureDim},
                                                 at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
          features.view({count, heads * n_max, kFeatureDim}).add_(shift.to(features.device()));
        }
        const at::Tensor scores = scorer_->Score(features).reshape({count, heads, n_max});
        return select_tokens_padded(scores, sizes, architecture_.selection, selection_params_);
      });
  for (std::size_t c = 0; c < updates.size(); ++c) {
    // The carried rows follow the cache (rows are only carried on the host).
    GatherCarriedRows(updates[c].layer, *updates[c].cache, nullptr, 0);
    kept.push_back(selected.ok() ? Result<at::Tensor>(std::move((*selected)[c])) : Result<at::Tensor>(selected.status()));
  }
  return kept;
}

}  // namespace namm
