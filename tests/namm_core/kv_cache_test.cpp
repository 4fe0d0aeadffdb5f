#include "namm/kv_cache.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <fstream>

#include "namm/batch_invariant.h"
#include "test_util.h"

namespace namm {
namespace {

at::Tensor Positions(int64_t start, int64_t n) { return at::arange(start, start + n, at::TensorOptions().dtype(at::kLong)); }

at::Tensor Index(const std::vector<std::vector<int64_t>>& rows) {
  at::Tensor t = at::zeros({static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows[0].size())},
                           at::TensorOptions().dtype(at::kLong));
  for (std::size_t h = 0; h < rows.size(); ++h)
    for (std::size_t i = 0; i < rows[h].size(); ++i) t[static_cast<int64_t>(h)][static_cast<int64_t>(i)] = rows[h][i];
  return t;
}

TEST(LayerKVCache, AppendThenGatherMovesEveryPerTokenTensorTogether) {
  LayerKVCache cache(2, 3, at::TensorOptions().dtype(at::kFloat), {{"ema", {2}, at::kFloat}});
  // Key of token t on head h = [100 h + t, ...]; value = -key; state ema = [t, t].
  at::Tensor keys = at::arange(5, at::TensorOptions().dtype(at::kFloat)).view({1, 5, 1}).expand({2, 5, 3}).clone();
  keys.select(0, 1).add_(100);
  ASSERT_TRUE(cache.Append(keys, -keys, Positions(10, 5)).ok());
  cache.state("ema").copy_(at::arange(5, at::TensorOptions().dtype(at::kFloat)).view({1, 5, 1}).expand({2, 5, 2}));
  EXPECT_EQ(cache.size(), 5);

  ASSERT_TRUE(cache.Gather(Index({{0, 2, 4}, {1, 3, 4}})).ok());
  EXPECT_EQ(cache.size(), 3);
  EXPECT_EQ(cache.tokens_seen(), 5);
  EXPECT_EQ(cache.keys()[1][0][0].item<float>(), 101.0f);
  EXPECT_EQ(cache.values()[0][1][2].item<float>(), -2.0f);
  EXPECT_EQ(cache.positions()[0][1].item<int64_t>(), 12);  // positions never change
  EXPECT_EQ(cache.positions()[1][0].item<int64_t>(), 11);
  EXPECT_EQ(cache.state("ema")[1][1][1].item<float>(), 3.0f);

  // New tokens after a gather: zero state, positions as given.
  ASSERT_TRUE(cache.Append(at::zeros({2, 1, 3}), at::zeros({2, 1, 3}), Positions(15, 1)).ok());
  EXPECT_EQ(cache.size(), 4);
  EXPECT_EQ(cache.positions()[1][3].item<int64_t>(), 15);
  EXPECT_EQ(cache.state("ema")[0][3][0].item<float>(), 0.0f);
  EXPECT_EQ(cache.state("ema")[0][2][0].item<float>(), 4.0f);
}

// The engine appends views of its packed rows ([t, kv_heads, head_dim] transposed): copied as they read, and a
// clone (a shared prefix handed to another sequence) shares no storage with its source.
TEST(LayerKVCache, AppendsStridedViewsAndClonesShareNothing) {
  LayerKVCache cache(3, 4, at::TensorOptions().dtype(at::kFloat), {{"ema", {2}, at::kFloat}});
  const at::Tensor rows = testing::RandomNormal({6, 3, 4}, 11);  // [t, kv_heads, head_dim]
  ASSERT_TRUE(cache.Append(rows.transpose(0, 1), (-rows).transpose(0, 1), Positions(0, 6)).ok());
  EXPECT_TRUE(cache.keys().equal(rows.transpose(0, 1)));
  EXPECT_TRUE(cache.values().equal((-rows).transpose(0, 1)));
  LayerKVCache copy = cache.Clone().value();
  cache.state("ema").fill_(7.0);
  ASSERT_TRUE(cache.Gather(Index({{0, 5}, {1, 5}, {2, 5}})).ok());
  EXPECT_EQ(copy.size(), 6);
  EXPECT_TRUE(copy.keys().equal(rows.transpose(0, 1)));
  EXPECT_EQ(copy.state("ema").abs().max().item<float>(), 0.0f);
  ASSERT_TRUE(copy.Append(rows.narrow(0, 0, 1).transpose(0, 1), rows.narrow(0, 0, 1).transpose(0, 1), Positions(6, 1)).ok());
  EXPECT_EQ(copy.tokens_seen(), 7);
  EXPECT_EQ(cache.tokens_seen(), 6);
  EXPECT_EQ(cache.size(), 2);
  EXPECT_EQ(cache.keys()[2][1][3].item<float>(), rows[5][2][3].item<float>());
}

// A copy of a cache whose whole allowance was reserved up front (a full cache) keeps that room and writes only the
// tokens held: the rest stays unwritten, so not resident (copying all of it took 7 s and 2 GiB for 800 KiB of
// keys and values at a 131,072-token allowance). Resident pages from /proc/self/statm.
TEST(LayerKVCache, ACopyWritesOnlyTheTokensHeldNotItsReservedRoom) {
  const auto resident_bytes = [] {
    std::ifstream statm("/proc/self/statm");
    int64_t size = 0, resident = 0;
    statm >> size >> resident;
    return resident * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
  };
  LayerKVCache cache(8, 64, at::TensorOptions().dtype(at::kFloat), {{"ema", {}, at::kFloat}});
  cache.ExpectTokens(int64_t{1} << 17, /*allocate_now=*/true);  // 256 MiB of keys and as much of values
  const at::Tensor rows = testing::RandomNormal({100, 8, 64}, 3);
  ASSERT_TRUE(cache.Append(rows.transpose(0, 1), (-rows).transpose(0, 1), Positions(0, 100)).ok());
  const int64_t before = resident_bytes();
  Result<LayerKVCache> copy = cache.Clone();
  ASSERT_TRUE(copy.ok()) << copy.status().ToString();
  EXPECT_LT(resident_bytes() - before, int64_t{64} << 20) << "the copy's unwritten room became resident";
  EXPECT_EQ(copy->capacity(), cache.capacity());
  EXPECT_TRUE(copy->keys().equal(cache.keys()));
  EXPECT_TRUE(copy->values().equal(cache.values()));
  EXPECT_TRUE(copy->positions().equal(cache.positions()));
  ASSERT_TRUE(copy->Append(rows.narrow(0, 0, 1).transpose(0, 1), rows.narrow(0, 0, 1).transpose(0, 1), Positions(100, 1)).ok());
  EXPECT_TRUE(copy->keys().narrow(1, 0, 100).equal(cache.keys()));
}

TEST(LayerKVCache, GrowthPreservesContents) {
  LayerKVCache cache(1, 0, at::TensorOptions().dtype(at::kFloat), {{"x", {}, at::kFloat}});
  for (int64_t t = 0; t < 300; ++t) {
    ASSERT_TRUE(cache.Append(at::Tensor(), at::Tensor(), Positions(t, 1)).ok());
    cache.state("x")[0][t].fill_(static_cast<double>(t));
  }
  EXPECT_EQ(cache.size(), 300);
  EXPECT_TRUE(cache.state("x")[0].equal(at::arange(300, at::TensorOptions().dtype(at::kFloat))));
  EXPECT_TRUE(cache.positions()[0].equal(Positions(0, 300)));
}

TEST(LayerKVCache, ExpectedLengthBoundsGrowthAndPreallocates) {
  auto append = [](LayerKVCache& cache, int64_t n) {
    const int64_t start = cache.tokens_seen();
    return cache.Append(at::zeros({1, n, 2}), at::zeros({1, n, 2}), Positions(start, n)).ok();
  };
  // Doubling would take 300 tokens' storage to 512; the bound stops it at the 300 the sequence can reach.
  LayerKVCache bounded(1, 2, at::TensorOptions().dtype(at::kFloat));
  bounded.ExpectTokens(300, /*allocate_now=*/false);
  ASSERT_TRUE(append(bounded, 200));
  EXPECT_EQ(bounded.capacity(), 200);
  ASSERT_TRUE(append(bounded, 1));
  EXPECT_EQ(bounded.capacity(), 300);
  // After evicting half, the room still counts only the tokens yet to come.
  ASSERT_TRUE(bounded.Gather(at::arange(0, 201, 2, at::TensorOptions().dtype(at::kLong)).view({1, -1})).ok());
  EXPECT_EQ(bounded.size(), 101);
  ASSERT_TRUE(append(bounded, 99));
  EXPECT_EQ(bounded.capacity(), 300);

  // Allocated whole at once: appending never reallocates (the storage the views point into stays put).
  LayerKVCache whole(1, 2, at::TensorOptions().dtype(at::kFloat));
  whole.ExpectTokens(1000, /*allocate_now=*/true);
  EXPECT_EQ(whole.capacity(), 1000);
  ASSERT_TRUE(append(whole, 1));
  const void* storage = whole.keys().data_ptr();
  for (int i = 0; i < 999; ++i) ASSERT_TRUE(append(whole, 1));
  EXPECT_EQ(whole.keys().data_ptr(), storage);
  EXPECT_EQ(whole.capacity(), 1000);
}

// What admission by memory counts: the storage allocated, and what an append will make it, before it happens.
TEST(LayerKVCache, ReservedBytesAfterAnAppendAreKnownBeforeIt) {
  LayerKVCache cache(2, 4, at::TensorOptions().dtype(at::kFloat));
  cache.ExpectTokens(300, /*allocate_now=*/false);
  const int64_t bytes_per_token = 2 * 2 * 4 * 4;
  for (const int64_t n : {int64_t{10}, int64_t{60}, int64_t{1}, int64_t{100}, int64_t{129}}) {
    const int64_t predicted = cache.reserved_kv_bytes_after(n);
    const int64_t start = cache.tokens_seen();
    ASSERT_TRUE(cache.Append(at::zeros({2, n, 4}), at::zeros({2, n, 4}), Positions(start, n)).ok());
    EXPECT_EQ(cache.reserved_kv_bytes(), predicted) << "after " << n;
    EXPECT_EQ(cache.reserved_kv_bytes(), cache.capacity() * bytes_per_token);
  }
  EXPECT_EQ(cache.capacity(), 300);  // 64, 128, 256, then the 300 the sequence can reach
}

// A cache in blocks of a pool holds what the rectangular cache holds, through appends (across block
// boundaries), gathers (compacting within each head) and a clone, and reserves whole blocks: the ones an
// eviction empties go back to the pool at once, and all of them when the cache goes. In float32 on the host (the
// attention kernel's table, rows copied in place; slabs of 5 blocks, with a limit or without) and in bfloat16
// (tensor operations, as on a GPU), with a pool of several slabs and, limited, of one (read and written by one
// tensor operation each).
TEST(LayerKVCache, InBlocksHoldsWhatARectangularCacheHoldsAndReturnsEmptiedBlocks) {
  for (const auto& [dtype, max_blocks] : {std::pair{at::kFloat, int64_t{0}}, std::pair{at::kFloat, int64_t{64}},
                                          std::pair{at::kBFloat16, int64_t{0}}, std::pair{at::kBFloat16, int64_t{64}}}) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + ", max_blocks " + std::to_string(max_blocks));
  const bool host_kernel = dtype == at::kFloat;
  const auto options = at::TensorOptions().dtype(dtype);
  auto pool = KvBlockPool::Create(4, 3, options, max_blocks, /*slab_blocks=*/5);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->one_slab(), max_blocks > 0 && !host_kernel);  // the host's float32 pool grows by slabs
  const std::vector<TokenStateSpec> state = {{"ema", {2}, at::kFloat}};
  {
    LayerKVCache rect(2, 3, options, state), blocks(2, 3, options, state, *pool);
    EXPECT_TRUE(blocks.in_blocks());
    int64_t seen = 0;
    const auto append = [&](int64_t t, uint64_t seed) {
      const at::Tensor rows = testing::RandomNormal({t, 2, 3}, seed).to(dtype);  // strided views, as the engine appends
      ASSERT_TRUE(rect.Append(rows.transpose(0, 1), (2 * rows).transpose(0, 1), Positions(seen, t)).ok());
      ASSERT_TRUE(blocks.Append(rows.transpose(0, 1), (2 * rows).transpose(0, 1), Positions(seen, t)).ok());
      seen += t;
    };
    const auto same = [&](const char* when) {
      SCOPED_TRACE(when);
      EXPECT_EQ(blocks.size(), rect.size());
      EXPECT_TRUE(blocks.keys().equal(rect.keys()));
      EXPECT_TRUE(blocks.values().equal(rect.values()));
      EXPECT_TRUE(blocks.positions().equal(rect.positions()));
      EXPECT_EQ(blocks.capacity(), (blocks.size() + 3) / 4 * 4);  // whole blocks, no more
      EXPECT_EQ(blocks.reserved_kv_bytes(), blocks.capacity() * 2 * 2 * 3 * static_cast<int64_t>(c10::elementSize(dtype)));
      const KvBlockView view = blocks.block_view();
      if (!host_kernel) {
        EXPECT_EQ(view.keys, nullptr);  // the kernel's table is for float32 on the host
        return;
      }
      ASSERT_NE(view.keys, nullptr);
      EXPECT_EQ(view.tokens, blocks.size());
      EXPECT_EQ(view.blocks_per_head, blocks.capacity() / 4);
      for (int64_t h = 0; h < 2; ++h) {  // the kernel's addressing: block j >> 2, row j & 3
        for (int64_t j = 0; j < blocks.size(); ++j) {
          const float* key = view.keys[h * view.blocks_per_head + (j >> 2)] + (j & 3) * 3;
          EXPECT_EQ(key[2], rect.keys()[h][j][2].item<float>());
        }
      }
    };
    append(6, 1);
    same("after 6");
    EXPECT_EQ((*pool)->blocks_in_use(), 4);  // 2 heads x 2 blocks
    const int64_t predicted = blocks.reserved_kv_bytes_after(7);
    append(7, 2);
    same("after 13");
    EXPECT_EQ(blocks.reserved_kv_bytes(), predicted);
    EXPECT_EQ((*pool)->blocks_in_use(), 8);  // 4 blocks each: past one slab of 5
    // Head 0 keeps 5 tokens spread over 4 blocks, head 1 another 5: 2 blocks each remain.
    const at::Tensor keep = Index({{0, 3, 4, 9, 12}, {1, 2, 7, 11, 12}});
    ASSERT_TRUE(rect.Gather(keep).ok());
    ASSERT_TRUE(blocks.Gather(keep).ok());
    same("after a gather");
    EXPECT_EQ((*pool)->blocks_in_use(), 4);
    append(1, 3);
    LayerKVCache copy = blocks.Clone().value();
    EXPECT_EQ((*pool)->blocks_in_use(), 8);
    append(5, 4);
    same("after 6 more");
    EXPECT_TRUE(copy.keys().equal(rect.keys().narrow(1, 0, 6)));
  }
  EXPECT_EQ((*pool)->blocks_in_use(), 0);
  }
}

// A pool with a limit: an append it cannot hold fails naming the pool and changes nothing; after an eviction
// frees blocks, it fits. On the host its storage grows a slab at a time, the last one cut at the limit (3 + 1).
TEST(LayerKVCache, InBlocksAnAppendPastThePoolFailsAndChangesNothing) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  auto pool = KvBlockPool::Create(8, 2, options, /*max_blocks=*/4, /*slab_blocks=*/3);
  ASSERT_TRUE(pool.ok());
  EXPECT_FALSE((*pool)->one_slab());
  LayerKVCache cache(2, 2, options, {}, *pool);
  const auto append = [&](int64_t n) {
    const int64_t start = cache.tokens_seen();
    return cache.Append(at::ones({2, n, 2}), at::ones({2, n, 2}), Positions(start, n));
  };
  EXPECT_EQ((*pool)->blocks_allocated(), 0);
  ASSERT_TRUE(append(16).ok());
  EXPECT_EQ((*pool)->blocks_allocated(), 4);  // slabs of 3 and 1
  const Status full = append(1);
  EXPECT_EQ(full.code(), Status::Code::kFailedPrecondition);
  EXPECT_NE(full.message().find("KV block pool is exhausted: 2 blocks asked, 0 of 4 free"), std::string::npos)
      << full.ToString();
  EXPECT_EQ(cache.size(), 16);
  EXPECT_EQ(cache.tokens_seen(), 16);
  ASSERT_TRUE(cache.Gather(at::arange(8, 16, at::TensorOptions().dtype(at::kLong)).view({1, 8}).expand({2, 8})).ok());
  EXPECT_EQ((*pool)->blocks_free(), 2);
  EXPECT_TRUE(append(1).ok());
  EXPECT_TRUE(cache.positions()[1][8].item<int64_t>() == 16);
  EXPECT_FALSE(KvBlockPool::Create(6, 2, options).ok());  // not a power of two
  EXPECT_THROW(LayerKVCache(2, 4, options, {}, *pool), c10::Error);  // the pool's heads are 2 wide
}

// A large limit costs the host's pool nothing until blocks are taken (its storage grows by slabs: namm-api's default
// limit is half the free memory); a pool read by tensor operations (bfloat16 here, a GPU's) is one slab of the limit.
TEST(LayerKVCache, InBlocksTheHostsPoolGrowsBySlabsAPoolOfTensorOperationsIsOneSlab) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    auto pool = KvBlockPool::Create(16, 8, at::TensorOptions().dtype(dtype), /*max_blocks=*/int64_t{1} << 16);
    ASSERT_TRUE(pool.ok());
    std::vector<int32_t> ids;
    ASSERT_TRUE((*pool)->Allocate(3, ids).ok());
    EXPECT_EQ((*pool)->blocks_allocated(), dtype == at::kFloat ? 1024 : int64_t{1} << 16) << c10::toString(dtype);
    EXPECT_EQ((*pool)->one_slab(), dtype != at::kFloat);
    (*pool)->Free(ids.data(), static_cast<int64_t>(ids.size()));
  }
}

TEST(LayerKVCache, RejectsBadIndicesAndShapes) {
  LayerKVCache cache(2, 4, at::TensorOptions().dtype(at::kFloat));
  EXPECT_FALSE(cache.Append(at::zeros({2, 3, 5}), at::zeros({2, 3, 4}), Positions(0, 3)).ok());
  ASSERT_TRUE(cache.Append(at::zeros({2, 3, 4}), at::zeros({2, 3, 4}), Positions(0, 3)).ok());
  EXPECT_FALSE(cache.Gather(Index({{0, 3}, {0, 1}})).ok());  // out of range
  EXPECT_FALSE(cache.Gather(Index({{1, 0}, {0, 1}})).ok());  // not ascending
  EXPECT_FALSE(cache.Gather(Index({{0, 1}})).ok());          // wrong head count
  EXPECT_EQ(cache.size(), 3);                                // nothing changed
  EXPECT_THROW(cache.state("nope"), c10::Error);
}

// On a GPU the gather checks its indices on the device (one transfer for all checks): the same errors.
TEST(LayerKVCache, OnCudaRejectsBadIndicesAsTheHostDoes) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device in this build or machine";
  const at::Device cuda(at::kCUDA, 0);
  LayerKVCache cache(2, 4, at::TensorOptions().dtype(at::kFloat).device(cuda));
  const at::Tensor keys = at::arange(24, at::TensorOptions().dtype(at::kFloat)).view({2, 3, 4}).to(cuda);
  ASSERT_TRUE(cache.Append(keys, keys, Positions(0, 3)).ok());
  EXPECT_FALSE(cache.Gather(Index({{0, 3}, {0, 1}}).to(cuda)).ok());   // out of range
  EXPECT_FALSE(cache.Gather(Index({{-1, 2}, {0, 1}}).to(cuda)).ok());  // vacant slots need the host
  EXPECT_FALSE(cache.Gather(Index({{1, 1}, {0, 1}}).to(cuda)).ok());   // not strictly ascending
  EXPECT_EQ(cache.size(), 3);                                          // nothing changed
  ASSERT_TRUE(cache.Gather(Index({{0, 2}, {1, 2}}).to(cuda)).ok());
  EXPECT_EQ(cache.size(), 2);
  EXPECT_EQ(cache.keys()[1][0][0].item<float>(), 16.0f);  // head 1 kept its token 1
}

// A ragged cache (kv_cache.h): a gather whose rows start with -1 leaves that head's oldest slots vacant. In
// blocks the vacant slots take no storage (their blocks go back to the pool), a rectangular cache holds the same
// tensors (zero keys, values and state, position -1 there), appends and clones go on from there, and the
// attention kernel reads each head's own tokens alone: the result of a softmax over the tokens the head holds
// (not the vacant slots), the same bits in blocks and rectangular, and probability 0 at every vacant slot.
TEST(LayerKVCache, ARaggedGatherLeavesVacantSlotsThatHoldNoStorageAndGetNoAttention) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  auto pool = KvBlockPool::Create(4, 8, options);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  const std::vector<TokenStateSpec> state = {{"ema", {2}, at::kFloat}};
  {
    LayerKVCache rect(2, 8, options, state), blocks(2, 8, options, state, *pool);
    int64_t seen = 0;
    const auto append = [&](int64_t t, uint64_t seed) {
      const at::Tensor rows = testing::RandomNormal({t, 2, 8}, seed);
      for (LayerKVCache* cache : {&rect, &blocks}) {
        ASSERT_TRUE(cache->Append(rows.transpose(0, 1), (rows * 0.5).transpose(0, 1), Positions(seen, t)).ok());
        cache->state("ema").fill_(1.0f);
      }
      seen += t;
    };
    append(16, 11);
    const at::Tensor keys_before = rect.keys().clone();
    // Head 0 keeps 10 tokens, head 1 three: 7 vacant slots.
    const at::Tensor keep = Index({{0, 2, 3, 5, 6, 8, 9, 11, 13, 15}, {-1, -1, -1, -1, -1, -1, -1, 4, 12, 15}});
    ASSERT_TRUE(rect.Gather(keep).ok());
    ASSERT_TRUE(blocks.Gather(keep).ok());
    for (const LayerKVCache* cache : {&rect, &blocks}) {
      ASSERT_NE(cache->vacant(), nullptr);
      EXPECT_EQ(cache->vacant()[0], 0);
      EXPECT_EQ(cache->vacant()[1], 7);
      EXPECT_EQ(cache->size(), 10);
      EXPECT_EQ(cache->held_tokens(), 13);
      EXPECT_EQ(cache->kv_bytes(), 13 * 2 * 8 * 4);
      EXPECT_TRUE(cache->keys()[1].narrow(0, 0, 7).eq(0).all().item<bool>());
      EXPECT_TRUE(cache->state("ema")[1].narrow(0, 0, 7).eq(0).all().item<bool>());
      EXPECT_TRUE(cache->state("ema")[1].narrow(0, 7, 3).eq(1).all().item<bool>());
      EXPECT_EQ(cache->positions()[1][6].item<int64_t>(), -1);
      EXPECT_EQ(cache->positions()[1][7].item<int64_t>(), 4);
      EXPECT_TRUE(cache->keys()[1][8].equal(keys_before[1][12]));
      EXPECT_TRUE(cache->keys()[0][9].equal(keys_before[0][15]));
    }
    EXPECT_TRUE(blocks.keys().equal(rect.keys()));
    EXPECT_TRUE(blocks.values().equal(rect.values()));
    EXPECT_TRUE(blocks.positions().equal(rect.positions()));
    EXPECT_EQ((*pool)->blocks_in_use(), 3 + 1);  // head 0: 10 tokens in 3 blocks; head 1: 3 in 1
    EXPECT_EQ(blocks.reserved_kv_bytes(), 4 * 4 * 2 * 8 * 4);
    EXPECT_EQ(blocks.reserved_kv_bytes_after(3), (4 + 2) * 4 * 2 * 8 * 4);  // head 0 needs a 4th, head 1 a 2nd
    // A vacant slot is not the head's to keep, and -1 only comes before a head's tokens.
    EXPECT_FALSE(blocks.Gather(Index({{0, 9}, {3, 9}})).ok());
    EXPECT_FALSE(blocks.Gather(Index({{0, 9}, {8, -1}})).ok());
    EXPECT_EQ(blocks.held_tokens(), 13);  // nothing changed
    append(3, 12);
    EXPECT_EQ((*pool)->blocks_in_use(), 4 + 2);
    LayerKVCache copy = blocks.Clone().value();
    EXPECT_EQ((*pool)->blocks_in_use(), 12);
    for (const LayerKVCache* cache : {&blocks, &copy}) {
      EXPECT_TRUE(cache->keys().equal(rect.keys()));
      EXPECT_TRUE(cache->positions().equal(rect.positions()));
      ASSERT_NE(cache->vacant(), nullptr);
      EXPECT_EQ(cache->vacant()[1], 7);
    }

    // The newest token's 4 query heads (2 per KV head) attend to the 13 slots.
    const at::Tensor q = testing::RandomNormal({1, 4 * 8}, 13);
    const double scale = 1.0 / std::sqrt(8.0);
    std::vector<AttentionResult> results;
    for (const LayerKVCache* cache : {&rect, &blocks}) {
      AttentionRequest in;
      in.q = q;
      if (cache->in_blocks()) {
        in.blocks = cache->block_view();
        ASSERT_NE(in.blocks.keys, nullptr);
      } else {
        in.keys = cache->keys();
        in.values = cache->values();
      }
      in.key_positions = cache->positions();
      in.vacant = cache->vacant();
      in.first_position = seen - 1;
      in.probabilities = true;
      results.push_back(invariant_attention({in}, 4, scale).front());
    }
    EXPECT_TRUE(results[0].out.equal(results[1].out));
    EXPECT_TRUE(results[0].probabilities.equal(results[1].probabilities));
    for (int64_t j = 0; j < 4; ++j) {
      const int64_t h = j / 2, first = rect.vacant()[h], n = rect.size() - first;
      const at::Tensor keys = rect.keys()[h].narrow(0, first, n).to(at::kDouble);
      const at::Tensor values = rect.values()[h].narrow(0, first, n).to(at::kDouble);
      const at::Tensor query = q[0].narrow(0, j * 8, 8).to(at::kDouble);
      const at::Tensor p = at::softmax(at::matmul(keys, query) * scale, 0);
      const at::Tensor probabilities = results[0].probabilities[j][0];
      EXPECT_TRUE(probabilities.narrow(0, 0, first).eq(0).all().item<bool>());
      EXPECT_TRUE(at::allclose(probabilities.narrow(0, first, n).to(at::kDouble), p, 1e-5, 1e-6));
      EXPECT_TRUE(at::allclose(results[0].out[0].narrow(0, j * 8, 8).to(at::kDouble), at::matmul(p, values), 1e-5, 1e-6));
    }
  }
  EXPECT_EQ((*pool)->blocks_in_use(), 0);
}

// The same in bfloat16 blocks, read and written by tensor operations (as on a GPU): a pool of slabs, and one
// slab (a limit), over two ragged gathers, an append and a clone.
TEST(LayerKVCache, ARaggedCacheInBlocksOfTensorOperationsHoldsWhatARectangularOneHolds) {
  for (const int64_t max_blocks : {int64_t{0}, int64_t{64}}) {
    SCOPED_TRACE("max_blocks " + std::to_string(max_blocks));
    const auto options = at::TensorOptions().dtype(at::kBFloat16);
    auto pool = KvBlockPool::Create(4, 8, options, max_blocks, /*slab_blocks=*/5);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    EXPECT_EQ((*pool)->one_slab(), max_blocks > 0);
    {
      LayerKVCache rect(2, 8, options), blocks(2, 8, options, {}, *pool);
      int64_t seen = 0;
      const auto append = [&](int64_t t, uint64_t seed) {
        const at::Tensor rows = testing::RandomNormal({t, 2, 8}, seed).to(at::kBFloat16);
        for (LayerKVCache* cache : {&rect, &blocks}) {
          ASSERT_TRUE(cache->Append(rows.transpose(0, 1), (rows * 2).transpose(0, 1), Positions(seen, t)).ok());
        }
        seen += t;
      };
      const auto same = [&](const char* when) {
        SCOPED_TRACE(when);
        EXPECT_TRUE(blocks.keys().equal(rect.keys()));
        EXPECT_TRUE(blocks.values().equal(rect.values()));
        EXPECT_TRUE(blocks.positions().equal(rect.positions()));
        EXPECT_EQ(blocks.held_tokens(), rect.held_tokens());
      };
      append(16, 21);
      ASSERT_TRUE(rect.Gather(Index({{0, 2, 3, 5, 6, 8, 9, 11, 13, 15}, {-1, -1, -1, -1, -1, -1, -1, 4, 12, 15}})).ok());
      ASSERT_TRUE(blocks.Gather(Index({{0, 2, 3, 5, 6, 8, 9, 11, 13, 15}, {-1, -1, -1, -1, -1, -1, -1, 4, 12, 15}})).ok());
      same("after a ragged gather");
      EXPECT_EQ((*pool)->blocks_in_use(), 3 + 1);
      append(3, 22);
      same("after an append");
      LayerKVCache copy = blocks.Clone().value();
      EXPECT_TRUE(copy.keys().equal(rect.keys()));
      // Head 0 now leaves 9 of its 13 slots, head 1 keeps its 6.
      const at::Tensor keep = Index({{-1, -1, -1, -1, -1, -1, -1, -1, -1, 9, 10, 11, 12}, {-1, -1, -1, -1, -1, -1, -1, 7, 8, 9, 10, 11, 12}});
      ASSERT_TRUE(rect.Gather(keep).ok());
      ASSERT_TRUE(blocks.Gather(keep).ok());
      same("after a second ragged gather");
      EXPECT_EQ(blocks.vacant()[0], 9);
      EXPECT_EQ(blocks.vacant()[1], 7);
      EXPECT_EQ((*pool)->blocks_in_use(), 1 + 2 + 4 + 2);  // this cache's, and the copy's
    }
    EXPECT_EQ((*pool)->blocks_in_use(), 0);
  }
}

}  // namespace
}  // namespace namm
