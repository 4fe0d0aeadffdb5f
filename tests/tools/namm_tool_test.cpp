// namm-tool as a user runs it: a real process, real files.
#include <ATen/ops/arange.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include "../namm_core/test_util.h"
#include "../process_util.h"
#include "namm/file_util.h"
#include "namm/namm_file.h"
#include "namm/policies/namm_policy.h"
#include "namm/npy.h"

namespace namm {
namespace {

using ToolRun = testing::ProcessResult;

ToolRun Tool(const std::string& args) { return testing::RunProcess(std::string(NAMM_TOOL_PATH) + " " + args); }

std::string Dir(const std::string& name) {
  const std::string dir = testing::TempPath(name);
  std::system(("rm -rf '" + dir + "' && mkdir -p '" + dir + "'").c_str());
  return dir;
}

at::Tensor Load(const std::string& path) {
  auto t = read_npy(path);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? *t : at::Tensor();
}

TEST(NammTool, InitInfoAndScoreWithAZeroNammKeepEverything) {
  const std::string dir = Dir("zero");
  ToolRun init = Tool("init --arch bam --zero --out " + dir + "/z.safetensors --meta origin=test");
  ASSERT_EQ(init.exit_code, 0) << init.output;
  ToolRun info = Tool("info " + dir + "/z.safetensors");
  ASSERT_EQ(info.exit_code, 0) << info.output;
  EXPECT_NE(info.output.find("4172"), std::string::npos) << info.output;
  EXPECT_NE(info.output.find("origin: test"), std::string::npos) << info.output;
  EXPECT_NE(info.output.find("collecting"), std::string::npos) << info.output;
  ToolRun json = Tool("info --json " + dir + "/z.safetensors");
  ASSERT_EQ(json.exit_code, 0) << json.output;
  EXPECT_NE(json.output.find("\"param_count\": 4172"), std::string::npos) << json.output;
  EXPECT_NE(json.output.find("\"origin\": \"test\""), std::string::npos) << json.output;

  ASSERT_TRUE(write_npy(dir + "/a0.npy", testing::RandomCausalAttention(4, 512, 0, 1)).ok());
  ASSERT_TRUE(write_npy(dir + "/a1.npy", testing::RandomCausalAttention(4, 512, 512, 2)).ok());
  ToolRun score = Tool("score --namm " + dir + "/z.safetensors --attention " + dir + "/a0.npy --attention " + dir +
                   "/a1.npy --kv-heads 2 --out " + dir + "/out");
  ASSERT_EQ(score.exit_code, 0) << score.output;
  at::Tensor features = Load(dir + "/out/update_1/features.npy");
  at::Tensor scores = Load(dir + "/out/update_1/scores.npy");
  at::Tensor keep = Load(dir + "/out/update_1/keep.npy");
  EXPECT_EQ(features.sizes(), (at::IntArrayRef{2, 1024, 25}));
  EXPECT_EQ(scores.abs().max().item<float>(), 0.0f);
  EXPECT_EQ(keep.scalar_type(), at::kLong);
  EXPECT_TRUE(keep.equal(at::arange(1024).unsqueeze(0).expand({2, 1024})));
  // Recency of the oldest token at update 1 (positions 0..1023) is 1023: sin(1023).
  EXPECT_NEAR(features[0][0][0].item<float>(), std::sin(1023.0), 1e-6);
  EXPECT_EQ(features[0][1023][4].item<float>(), 1.0f);  // newest: cos(0)
}

TEST(NammTool, ScoreMatchesTheLibraryForAnImportedFrozenNamm) {
  const std::string dir = Dir("imported");
  at::Tensor params = testing::RandomNormal({4172}, 31, 0.15);
  at::Tensor mean = at::arange(17, at::TensorOptions().dtype(at::kFloat)).mul(1e-4).add(1e-3);
  at::Tensor var = at::arange(17, at::TensorOptions().dtype(at::kFloat)).add(1).mul(1e-6);
  ASSERT_TRUE(write_npy(dir + "/p.npy", params).ok());
  ASSERT_TRUE(write_npy(dir + "/m.npy", mean).ok());
  ASSERT_TRUE(write_npy(dir + "/v.npy", var).ok());
  ToolRun init = Tool("init --arch bam --params " + dir + "/p.npy --norm-mean " + dir + "/m.npy --norm-var " + dir +
                  "/v.npy --out " + dir + "/n.safetensors");
  ASSERT_EQ(init.exit_code, 0) << init.output;
  auto model = read_namm_file(dir + "/n.safetensors");
  ASSERT_TRUE(model.ok());
  EXPECT_EQ(model->norm_state, NormState::kFrozen);
  EXPECT_EQ(model->norm_stats.var[16], static_cast<double>(var[16].item<float>()));
  EXPECT_EQ(model->norm_stats.count, 1);

  // Update 0 starts at position 1000; update 1 has its own positions with a jump.
  at::Tensor positions = at::zeros({2, 512}, at::TensorOptions().dtype(at::kLong));
  positions[0].copy_(at::arange(1000, 1512));
  positions[1].copy_(at::arange(5000, 5512));
  ASSERT_TRUE(write_npy(dir + "/pos.npy", positions).ok());
  ASSERT_TRUE(write_npy(dir + "/pos0.npy", positions[0]).ok());  // the 1-D form: first update only
  at::Tensor a0 = testing::RandomCausalAttention(8, 512, 0, 3);
  ASSERT_TRUE(write_npy(dir + "/a0.npy", a0).ok());
  ToolRun first = Tool("score --namm " + dir + "/n.safetensors --attention " + dir + "/a0.npy --kv-heads 2 --positions " +
                   dir + "/pos0.npy --out " + dir + "/first");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const int64_t retained = Load(dir + "/first/update_0/keep.npy").size(1);
  ASSERT_LT(retained, 512) << "this NAMM should evict something";
  at::Tensor a1 = testing::RandomCausalAttention(8, 512, retained, 4);
  ASSERT_TRUE(write_npy(dir + "/a1.npy", a1).ok());
  ToolRun both = Tool("score --namm " + dir + "/n.safetensors --attention " + dir + "/a0.npy --attention " + dir +
                  "/a1.npy --kv-heads 2 --positions " + dir + "/pos.npy --out " + dir + "/both");
  ASSERT_EQ(both.exit_code, 0) << both.output;

  // The same two updates through the library.
  auto policy = NammPolicy::Create(*model);
  ASSERT_TRUE(policy.ok());
  (*policy)->set_tracing(true);
  LayerKVCache cache(2, 0, at::TensorOptions().dtype(at::kFloat), (*policy)->token_state());
  const at::Tensor updates[2] = {a0, a1};
  for (int u = 0; u < 2; ++u) {
    ASSERT_TRUE(cache.Append(at::Tensor(), at::Tensor(), positions[u]).ok());
    ASSERT_TRUE(observe_newest(**policy, 0, updates[u], cache).ok());
    auto keep = (*policy)->Select(0, cache);
    ASSERT_TRUE(keep.ok());
    const std::string out = dir + "/both/update_" + std::to_string(u);
    EXPECT_TRUE(Load(out + "/keep.npy").equal(*keep)) << "update " << u;
    EXPECT_TRUE(Load(out + "/scores.npy").equal((*policy)->last_trace().scores)) << "update " << u;
    EXPECT_TRUE(Load(out + "/features.npy").equal((*policy)->last_trace().features)) << "update " << u;
    ASSERT_TRUE(cache.Gather(*keep).ok());
  }
}

TEST(NammTool, BadInputGetsAClearError) {
  const std::string dir = Dir("errors");
  ASSERT_EQ(Tool("init --arch bam --zero --out " + dir + "/z.safetensors").exit_code, 0);
  ASSERT_TRUE(write_npy(dir + "/a0.npy", testing::RandomCausalAttention(4, 512, 0, 1)).ok());
  ASSERT_TRUE(write_npy(dir + "/wrong_keys.npy", testing::RandomCausalAttention(4, 512, 3, 2)).ok());
  ASSERT_TRUE(write_npy(dir + "/odd.npy", testing::RandomCausalAttention(4, 100, 0, 2)).ok());
  at::Tensor nan = testing::RandomCausalAttention(4, 512, 0, 1);
  nan[0][5][2] = std::nan("");
  ASSERT_TRUE(write_npy(dir + "/nan.npy", nan).ok());
  ASSERT_TRUE(write_npy(dir + "/short_params.npy", at::zeros({100})).ok());
  ASSERT_TRUE(write_npy(dir + "/one_row.npy", at::arange(512).view({1, 512})).ok());
  ASSERT_TRUE(write_npy(dir + "/no_heads.npy", at::zeros({0, 512, 512})).ok());  // was 0 % 0: SIGFPE

  struct Case {
    std::string args, message;
  };
  const std::string score = "score --namm " + dir + "/z.safetensors --out " + dir + "/out --attention ";
  const std::vector<Case> cases = {
      {score + dir + "/a0.npy --attention " + dir + "/wrong_keys.npy", "n_keys = 515, expected 1024"},
      {score + dir + "/wrong_keys.npy", "n_keys = 515, expected 512"},
      {score + dir + "/odd.npy", "positive multiple of 16"},
      {score + dir + "/a0.npy --attention " + dir + "/a0.npy --positions " + dir + "/one_row.npy",
       "has positions for 1 updates, but 2 attention files"},
      {score + dir + "/a0.npy --kv-heads 3", "not a multiple of --kv-heads 3"},
      {score + dir + "/nan.npy", "non-finite"},
      {score + dir + "/no_heads.npy", "no query heads"},
      {"init --arch bam --params " + dir + "/short_params.npy --out " + dir + "/x.safetensors", "float32 [4172]"},
      {"init --arch transformer --zero --out " + dir + "/x.safetensors", "unknown --arch 'transformer'"},
      {"init --arch bam --zero --out " + dir + "/z.safetensors", "already exists"},
      {"init --arch bam --zero --selection topk --out " + dir + "/y.safetensors", "budget"},
      {"init --arch mlp --hidden 32 --zero --out " + dir + "/y.safetensors", "hidden size must be 25"},
      {"info " + dir + "/a0.npy", "header length"},
  };
  for (const auto& c : cases) {
    ToolRun r = Tool(c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.args << "\n" << r.output;
  }
}

TEST(NammTool, MetricSingleAndBatch) {
  ToolRun one = Tool("metric qa_f1 --prediction 'The Eiffel Tower!' --answer 'eiffel tower'");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(one.output, "1.0\n");
  ToolRun classes = Tool("metric classification --prediction ABC --answer ABC --all-classes A,AB,B,ABC");
  EXPECT_EQ(classes.output, "0.5\n");
  const std::string dir = Dir("metric");
  ASSERT_TRUE(write_file_atomically(dir + "/batch.jsonl",
                                    {"{\"prediction\": \"Paragraph 3\", \"answers\": [\"Paragraph 3\"]}\n"
                                     "{\"prediction\": \"3 or 4\", \"answers\": [\"Paragraph 4\", \"Paragraph 3\"]}\n"
                                     "\n"
                                     "{\"prediction\": \"none\", \"answers\": [\"Paragraph 9\"]}\n"})
                  .ok());
  ToolRun batch = Tool("metric retrieval --jsonl " + dir + "/batch.jsonl");
  ASSERT_EQ(batch.exit_code, 0) << batch.output;
  EXPECT_EQ(batch.output, "1.0\n0.5\n0.0\n");
  ASSERT_TRUE(write_file_atomically(dir + "/bad.jsonl", {"{\"prediction\": 3}\n"}).ok());
  ToolRun bad = Tool("metric retrieval --jsonl " + dir + "/bad.jsonl");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("bad.jsonl line 1"), std::string::npos) << bad.output;
  // Nesting the metrics would recurse through (answers 20,000 arrays deep crashed the tool) is refused by name.
  ASSERT_TRUE(write_file_atomically(dir + "/deep.jsonl", {"{\"prediction\": \"a\", \"answers\": " +
                                                              std::string(20000, '[') + "\"a\"" +
                                                              std::string(20000, ']') + "}\n"})
                  .ok());
  ToolRun deep = Tool("metric qa_f1 --jsonl " + dir + "/deep.jsonl");
  EXPECT_EQ(deep.exit_code, 1) << deep.output;
  EXPECT_NE(deep.output.find("deep.jsonl line 1"), std::string::npos) << deep.output;
  EXPECT_NE(deep.output.find("64"), std::string::npos) << "the message names the limit: " << deep.output;
  ToolRun unknown = Tool("metric bleu --prediction a --answer b");
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_NE(unknown.output.find("unknown metric 'bleu'"), std::string::npos);
}

}  // namespace
}  // namespace namm
