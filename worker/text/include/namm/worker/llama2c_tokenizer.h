// llama2.c's tokenizer.bin: a SentencePiece-style BPE vocabulary with merge scores.
// File: int32 max_token_length, then per token: float32 score, int32 byte length, bytes.
// Encoding (as llama2.c's run.c): a space is prepended to non-empty text; each UTF-8 character becomes its
// token, or its bytes' <0xXX> tokens (ids 3 + byte) when it has none; then the adjacent pair whose
// concatenation is a token with the highest score is merged, leftmost first, until no pair merges.
// Ids 0, 1, 2 are <unk>, BOS <s> and EOS </s>.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "namm/worker/tokenizer.h"

namespace namm::worker {

class Llama2cTokenizer final : public Tokenizer {
 public:
  static Result<std::unique_ptr<Llama2cTokenizer>> Load(const std::string& path);

  Result<std::vector<int64_t>> Encode(const std::string& text) const override;
  Result<std::vector<int64_t>> EncodeForModel(const std::string& text) const override;  // BOS + Encode
  // Concatenated pieces (<0xXX> pieces as bytes); the dummy-prefix space of the first piece is removed, as
  // SentencePiece does.
  std::string Decode(const std::vector<int64_t>& ids, bool skip_special_tokens = true) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(pieces_.size()); }
  std::vector<int64_t> eos_ids() const override { return {kEos}; }

  static constexpr int64_t kUnk = 0, kBos = 1, kEos = 2;

 private:
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int64_t> ids_;
};

}  // namespace namm::worker
