// Hugging Face tokenizer.json BPE tokenizers: byte-level BPE (GPT-2, Llama 3: ByteLevel and regex Split
// pre-tokenizers, PCRE2 for Unicode classes) and SentencePiece-style BPE with byte fallback and the "▁"
// convention (Llama 2, Mistral: Prepend/Replace normalizers or the Metaspace pre-tokenizer).
//
// Supported pieces — normalizers: Sequence, Prepend, Replace; pre-tokenizers: Sequence, ByteLevel, Split
// (Isolated/Removed), Metaspace; model: BPE (byte_fallback, unk_token, fuse_unk, ignore_merges); post-processors:
// TemplateProcessing, ByteLevel, Sequence; decoders: Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip,
// Metaspace. Anything else (and BPE dropout) is refused at load time with a message naming it. Added tokens are
// matched leftmost-longest, in the raw text or, for "normalized" ones, in the normalized text, honouring lstrip,
// rstrip and single_word. From tokenizer_config.json: add_bos_token / add_eos_token replace the template when a
// Llama tokenizer class sets them (as transformers' LlamaTokenizerFast does), eos_token names the end of
// sequence, and clean_up_tokenization_spaces applies transformers' clean-up (" ." -> ".", " 's" -> "'s", ...)
// to decoded text, as the reference's transformers decode does.
//
// Limits against hostile files (each refused with an error naming it): nesting deeper than 64 JSON levels;
// more than 16 steps in a normalizer, pre-tokenizer, decoder or post-processor (each Sequence counting too);
// token ids beyond 2 x (tokens + added tokens) + 1024; an empty Metaspace replacement or Strip content, or a
// Strip count beyond 64; decoder Replace steps that could make a text more than 4x longer. At encoding time,
// a normalizer or pre-tokenizer output beyond 4x its input + 1 KiB, or a regex match beyond PCRE2's limits,
// fails the encoding.
#pragma once

#include <memory>
#include <string>

#include "namm/worker/tokenizer.h"

namespace namm::worker {

class HfTokenizer final : public Tokenizer {
 public:
  // `path`: a tokenizer.json file or a directory holding tokenizer.json (and optionally tokenizer_config.json).
  static Result<std::unique_ptr<HfTokenizer>> Load(const std::string& path);
  // From the two files' contents; `config_json` may be empty. `source` names them in error messages.
  static Result<std::unique_ptr<HfTokenizer>> FromJson(const std::string& tokenizer_json,
                                                       const std::string& config_json, const std::string& source);
  ~HfTokenizer() override;

  Result<std::vector<int64_t>> Encode(const std::string& text) const override;
  Result<std::vector<int64_t>> EncodeForModel(const std::string& text) const override;
  Result<std::vector<int64_t>> EncodeControlled(const std::string& text, const Spans& control,
                                                bool for_model) const override;
  std::string Decode(const std::vector<int64_t>& ids, bool skip_special_tokens = true) const override;
  int64_t vocab_size() const override;
  std::vector<int64_t> eos_ids() const override;

 private:
  struct Impl;
  explicit HfTokenizer(std::unique_ptr<Impl> impl);
  static Result<std::unique_ptr<HfTokenizer>> Parse(const std::string& tokenizer_json, const std::string& config_json,
                                                    const std::string& source);
  // Encode; with `control`, special tokens match only inside those spans.
  Result<std::vector<int64_t>> EncodeText(const std::string& text, const Spans* control) const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace namm::worker
