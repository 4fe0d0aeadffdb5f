// `--chat`: prompts become one user turn of the model's chat template (chat_tokenizer.h), with the real GPT-2
// tokenizer and a template written beside it.
#include "namm/worker/chat_tokenizer.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "../temp_path.h"
#include "namm/file_util.h"
#include "shared_data.h"

namespace namm::worker {
namespace {

using testing::SharedPath;

constexpr int64_t kEndOfText = 50256;  // GPT-2's <|endoftext|>, its bos_token

// A directory with GPT-2's tokenizer.json and a tokenizer_config.json carrying `chat_template`.
std::string TokenizerWithTemplate(const std::string& name, const std::string& chat_template) {
  const std::string dir = testing::TempPath(name);
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(SharedPath(testing::kGpt2Tokenizer), dir + "/tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
  nlohmann::json config = {{"bos_token", "<|endoftext|>"}, {"eos_token", "<|endoftext|>"},
                           {"chat_template", chat_template}};
  EXPECT_TRUE(write_file_atomically(dir + "/tokenizer_config.json", {config.dump()}).ok());
  return dir;
}

std::unique_ptr<Tokenizer> ChatTokenizerIn(const std::string& dir) {
  auto base = load_tokenizer(dir);
  EXPECT_TRUE(base.ok()) << base.status().ToString();
  auto chat = load_chat_template(dir);
  EXPECT_TRUE(chat.ok()) << chat.status().ToString();
  auto tokenizer = with_chat_template(std::move(base).value(), std::move(chat).value());
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  return std::move(tokenizer).value();
}

const char* kTurnTemplate =
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}";

TEST(ChatTokenizer, FormatsAUserTurnAndWritesBosOnce) {
  NAMM_REQUIRE_SHARED(testing::kGpt2Tokenizer);
  const std::string dir = TokenizerWithTemplate("chat_turn", kTurnTemplate);
  const auto chat = ChatTokenizerIn(dir);
  const auto plain = load_tokenizer(dir).value();
  const std::vector<int64_t> ids = chat->EncodeForModel("  Where is the key?  ").value();
  EXPECT_EQ(ids, plain->Encode("<|endoftext|><|user|>\nWhere is the key?\n<|assistant|>\n").value());
  EXPECT_EQ(ids.front(), kEndOfText);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), kEndOfText), 1);  // the template's BOS, no second one
  // Everything but the prompt's formatting is the base tokenizer's.
  EXPECT_EQ(chat->Encode("Where").value(), plain->Encode("Where").value());
  EXPECT_EQ(chat->Decode(ids, true), plain->Decode(ids, true));
  EXPECT_EQ(chat->eos_ids(), plain->eos_ids());
  // Without the template (a LongBench few-shot or code task under --chat): the base tokenizer's prompt.
  EXPECT_EQ(chat->without_chat().EncodeForModel("Where is the key?").value(),
            plain->EncodeForModel("Where is the key?").value());
  EXPECT_EQ(&plain->without_chat(), plain.get());
}

TEST(ChatTokenizer, TruncationCutsTheRawPromptAndKeepsTheTurnWhole) {
  NAMM_REQUIRE_SHARED(testing::kGpt2Tokenizer);
  const auto chat = ChatTokenizerIn(TokenizerWithTemplate("chat_truncate", kTurnTemplate));
  std::string text;
  for (int i = 0; i < 200; ++i) text += "The key is under the mat number " + std::to_string(i) + ". ";
  auto fitted = truncate_to_context(*chat, text, /*context=*/256, /*max_new_tokens=*/32);
  ASSERT_TRUE(fitted.ok()) << fitted.status().ToString();
  const std::vector<int64_t>& ids = fitted->ids;
  // The middle of the raw text is gone; the turn's opening and its generation prompt are both there.
  const std::string decoded = chat->Decode(ids, /*skip_special_tokens=*/false);
  EXPECT_EQ(decoded.rfind("<|endoftext|><|user|>\nThe key is under the mat number 0.", 0), 0u) << decoded;
  EXPECT_NE(decoded.find("number 199.\n<|assistant|>\n"), std::string::npos) << decoded;
  EXPECT_EQ(decoded.find("number 100."), std::string::npos);
  // The raw prompt got the budget (224 tokens); the turn's few tokens are the overshoot the context allows.
  EXPECT_GT(static_cast<int64_t>(ids.size()), 224);
  EXPECT_LT(static_cast<int64_t>(ids.size()), 224 + 16);
  EXPECT_EQ(fitted->context, 256 + static_cast<int64_t>(ids.size()) - 224);
}

TEST(ChatTokenizer, RefusesATemplateThatCannotFormatAUserTurnOrIsMissing) {
  NAMM_REQUIRE_SHARED(testing::kGpt2Tokenizer);
  const std::string dir = TokenizerWithTemplate(
      "chat_system_only", "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn first') }}"
                          "{% endif %}{{ messages[0]['content'] }}");
  auto chat = load_chat_template(dir);
  ASSERT_TRUE(chat.ok()) << chat.status().ToString();
  auto refused = with_chat_template(load_tokenizer(dir).value(), std::move(chat).value());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("cannot format a user prompt"), std::string::npos);
  EXPECT_NE(refused.status().message().find("a system turn first"), std::string::npos) << refused.status().message();

  // GPT-2's own files have no chat template.
  auto none = load_chat_template(std::filesystem::path(SharedPath(testing::kGpt2Tokenizer)).parent_path().string());
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), Status::Code::kNotFound);
}

}  // namespace
}  // namespace namm::worker
