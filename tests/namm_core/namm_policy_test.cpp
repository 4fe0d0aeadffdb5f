// The NAMM policy end to end — streamed attention, cache, features, normalization, BAM, selection, eviction —
// against the slow reference implementation of the spec, over three consecutive 512-query updates.
#include "namm/policies/namm_policy.h"

#include <ATen/Context.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "namm/budget_input.h"
#include "test_util.h"

namespace namm {
namespace {

using testing::Array;
using testing::ToArray;

constexpr int64_t kQHeads = 8, kKvHeads = 2, kNew = 512, kChunk = 128;

std::vector<std::vector<int64_t>> Rows(const at::Tensor& keep) {
  std::vector<std::vector<int64_t>> out(static_cast<std::size_t>(keep.size(0)));
  for (int64_t h = 0; h < keep.size(0); ++h)
    for (int64_t i = 0; i < keep.size(1); ++i) out[static_cast<std::size_t>(h)].push_back(keep[h][i].item<int64_t>());
  return out;
}

NammModel BamModel(double scale, uint64_t seed) {
  NammModel model;
  model.architecture.scorer = default_scorer_config(ScorerKind::kBam);
  at::Tensor p = testing::RandomNormal({4172}, seed, scale);
  model.params.assign(p.data_ptr<float>(), p.data_ptr<float>() + 4172);
  return model;
}

Array Concat(const Array& a, const Array& b) {  // along dim 1 of [H, n, F] arrays
  const int64_t h = a.shape[0], f = a.shape[2];
  Array out({h, a.shape[1] + b.shape[1], f});
  for (int64_t i = 0; i < h; ++i) {
    for (int64_t j = 0; j < a.shape[1]; ++j)
      for (int64_t c = 0; c < f; ++c) out.at({i, j, c}) = a.at({i, j, c});
    for (int64_t j = 0; j < b.shape[1]; ++j)
      for (int64_t c = 0; c < f; ++c) out.at({i, a.shape[1] + j, c}) = b.at({i, j, c});
  }
  return out;
}

// Runs three updates through NammPolicy and through the reference, comparing every update's output.
void RunAgainstReference(const NammModel& model) {
  auto policy = NammPolicy::Create(model);
  ASSERT_TRUE(policy.ok()) << policy.status().ToString();
  (*policy)->set_tracing(true);
  LayerKVCache cache(kKvHeads, 0, at::TensorOptions().dtype(at::kFloat), (*policy)->token_state());

  testing::RefLayerState ref{Array({kKvHeads, 0, 16}), Array({kKvHeads, 0, 17}), Array({kKvHeads, 0})};
  Array all_ema({kKvHeads, 0, 17});  // every EMA the collecting statistics have seen
  int64_t evicted_total = 0;
  for (int64_t u = 0; u < 3; ++u) {
    const int64_t n_old = cache.size();
    ASSERT_EQ(n_old, ref.n());
    at::Tensor attention = testing::RandomCausalAttention(kQHeads, kNew, n_old, 1000 + static_cast<uint64_t>(u));

    // namm_core: the engine's protocol, 128 queries at a time.
    for (int64_t q0 = 0; q0 < kNew; q0 += kChunk) {
      at::Tensor positions = at::arange(u * kNew + q0, u * kNew + q0 + kChunk, at::TensorOptions().dtype(at::kLong));
      ASSERT_TRUE(cache.Append(at::Tensor(), at::Tensor(), positions).ok());
      ASSERT_TRUE(observe_newest(**policy, 0, attention.narrow(1, q0, kChunk).narrow(2, 0, cache.size()), cache).ok());
    }
    auto keep = (*policy)->Select(0, cache);
    ASSERT_TRUE(keep.ok()) << keep.status().ToString();
    const NammPolicy::Trace trace = (*policy)->last_trace();

    // Reference: the whole update at once.
    Array carry;
    Array ema = testing::RefSpectrogramEma(testing::RefGqaMean(ToArray(attention), kKvHeads, true), ref, &carry);
    Array positions({kKvHeads, n_old + kNew});
    for (int64_t h = 0; h < kKvHeads; ++h) {
      for (int64_t i = 0; i < n_old; ++i) positions.at({h, i}) = ref.positions.at({h, i});
      for (int64_t i = 0; i < kNew; ++i) positions.at({h, n_old + i}) = static_cast<double>(u * kNew + i);
    }
    testing::RefStats stats;
    if (model.norm_state == NormState::kCollecting) {
      all_ema = Concat(all_ema, ema);
      stats = testing::RefStatsOf(all_ema);
    } else {
      stats.mean.assign(model.norm_stats.mean.begin(), model.norm_stats.mean.end());
      stats.var.assign(model.norm_stats.var.begin(), model.norm_stats.var.end());
    }
    Array features = testing::RefFeatures(ema, positions, stats);
    std::vector<std::vector<double>> scores;
    Array score_array({kKvHeads, n_old + kNew});
    for (int64_t h = 0; h < kKvHeads; ++h) {
      scores.push_back(testing::RefBamScores(model.params, 32, features, h));
      for (int64_t i = 0; i < n_old + kNew; ++i) score_array.at({h, i}) = scores.back()[static_cast<std::size_t>(i)];
    }
    auto ref_keep = testing::RefBinarySelect(scores);

    EXPECT_TRUE(testing::AllClose(cache.state("namm.ema"), ema, 1e-7, 1e-5)) << "update " << u;
    EXPECT_TRUE(testing::AllClose(trace.features, features, 2e-5, 1e-4)) << "update " << u;
    EXPECT_TRUE(testing::AllClose(trace.scores, score_array, 1e-4, 1e-4)) << "update " << u;
    ASSERT_EQ(Rows(*keep), ref_keep) << "update " << u;

    evicted_total += cache.size() - (*keep).size(1);
    ASSERT_TRUE(cache.Gather(*keep).ok());
    ref = testing::RefGather({carry, ema, positions}, ref_keep);
    EXPECT_TRUE(testing::AllClose(cache.positions(), ref.positions, 0, 0));
  }
  // The comparison is only meaningful if the NAMM actually evicted tokens and kept others.
  EXPECT_GT(evicted_total, 100);
  EXPECT_GT(cache.size(), 100);
}

TEST(NammPolicy, MatchesTheReferenceWhileCollectingStatistics) { RunAgainstReference(BamModel(0.15, 77)); }

TEST(NammPolicy, MatchesTheReferenceWithFrozenStatistics) {
  NammModel model = BamModel(0.15, 78);
  model.norm_state = NormState::kFrozen;
  for (std::size_t f = 0; f < 17; ++f) {
    model.norm_stats.mean[f] = 0.002 / static_cast<double>(f + 1);
    model.norm_stats.var[f] = 1e-6 * static_cast<double>(f + 1);
  }
  model.norm_stats.count = 1000;
  RunAgainstReference(model);
}

TEST(NammPolicy, ZeroParametersKeepEveryTokenAndEqualTheFullCache) {
  NammModel model;
  model.params = initial_params(model.architecture);
  auto policy = NammPolicy::Create(model);
  ASSERT_TRUE(policy.ok());
  LayerKVCache cache(kKvHeads, 0, at::TensorOptions().dtype(at::kFloat), (*policy)->token_state());
  for (int64_t u = 0; u < 2; ++u) {
    at::Tensor attention = testing::RandomCausalAttention(kQHeads, kNew, cache.size(), 5 + static_cast<uint64_t>(u));
    ASSERT_TRUE(cache.Append(at::Tensor(), at::Tensor(), at::arange(u * kNew, (u + 1) * kNew, at::TensorOptions().dtype(at::kLong))).ok());
    ASSERT_TRUE(observe_newest(**policy, 0, attention, cache).ok());
    ASSERT_TRUE(apply_memory_update(**policy, 0, cache).ok());
    EXPECT_EQ(cache.size(), (u + 1) * kNew);
  }
  // Statistics were collected over both updates: 2 heads x (512 + 1024) tokens.
  EXPECT_EQ((*policy)->normalizer().stats().count, 2 * (512 + 1024));
}

TEST(NammPolicy, ConstantScorerShortcutKeepsWhatTheFullPipelineKeeps) {
  // Random parameters except a zero output layer with bias -1: every score is -1, so each head keeps only
  // its newest token. The shortcut (no features, no scorer) must decide exactly as the traced full pipeline.
  NammModel model = BamModel(0.3, 80);
  for (int i = 4146; i < 4171; ++i) model.params[static_cast<std::size_t>(i)] = 0.0f;
  model.params[4171] = -1.0f;
  model.norm_state = NormState::kFrozen;
  model.norm_stats.count = 1;
  model.norm_stats.mean.fill(0.001);
  model.norm_stats.var.fill(1e-6);
  auto fast = NammPolicy::Create(model);
  auto full = NammPolicy::Create(model);
  ASSERT_TRUE(fast.ok() && full.ok());
  (*full)->set_tracing(true);
  LayerKVCache fast_cache(kKvHeads, 0, at::TensorOptions().dtype(at::kFloat), (*fast)->token_state());
  LayerKVCache full_cache(kKvHeads, 0, at::TensorOptions().dtype(at::kFloat), (*full)->token_state());
  at::Tensor attention = testing::RandomCausalAttention(kQHeads, kNew, 0, 9);
  at::Tensor positions = at::arange(kNew, at::TensorOptions().dtype(at::kLong));
  for (auto* pair : {&fast_cache, &full_cache}) ASSERT_TRUE(pair->Append(at::Tensor(), at::Tensor(), positions).ok());
  ASSERT_TRUE(observe_newest(**fast, 0, attention, fast_cache).ok());
  ASSERT_TRUE(observe_newest(**full, 0, attention, full_cache).ok());
  auto a = (*fast)->Select(0, fast_cache), b = (*full)->Select(0, full_cache);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(a->equal(*b));
  EXPECT_EQ(a->size(1), 1);
  EXPECT_EQ((*full)->last_trace().scores.max().item<float>(), -1.0f);
  // The shortcut skipped the spectrogram, so tracing cannot be switched on afterwards.
  (*fast)->set_tracing(true);
  EXPECT_FALSE((*fast)->Select(0, fast_cache).ok());
}

TEST(NammPolicy, CudaMatchesCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device in this build or machine";
  NammModel model = BamModel(0.15, 79);
  auto cpu = NammPolicy::Create(model);
  auto gpu = NammPolicy::Create(model, at::Device(at::kCUDA, 0));
  ASSERT_TRUE(cpu.ok() && gpu.ok());
  const auto options = at::TensorOptions().dtype(at::kFloat);
  LayerKVCache cpu_cache(kKvHeads, 0, options, (*cpu)->token_state());
  LayerKVCache gpu_cache(kKvHeads, 0, options.device(at::kCUDA, 0), (*gpu)->token_state());
  for (int64_t u = 0; u < 2; ++u) {
    at::Tensor attention = testing::RandomCausalAttention(kQHeads, kNew, cpu_cache.size(), 50 + static_cast<uint64_t>(u));
    at::Tensor positions = at::arange(u * kNew, (u + 1) * kNew, at::TensorOptions().dtype(at::kLong));
    ASSERT_TRUE(cpu_cache.Append(at::Tensor(), at::Tensor(), positions).ok());
    ASSERT_TRUE(gpu_cache.Append(at::Tensor(), at::Tensor(), positions.cuda()).ok());
    ASSERT_TRUE(observe_newest(**cpu, 0, attention, cpu_cache).ok());
    ASSERT_TRUE(observe_newest(**gpu, 0, attention.cuda(), gpu_cache).ok());
    ASSERT_TRUE(apply_memory_update(**cpu, 0, cpu_cache).ok());
    ASSERT_TRUE(apply_memory_update(**gpu, 0, gpu_cache).ok());
    EXPECT_TRUE(testing::AllClose(gpu_cache.state("namm.ema"), ToArray(cpu_cache.state("namm.ema")), 1e-7, 1e-5));
    EXPECT_TRUE(gpu_cache.positions().cpu().equal(cpu_cache.positions())) << "update " << u;
  }
}

// On a GPU a sequence's layers are scored and selected together (SelectOnDevice: their tokens left-padded to the
// longest layer's): each layer keeps what the CPU's NAMM keeps for it alone. Layers of different sizes, frozen
// statistics (the path's condition), binary, dynamic and top-k selection, BAM and MLP scorers.
TEST(NammPolicy, OnCudaASequencesLayersSelectedTogetherKeepWhatTheCpuKeepsForEach) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device in this build or machine";
  NammModel bam = BamModel(0.15, 81);
  NammModel mlp = bam;
  mlp.architecture.scorer = default_scorer_config(ScorerKind::kMlp);
  mlp.params.assign(static_cast<std::size_t>(scorer_param_count(mlp.architecture.scorer)), 0.0f);
  at::Tensor p = testing::RandomNormal({static_cast<int64_t>(mlp.params.size())}, 96, 0.3);
  std::copy(p.data_ptr<float>(), p.data_ptr<float>() + p.numel(), mlp.params.begin());
  NammModel dynamic = BamModel(0.15, 82);
  dynamic.architecture.selection = SelectionConfig{SelectionKind::kDynamic, 0, -2.0};
  dynamic.params.push_back(-2.0f);
  NammModel top_k = BamModel(0.15, 83);
  top_k.architecture.selection = SelectionConfig{SelectionKind::kTopK, 300};
  constexpr int kLayers = 4;
  for (NammModel model : {bam, mlp, dynamic, top_k}) {
    model.norm_state = NormState::kFrozen;
    model.norm_stats.count = 100;
    model.norm_stats.mean.fill(0.003);
    model.norm_stats.var.fill(2e-6);
    auto cpu = NammPolicy::Create(model);
    auto gpu = NammPolicy::Create(model, at::Device(at::kCUDA, 0));
    ASSERT_TRUE(cpu.ok() && gpu.ok());
    const auto options = at::TensorOptions().dtype(at::kFloat);
    std::vector<LayerKVCache> cpu_caches, gpu_caches;
    for (int l = 0; l < kLayers; ++l) {
      cpu_caches.emplace_back(kKvHeads, 0, options, (*cpu)->token_state());
      gpu_caches.emplace_back(kKvHeads, 0, options.device(at::kCUDA, 0), (*gpu)->token_state());
    }
    int64_t evicted = 0;
    for (int64_t u = 0; u < 2; ++u) {
      std::vector<MemoryUpdate> updates;
      for (int l = 0; l < kLayers; ++l) {
        const int64_t n_new = kNew - 96 * l;  // layers of different sizes
        LayerKVCache& on_cpu = cpu_caches[static_cast<std::size_t>(l)];
        LayerKVCache& on_gpu = gpu_caches[static_cast<std::size_t>(l)];
        const int64_t first = on_cpu.tokens_seen();
        at::Tensor attention = testing::RandomCausalAttention(kQHeads, n_new, on_cpu.size(), 300 + l + 10 * u);
        at::Tensor positions = at::arange(first, first + n_new, at::TensorOptions().dtype(at::kLong));
        ASSERT_TRUE(on_cpu.Append(at::Tensor(), at::Tensor(), positions).ok());
        ASSERT_TRUE(on_gpu.Append(at::Tensor(), at::Tensor(), positions.cuda()).ok());
        ASSERT_TRUE(observe_newest(**cpu, l, attention, on_cpu).ok());
        ASSERT_TRUE(observe_newest(**gpu, l, attention.cuda(), on_gpu).ok());
        updates.push_back(MemoryUpdate{gpu->get(), l, &on_gpu});
      }
      const std::vector<Status> statuses = apply_memory_updates(updates);
      for (int l = 0; l < kLayers; ++l) {
        SCOPED_TRACE("layer " + std::to_string(l) + ", update " + std::to_string(u));
        ASSERT_TRUE(statuses[static_cast<std::size_t>(l)].ok()) << statuses[static_cast<std::size_t>(l)].ToString();
        LayerKVCache& on_cpu = cpu_caches[static_cast<std::size_t>(l)];
        const int64_t before = on_cpu.size();
        ASSERT_TRUE(apply_memory_update(**cpu, l, on_cpu).ok());
        evicted += before - on_cpu.size();
        EXPECT_TRUE(gpu_caches[static_cast<std::size_t>(l)].positions().cpu().equal(on_cpu.positions()));
      }
    }
    EXPECT_GT(evicted, 50);  // the comparison means something only if tokens were dropped
  }
}

// A batch's memory update (apply_memory_updates: every NAMM's features, scorer and selection in one pass of our
// kernels, no tensor operation) keeps, for each sequence, exactly what the traced tensor pipeline keeps alone:
// BAM and MLP scorers, binary and dynamic selection, collecting and frozen statistics, caches of different sizes.
TEST(NammPolicy, UpdatesOfABatchKeepWhatEachTensorPipelineKeepsAlone) {
  std::vector<NammModel> models;
  for (uint64_t seed = 0; seed < 4; ++seed) models.push_back(BamModel(0.15, 90 + seed));
  NammModel mlp = models[0];
  mlp.architecture.scorer = default_scorer_config(ScorerKind::kMlp);
  mlp.params.assign(static_cast<std::size_t>(scorer_param_count(mlp.architecture.scorer)), 0.0f);
  at::Tensor p = testing::RandomNormal({static_cast<int64_t>(mlp.params.size())}, 95, 0.3);
  std::copy(p.data_ptr<float>(), p.data_ptr<float>() + p.numel(), mlp.params.begin());
  models.push_back(mlp);
  models[1].architecture.selection = SelectionConfig{SelectionKind::kDynamic, 0, -2.0};
  models[1].params.push_back(-2.0f);
  for (std::size_t m : {std::size_t{2}, std::size_t{4}}) {
    models[m].norm_state = NormState::kFrozen;
    models[m].norm_stats.count = 100;
    models[m].norm_stats.mean.fill(0.003);
    models[m].norm_stats.var.fill(2e-6);
  }
  std::vector<std::unique_ptr<NammPolicy>> batched, traced;
  std::vector<LayerKVCache> batch_caches, traced_caches;
  for (std::size_t m = 0; m < models.size(); ++m) {
    batched.push_back(std::move(NammPolicy::Create(models[m])).value());
    traced.push_back(std::move(NammPolicy::Create(models[m])).value());
    traced.back()->set_tracing(true);
    batch_caches.emplace_back(kKvHeads, 0, at::TensorOptions().dtype(at::kFloat), batched.back()->token_state());
    traced_caches.emplace_back(kKvHeads, 0, at::TensorOptions().dtype(at::kFloat), traced.back()->token_state());
  }
  for (int64_t u = 0; u < 2; ++u) {
    std::vector<MemoryUpdate> updates;
    for (std::size_t m = 0; m < models.size(); ++m) {
      const int64_t n_new = kNew - 64 * static_cast<int64_t>(m);  // caches of different sizes
      for (const auto& pair : {std::make_pair(&batch_caches[m], batched[m].get()),
                               std::make_pair(&traced_caches[m], traced[m].get())}) {
        LayerKVCache& cache = *pair.first;
        const int64_t first = cache.tokens_seen();
        at::Tensor attention = testing::RandomCausalAttention(kQHeads, n_new, cache.size(), 200 + m + 10 * u);
        ASSERT_TRUE(cache.Append(at::Tensor(), at::Tensor(), at::arange(first, first + n_new, at::TensorOptions().dtype(at::kLong))).ok());
        ASSERT_TRUE(observe_newest(*pair.second, 0, attention, cache).ok());
      }
      updates.push_back(MemoryUpdate{batched[m].get(), 0, &batch_caches[m]});
    }
    const std::vector<Status> statuses = apply_memory_updates(updates);
    int64_t evicted = 0;
    for (std::size_t m = 0; m < models.size(); ++m) {
      SCOPED_TRACE("model " + std::to_string(m) + ", update " + std::to_string(u));
      ASSERT_TRUE(statuses[m].ok()) << statuses[m].ToString();
      const int64_t before = traced_caches[m].size();
      ASSERT_TRUE(apply_memory_update(*traced[m], 0, traced_caches[m]).ok());
      evicted += before - traced_caches[m].size();
      EXPECT_TRUE(batch_caches[m].positions().equal(traced_caches[m].positions()));
      EXPECT_TRUE(batch_caches[m].state("namm.ema").equal(traced_caches[m].state("namm.ema")));
      EXPECT_EQ(batched[m]->normalizer().stats().count, traced[m]->normalizer().stats().count);
    }
    EXPECT_GT(evicted, 50);  // the comparison means something only if tokens were dropped
  }
}

TEST(NammPolicy, RefusesAnUpdateInTheMiddleOfASpectrogramHop) {
  NammModel model;
  model.params = initial_params(model.architecture);
  auto policy = NammPolicy::Create(model);
  ASSERT_TRUE(policy.ok());
  LayerKVCache cache(1, 0, at::TensorOptions().dtype(at::kFloat), (*policy)->token_state());
  ASSERT_TRUE(cache.Append(at::Tensor(), at::Tensor(), at::arange(20, at::TensorOptions().dtype(at::kLong))).ok());
  auto keep = (*policy)->Select(0, cache);
  ASSERT_FALSE(keep.ok());
  EXPECT_NE(keep.status().message().find("multiple of 16"), std::string::npos);
  // Attention that does not cover the cache is refused with a message, not a crash.
  Status bad = observe_newest(**policy, 0, at::zeros({1, 4, 19}), cache);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("19 keys"), std::string::npos);
}

// One 512-query update of `policy` on a fresh cache (seeded attention): what Select() keeps, and the scores it
// ranked (tracing on).
at::Tensor OneUpdate(NammPolicy& policy, at::Tensor* scores) {
  policy.set_tracing(true);
  LayerKVCache cache(kKvHeads, 0, at::TensorOptions().dtype(at::kFloat), policy.token_state());
  const at::Tensor attention = testing::RandomCausalAttention(kQHeads, kNew, 0, 4242);
  for (int64_t q0 = 0; q0 < kNew; q0 += kChunk) {
    at::Tensor positions = at::arange(q0, q0 + kChunk, at::TensorOptions().dtype(at::kLong));
    EXPECT_TRUE(cache.Append(at::Tensor(), at::Tensor(), positions).ok());
    EXPECT_TRUE(observe_newest(policy, 0, attention.narrow(1, q0, kChunk).narrow(2, 0, cache.size()), cache).ok());
  }
  Result<at::Tensor> keep = policy.Select(0, cache);
  EXPECT_TRUE(keep.ok()) << keep.status().ToString();
  *scores = policy.last_trace().scores.clone();
  scores->select(1, scores->size(1) - 1).fill_(std::numeric_limits<float>::max());  // the newest is always kept
  return keep.ok() ? *keep : at::Tensor();
}

// heads=own: at the first update (no head has left a slot yet) each head keeps exactly its tokens scoring >= 0 —
// the reference's kept set less its padding —, the rest of its row vacant. At the next ones, collecting
// statistics count only the slots the heads hold, no head keeps a slot it left, and the traced tensor pipeline
// keeps what the host's keeps.
TEST(NammPolicy, HeadsKeepingTheirOwnCountsDropThePaddingAndCountOnlyTheirOwnSlots) {
  const NammModel model = BamModel(0.15, 77);  // collecting statistics
  auto reference = NammPolicy::Create(model);
  ASSERT_TRUE(reference.ok());
  at::Tensor scores;
  const at::Tensor padded = OneUpdate(**reference, &scores);
  std::vector<std::unique_ptr<NammPolicy>> own;  // on the host, and traced (tensor operations)
  std::vector<LayerKVCache> caches;
  for (bool traced : {false, true}) {
    own.push_back(std::move(NammPolicy::Create(model)).value());
    own.back()->set_own_head_counts(true);
    own.back()->set_tracing(traced);
    caches.emplace_back(kKvHeads, 0, at::TensorOptions().dtype(at::kFloat), own.back()->token_state());
  }
  const auto update = [&](uint64_t seed) {
    std::vector<at::Tensor> kept;
    for (std::size_t p = 0; p < own.size(); ++p) {
      LayerKVCache& cache = caches[p];
      const int64_t n_old = cache.size(), first = cache.tokens_seen();
      const at::Tensor attention = testing::RandomCausalAttention(kQHeads, kNew, n_old, seed);
      for (int64_t q0 = 0; q0 < kNew; q0 += kChunk) {
        at::Tensor positions = at::arange(first + q0, first + q0 + kChunk, at::TensorOptions().dtype(at::kLong));
        EXPECT_TRUE(cache.Append(at::Tensor(), at::Tensor(), positions).ok());
        EXPECT_TRUE(observe_newest(*own[p], 0, attention.narrow(1, q0, kChunk).narrow(2, 0, cache.size()), cache).ok());
      }
      Result<at::Tensor> keep = own[p]->Select(0, cache);
      EXPECT_TRUE(keep.ok()) << keep.status().ToString();
      kept.push_back(keep.ok() ? *keep : at::Tensor());
    }
    EXPECT_TRUE(kept[0].equal(kept[1])) << "the host and the traced pipeline keep the same tokens";
    return kept[0];
  };
  const at::Tensor keep = update(4242);  // OneUpdate's attention
  ASSERT_EQ(keep.size(1), padded.size(1));  // the largest count is the reference's k
  int64_t vacant = 0;
  for (int64_t h = 0; h < kKvHeads; ++h) {
    std::vector<int64_t> expected;  // the reference's row without its padding, -1 in front
    for (int64_t j = 0; j < padded.size(1); ++j) {
      const int64_t i = padded[h][j].item<int64_t>();
      if (scores[h][i].item<float>() >= 0) expected.push_back(i);
    }
    vacant += padded.size(1) - static_cast<int64_t>(expected.size());
    expected.insert(expected.begin(), padded.size(1) - static_cast<int64_t>(expected.size()), -1);
    EXPECT_EQ(Rows(keep)[static_cast<std::size_t>(h)], expected) << "head " << h;
  }
  EXPECT_GT(vacant, 5) << "the test means something only if a head was padded";
  for (LayerKVCache& cache : caches) ASSERT_TRUE(cache.Gather(keep).ok());
  ASSERT_NE(caches[0].vacant(), nullptr);
  for (uint64_t u = 1; u < 3; ++u) {
    const int64_t counted = own[0]->normalizer().stats().count;
    const int64_t held = caches[0].held_tokens() + kKvHeads * kNew;  // what the heads will hold at the update
    const at::Tensor next = update(4242 + u);
    ASSERT_TRUE(next.defined());
    EXPECT_EQ(own[0]->normalizer().stats().count - counted, held);
    EXPECT_EQ(own[1]->normalizer().stats().count, own[0]->normalizer().stats().count);
    for (LayerKVCache& cache : caches) ASSERT_TRUE(cache.Gather(next).ok()) << "every kept index is a slot its head holds";
    EXPECT_TRUE(caches[0].positions().equal(caches[1].positions()));
  }
  EXPECT_LT(caches[0].held_tokens(), kKvHeads * caches[0].size());
}

// The deployment's knob (namm:FILE,budget=N|ratio=R|threshold=T): each KV head keeps its N best-scored tokens, or
// R of the prompt, or those scoring at least T; the same NAMM without it keeps what scores >= 0.
TEST(NammPolicy, TheKnobKeepsEachHeadsBestTokensOrMovesTheThreshold) {
  const NammModel model = BamModel(0.15, 77);
  const auto make = [&](NammPolicy::SelectionKnob knob) {
    auto policy = NammPolicy::Create(model);
    EXPECT_TRUE(policy.ok());
    if (knob.budget || knob.ratio || knob.threshold) {
      EXPECT_TRUE((*policy)->set_selection_knob(knob).ok());
    }
    return std::move(*policy);
  };
  at::Tensor scores;
  const auto count_at_least = [&](double t) {
    return (scores >= t).sum(1).max().item<int64_t>();  // the most any head keeps: every head keeps that many
  };
  // Each kept token outscores (or ties) every dropped one of its head.
  const auto best_kept = [&](const at::Tensor& keep) {
    for (int64_t h = 0; h < kKvHeads; ++h) {
      at::Tensor kept_mask = at::zeros({scores.size(1)}, at::TensorOptions().dtype(at::kBool));
      kept_mask.index_fill_(0, keep[h], true);
      const at::Tensor row = scores[h];
      if (kept_mask.all().item<bool>()) continue;
      EXPECT_GE(row.masked_select(kept_mask).min().item<float>(), row.masked_select(~kept_mask).max().item<float>());
    }
  };
  const at::Tensor own = OneUpdate(*make({}), &scores);
  EXPECT_EQ(own.size(1), count_at_least(0.0));
  EXPECT_GT(own.size(1), 100) << "the test needs a NAMM that keeps more than the budgets below";
  EXPECT_LT(own.size(1), kNew);

  const at::Tensor budget = OneUpdate(*make({int64_t{64}, std::nullopt, std::nullopt}), &scores);
  EXPECT_EQ(budget.size(1), 64);
  best_kept(budget);

  auto by_ratio = make({std::nullopt, 0.25, std::nullopt});
  ASSERT_TRUE(by_ratio->BeginSequence(SequenceInfo{std::vector<int64_t>(300, 1)}).ok());  // ceil(0.25 x 300) = 75
  const at::Tensor ratio = OneUpdate(*by_ratio, &scores);
  EXPECT_EQ(ratio.size(1), 75);
  best_kept(ratio);

  const double median = scores.flatten().median().item<double>();
  const at::Tensor moved = OneUpdate(*make({std::nullopt, std::nullopt, median}), &scores);
  EXPECT_EQ(moved.size(1), count_at_least(median));
  EXPECT_NE(moved.size(1), own.size(1));
  best_kept(moved);

  // Refused: none or two settings, a budget of 0, a ratio over 1, a threshold for a NAMM that learned its own.
  auto policy = NammPolicy::Create(model);
  ASSERT_TRUE(policy.ok());
  EXPECT_FALSE((*policy)->set_selection_knob({}).ok());
  EXPECT_FALSE((*policy)->set_selection_knob({int64_t{4}, 0.5, std::nullopt}).ok());
  EXPECT_FALSE((*policy)->set_selection_knob({int64_t{0}, std::nullopt, std::nullopt}).ok());
  EXPECT_FALSE((*policy)->set_selection_knob({std::nullopt, 1.5, std::nullopt}).ok());
  NammModel dynamic = model;
  dynamic.architecture.selection.kind = SelectionKind::kDynamic;
  dynamic.params.push_back(static_cast<float>(std::log(1.0 / 2048.0)));
  auto learned = NammPolicy::Create(dynamic);
  ASSERT_TRUE(learned.ok()) << learned.status().ToString();
  const Status refused = (*learned)->set_selection_knob({std::nullopt, std::nullopt, 0.5});
  EXPECT_NE(refused.message().find("learned its threshold"), std::string::npos) << refused.ToString();
  EXPECT_TRUE((*learned)->set_selection_knob({int64_t{32}, std::nullopt, std::nullopt}).ok());
  EXPECT_EQ((*learned)->selection().budget, 32) << "a cap on what it keeps";
}

// The budget as an input (budget_input.h): without a budget the NAMM scores as without the input; under a budget
// every token's features move by pressure x the embedding, on the tensor path and on the host path alike, and the
// ranking moves with them; an embedding of zeros changes nothing.
TEST(NammPolicy, TheBudgetInputShiftsTheFeaturesOnlyUnderABudget) {
  const NammModel base = BamModel(0.15, 77);
  NammModel with = base, zeros = base;
  with.architecture.budget_input = zeros.architecture.budget_input = true;
  const at::Tensor e = testing::RandomNormal({kFeatureDim}, 78, 1.0);
  with.params.insert(with.params.end(), e.data_ptr<float>(), e.data_ptr<float>() + kFeatureDim);
  zeros.params.resize(zeros.params.size() + kFeatureDim, 0.0f);
  EXPECT_EQ(with.architecture.param_count(), 4172 + kFeatureDim);
  EXPECT_NE(with.architecture.Describe().find("budget input"), std::string::npos);
  EXPECT_EQ(base.architecture.ToJson().find("budget_input"), std::string::npos) << "files without it read as before";
  auto parsed = NammArchitecture::FromJson(with.architecture.ToJson());
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_TRUE(parsed->budget_input);
  EXPECT_EQ(parsed->param_count(), 4172 + kFeatureDim);

  // One update of 512 tokens, traced (the tensor path) or not (the host path), with or without a budget of 64.
  const auto update = [](const NammModel& model, std::optional<int64_t> budget, bool traced, at::Tensor* features,
                         at::Tensor* scores) {
    auto policy = std::move(NammPolicy::Create(model)).value();
    if (budget) {
      EXPECT_TRUE(policy->set_selection_knob({*budget, std::nullopt, std::nullopt}).ok());
    }
    policy->set_tracing(traced);
    LayerKVCache cache(kKvHeads, 0, at::TensorOptions().dtype(at::kFloat), policy->token_state());
    const at::Tensor attention = testing::RandomCausalAttention(kQHeads, kNew, 0, 4242);
    for (int64_t q0 = 0; q0 < kNew; q0 += kChunk) {
      EXPECT_TRUE(cache.Append(at::Tensor(), at::Tensor(), at::arange(q0, q0 + kChunk, at::TensorOptions().dtype(at::kLong))).ok());
      EXPECT_TRUE(observe_newest(*policy, 0, attention.narrow(1, q0, kChunk).narrow(2, 0, cache.size()), cache).ok());
    }
    Result<at::Tensor> keep = policy->Select(0, cache);
    EXPECT_TRUE(keep.ok()) << keep.status().ToString();
    if (traced) {
      *features = policy->last_trace().features.clone();
      *scores = policy->last_trace().scores.clone();
    }
    return keep.ok() ? Rows(*keep) : std::vector<std::vector<int64_t>>{};
  };
  at::Tensor base_features, base_scores, features, scores, unused;
  // Own threshold: the same features, scores and tokens.
  const auto own = update(base, std::nullopt, true, &base_features, &base_scores);
  EXPECT_EQ(update(with, std::nullopt, true, &features, &scores), own);
  EXPECT_TRUE(features.equal(base_features));
  EXPECT_TRUE(scores.equal(base_scores));
  EXPECT_EQ(update(with, std::nullopt, false, &unused, &unused), own);

  // Budget 64 of 512 tokens: pressure log2(512 / 64) = 3.
  const auto base_64 = update(base, int64_t{64}, true, &base_features, &base_scores);
  const auto with_64 = update(with, int64_t{64}, true, &features, &scores);
  const at::Tensor shift = at::from_blob(budget_shift(3.0f, std::vector<float>(e.data_ptr<float>(),
                                                                                     e.data_ptr<float>() + kFeatureDim))
                                             .data(),
                                         {kFeatureDim}, at::TensorOptions().dtype(at::kFloat))
                               .clone();
  EXPECT_TRUE(features.equal(base_features + shift));
  EXPECT_NE(with_64, base_64) << "a shift common to every token still moves the ranking";
  EXPECT_EQ(update(with, int64_t{64}, false, &unused, &unused), with_64) << "the host path adds the same shift";
  EXPECT_EQ(update(zeros, int64_t{64}, false, &unused, &unused), base_64);
  EXPECT_FLOAT_EQ(budget_pressure(SelectionConfig{SelectionKind::kTopK, 64, 0}, 512), 3.0f);
  EXPECT_EQ(budget_pressure(SelectionConfig{SelectionKind::kTopK, 64, 0}, 64), 0.0f);
  EXPECT_EQ(budget_pressure(SelectionConfig{SelectionKind::kBinary, 0, 0}, 512), 0.0f);

  // A learned threshold (dynamic selection: theta right after the scorer's parameters, the embedding after it) with
  // frozen statistics (the host path's own normalization): at its threshold it keeps what the same NAMM without the
  // input keeps; under a budget the host and tensor paths keep the same tokens.
  const auto learned = [](NammModel m) {
    m.architecture.selection = SelectionConfig{SelectionKind::kDynamic, 0, -2.0};
    m.params.insert(m.params.begin() + 4172, -2.0f);
    m.norm_state = NormState::kFrozen;
    m.norm_stats.count = 100;
    m.norm_stats.mean.fill(0.003);
    m.norm_stats.var.fill(2e-6);
    return m;
  };
  const NammModel dynamic = learned(with), dynamic_base = learned(base);
  EXPECT_EQ(update(dynamic, std::nullopt, false, &unused, &unused),
            update(dynamic_base, std::nullopt, false, &unused, &unused));
  const auto dynamic_64 = update(dynamic, int64_t{64}, false, &unused, &unused);
  EXPECT_EQ(update(dynamic, int64_t{64}, true, &unused, &unused), dynamic_64);
  EXPECT_NE(dynamic_64, update(dynamic_base, int64_t{64}, false, &unused, &unused));
}

// namm:FILE,prompt=keep: updates inside the prompt keep every token, the NAMM's eviction comes at the prompt's end
// (EndPrefill, at any length), and what it keeps there is what the same NAMM's Select() keeps on the same cache.
TEST(NammPolicy, KeepingThePromptEvictsAtItsEndWhatSelectWouldThere) {
  const NammModel model = BamModel(0.15, 77);
  const at::Tensor attention = testing::RandomCausalAttention(kQHeads, kNew + 64, 0, 4242);
  // The first `tokens` queries through `policy` (chunks of 128, then what is left), a memory update at each 256.
  const auto read = [&](NammPolicy& policy, LayerKVCache& cache, int64_t tokens, bool updates) {
    for (int64_t q0 = 0; q0 < tokens; q0 += kChunk) {
      const int64_t t = std::min(kChunk, tokens - q0);
      ASSERT_TRUE(cache.Append(at::Tensor(), at::Tensor(), at::arange(q0, q0 + t, at::TensorOptions().dtype(at::kLong))).ok());
      ASSERT_TRUE(observe_newest(policy, 0, attention.narrow(1, q0, t).narrow(2, 0, cache.size()), cache).ok());
      if (updates && (q0 + t) % 256 == 0) {
        ASSERT_TRUE(apply_memory_update(policy, 0, cache).ok());
      }
    }
  };
  const auto make = [&](bool keep, int64_t prompt) {
    auto policy = NammPolicy::Create(model);
    EXPECT_TRUE(policy.ok());
    (*policy)->set_keep_prompt(keep);
    EXPECT_TRUE((*policy)->BeginSequence(SequenceInfo{std::vector<int64_t>(static_cast<std::size_t>(prompt), 1)}).ok());
    return std::move(*policy);
  };

  auto keeping = make(true, kNew);
  LayerKVCache kept_cache(kKvHeads, 0, at::TensorOptions().dtype(at::kFloat), keeping->token_state());
  read(*keeping, kept_cache, kNew, /*updates=*/true);
  EXPECT_EQ(kept_cache.size(), kNew) << "the updates at 256 and 512 kept every token";
  const Result<std::optional<at::Tensor>> at_end = keeping->EndPrefill(0, kept_cache);
  ASSERT_TRUE(at_end.ok()) << at_end.status().ToString();
  ASSERT_TRUE(at_end->has_value());

  auto plain = make(false, kNew);
  LayerKVCache plain_cache(kKvHeads, 0, at::TensorOptions().dtype(at::kFloat), plain->token_state());
  read(*plain, plain_cache, kNew, /*updates=*/false);
  const Result<at::Tensor> selected = plain->Select(0, plain_cache);
  ASSERT_TRUE(selected.ok());
  EXPECT_TRUE(at::equal(**at_end, *selected));
  EXPECT_LT(selected->size(1), kNew) << "the test needs a NAMM that evicts";
  const Result<std::optional<at::Tensor>> plain_end = plain->EndPrefill(0, plain_cache);
  ASSERT_TRUE(plain_end.ok());
  EXPECT_FALSE(plain_end->has_value()) << "without prompt=keep the prompt's end is not an update";

  // A prompt whose length is no multiple of the hop: evicted at its end all the same, its newest token kept.
  auto odd = make(true, kNew + 8);
  LayerKVCache odd_cache(kKvHeads, 0, at::TensorOptions().dtype(at::kFloat), odd->token_state());
  read(*odd, odd_cache, kNew + 8, /*updates=*/true);
  const Result<bool> compressed = apply_end_of_prefill(*odd, 0, odd_cache);
  ASSERT_TRUE(compressed.ok()) << compressed.status().ToString();
  EXPECT_TRUE(*compressed);
  EXPECT_LT(odd_cache.size(), kNew + 8);
  EXPECT_EQ(odd_cache.positions()[0][odd_cache.size() - 1].item<int64_t>(), kNew + 7);
}

}  // namespace
}  // namespace namm
