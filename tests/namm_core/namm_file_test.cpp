#include "namm/namm_file.h"

#include <gtest/gtest.h>

#include <functional>

#include "namm/safetensors.h"
#include "test_util.h"

namespace namm {
namespace {

NammModel ExampleModel() {
  NammModel model;
  model.architecture.scorer = default_scorer_config(ScorerKind::kBam);
  model.architecture.scorer.hidden = 16;
  model.architecture.selection = {SelectionKind::kDynamic, 4096, -7.5};
  model.architecture.attention_precision = AttentionPrecision::kF32;
  model.params = initial_params(model.architecture);
  for (std::size_t i = 0; i < model.params.size(); ++i) model.params[i] += 0.001f * static_cast<float>(i % 7);
  model.norm_state = NormState::kFrozen;
  model.norm_stats.count = 123456789012;
  for (std::size_t f = 0; f < 17; ++f) {
    model.norm_stats.mean[f] = 0.1 * static_cast<double>(f);
    model.norm_stats.var[f] = 1.0 / 3.0 + static_cast<double>(f);
  }
  model.metadata = {{"run", "stage-1"}, {"generation", "300"}};
  return model;
}

TEST(NammFile, RoundTripsEverythingBitExactly) {
  const NammModel model = ExampleModel();
  EXPECT_EQ(model.architecture.param_count(), 25 * 48 + 48 + 16 * 50 + 50 + 26 + 1);
  const std::string path = testing::TempPath("model.safetensors");
  ASSERT_TRUE(write_namm_file(path, model).ok());
  auto back = read_namm_file(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->params, model.params);
  EXPECT_EQ(initial_params(model.architecture).back(), -7.5f);  // the dynamic threshold comes last
  EXPECT_EQ(back->norm_state, NormState::kFrozen);
  EXPECT_EQ(back->norm_stats.count, model.norm_stats.count);
  EXPECT_EQ(back->norm_stats.mean, model.norm_stats.mean);
  EXPECT_EQ(back->norm_stats.var, model.norm_stats.var);
  EXPECT_EQ(back->metadata, model.metadata);
  EXPECT_EQ(back->architecture.ToJson(), model.architecture.ToJson());
  EXPECT_EQ(back->architecture.attention_precision, AttentionPrecision::kF32);
}

// With the budget input its embedding comes after the selection's threshold; a file keeps the flag and all three.
TEST(NammFile, RoundTripsTheBudgetInput) {
  NammModel model = ExampleModel();
  model.architecture.budget_input = true;
  const std::vector<float> start = initial_params(model.architecture);
  const auto scorer_n = static_cast<std::size_t>(scorer_param_count(model.architecture.scorer));
  ASSERT_EQ(start.size(), scorer_n + 1 + kFeatureDim);
  EXPECT_EQ(start[scorer_n], -7.5f) << "the dynamic threshold stays right after the scorer's parameters";
  EXPECT_EQ(start.back(), 0.0f) << "the embedding starts at zeros";
  model.params = start;
  for (int64_t c = 0; c < kFeatureDim; ++c) model.params[scorer_n + 1 + static_cast<std::size_t>(c)] = 0.5f * c;
  const std::string path = testing::TempPath("budget-input.safetensors");
  ASSERT_TRUE(write_namm_file(path, model).ok());
  auto back = read_namm_file(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(back->architecture.budget_input);
  EXPECT_EQ(back->params, model.params);
  model.params.resize(model.params.size() - kFeatureDim);  // a file without the embedding is refused, by count
  EXPECT_FALSE(write_namm_file(path, model).ok());
}

TEST(NammFile, WriterRefusesInconsistentModels) {
  NammModel model = ExampleModel();
  model.params.pop_back();
  EXPECT_FALSE(write_namm_file(testing::TempPath("bad1.safetensors"), model).ok());
  model = ExampleModel();
  model.params[3] = std::nanf("");
  EXPECT_FALSE(write_namm_file(testing::TempPath("bad2.safetensors"), model).ok());
  model = ExampleModel();
  model.metadata["namm.architecture"] = "x";
  EXPECT_FALSE(write_namm_file(testing::TempPath("bad3.safetensors"), model).ok());
}

// Rewrites a valid NAMM file with one piece changed.
std::string Tampered(const std::string& name, const std::function<void(std::map<std::string, std::string>&,
                                                                         std::vector<float>&)>& change) {
  const NammModel model = ExampleModel();
  const std::string good = testing::TempPath("good.safetensors");
  EXPECT_TRUE(write_namm_file(good, model).ok());
  auto file = SafetensorsFile::Open(good);
  std::map<std::string, std::string> metadata = file->metadata();
  std::vector<float> params = model.params;
  change(metadata, params);
  const std::string path = testing::TempPath(name);
  const int64_t count = 1;
  EXPECT_TRUE(write_safetensors(path,
                                {{"params", DType::kF32, {static_cast<int64_t>(params.size())}, params.data()},
                                 {"norm.mean", DType::kF64, {17}, model.norm_stats.mean.data()},
                                 {"norm.var", DType::kF64, {17}, model.norm_stats.var.data()},
                                 {"norm.count", DType::kI64, {1}, &count}},
                                metadata)
                  .ok());
  return path;
}

void ExpectRefused(const std::string& path, const std::string& fragment) {
  auto model = read_namm_file(path);
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find(fragment), std::string::npos) << model.status().message();
}

// The architecture JSON is outside bytes too: nesting is bounded, and errors describe a bad field in a few
// words instead of dumping it (here a million-item list).
TEST(NammFile, ArchitectureErrorsAreBounded) {
  const auto deep = NammArchitecture::FromJson(R"({"scorer": )" + std::string(100000, '[') +
                                               std::string(100000, ']') + "}");
  ASSERT_FALSE(deep.ok());
  EXPECT_EQ(deep.status().message(), "architecture: JSON nests arrays and objects more than 64 levels deep");
  std::string wide = "[0";
  for (int k = 0; k < 1000000; ++k) wide += ",0";
  const auto big = NammArchitecture::FromJson(R"({"scorer": {"kind": "bam", "hidden": )" + wide +
                                              R"(]}, "selection": {"kind": "binary"}})");
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().message(),
            "architecture: field 'hidden' must be an integer, not an array of 1000001 items");
}

TEST(NammFile, ReaderRefusesInconsistentFiles) {
  ExpectRefused(Tampered("short.safetensors", [](auto&, auto& p) { p.pop_back(); }), "tensor 'params' is F32");
  ExpectRefused(Tampered("future.safetensors", [](auto& m, auto&) { m["namm.format"] = "2"; }),
                "format '2' is not supported");
  ExpectRefused(Tampered("arch.safetensors",
                         [](auto& m, auto&) {
                           m["namm.architecture"] = R"({"scorer":{"kind":"tcn"},"selection":{"kind":"binary"}})";
                         }),
                "unknown scorer kind 'tcn'");
  // The example's architecture JSON with one fragment replaced.
  auto arch_with = [](std::string from, std::string to) {
    return [from, to](std::map<std::string, std::string>& m, std::vector<float>&) {
      std::string arch = ExampleModel().architecture.ToJson();
      arch.replace(arch.find(from), from.size(), to);
      m["namm.architecture"] = arch;
    };
  };
  ExpectRefused(Tampered("stft.safetensors", arch_with("\"stft_hop\":16", "\"stft_hop\":8")), "stft_hop = 8");
  ExpectRefused(Tampered("hidden.safetensors", arch_with("\"hidden\":16", "\"hidden\":16.5")),
                "'hidden' must be an integer");
  ExpectRefused(Tampered("state.safetensors", [](auto& m, auto&) { m["namm.norm_state"] = "melting"; }),
                "unknown normalization state");
  ExpectRefused(Tampered("nometa.safetensors", [](auto& m, auto&) { m.erase("namm.architecture"); }),
                "not a NAMM file");
  ExpectRefused(Tampered("nan.safetensors", [](auto&, auto& p) { p[0] = std::nanf(""); }), "not finite");
}

}  // namespace
}  // namespace namm
