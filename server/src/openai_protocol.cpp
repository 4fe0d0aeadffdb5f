#include "namm/server/openai_protocol.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>
#include <set>

#include "namm/json_util.h"
#include "namm/utf8.h"

namespace namm::server {

namespace {

using json = nlohmann::json;
using ordered = nlohmann::ordered_json;

ApiError Invalid(std::string message, std::string param) {
  return ApiError{400, std::move(message), "invalid_request_error", std::move(param), ""};
}

// JSON text; strings that are not valid UTF-8 (a client's, or a model name from a file path) have their bad bytes
// replaced rather than throwing.
std::string Dump(const ordered& value) { return value.dump(-1, ' ', false, ordered::error_handler_t::replace); }

// A field's JSON type name, for messages.
std::string TypeName(const json& value) { return value.type_name(); }

// The fields each endpoint takes; any other is refused, as OpenAI refuses them.
const std::set<std::string>& KnownFields(Endpoint endpoint) {
  static const std::set<std::string> completions = {
      "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
      "user", "presence_penalty", "frequency_penalty", "logprobs", "echo", "suffix", "best_of", "logit_bias",
      "namm_policy", "ignore_eos"};
  static const std::set<std::string> chat = {
      "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
      "stream_options", "stop", "seed", "user", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs",
      "logit_bias", "namm_policy", "ignore_eos"};
  return endpoint == Endpoint::kCompletions ? completions : chat;
}

// A field that must be absent, null or equal to its neutral value, since namm-api does not implement it.
std::optional<ApiError> Unsupported(const json& body, const std::string& field, const json& neutral) {
  const auto it = body.find(field);
  if (it == body.end() || it->is_null() || *it == neutral) return std::nullopt;
  return Invalid(field + " is not supported by namm-api (only " + neutral.dump() + ")", field);
}

std::optional<ApiError> ReadInteger(const json& body, const std::string& field, int64_t min, std::optional<int64_t>* out) {
  const auto it = body.find(field);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number_integer()) return Invalid(field + " must be an integer, not " + TypeName(*it), field);
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Invalid(field + " is too large", field);
  }
  const auto value = it->get<int64_t>();
  if (value < min) return Invalid(field + " must be at least " + std::to_string(min), field);
  *out = value;
  return std::nullopt;
}

std::optional<ApiError> ReadNumber(const json& body, const std::string& field, double min, double max, double* out) {
  const auto it = body.find(field);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) return Invalid(field + " must be a number, not " + TypeName(*it), field);
  const auto value = it->get<double>();
  if (!(value >= min && value <= max)) {
    return Invalid(field + " must be between " + json(min).dump() + " and " + json(max).dump(), field);
  }
  *out = value;
  return std::nullopt;
}

std::optional<ApiError> ReadBool(const json& body, const std::string& field, bool* out) {
  const auto it = body.find(field);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) return Invalid(field + " must be a boolean, not " + TypeName(*it), field);
  *out = it->get<bool>();
  return std::nullopt;
}

std::optional<ApiError> ReadStop(const json& body, std::vector<std::string>* stop) {
  const auto it = body.find("stop");
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) {
    if (!it->get_ref<const std::string&>().empty()) stop->push_back(it->get<std::string>());
    return std::nullopt;
  }
  if (!it->is_array()) return Invalid("stop must be a string or an array of strings, not " + TypeName(*it), "stop");
  if (it->size() > 4) return Invalid("stop takes at most 4 sequences", "stop");
  for (const json& s : *it) {
    if (!s.is_string()) return Invalid("stop must hold strings, not " + TypeName(s), "stop");
    if (!s.get_ref<const std::string&>().empty()) stop->push_back(s.get<std::string>());
  }
  return std::nullopt;
}

std::optional<ApiError> ReadPrompt(const json& body, CompletionRequest* request) {
  const auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) return Invalid("prompt is required", "prompt");
  if (it->is_string()) {
    request->prompt = it->get<std::string>();
    return std::nullopt;
  }
  if (!it->is_array()) return Invalid("prompt must be a string, an array of one string or of token ids, not " + TypeName(*it), "prompt");
  if (it->size() == 1 && (*it)[0].is_string()) {
    request->prompt = (*it)[0].get<std::string>();
    return std::nullopt;
  }
  const json& ids = it->size() == 1 && (*it)[0].is_array() ? (*it)[0] : *it;
  for (const json& id : ids) {
    if (id.is_string()) return Invalid("prompt holds several strings: namm-api answers one prompt per request", "prompt");
    if (!id.is_number_integer() || id.get<int64_t>() < 0) {
      return Invalid("prompt token ids must be non-negative integers", "prompt");
    }
    request->prompt_ids.push_back(id.get<int64_t>());
  }
  if (request->prompt_ids.empty()) return Invalid("prompt is empty", "prompt");
  request->prompt_is_ids = true;
  return std::nullopt;
}

// A message's content: a string, or an array of text parts ({"type": "text", "text": ...}) joined.
std::optional<ApiError> ReadContent(const json& content, std::string* out) {
  if (content.is_null()) return std::nullopt;  // an assistant turn with tool calls only
  if (content.is_string()) {
    *out = content.get<std::string>();
    return std::nullopt;
  }
  if (!content.is_array()) return Invalid("message content must be a string or an array of parts, not " + TypeName(content), "messages");
  for (const json& part : content) {
    const auto type = part.is_object() ? part.find("type") : part.end();
    if (!part.is_object() || type == part.end() || *type != "text" || !part.contains("text") || !part["text"].is_string()) {
      return Invalid("message content parts must be {\"type\": \"text\", \"text\": ...}: this model reads text only",
                     "messages");
    }
    *out += part["text"].get<std::string>();
  }
  return std::nullopt;
}

std::optional<ApiError> ReadMessages(const json& body, CompletionRequest* request) {
  const auto it = body.find("messages");
  if (it == body.end() || it->is_null()) return Invalid("messages is required", "messages");
  if (!it->is_array() || it->empty()) return Invalid("messages must be a non-empty array", "messages");
  for (const json& message : *it) {
    if (!message.is_object()) return Invalid("each message must be an object, not " + TypeName(message), "messages");
    const auto role = message.find("role");
    if (role == message.end() || !role->is_string() || role->get_ref<const std::string&>().empty()) {
      return Invalid("each message needs a role (a string)", "messages");
    }
    worker::ChatMessage m{role->get<std::string>(), ""};
    if (const auto content = message.find("content"); content != message.end()) {
      if (auto error = ReadContent(*content, &m.content)) return error;
    }
    request->messages.push_back(std::move(m));
  }
  return std::nullopt;
}

ordered Usage(const CompletionOutcome& outcome) {
  return {{"prompt_tokens", outcome.prompt_tokens},
          {"completion_tokens", outcome.completion_tokens},
          {"total_tokens", outcome.prompt_tokens + outcome.completion_tokens}};
}

ordered NammExtension(const CompletionOutcome& outcome) {
  const CacheReport& c = outcome.cache;
  return {{"policy", c.policy},
          {"seed", static_cast<int64_t>(outcome.seed)},  // as the request gave it (OpenAI's seeds are signed)
          {"cache",
           {{"mean_kv_tokens", c.mean_kv_tokens},
            {"relative_cache", c.relative_cache},
            {"peak_kv_tokens", c.peak_kv_tokens},
            {"final_kv_tokens", c.final_kv_tokens},
            {"evicted_tokens", c.evicted_tokens},
            {"peak_kv_bytes", c.peak_kv_bytes}}}};
}

bool IsChat(const CompletionRequest& request) { return request.endpoint == Endpoint::kChatCompletions; }

ordered Header(const CompletionRequest& request, const ResponseHeader& header, bool chunk) {
  return {{"id", header.id},
          {"object", IsChat(request) ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
          {"created", header.created},
          {"model", header.model}};
}

// One choice of a chunk: text (completions) or a delta (chat), and the finish reason (null until the end).
ordered ChunkChoice(const CompletionRequest& request, std::string_view text, bool first, const std::string& finish) {
  ordered choice = {{"index", 0}};
  if (IsChat(request)) {
    ordered delta = ordered::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || finish.empty()) delta["content"] = std::string(text);
    choice["delta"] = delta;
    choice["logprobs"] = nullptr;
  } else {
    choice["text"] = std::string(text);
    choice["logprobs"] = nullptr;
  }
  choice["finish_reason"] = finish.empty() ? ordered(nullptr) : ordered(finish);
  return choice;
}

}  // namespace

std::string ApiError::ToJson() const {
  ordered error = {{"message", message},
                   {"type", type},
                   {"param", param.empty() ? ordered(nullptr) : ordered(param)},
                   {"code", code.empty() ? ordered(nullptr) : ordered(code)}};
  return Dump(ordered{{"error", error}});
}

std::variant<CompletionRequest, ApiError> parse_completion_request(Endpoint endpoint, std::string_view body_text) {
  // (Copies and dumps of a value recurse per level; a 1 MiB body could nest half a million.)
  if (json_nests_deeper_than(body_text)) {
    return Invalid("the request body nests arrays and objects more than " + std::to_string(kMaxJsonDepth) +
                       " levels deep",
                   "");
  }
  const json body = json::parse(body_text.begin(), body_text.end(), nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) {
    // JSON is UTF-8: name the first ill-formed byte, which a client can find, rather than a parse error.
    const std::string text(body_text);
    for (std::size_t i = 0; i < text.size();) {
      const int n = utf8_sequence_length(text, i);
      if (n < 0) return Invalid("the request body is not valid UTF-8 (an ill-formed byte at offset " + std::to_string(i) + ")", "");
      i += static_cast<std::size_t>(n);
    }
    return Invalid("the request body is not valid JSON", "");
  }
  if (!body.is_object()) return Invalid("the request body must be a JSON object, not " + TypeName(body), "");
  const std::set<std::string>& known = KnownFields(endpoint);
  for (const auto& [key, value] : body.items()) {
    if (known.count(key) == 0) return Invalid("Unrecognized request argument supplied: " + key, key);
  }
  CompletionRequest request;
  request.endpoint = endpoint;
  const auto model = body.find("model");
  if (model == body.end() || !model->is_string()) return Invalid("model is required (a string)", "model");
  request.model = model->get<std::string>();

  if (auto error = endpoint == Endpoint::kCompletions ? ReadPrompt(body, &request) : ReadMessages(body, &request)) {
    return *error;
  }
  for (const auto& [field, neutral] : std::vector<std::pair<std::string, json>>{
           {"n", 1}, {"best_of", 1}, {"echo", false}, {"suffix", ""}, {"logit_bias", json::object()},
           {"top_p", 1}, {"presence_penalty", 0}, {"frequency_penalty", 0}, {"top_logprobs", 0}}) {
    if (auto error = Unsupported(body, field, neutral)) return *error;
  }
  // Off is null (and false in chat, where it is a flag); a completion's logprobs: 0 still asks for the chosen
  // token's log probability.
  if (const auto logprobs = body.find("logprobs");
      logprobs != body.end() && !logprobs->is_null() && !(endpoint == Endpoint::kChatCompletions && *logprobs == false)) {
    return Invalid("logprobs is not supported by namm-api", "logprobs");
  }
  if (const auto user = body.find("user"); user != body.end() && !user->is_null() && !user->is_string()) {
    return Invalid("user must be a string, not " + TypeName(*user), "user");
  }
  std::optional<int64_t> max_tokens, max_completion_tokens, seed;
  if (auto error = ReadInteger(body, "max_tokens", 0, &max_tokens)) return *error;
  if (auto error = ReadInteger(body, "max_completion_tokens", 0, &max_completion_tokens)) return *error;
  request.max_tokens = max_completion_tokens ? max_completion_tokens : max_tokens;
  if (max_completion_tokens) request.max_tokens_field = "max_completion_tokens";
  if (auto error = ReadInteger(body, "seed", std::numeric_limits<int64_t>::min(), &seed)) return *error;
  if (seed) request.seed = static_cast<uint64_t>(*seed);
  if (auto error = ReadNumber(body, "temperature", 0.0, 2.0, &request.temperature)) return *error;
  if (auto error = ReadBool(body, "stream", &request.stream)) return *error;
  if (auto error = ReadBool(body, "ignore_eos", &request.ignore_eos)) return *error;
  if (auto error = ReadStop(body, &request.stop)) return *error;
  if (const auto options = body.find("stream_options"); options != body.end() && !options->is_null()) {
    if (!options->is_object()) return Invalid("stream_options must be an object", "stream_options");
    if (!request.stream) return Invalid("stream_options is only allowed with stream: true", "stream_options");
    for (const auto& [key, value] : options->items()) {
      if (key != "include_usage") return Invalid("Unrecognized stream option: " + key, "stream_options");
    }
    if (auto error = ReadBool(*options, "include_usage", &request.include_usage)) {
      error->param = "stream_options";
      return *error;
    }
  }
  if (const auto policy = body.find("namm_policy"); policy != body.end() && !policy->is_null()) {
    if (!policy->is_string()) return Invalid("namm_policy must be a policy spec string", "namm_policy");
    request.policy = policy->get<std::string>();
  }
  return request;
}

std::string completion_response(const CompletionRequest& request, const ResponseHeader& header,
                                const CompletionOutcome& outcome) {
  ordered response = Header(request, header, false);
  ordered choice = {{"index", 0}};
  if (IsChat(request)) {
    choice["message"] = {{"role", "assistant"}, {"content", outcome.text}};
    choice["logprobs"] = nullptr;
  } else {
    choice["text"] = outcome.text;
    choice["logprobs"] = nullptr;
  }
  choice["finish_reason"] = outcome.finish_reason;
  response["choices"] = ordered::array({choice});
  response["usage"] = Usage(outcome);
  response["namm"] = NammExtension(outcome);
  return Dump(response);
}

std::string stream_text_chunk(const CompletionRequest& request, const ResponseHeader& header, std::string_view text,
                              bool first) {
  ordered chunk = Header(request, header, true);
  chunk["choices"] = ordered::array({ChunkChoice(request, text, first, "")});
  if (request.include_usage) chunk["usage"] = nullptr;  // OpenAI's: null on every chunk but the last
  return Dump(chunk);
}

std::vector<std::string> stream_final_chunks(const CompletionRequest& request, const ResponseHeader& header,
                                             const CompletionOutcome& outcome) {
  std::vector<std::string> chunks;
  ordered last = Header(request, header, true);
  last["choices"] = ordered::array({ChunkChoice(request, "", false, outcome.finish_reason)});
  if (request.include_usage) last["usage"] = nullptr;
  last["namm"] = NammExtension(outcome);
  chunks.push_back(Dump(last));
  if (request.include_usage) {
    ordered usage = Header(request, header, true);
    usage["choices"] = ordered::array();
    usage["usage"] = Usage(outcome);
    chunks.push_back(Dump(usage));
  }
  return chunks;
}

std::string model_object(const std::string& model, int64_t created) {
  return Dump(ordered{{"id", model}, {"object", "model"}, {"created", created}, {"owned_by", "namm"}});
}

std::string model_list(const std::string& model, int64_t created) {
  ordered list = {{"object", "list"}, {"data", ordered::array({ordered::parse(model_object(model, created))})}};
  return Dump(list);
}

}  // namespace namm::server
