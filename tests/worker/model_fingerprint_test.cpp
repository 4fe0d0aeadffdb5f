// The model fingerprint: what a run accepts workers and stores base-model scores by. Every file that changes a
// score must change it, and nothing else may.
#include "namm/worker/model_fingerprint.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "../temp_path.h"
#include "shared_data.h"

namespace namm::worker {
namespace {

void Write(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

std::string Fingerprint(const std::string& model, const std::string& tokenizer) {
  Result<std::string> fingerprint = model_fingerprint(model, tokenizer);
  EXPECT_TRUE(fingerprint.ok()) << fingerprint.status().ToString();
  return fingerprint.ok() ? *fingerprint : "";
}

// A Hugging Face directory's files (contents are not parsed: only hashed).
std::string MakeHfDirectory(const std::string& name) {
  const std::string dir = testing::TempPath(name);
  std::filesystem::create_directories(dir);
  Write(dir + "/config.json", R"({"model_type": "llama"})");
  Write(dir + "/model-00001-of-00002.safetensors", "weights one");
  Write(dir + "/model-00002-of-00002.safetensors", "weights two");
  Write(dir + "/generation_config.json", R"({"eos_token_id": [1, 2]})");
  Write(dir + "/tokenizer.json", R"({"model": {"type": "BPE"}})");
  Write(dir + "/tokenizer_config.json", R"({"add_bos_token": true})");
  Write(dir + "/special_tokens_map.json", R"({"bos_token": "<s>"})");
  Write(dir + "/chat_template.jinja", "{{ messages }}");
  Write(dir + "/README.md", "a model card");
  return dir;
}

TEST(ModelFingerprint, EveryFileThatDecidesAScoreChangesItAndNoOtherDoes) {
  const std::string dir = MakeHfDirectory("fingerprint-hf");
  const std::string base = Fingerprint(dir, "");
  ASSERT_EQ(base.rfind("sha256:", 0), 0u) << base;
  // The tokenizer of the model's own directory, named or not, counts once.
  EXPECT_EQ(Fingerprint(dir, dir), base);
  EXPECT_EQ(Fingerprint(dir + "/", dir + "/tokenizer.json"), base);

  for (const char* name : {"config.json", "model-00002-of-00002.safetensors", "generation_config.json",
                           "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                           "chat_template.jinja"}) {
    SCOPED_TRACE(name);
    const std::string path = dir + "/" + name;
    std::string text;
    {
      std::ifstream in(path, std::ios::binary);
      text.assign(std::istreambuf_iterator<char>(in), {});
    }
    Write(path, text + " ");
    EXPECT_NE(Fingerprint(dir, ""), base);
    Write(path, text);
    EXPECT_EQ(Fingerprint(dir, ""), base);
  }
  Write(dir + "/README.md", "another model card");
  EXPECT_EQ(Fingerprint(dir, ""), base);
  Write(dir + "/notes.json", "{}");
  EXPECT_EQ(Fingerprint(dir, ""), base);
}

TEST(ModelFingerprint, ATokenizerGivenApartCountsWithItsSettings) {
  const std::string dir = MakeHfDirectory("fingerprint-hf-apart");
  const std::string tokenizer = testing::TempPath("fingerprint-tokenizer");
  std::filesystem::create_directories(tokenizer);
  Write(tokenizer + "/tokenizer.json", R"({"model": {"type": "Unigram"}})");
  Write(tokenizer + "/tokenizer_config.json", R"({"add_bos_token": false})");
  const std::string base = Fingerprint(dir, "");
  const std::string apart = Fingerprint(dir, tokenizer);
  EXPECT_NE(apart, base);
  // A tokenizer.json given as a file brings the settings its loader reads beside it.
  EXPECT_EQ(Fingerprint(dir, tokenizer + "/tokenizer.json"), apart);
  Write(tokenizer + "/tokenizer_config.json", R"({"add_bos_token": true})");
  EXPECT_NE(Fingerprint(dir, tokenizer + "/tokenizer.json"), apart);
  EXPECT_NE(Fingerprint(dir, tokenizer), apart);

  const Result<std::string> missing = model_fingerprint(dir, tokenizer + "/absent.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("absent.json: no such tokenizer"), std::string::npos)
      << missing.status().ToString();
  const std::string empty = testing::TempPath("fingerprint-empty");
  std::filesystem::create_directories(empty);
  Write(empty + "/tokenizer.json", "{}");
  const Result<std::string> no_model = model_fingerprint(empty, "");
  ASSERT_FALSE(no_model.ok());
  EXPECT_NE(no_model.status().message().find("no config.json or *.safetensors"), std::string::npos);
}

// A llama2.c checkpoint and its tokenizer: the checkpoint, then the tokenizer file. The bundled model's
// fingerprint is what the run specs in coordinator/runs name, so it must not move.
TEST(ModelFingerprint, Llama2cCheckpointsKeepTheirFingerprint) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  EXPECT_EQ(Fingerprint(testing::SharedPath(testing::kStoriesModel), testing::SharedPath(testing::kStoriesTokenizer)),
            "sha256:e50c5b2f34dda36627f94c1d4a196afd36f3fbf9956fb11daeffecbba6b2508b");
}

// `--chat` reads the template beside a llama2.c tokenizer too: a resumed evaluation must not mix rows formatted
// by two templates.
TEST(ModelFingerprint, ALlama2cTokenizersChatTemplateBesideItCounts) {
  NAMM_REQUIRE_SHARED(testing::kStoriesModel);
  const std::string dir = testing::TempPath("fingerprint-llama2c-chat");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(testing::SharedPath(testing::kStoriesTokenizer), dir + "/tokenizer.bin");
  const std::string model = testing::SharedPath(testing::kStoriesModel);
  const std::string alone = Fingerprint(model, dir + "/tokenizer.bin");
  Write(dir + "/chat_template.jinja", "{{ messages[0]['content'] }}");
  const std::string with_template = Fingerprint(model, dir + "/tokenizer.bin");
  EXPECT_NE(with_template, alone);
  Write(dir + "/chat_template.jinja", "User: {{ messages[0]['content'] }}");
  EXPECT_NE(Fingerprint(model, dir + "/tokenizer.bin"), with_template);
}

}  // namespace
}  // namespace namm::worker
