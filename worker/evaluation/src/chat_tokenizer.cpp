#include "namm/worker/chat_tokenizer.h"

#include <spdlog/spdlog.h>

#include "namm/worker/chat_encoding.h"

namespace namm::worker {

namespace {

// Prompts as one user turn of the model's chat template; everything else is the base tokenizer's.
class ChatTokenizer final : public Tokenizer {
 public:
  ChatTokenizer(std::unique_ptr<Tokenizer> base, LoadedChatTemplate chat)
      : base_(std::move(base)), chat_(std::move(chat)) {}

  Result<std::string> Format(const std::string& text) const {
    return chat_.chat_template.Render({{"user", text}}, /*add_generation_prompt=*/true, chat_.variables);
  }

  Result<std::vector<int64_t>> Encode(const std::string& text) const override { return base_->Encode(text); }
  // As apply_chat_template(tokenize=True): the rendered prompt without the tokenizer's template tokens (the chat
  // template writes BOS itself where the model wants it).
  Result<std::vector<int64_t>> EncodeForModel(const std::string& text) const override {
    Result<std::string> prompt = Format(text);
    if (!prompt.ok()) {
      // with_chat_template() rendered a user turn already; a template that fails on some text only (it inspects
      // the content) leaves that prompt plain rather than losing it.
      spdlog::warn("chat template failed on a prompt, which is used without it: {}", prompt.status().message());
      return base_->EncodeForModel(text);
    }
    // The prompt as text within the template's tokens (encode_chat); rendered again there.
    return encode_chat(*base_, chat_.chat_template, {{"user", text}}, /*add_generation_prompt=*/true, chat_.variables,
                       /*for_model=*/false);
  }
  Result<std::vector<int64_t>> EncodeControlled(const std::string& text, const Spans& control,
                                                bool for_model) const override {
    return base_->EncodeControlled(text, control, for_model);
  }
  std::string Decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const override {
    return base_->Decode(ids, skip_special_tokens);
  }
  int64_t vocab_size() const override { return base_->vocab_size(); }
  std::vector<int64_t> eos_ids() const override { return base_->eos_ids(); }
  const Tokenizer& without_chat() const override { return base_->without_chat(); }

 private:
  std::unique_ptr<Tokenizer> base_;
  LoadedChatTemplate chat_;
};

}  // namespace

Result<std::unique_ptr<Tokenizer>> with_chat_template(std::unique_ptr<Tokenizer> base, LoadedChatTemplate chat) {
  auto tokenizer = std::make_unique<ChatTokenizer>(std::move(base), std::move(chat));
  Result<std::string> probe = tokenizer->Format("");
  if (!probe.ok()) return probe.status().WithContext("the chat template cannot format a user prompt");
  return std::unique_ptr<Tokenizer>(std::move(tokenizer));
}

}  // namespace namm::worker
