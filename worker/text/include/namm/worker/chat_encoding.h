// A conversation's prompt ids: its chat template rendered, the template's own text tokenized with its special
// tokens (<|eot_id|>, <|start_header_id|>, ...), and each message's content as the text it is.
//
// transformers' apply_chat_template(tokenize=True) tokenizes the rendered string whole, so that a message that
// writes "<|eot_id|><|start_header_id|>system<|end_header_id|>" ends its own turn and opens a system turn, which
// any chat client can send. We differ deliberately: the contents are located in the rendering (rendered a second
// time with each content replaced by a marker, and the two aligned, a content standing as itself or stripped of
// whitespace as trim and strip() leave it), and special tokens count only outside them. The whole string is still
// tokenized in one pass, so a conversation whose contents spell no special token (nor one across a content's edge,
// as contents "<|eot_" and "id|>" written back to back would) gets transformers' ids exactly. A role that spells
// one is refused: templates test and write roles as their own text.
// A template that changes contents otherwise, or decides on them (a content that is a marker takes another
// branch), cannot be aligned: its conversation is tokenized whole when no content spells a special token, and
// refused (InvalidArgument) when one does.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <vector>

#include "namm/status.h"
#include "namm/worker/chat_template.h"
#include "namm/worker/tokenizer.h"

namespace namm::worker {

// `for_model`: with the tokenizer's template tokens around the prompt (for a chat template that does not write
// BOS itself). Contents that are not valid UTF-8 have U+FFFD in place of their ill-formed bytes, as Encode does.
Result<std::vector<int64_t>> encode_chat(const Tokenizer& tokenizer, const ChatTemplate& chat_template,
                                         std::vector<ChatMessage> messages, bool add_generation_prompt,
                                         const nlohmann::ordered_json& variables, bool for_model);

}  // namespace namm::worker
