// Fuzz target: namm-api's request bodies (/v1/completions and /v1/chat/completions; the first byte picks which).
// A body is parsed into a request or refused with an error object; a parsed request's responses (whole and
// streamed, with its strings echoed back, e.g. invalid UTF-8 in a stop string or message) serialize.
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <variant>

#include "namm/server/openai_protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  using namespace namm::server;
  const Endpoint endpoint = data[0] % 2 == 0 ? Endpoint::kCompletions : Endpoint::kChatCompletions;
  const std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  auto parsed = parse_completion_request(endpoint, body);
  if (const auto* error = std::get_if<ApiError>(&parsed)) {
    (void)error->ToJson();
    return 0;
  }
  const CompletionRequest& request = std::get<CompletionRequest>(parsed);
  CompletionOutcome outcome;
  outcome.text = request.stop.empty() ? request.model : request.stop.front();
  outcome.finish_reason = "stop";
  outcome.cache.policy = request.policy;
  const ResponseHeader header{"cmpl-1", 0, request.model};
  (void)completion_response(request, header, outcome);
  (void)stream_text_chunk(request, header, request.messages.empty() ? request.prompt : request.messages[0].content, true);
  (void)stream_final_chunks(request, header, outcome);
  return 0;
}
