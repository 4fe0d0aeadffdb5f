// Text <-> token ids. Implementations: Hugging Face tokenizer.json BPE (hf_tokenizer.h) and llama2.c's
// tokenizer.bin (llama2c_tokenizer.h). All are immutable after loading and safe to use from several threads.
#pragma once

#include <cstdint>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "namm/status.h"
#include "namm/utf8.h"  // sanitize_utf8, which decoded text goes through

namespace namm::worker {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Ids of `text` without any template tokens (BOS/EOS); special tokens written literally in the text are
  // recognized. Invalid UTF-8 is replaced by U+FFFD first. An error only when a regex of the tokenizer cannot
  // match the text within PCRE2's limits (Regex::FindAll): a text is tokenized whole or not at all.
  virtual Result<std::vector<int64_t>> Encode(const std::string& text) const = 0;
  // Ids with the tokenizer's template applied (e.g. BOS prepended): Hugging Face's add_special_tokens=True.
  virtual Result<std::vector<int64_t>> EncodeForModel(const std::string& text) const = 0;
  // Byte ranges [first, second) of a text.
  using Spans = std::vector<std::pair<std::size_t, std::size_t>>;
  // Encode (EncodeForModel when `for_model`), except that a special token written in `text` is that token only
  // where it lies wholly inside one of `control`, and elsewhere the text it spells: a chat template's own
  // control tokens stay tokens while a user's message writing "<|eot_id|>" stays text (encode_chat). Special
  // only: other added tokens match everywhere, as tokenizers' split_special_tokens has it. `text` must be valid
  // UTF-8 (the spans are its offsets). Tokenizers without special tokens in text (llama2.c's) encode as usual.
  virtual Result<std::vector<int64_t>> EncodeControlled(const std::string& text, const Spans& control,
                                                        bool for_model) const {
    (void)control;
    return for_model ? EncodeForModel(text) : Encode(text);
  }
  // Text of `ids`; special tokens are dropped when skip_special_tokens. Invalid UTF-8 becomes U+FFFD.
  virtual std::string Decode(const std::vector<int64_t>& ids, bool skip_special_tokens = true) const = 0;

  virtual int64_t vocab_size() const = 0;
  // End-of-sequence ids (generation stops at any of them); may be empty.
  virtual std::vector<int64_t> eos_ids() const = 0;
  // The tokenizer without a chat template around its prompts (with_chat_template's base; itself otherwise).
  virtual const Tokenizer& without_chat() const { return *this; }
};

// Loads a tokenizer: a tokenizer.json file, a directory containing one (its tokenizer_config.json is read too),
// or a llama2.c tokenizer .bin file.
Result<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& path);

// The text of `ids` as it continues `context` (a prompt's last tokens): where a decoder drops the leading space of
// a text (SentencePiece's Metaspace, llama2.c), the space the first of `ids` carries is kept, as in the text of
// context + ids. Decode(ids) when `context` is empty or its text is not a prefix of the joined text's (a UTF-8
// character split between the two).
std::string decode_continuation(const Tokenizer& tokenizer, const std::vector<int64_t>& context,
                                const std::vector<int64_t>& ids);

// Ids of `text` for the model, truncated in the middle to at most about max_tokens as the reference does
// (spec §1.5): encode without template tokens; if longer than max_tokens, decode the first and the last
// max_tokens / 2 tokens separately (special tokens skipped), join the two strings and encode again (so the
// result can differ from max_tokens by a few tokens); then apply the template.
Result<std::vector<int64_t>> encode_truncated_middle(const Tokenizer& tokenizer, const std::string& text,
                                                     int64_t max_tokens);

// A prompt cut to fit a context as the reference does it: encode_truncated_middle to context - max_new_tokens,
// nothing more. BOS and re-encoding can leave the prompt a few tokens over that budget; the reference then runs
// that far past its context, and so do we: `context` is the limit to give the generator, the requested context
// plus the overshoot. An error when max_new_tokens leaves no room for a prompt.
struct ContextPrompt {
  std::vector<int64_t> ids;
  int64_t context = 0;
};
Result<ContextPrompt> truncate_to_context(const Tokenizer& tokenizer, const std::string& text, int64_t context,
                                         int64_t max_new_tokens);

}  // namespace namm::worker
