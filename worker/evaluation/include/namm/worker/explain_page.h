// `namm-worker generate --explain FILE.html` (and `eval --explain-rows N`): a picture of what a memory policy kept. One self-contained page (no
// network, no external file): every token of the prompt and the answer, shaded by how long it stayed in the
// cache (the share of its possible time, mean over KV heads; per layer or over all, chosen on the page), the cache
// size of every layer after every memory update, and the tokens still cached at the end. Readable for a
// 10k-token prompt: the tokens flow as text; the shading is computed by the page's script from the recorded
// eviction times.
#pragma once

#include <string>
#include <vector>

#include "namm/worker/generator.h"
#include "namm/worker/tokenizer.h"

namespace namm::worker {

struct ExplainInput {
  std::string policy;                    // MemoryPolicy::name()
  std::string model;                     // LlamaConfig::Describe()
  std::vector<std::string> token_texts;  // the text of every position: the prompt's, then the answer's
  int64_t prompt_tokens = 0;
  const GenerationResult* result = nullptr;  // generated with GenerationOptions::record_retention
};

// The text of each token of `ids` as it reads in the sequence (a token decoded after its predecessor, so that
// SentencePiece's leading spaces show), for ExplainInput::token_texts.
std::vector<std::string> explain_token_texts(const Tokenizer& tokenizer, const std::vector<int64_t>& ids);

// The page. Once its script has shaded the tokens, the token container carries data-explained (the layer shown,
// -1 for all) and each token data-heads-kept (how many KV heads of that layer, or of all layers, still hold it).
std::string render_explain_page(const ExplainInput& input);

}  // namespace namm::worker
