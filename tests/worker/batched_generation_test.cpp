// The batched engine's determinism rule: a sequence generated in a batch (any size, beside any other
// sequences, policies and lengths) gets the same bits as generated alone, on the CPU in float32: tokens, text,
// logits, memory updates and cache sizes.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "namm/cpu_threads.h"
#include "namm/kv_block_pool.h"
#include "namm/policies/memory_policy.h"
#include "namm/policies/namm_policy.h"
#include "namm/policies/oracle_policy.h"
#include "namm/worker/generator.h"
#include "namm/worker/llama_model.h"
#include "namm/worker/policy_spec.h"
#include "shared_data.h"
#include "stories_inputs.h"

namespace namm::worker {
namespace {

struct Stories {
  LlamaModel model;
  std::unique_ptr<Tokenizer> tokenizer;
};

Stories LoadStories() {
  LoadOptions options;
  options.rope_scaling = RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0};  // prompts past the trained 512
  auto model = LlamaModel::Load(testing::SharedPath(testing::kStoriesModel), options);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  auto tokenizer = load_tokenizer(testing::SharedPath(testing::kStoriesTokenizer));
  EXPECT_TRUE(tokenizer.ok());
  return {std::move(model).value(), std::move(tokenizer).value()};
}

// A policy from a spec, or "namm/SEED" (seeded parameters: rows of one prompt whose caches diverge), or
// "oracle" (evicting a span of the prompt).
std::unique_ptr<MemoryPolicy> MakePolicy(const std::string& spec, const Tokenizer& tokenizer) {
  if (spec.rfind("namm/", 0) == 0) {  // "namm/SEED[,prompt=keep][,heads=own]"
    auto namm = NammPolicy::Create(NammWith(0.15, std::stoull(spec.substr(5))));
    EXPECT_TRUE(namm.ok());
    (*namm)->set_keep_prompt(spec.find(",prompt=keep") != std::string::npos);
    (*namm)->set_own_head_counts(spec.find(",heads=own") != std::string::npos);
    return std::move(namm).value();
  }
  if (spec == "oracle") {
    auto oracle = OraclePolicy::Create({{40, 120}});
    EXPECT_TRUE(oracle.ok());
    return std::move(oracle).value();
  }
  PolicyContext context;
  context.tokenizer = &tokenizer;
  auto policy = make_policy(spec, context);
  EXPECT_TRUE(policy.ok()) << spec << ": " << policy.status().ToString();
  return std::move(policy).value();
}

void ExpectSame(const GenerationResult& batched, const GenerationResult& alone) {
  EXPECT_EQ(batched.token_ids, alone.token_ids);
  EXPECT_EQ(batched.text, alone.text);
  EXPECT_EQ(batched.stop_reason, alone.stop_reason);
  EXPECT_EQ(batched.final_cache_sizes, alone.final_cache_sizes);
  ASSERT_EQ(batched.updates.size(), alone.updates.size());
  for (std::size_t u = 0; u < alone.updates.size(); ++u) {
    EXPECT_EQ(batched.updates[u].sequence_length, alone.updates[u].sequence_length);
    EXPECT_EQ(batched.updates[u].cache_sizes, alone.updates[u].cache_sizes);
  }
  EXPECT_DOUBLE_EQ(batched.mean_kv_tokens, alone.mean_kv_tokens);
  EXPECT_DOUBLE_EQ(batched.peak_kv_tokens, alone.peak_kv_tokens);
  for (const auto& [b, a] : {std::pair{batched.prompt_logits, alone.prompt_logits},
                             std::pair{batched.generated_logits, alone.generated_logits},
                             std::pair{batched.forced_logits, alone.forced_logits}}) {
    ASSERT_EQ(b.defined(), a.defined());
    if (a.defined()) {
      EXPECT_TRUE(b.equal(a)) << "largest difference " << (b - a).abs().max().item<float>();
    }
  }
}

// Expects `got` (a row's result from a batch) to be what `request` gets alone, with a fresh `policy`.
void ExpectAsAlone(const Stories& s, const Result<GenerationResult>& got, const std::string& policy,
                   const Generator::Request& request) {
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  const std::unique_ptr<MemoryPolicy> fresh = MakePolicy(policy, *s.tokenizer);
  const Result<GenerationResult> alone =
      Generator(s.model, *s.tokenizer).Generate(request.prompt_ids, *fresh, request.options);
  ASSERT_TRUE(alone.ok()) << alone.status().ToString();
  ExpectSame(*got, *alone);
}

// Row i of a batch: prompt length, new tokens (rows stop at different times) and, for one row, teacher forcing.
struct Row {
  std::string policy;
  int64_t prompt_tokens, new_tokens;
  bool forced = false;
};

// A row's prompt and policy, with memory updates every 128 tokens in chunks of 64.
Generator::Request RowRequest(const Stories& s, const Row& row, MemoryPolicy* policy) {
  Generator::Request request;
  request.prompt_ids = LongPrompt(*s.tokenizer, row.prompt_tokens);
  request.policy = policy;
  request.options.memory_update_interval = 128;
  request.options.chunk_size = 64;
  return request;
}

// The rows' requests, logits recorded, each with its own policy (appended to `policies`).
std::vector<Generator::Request> BatchRequests(const Stories& s, const std::vector<Row>& rows,
                                              std::vector<std::unique_ptr<MemoryPolicy>>* policies) {
  std::vector<Generator::Request> requests;
  for (const Row& row : rows) {
    policies->push_back(MakePolicy(row.policy, *s.tokenizer));
    Generator::Request request = RowRequest(s, row, policies->back().get());
    request.options.record_logits = true;
    request.options.eos_ids = {2};
    if (row.forced) {
      request.options.max_new_tokens = 0;
      request.options.teacher_forcing = true;
      request.options.forced_tokens = std::vector<int64_t>(static_cast<std::size_t>(row.new_tokens), 300);
    } else {
      request.options.max_new_tokens = row.new_tokens;
    }
    requests.push_back(std::move(request));
  }
  return requests;
}

// Returns the batch's results (checked against each row alone).
std::vector<Result<GenerationResult>> ExpectBatchEqualsAlone(const Stories& s, const std::vector<Row>& rows) {
  const Generator generator(s.model, *s.tokenizer);
  std::vector<std::unique_ptr<MemoryPolicy>> batch_policies;
  const std::vector<Generator::Request> requests = BatchRequests(s, rows, &batch_policies);
  std::vector<Result<GenerationResult>> batched = generator.GenerateBatch(requests);
  EXPECT_EQ(batched.size(), rows.size());
  if (batched.size() != rows.size()) return batched;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    SCOPED_TRACE("row " + std::to_string(i) + " (" + rows[i].policy + ", " + std::to_string(rows[i].prompt_tokens) +
                 " tokens) of " + std::to_string(rows.size()));
    const std::unique_ptr<MemoryPolicy> policy = MakePolicy(rows[i].policy, *s.tokenizer);
    Result<GenerationResult> alone = generator.Generate(requests[i].prompt_ids, *policy, requests[i].options);
    EXPECT_TRUE(alone.ok()) << alone.status().ToString();
    EXPECT_TRUE(batched[i].ok()) << batched[i].status().ToString();
    if (!alone.ok() || !batched[i].ok()) continue;
    EXPECT_EQ(alone->shared_prefix_tokens, 0);
    ExpectSame(*batched[i], *alone);
  }
  return batched;
}

// The batch of `rows` (BatchRequests), generated once.
std::vector<Result<GenerationResult>> GenerateRows(const Stories& s, const std::vector<Row>& rows) {
  std::vector<std::unique_ptr<MemoryPolicy>> policies;
  return Generator(s.model, *s.tokenizer).GenerateBatch(BatchRequests(s, rows, &policies));
}

// Keys and values in blocks of a shared pool (namm-api's --kv-block-tokens) change no number: every policy's rows,
// two NAMM candidates sharing a prompt's prefix (a cache copied into fresh blocks), blocks of 1, 4 and 16 tokens
// (boundaries inside the kernel's tiles). Every block goes back to the pool when the rows end; a pool too small
// for a row fails that row alone, naming the pool.
TEST(BatchedGeneration, KvInBlocksGivesEveryRowTheSameBitsAsRectangularCaches) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  Stories s = LoadStories();
  const std::vector<Row> rows = {{"namm/1", 300, 12}, {"namm/2", 300, 12}, {"full", 250, 9},
                                 {"h2o:budget=100", 233, 7}, {"streaming:budget=90", 311, 5},
                                 {"l2:budget=80", 140, 6}, {"snapkv:budget=64", 129, 3},
                                 {"namm/1,heads=own", 300, 12}, {"namm/2,heads=own,prompt=keep", 300, 12},
                                 {"fastgen:budget=40,recovery=0.5", 300, 6},
                                 {"fastgen:budget=40,recovery=0.5,heads=own", 300, 6}};
  const std::vector<Result<GenerationResult>> rectangular = GenerateRows(s, rows);
  // Heads keeping their own counts (a ragged cache) hold fewer tokens than the layer's largest count.
  ASSERT_TRUE(rectangular[0].ok() && rectangular[7].ok());
  EXPECT_LT(rectangular[7]->mean_kv_tokens, 0.95 * rectangular[0]->mean_kv_tokens);
  EXPECT_LT(rectangular[7]->peak_kv_bytes, rectangular[0]->peak_kv_bytes);
  ASSERT_TRUE(rectangular[9].ok() && rectangular[10].ok());  // FastGen's heads, profiled apart, likewise
  EXPECT_LT(rectangular[10]->answer_kv_tokens, rectangular[9]->answer_kv_tokens);
  for (const int64_t block_tokens : {int64_t{16}, int64_t{4}, int64_t{1}}) {
    SCOPED_TRACE("blocks of " + std::to_string(block_tokens));
    auto pool = KvBlockPool::Create(block_tokens, s.model.config().head_dim, s.model.options());
    ASSERT_TRUE(pool.ok());
    ASSERT_TRUE(s.model.set_kv_block_pool(*pool).ok());
    const std::vector<Result<GenerationResult>> blocks = GenerateRows(s, rows);
    ASSERT_EQ(blocks.size(), rows.size());
    for (std::size_t i = 0; i < rows.size(); ++i) {
      SCOPED_TRACE(rows[i].policy);
      ASSERT_TRUE(blocks[i].ok() && rectangular[i].ok()) << blocks[i].status().ToString();
      ExpectSame(*blocks[i], *rectangular[i]);
      EXPECT_EQ(blocks[i]->shared_prefix_tokens, rectangular[i]->shared_prefix_tokens);
    }
    EXPECT_EQ((*pool)->blocks_in_use(), 0);
  }
  // Room for the full row's first chunk of 64 tokens on every layer and head, not for its whole prompt.
  const int64_t per_chunk = s.model.config().n_layers * s.model.config().n_kv_heads * (64 / 16);
  auto small = KvBlockPool::Create(16, s.model.config().head_dim, s.model.options(), 2 * per_chunk);
  ASSERT_TRUE(small.ok());
  ASSERT_TRUE(s.model.set_kv_block_pool(*small).ok());
  const std::vector<Result<GenerationResult>> starved = GenerateRows(s, {{"full", 250, 4}, {"full", 60, 4}});
  ASSERT_EQ(starved.size(), 2u);
  ASSERT_FALSE(starved[0].ok());
  EXPECT_NE(starved[0].status().message().find("KV block pool is exhausted"), std::string::npos)
      << starved[0].status().ToString();
  ASSERT_TRUE(starved[1].ok()) << starved[1].status().ToString();
  EXPECT_EQ(starved[1]->token_ids, GenerateRows(s, {{"full", 60, 4}})[0]->token_ids);
  EXPECT_EQ((*small)->blocks_in_use(), 0);
  // Two rows of one prompt on room for one: the follower's copy of the shared prefix finds the pool dry and fails
  // alone, as an append does, with the pool's status (the executor then runs it with fewer beside it); before, the
  // copy threw and failed the whole batch, the leader's answer with it.
  auto one_prompt = KvBlockPool::Create(16, s.model.config().head_dim, s.model.options(), 3 * per_chunk / 2);
  ASSERT_TRUE(one_prompt.ok());
  ASSERT_TRUE(s.model.set_kv_block_pool(*one_prompt).ok());
  const std::vector<Result<GenerationResult>> forked = GenerateRows(s, {{"full", 60, 4}, {"full", 60, 4}});
  ASSERT_EQ(forked.size(), 2u);
  ASSERT_TRUE(forked[0].ok()) << forked[0].status().ToString();
  EXPECT_EQ(forked[0]->token_ids, starved[1]->token_ids);
  ASSERT_FALSE(forked[1].ok());
  EXPECT_TRUE(KvBlockPool::IsExhausted(forked[1].status())) << forked[1].status().ToString();
  EXPECT_EQ((*one_prompt)->blocks_in_use(), 0);
  ASSERT_TRUE(s.model.set_kv_block_pool(nullptr).ok());

  // In bfloat16 (libtorch's attention over keys and values gathered from the blocks, as on a GPU; the pool one
  // slab, read and written by one tensor operation each): the same bits here too.
  LoadOptions bf16;
  bf16.dtype = at::kBFloat16;
  bf16.rope_scaling = RopeScaling{RopeScaling::Kind::kNtk, 4.0, 2.0};
  auto half = LlamaModel::Load(testing::SharedPath(testing::kStoriesModel), bf16);
  ASSERT_TRUE(half.ok()) << half.status().ToString();
  Stories h{std::move(*half), std::move(s.tokenizer)};
  const std::vector<Row> few = {{"namm/1", 300, 8}, {"h2o:budget=100", 233, 6}, {"full", 140, 5},
                                {"namm/1,heads=own", 300, 8}, {"fastgen:budget=40,recovery=0.5,heads=own", 300, 6}};
  const std::vector<Result<GenerationResult>> half_rectangular = GenerateRows(h, few);
  ASSERT_TRUE(half_rectangular[0].ok() && half_rectangular[3].ok()) << half_rectangular[3].status().ToString();
  EXPECT_LT(half_rectangular[3]->mean_kv_tokens, 0.95 * half_rectangular[0]->mean_kv_tokens);  // ragged in bf16 too
  auto one_slab = KvBlockPool::Create(16, h.model.config().head_dim, h.model.options(), 4096);
  ASSERT_TRUE(one_slab.ok());
  ASSERT_TRUE(h.model.set_kv_block_pool(*one_slab).ok());
  const std::vector<Result<GenerationResult>> half_blocks = GenerateRows(h, few);
  for (std::size_t i = 0; i < few.size(); ++i) {
    SCOPED_TRACE("bfloat16 " + few[i].policy);
    ASSERT_TRUE(half_blocks[i].ok() && half_rectangular[i].ok()) << half_blocks[i].status().ToString();
    ExpectSame(*half_blocks[i], *half_rectangular[i]);
  }
  EXPECT_EQ((*one_slab)->blocks_in_use(), 0);
}

// Eight rows of each policy: different prompt lengths (chunks and updates at different steps), different
// lengths of answer, one teacher-forced row.
TEST(BatchedGeneration, EveryPolicyGivesEachRowWhatItGetsAlone) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const Stories s = LoadStories();
  for (const std::string policy : {"full", "h2o:budget=100", "l2:budget=80", "streaming:budget=90", "tova:budget=100",
                                   "snapkv:budget=64", "fastgen:budget=100", "oracle", "namm/1",
                                   "namm/1,prompt=keep", "namm/1,heads=own", "fastgen:budget=40,recovery=0.5,heads=own"}) {
    SCOPED_TRACE(policy);
    ExpectBatchEqualsAlone(s, {{policy, 300, 20},
                               {policy, 250, 5},
                               {policy, 350, 30, true},
                               {policy, 233, 12},
                               {policy, 300, 1},
                               {policy, 311, 25},
                               {policy, 129, 8},
                               {policy, 320, 0}});
  }
}

// One prompt, eight NAMMs (the training case: a generation's candidates on the same prompt): the rows start in
// lockstep and their caches diverge at the first memory update. One of them computes the prompt's first 128
// tokens (up to that update) and the seven others copy it. Then batches of 1 and 3 mixing policies.
TEST(BatchedGeneration, CandidatesOnOnePromptAndMixedBatchesGiveEachRowWhatItGetsAlone) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const Stories s = LoadStories();
  std::vector<Row> candidates;
  for (int seed = 1; seed <= 8; ++seed) candidates.push_back({"namm/" + std::to_string(seed), 400, 24});
  const std::vector<Result<GenerationResult>> results = ExpectBatchEqualsAlone(s, candidates);
  int64_t copied = 0;
  for (const auto& r : results) copied += r.ok() && r->shared_prefix_tokens == 128 ? 1 : 0;
  EXPECT_EQ(copied, 7);
  // Sharers and others interleaved: the one that forks is not the last of its step (namm-api admits rows in any
  // order), and the rows after it have updates of their own at that step.
  const std::vector<Result<GenerationResult>> mixed = ExpectBatchEqualsAlone(
      s, {{"namm/1", 400, 24}, {"h2o:budget=100", 256, 6}, {"namm/2", 400, 24}, {"full", 100, 4}, {"namm/3", 400, 24}});
  ASSERT_EQ(mixed.size(), 5u);
  ASSERT_TRUE(mixed[2].ok() && mixed[4].ok());
  EXPECT_EQ(mixed[2]->shared_prefix_tokens, 128);
  EXPECT_EQ(mixed[4]->shared_prefix_tokens, 128);
  ExpectBatchEqualsAlone(s, {{"namm/3", 500, 10}});
  ExpectBatchEqualsAlone(s, {{"namm/5", 420, 10}, {"h2o:budget=100", 300, 40}, {"snapkv:budget=64", 390, 3, true}});
}

// Sets the CPU thread budget for a scope, then one thread per core again (the process default).
struct ThreadBudget {
  explicit ThreadBudget(int threads) { set_cpu_threads(threads); }
  ~ThreadBudget() { set_cpu_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))); }
};

// The full cache, noting the threads that ask whether it needs attention: each sequence's forward pass asks,
// on the thread it runs on (the observation, which runs apart on the budget in any case, is not asked for).
class ThreadNotingPolicy : public MemoryPolicy {
 public:
  ThreadNotingPolicy(std::set<std::thread::id>* threads, std::mutex* mutex) : threads_(threads), mutex_(mutex) {}
  std::string name() const override { return "thread-noting"; }
  bool needs_attention() const override {
    std::lock_guard<std::mutex> lock(*mutex_);
    threads_->insert(std::this_thread::get_id());
    return false;
  }
  bool may_evict() const override { return false; }
  Result<at::Tensor> Select(int, LayerKVCache& cache) override { return all_token_indices(cache); }

 private:
  std::set<std::thread::id>* threads_;
  std::mutex* mutex_;
};

// A small model's batch runs in groups on the thread budget (LlamaModel::GroupsApart): on two threads every row
// gets what it gets alone, and what it gets on one thread, and the rows' passes run on both threads.
TEST(BatchedGeneration, ASmallModelsBatchInGroupsOnTwoThreadsGivesEachRowWhatItGetsAlone) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const Stories s = LoadStories();
  const std::vector<Row> rows = {{"namm/1", 300, 20}, {"h2o:budget=100", 250, 5}, {"namm/2", 350, 12, true},
                                 {"full", 233, 12},   {"namm/3", 300, 1},        {"snapkv:budget=64", 311, 25}};
  std::vector<Result<GenerationResult>> two_threads;
  {
    const ThreadBudget budget(2);
    two_threads = ExpectBatchEqualsAlone(s, rows);
  }
  std::vector<Result<GenerationResult>> one_thread;
  {
    const ThreadBudget budget(1);
    one_thread = GenerateRows(s, rows);
  }
  ASSERT_EQ(two_threads.size(), rows.size());
  ASSERT_EQ(one_thread.size(), rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    SCOPED_TRACE("row " + std::to_string(i));
    ASSERT_TRUE(two_threads[i].ok() && one_thread[i].ok());
    ExpectSame(*two_threads[i], *one_thread[i]);
  }

  // Eight prompts and a few tokens each on a budget of two: both threads run rows' passes.
  const ThreadBudget budget(2);
  std::set<std::thread::id> threads;
  std::mutex mutex;
  std::vector<std::unique_ptr<MemoryPolicy>> policies;
  std::vector<Generator::Request> requests;
  for (int r = 0; r < 8; ++r) {
    policies.push_back(std::make_unique<ThreadNotingPolicy>(&threads, &mutex));
    requests.push_back(RowRequest(s, {"", 400, 4}, policies.back().get()));
    requests.back().options.max_new_tokens = 4;
  }
  for (const Result<GenerationResult>& result : Generator(s.model, *s.tokenizer).GenerateBatch(requests)) {
    EXPECT_TRUE(result.ok()) << result.status().ToString();
  }
  EXPECT_EQ(threads.size(), 2u);
}

// Continuous batching (GenerationBatch, namm-api's scheduler): sequences join a running batch at different
// steps, while others prefill or decode, and one leaves unfinished; each that finishes gets what it gets alone.
TEST(BatchedGeneration, SequencesJoiningAndLeavingARunningBatchGetWhatTheyGetAlone) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const Stories s = LoadStories();
  const std::vector<Row> rows = {{"namm/2", 300, 30}, {"h2o:budget=100", 250, 12}, {"full", 140, 40},
                                 {"namm/4", 330, 8}, {"streaming:budget=90", 200, 20}};
  const std::vector<int> join_at = {0, 0, 3, 6, 11};  // the step before which row i joins
  std::vector<std::unique_ptr<MemoryPolicy>> policies;
  std::vector<Generator::Request> requests;
  for (const Row& row : rows) {
    policies.push_back(MakePolicy(row.policy, *s.tokenizer));
    Generator::Request request = RowRequest(s, row, policies.back().get());
    request.options.max_new_tokens = row.new_tokens;
    request.options.temperature = 0.8;  // sampled: the draws must not depend on the step a row joined at
    request.options.seed = 7;
    requests.push_back(std::move(request));
  }
  // A row that leaves at step 5 (a client that disconnected), in the middle of its prefill.
  const std::unique_ptr<MemoryPolicy> leaver_policy = MakePolicy("full", *s.tokenizer);
  Generator::Request leaver = requests[0];
  leaver.policy = leaver_policy.get();

  GenerationBatch batch(s.model, *s.tokenizer);
  std::vector<int64_t> ids(rows.size(), -1);
  std::vector<Result<GenerationResult>> results(rows.size(), Status::Internal("never finished"));
  const int64_t leaver_id = batch.Join(leaver);
  for (int step = 0; step < 1000; ++step) {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (join_at[i] == step) ids[i] = batch.Join(requests[i]);
    }
    if (step == 5) {
      EXPECT_FALSE(batch.finished(leaver_id));
      EXPECT_GT(batch.kv_bytes(leaver_id), 0);
      Result<GenerationResult> left = batch.Leave(leaver_id);
      ASSERT_FALSE(left.ok());
      EXPECT_EQ(left.status().code(), Status::Code::kFailedPrecondition);
    }
    const bool stepped = batch.Step();
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (ids[i] >= 0 && batch.finished(ids[i])) {
        results[i] = batch.Leave(ids[i]);
        ids[i] = -1;
      }
    }
    if (!stepped && step > join_at.back()) break;
  }
  EXPECT_EQ(batch.size(), 0u);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    SCOPED_TRACE("row " + std::to_string(i) + " (" + rows[i].policy + "), joined before step " + std::to_string(join_at[i]));
    ExpectAsAlone(s, results[i], rows[i].policy, requests[i]);
    if (results[i].ok()) {
      EXPECT_EQ(static_cast<int64_t>(results[i]->token_ids.size()), rows[i].new_tokens);
    }
  }
}

// Rows held back (GenerationBatch::Hold, namm-api waiting for memory) take no step and keep their caches as
// they are; let go, they go on where they stopped. A held leader's followers run their own prefix; a held row
// follows no one, and once let go it may follow a leader again. Every row gets what it gets alone.
TEST(BatchedGeneration, HeldRowsWaitWithTheirCachesAndGetWhatTheyGetAlone) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const Stories s = LoadStories();
  // Rows 0, 1 and 2 share their prompt and prefix (NAMMs, chunks of 64, the first update at 128 tokens). Step
  // 0: row 2 is held, row 0 leads, row 1 follows. Step 1: row 0 is held after one chunk, so row 1 leads and
  // row 2, let go, follows it; it takes row 1's caches after step 2. Row 3 is held in its prefill.
  const std::vector<Row> rows = {
      {"namm/1", 300, 10}, {"namm/2", 300, 10}, {"namm/3", 300, 10}, {"full", 200, 20}};
  const std::vector<std::pair<int, int>> held = {{1, 4}, {-1, -1}, {0, 1}, {2, 9}};  // [from, to) steps
  std::vector<std::unique_ptr<MemoryPolicy>> policies;
  std::vector<Generator::Request> requests;
  GenerationBatch batch(s.model, *s.tokenizer);
  std::vector<int64_t> ids;
  for (const Row& row : rows) {
    policies.push_back(MakePolicy(row.policy, *s.tokenizer));
    requests.push_back(RowRequest(s, row, policies.back().get()));
    requests.back().options.max_new_tokens = row.new_tokens;
    ids.push_back(batch.Join(requests.back()));
  }
  std::vector<int64_t> bytes(rows.size(), 0);
  std::vector<std::size_t> made(rows.size(), 0);
  for (int step = 0; step < 1000; ++step) {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (step == held[i].first) {
        batch.Hold(ids[i], true);
        bytes[i] = batch.kv_bytes(ids[i]);
        made[i] = batch.tokens(ids[i]).size();
      }
      if (step == held[i].second) batch.Hold(ids[i], false);
    }
    if (!batch.Step()) break;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (step < held[i].first || step >= held[i].second) continue;
      EXPECT_EQ(batch.kv_bytes(ids[i]), bytes[i]) << "row " << i << " at step " << step;
      EXPECT_EQ(batch.tokens(ids[i]).size(), made[i]) << "row " << i << " at step " << step;
    }
  }
  for (std::size_t i = 0; i < rows.size(); ++i) {
    SCOPED_TRACE("row " + std::to_string(i) + " (" + rows[i].policy + ")");
    ASSERT_TRUE(batch.finished(ids[i]));
    const Result<GenerationResult> got = batch.Leave(ids[i]);
    ExpectAsAlone(s, got, rows[i].policy, requests[i]);
    if (got.ok()) {
      EXPECT_EQ(got->shared_prefix_tokens, i == 2 ? 128 : 0);
    }
  }
}

// A step token budget (namm-api's --step-tokens): decoding rows take a token each, then prompt chunks run in the
// order the rows joined while the budget lasts, so first tokens come in arrival order instead of together, and
// every row's result is still the same bits as alone.
TEST(BatchedGeneration, AStepTokenBudgetPrefillsInArrivalOrderAndChangesNoResult) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const Stories s = LoadStories();
  const std::vector<Row> rows = {{"full", 250, 6}, {"namm/2", 230, 6}, {"h2o:budget=100", 200, 6},
                                 {"streaming:budget=90", 190, 6}};
  // The step at which each row had its first new token; `step_tokens` 0: no budget.
  const auto first_tokens = [&](int64_t step_tokens, std::vector<int64_t>& first) {
    std::vector<std::unique_ptr<MemoryPolicy>> policies;
    std::vector<Generator::Request> requests;
    GenerationBatch batch(s.model, *s.tokenizer);
    std::vector<int64_t> ids;
    first.assign(rows.size(), -1);
    for (const Row& row : rows) {
      policies.push_back(MakePolicy(row.policy, *s.tokenizer));
      requests.push_back(RowRequest(s, row, policies.back().get()));
      requests.back().options.max_new_tokens = row.new_tokens;
      ids.push_back(batch.Join(requests.back()));
    }
    for (int64_t step = 0; batch.Step(step_tokens); ++step) {
      for (std::size_t i = 0; i < rows.size(); ++i) {
        if (first[i] < 0 && !batch.tokens(ids[i]).empty()) first[i] = step;
      }
    }
    for (std::size_t i = 0; i < rows.size(); ++i) {
      SCOPED_TRACE(rows[i].policy + " at step_tokens " + std::to_string(step_tokens));
      ExpectAsAlone(s, batch.Leave(ids[i]), rows[i].policy, requests[i]);
    }
  };
  std::vector<int64_t> together, in_order;
  first_tokens(0, together);
  first_tokens(64, in_order);
  // Chunks of 64: without a budget every prompt advances each step and the four finish within a step of each
  // other; with room for one chunk a step, each waits for the ones before it.
  EXPECT_LE(*std::max_element(together.begin(), together.end()) - *std::min_element(together.begin(), together.end()), 1);
  for (std::size_t i = 1; i < rows.size(); ++i) EXPECT_GT(in_order[i], in_order[i - 1] + 1) << "row " << i;
  EXPECT_EQ(in_order[0], 3);  // 250 tokens: four chunks, the first token after the fourth step (step 3)
}

// A policy whose observation throws a torch error on its third call (a cache growing out of memory would throw
// from the same place).
class ThrowingPolicy final : public MemoryPolicy {
 public:
  std::string name() const override { return "throwing"; }
  bool needs_attention() const override { return true; }
  bool may_evict() const override { return false; }
  Status Observe(int, const at::Tensor&, int64_t, LayerKVCache&) override {
    TORCH_CHECK(++calls_ < 3, "the policy failed on call ", calls_);
    return Status::Ok();
  }
  Result<at::Tensor> Select(int, LayerKVCache& cache) override { return all_token_indices(cache); }

 private:
  int calls_ = 0;
};

// A server's batch (set_contain_failures): a row whose step throws fails alone, with the error's first line and
// no stack frames; the rows beside it get what they get alone. Without containment the exception propagates.
TEST(BatchedGeneration, ARowThatThrowsMidBatchFailsAlone) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const Stories s = LoadStories();
  const ThreadBudget budget(2);  // rows in groups on two threads (LlamaModel::GroupsApart), whatever the machine
  const std::vector<Row> rows = {{"namm/2", 300, 12}, {"throwing", 200, 12}, {"full", 150, 12}};
  std::vector<std::unique_ptr<MemoryPolicy>> policies;
  std::vector<Generator::Request> requests;
  for (const Row& row : rows) {
    policies.push_back(row.policy == "throwing" ? std::make_unique<ThrowingPolicy>() : MakePolicy(row.policy, *s.tokenizer));
    Generator::Request request = RowRequest(s, row, policies.back().get());
    request.options.max_new_tokens = row.new_tokens;
    requests.push_back(std::move(request));
  }
  GenerationBatch batch(s.model, *s.tokenizer);
  batch.set_contain_failures(true);
  std::vector<int64_t> ids;
  for (const Generator::Request& request : requests) ids.push_back(batch.Join(request));
  while (batch.Step()) {
  }
  const Result<GenerationResult> failed = batch.Leave(ids[1]);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("the policy failed on call 3"), std::string::npos) << failed.status().ToString();
  EXPECT_EQ(failed.status().message().find("Exception raised from"), std::string::npos) << failed.status().ToString();
  for (std::size_t i : {std::size_t{0}, std::size_t{2}}) {
    ExpectAsAlone(s, batch.Leave(ids[i]), rows[i].policy, requests[i]);
  }
  // The default (a training worker's batch): the exception reaches the caller, which can retry with less.
  const Generator generator(s.model, *s.tokenizer);
  ThrowingPolicy again;
  Generator::Request throwing = requests[1];
  throwing.policy = &again;
  EXPECT_THROW((void)generator.GenerateBatch({throwing}), c10::Error);
}

TEST(BatchedGeneration, ABadRequestFailsAloneAndTheOthersGoOn) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const Stories s = LoadStories();
  const std::unique_ptr<MemoryPolicy> good = MakePolicy("full", *s.tokenizer), other = MakePolicy("full", *s.tokenizer);
  std::vector<Generator::Request> requests(3);
  requests[0].prompt_ids = LongPrompt(*s.tokenizer, 50);
  requests[0].policy = good.get();
  requests[0].options.max_new_tokens = 5;
  requests[1].prompt_ids = {};  // empty prompt
  requests[1].policy = other.get();
  requests[2].prompt_ids = {1, 99999};  // outside the vocabulary
  requests[2].policy = other.get();
  const Generator generator(s.model, *s.tokenizer);
  std::vector<Result<GenerationResult>> results = generator.GenerateBatch(requests);
  ASSERT_TRUE(results[0].ok()) << results[0].status().ToString();
  EXPECT_EQ(results[0]->token_ids.size(), 5u);
  ASSERT_FALSE(results[1].ok());
  EXPECT_NE(results[1].status().message().find("empty"), std::string::npos);
  ASSERT_FALSE(results[2].ok());
  EXPECT_NE(results[2].status().message().find("vocabulary"), std::string::npos);
  const std::unique_ptr<MemoryPolicy> alone = MakePolicy("full", *s.tokenizer);
  auto reference = generator.Generate(requests[0].prompt_ids, *alone, requests[0].options);
  ASSERT_TRUE(reference.ok());
  EXPECT_EQ(results[0]->token_ids, reference->token_ids);
}

}  // namespace
}  // namespace namm::worker
