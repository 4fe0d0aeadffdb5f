// The OpenAI API as namm-api speaks it: completion and chat-completion requests read from their JSON bodies,
// and the JSON answered (whole responses, server-sent-event chunks, error objects), after
// https://platform.openai.com/docs/api-reference (completions, chat). Torch-free: the fuzz target builds it alone.
//
// What namm-api adds, as extensions the official clients pass through:
//   request  "namm_policy": "h2o:budget=64"   the memory policy of this request (default: the server's --policy)
//   response "namm": {"policy", "seed", "cache": {...}}   what the policy kept (see CacheReport)
// What it refuses with a 400 naming the field: unknown fields ("Unrecognized request argument supplied"), n > 1,
// best_of > 1, logprobs, echo, suffix, logit_bias, top_p < 1, non-zero presence/frequency penalties, messages
// with parts other than text.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "namm/worker/chat_template.h"

namespace namm::server {

enum class Endpoint { kCompletions, kChatCompletions };

// An OpenAI error object ({"error": {"message", "type", "param", "code"}}) and the HTTP status it is sent with.
struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the request field at fault; empty: null
  std::string code;   // empty: null
  std::string ToJson() const;
};

struct CompletionRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;
  // /v1/completions: the prompt as text, or as token ids (prompt_is_ids).
  std::string prompt;
  std::vector<int64_t> prompt_ids;
  bool prompt_is_ids = false;
  // /v1/chat/completions.
  std::vector<worker::ChatMessage> messages;
  // Absent: 16 for completions (OpenAI's default), what the context leaves for chat.
  std::optional<int64_t> max_tokens;
  std::string max_tokens_field = "max_tokens";  // the field it came from (chat: max_completion_tokens wins), for errors
  double temperature = 1.0;  // 0: greedy
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool stream = false;
  bool ignore_eos = false;  // vLLM's extension: generate max_tokens tokens whatever end-of-sequence token comes
  bool include_usage = false;  // stream_options.include_usage: a last chunk with the usage
  std::string policy;          // namm_policy; empty: the server's default
};

// Parses a request body for `endpoint`: malformed JSON, a field of the wrong type or out of range, an unknown
// field or an option namm-api does not implement gives an ApiError naming it (http_status 400).
std::variant<CompletionRequest, ApiError> parse_completion_request(Endpoint endpoint, std::string_view body);

// What the memory policy kept of one request's cache, in tokens per KV head averaged over layers.
struct CacheReport {
  std::string policy;
  double mean_kv_tokens = 0;   // cached tokens each query attended to, on average
  double relative_cache = 0;   // mean_kv_tokens / the full cache's over the same queries ((n + 1) / 2)
  double peak_kv_tokens = 0;
  double final_kv_tokens = 0;
  double evicted_tokens = 0;   // tokens that went through the cache and were dropped
  int64_t peak_kv_bytes = 0;   // keys and values of all layers at their largest
};

struct CompletionOutcome {
  std::string text;  // the whole answer (non-streamed responses)
  std::string finish_reason;  // "stop" or "length"
  int64_t prompt_tokens = 0, completion_tokens = 0;
  uint64_t seed = 0;  // the sampling seed used (the request's, or the one the server drew)
  CacheReport cache;
};

// The identity of one response, shared by all its chunks.
struct ResponseHeader {
  std::string id;       // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;  // Unix seconds
  std::string model;
};

// The whole response of a non-streamed request.
std::string completion_response(const CompletionRequest& request, const ResponseHeader& header,
                                const CompletionOutcome& outcome);
// One streamed chunk carrying `text` (for chat, the first chunk also carries the assistant role).
std::string stream_text_chunk(const CompletionRequest& request, const ResponseHeader& header, std::string_view text,
                              bool first);
// The chunk with the finish reason; with include_usage, followed by the usage chunk (choices empty). Each is one
// JSON object; the caller frames them as events.
std::vector<std::string> stream_final_chunks(const CompletionRequest& request, const ResponseHeader& header,
                                             const CompletionOutcome& outcome);

// GET /v1/models and /v1/models/{id}.
std::string model_object(const std::string& model, int64_t created);
std::string model_list(const std::string& model, int64_t created);

}  // namespace namm::server
