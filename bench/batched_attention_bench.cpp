// The batched engine's attention: 16 sequences' chunks in one row-invariant kernel call (cpu::batched_attention)
// against LlamaModel::Attention's libtorch operations run sequence by sequence, at stories260K's shapes
// (4 KV heads, GQA group 2, head_dim 8), and the same kernel reading caches kept in blocks of 16 tokens of a shared
// pool (LayerKVCache with a KvBlockPool, the sequences' blocks interleaved as a server's are). Args: chunk rows t,
// cache length n.
#include <ATen/ops/arange.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <benchmark/benchmark.h>

#include <cmath>
#include <limits>
#include <vector>

#include "cpu_kernels/tensor_kernels.h"
#include "namm/kv_cache.h"

namespace namm {
namespace {

constexpr int64_t kSequences = 16, kKvHeads = 4, kGroup = 2, kHeads = kKvHeads * kGroup, kHeadDim = 8;

std::vector<cpu::AttentionInput> Make(const benchmark::State& state) {
  const int64_t t = state.range(0), n = state.range(1);
  std::vector<cpu::AttentionInput> sequences(kSequences);
  for (cpu::AttentionInput& in : sequences) {
    in.q = at::randn({t, kHeads * kHeadDim});
    // A cache with spare capacity, as the engine's.
    in.keys = at::randn({kKvHeads, n + 64, kHeadDim}).narrow(1, 0, n);
    in.values = at::randn({kKvHeads, n + 64, kHeadDim}).narrow(1, 0, n);
  }
  return sequences;
}

const double kScale = 1.0 / std::sqrt(static_cast<double>(kHeadDim));

// LlamaModel::Attention's operations after the cache append (one block of rows, no window, no policy).
void BM_TorchAttentionPerSequence(benchmark::State& state) {
  const std::vector<cpu::AttentionInput> sequences = Make(state);
  const int64_t t = state.range(0), n = state.range(1);
  for (auto _ : state) {
    for (const cpu::AttentionInput& in : sequences) {
      const at::Tensor q = in.q.view({t, kHeads, kHeadDim}).transpose(0, 1).reshape({kKvHeads, kGroup * t, kHeadDim});
      at::Tensor scores = at::bmm(q, in.keys.transpose(1, 2)).view({kKvHeads, kGroup, t, n});
      scores.mul_(kScale);
      const at::Tensor future = at::ones({t, t}, at::TensorOptions().dtype(at::kBool)).triu(1);
      scores.narrow(3, n - t, t).masked_fill_(future, -std::numeric_limits<float>::infinity());
      const at::Tensor probs = scores.softmax(-1);
      const at::Tensor out = at::empty({kKvHeads, kGroup, t, kHeadDim});
      out.copy_(at::bmm(probs.view({kKvHeads, kGroup * t, n}), in.values).view({kKvHeads, kGroup, t, kHeadDim}));
      benchmark::DoNotOptimize(out.view({kHeads, t, kHeadDim}).transpose(0, 1).reshape({t, kHeads * kHeadDim}));
    }
  }
}

void BM_BatchedAttention(benchmark::State& state) {
  const std::vector<cpu::AttentionInput> sequences = Make(state);
  for (auto _ : state) benchmark::DoNotOptimize(cpu::batched_attention(sequences, kHeads, kScale, cpu::kernels()));
}

void BM_BatchedAttentionInBlocks(benchmark::State& state) {
  std::vector<cpu::AttentionInput> sequences = Make(state);
  const int64_t n = state.range(1);
  auto pool = KvBlockPool::Create(16, kHeadDim, at::TensorOptions().dtype(at::kFloat));
  std::vector<LayerKVCache> caches;
  for (std::size_t s = 0; s < sequences.size(); ++s) {
    caches.emplace_back(kKvHeads, kHeadDim, at::TensorOptions(), std::vector<TokenStateSpec>{}, *pool);
  }
  // 16 tokens at a time, sequence after sequence: each cache's blocks lie between the others'.
  for (int64_t j = 0; j < n; j += 16) {
    for (std::size_t s = 0; s < sequences.size(); ++s) {
      const int64_t rows = std::min<int64_t>(16, n - j);
      const at::Tensor positions = at::arange(j, j + rows, at::TensorOptions().dtype(at::kLong));
      const AttentionRequest& in = sequences[s];
      if (!caches[s].Append(in.keys.narrow(1, j, rows), in.values.narrow(1, j, rows), positions).ok()) {
        state.SkipWithError("append failed");
        return;
      }
    }
  }
  for (std::size_t s = 0; s < sequences.size(); ++s) sequences[s].blocks = caches[s].block_view();
  for (auto _ : state) benchmark::DoNotOptimize(cpu::batched_attention(sequences, kHeads, kScale, cpu::kernels()));
}

void Shapes(benchmark::internal::Benchmark* b) {
  b->Args({32, 400});
  b->Args({1, 400});
  b->Args({1, 100});
}

BENCHMARK(BM_TorchAttentionPerSequence)->Apply(Shapes)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_BatchedAttention)->Apply(Shapes)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_BatchedAttentionInBlocks)->Apply(Shapes)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace namm
