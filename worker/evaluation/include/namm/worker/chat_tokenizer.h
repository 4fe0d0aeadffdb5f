// A tokenizer that formats every prompt as one user turn of the model's chat template (`--chat`).
#pragma once

#include <memory>

#include "namm/status.h"
#include "namm/worker/chat_template.h"
#include "namm/worker/tokenizer.h"

namespace namm::worker {

// EncodeForModel(text) becomes base.Encode() of the template rendered for [{role: user, content: text}] with
// the generation prompt after it: transformers' apply_chat_template(tokenize=True), whose template writes BOS
// itself. Encode, Decode, the vocabulary and EOS ids stay the base's, so middle truncation cuts the raw prompt
// and the turn is formatted around what is left, as LongBench does. Fails when the template cannot format a
// user turn (e.g. it raises for conversations without a system message).
Result<std::unique_ptr<Tokenizer>> with_chat_template(std::unique_ptr<Tokenizer> base, LoadedChatTemplate chat);

}  // namespace namm::worker
