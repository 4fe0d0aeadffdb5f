// namm-api's request parsing and responses (server/include/namm/server/openai_protocol.h).
#include "namm/server/openai_protocol.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace namm::server {
namespace {

using json = nlohmann::json;

CompletionRequest Parsed(Endpoint endpoint, const std::string& body) {
  auto parsed = parse_completion_request(endpoint, body);
  if (const auto* error = std::get_if<ApiError>(&parsed)) ADD_FAILURE() << body << ": " << error->message;
  return std::holds_alternative<CompletionRequest>(parsed) ? std::get<CompletionRequest>(parsed) : CompletionRequest{};
}

ApiError Refused(Endpoint endpoint, const std::string& body) {
  auto parsed = parse_completion_request(endpoint, body);
  if (std::holds_alternative<CompletionRequest>(parsed)) ADD_FAILURE() << body << " was accepted";
  return std::holds_alternative<ApiError>(parsed) ? std::get<ApiError>(parsed) : ApiError{};
}

TEST(OpenAIProtocol, ReadsACompletionRequestWithEveryOption) {
  const CompletionRequest r = Parsed(Endpoint::kCompletions, R"({"model": "m", "prompt": "Once", "max_tokens": 7,
      "temperature": 0.5, "seed": -2, "stop": ["\n", "", "The"], "stream": true, "stream_options": {"include_usage": true},
      "n": 1, "top_p": 1.0, "logprobs": null, "echo": false, "user": "u", "namm_policy": "h2o:budget=8",
      "ignore_eos": true})");
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(r.prompt, "Once");
  EXPECT_FALSE(r.prompt_is_ids);
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_DOUBLE_EQ(r.temperature, 0.5);
  EXPECT_EQ(r.seed, static_cast<uint64_t>(-2));
  EXPECT_EQ(r.stop, (std::vector<std::string>{"\n", "The"}));  // empty stop strings stop nothing
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.policy, "h2o:budget=8");
  EXPECT_TRUE(r.ignore_eos);

  const CompletionRequest defaults = Parsed(Endpoint::kCompletions, R"({"model": "m", "prompt": ["Once"]})");
  EXPECT_EQ(defaults.prompt, "Once");
  EXPECT_FALSE(defaults.max_tokens.has_value());
  EXPECT_DOUBLE_EQ(defaults.temperature, 1.0);
  EXPECT_FALSE(defaults.seed.has_value());
  EXPECT_FALSE(defaults.stream);
  EXPECT_FALSE(defaults.ignore_eos);

  const CompletionRequest ids = Parsed(Endpoint::kCompletions, R"({"model": "m", "prompt": [1, 2, 3], "stop": "x"})");
  EXPECT_TRUE(ids.prompt_is_ids);
  EXPECT_EQ(ids.prompt_ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(ids.stop, std::vector<std::string>{"x"});
}

TEST(OpenAIProtocol, ReadsChatMessagesAsStringsOrTextParts) {
  const CompletionRequest r = Parsed(Endpoint::kChatCompletions, R"({"model": "m", "max_completion_tokens": 3,
      "max_tokens": 9, "messages": [{"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
      {"role": "assistant", "content": null}]})");
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[1].content, "Hi there");
  EXPECT_EQ(r.messages[2].content, "");
  EXPECT_EQ(r.max_tokens, 3);  // max_completion_tokens wins, as OpenAI's newer name
  EXPECT_EQ(r.max_tokens_field, "max_completion_tokens");  // errors name the field the client sent
  const CompletionRequest plain = Parsed(Endpoint::kChatCompletions, R"({"model": "m", "max_tokens": 9,
      "messages": [{"role": "user", "content": "x"}]})");
  EXPECT_EQ(plain.max_tokens_field, "max_tokens");
}

TEST(OpenAIProtocol, RefusesWhatItCannotHonourNamingTheField) {
  struct Case {
    Endpoint endpoint;
    std::string body, param, says;
  };
  const Endpoint c = Endpoint::kCompletions, chat = Endpoint::kChatCompletions;
  for (const Case& k : std::vector<Case>{
           {c, "{", "", "not valid JSON"},
           {c, "{\"model\": \"m\", \"prompt\": \"a\xff\"}", "", "not valid UTF-8 (an ill-formed byte at offset 27)"},
           {chat, "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"\xc0\xaf\"}]}", "",
            "not valid UTF-8 (an ill-formed byte at offset 57)"},
           {c, "{\"model\": \"m\", \"prompt\": " + std::string(100000, '[') + std::string(100000, ']') + "}", "",
            "nests arrays and objects more than 64 levels deep"},
           {c, "[1]", "", "must be a JSON object"},
           {c, R"({"prompt": "x"})", "model", "model is required"},
           {c, R"({"model": "m"})", "prompt", "prompt is required"},
           {c, R"({"model": "m", "prompt": "x", "frobnicate": 1})", "frobnicate", "Unrecognized request argument supplied: frobnicate"},
           {c, R"({"model": "m", "prompt": "x", "messages": []})", "messages", "Unrecognized"},
           {chat, R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt": "x"})", "prompt", "Unrecognized"},
           {c, R"({"model": "m", "prompt": "x", "n": 2})", "n", "n is not supported"},
           {c, R"({"model": "m", "prompt": "x", "top_p": 0.9})", "top_p", "top_p is not supported"},
           {c, R"({"model": "m", "prompt": "x", "logprobs": 2})", "logprobs", "logprobs"},
           {c, R"({"model": "m", "prompt": "x", "logprobs": 0})", "logprobs", "logprobs"},
           {chat, R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": true})", "logprobs", "logprobs"},
           {c, R"({"model": "m", "prompt": "x", "max_tokens": -1})", "max_tokens", "at least 0"},
           {c, R"({"model": "m", "prompt": "x", "max_tokens": 1.5})", "max_tokens", "must be an integer"},
           {c, R"({"model": "m", "prompt": "x", "max_tokens": 18446744073709551615})", "max_tokens", "too large"},
           {c, R"({"model": "m", "prompt": "x", "temperature": 3})", "temperature", "between 0.0 and 2.0"},
           {c, R"({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]})", "stop", "at most 4"},
           {c, R"({"model": "m", "prompt": "x", "stop": [1]})", "stop", "must hold strings"},
           {c, R"({"model": "m", "prompt": "x", "stream_options": {"include_usage": true}})", "stream_options", "only allowed with stream"},
           {c, R"({"model": "m", "prompt": ["a", "b"]})", "prompt", "one prompt per request"},
           {c, R"({"model": "m", "prompt": [1, -2]})", "prompt", "non-negative"},
           {c, R"({"model": "m", "prompt": []})", "prompt", "empty"},
           {c, R"({"model": "m", "prompt": "x", "namm_policy": 3})", "namm_policy", "policy spec string"},
           {chat, R"({"model": "m", "messages": []})", "messages", "non-empty array"},
           {chat, R"({"model": "m", "messages": [{"content": "x"}]})", "messages", "needs a role"},
           {chat, R"({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", "messages", "text only"},
       }) {
    const ApiError e = Refused(k.endpoint, k.body);
    EXPECT_EQ(e.http_status, 400) << k.body;
    EXPECT_EQ(e.type, "invalid_request_error") << k.body;
    EXPECT_EQ(e.param, k.param) << k.body;
    EXPECT_NE(e.message.find(k.says), std::string::npos) << k.body << ": " << e.message;
    const json error = json::parse(e.ToJson())["error"];
    EXPECT_EQ(error["message"], e.message);
    EXPECT_EQ(error["param"], k.param.empty() ? json(nullptr) : json(k.param));
    EXPECT_TRUE(error["code"].is_null());
  }
}

TEST(OpenAIProtocol, AnswersInOpenAIsShapes) {
  CompletionOutcome outcome;
  outcome.text = "Lily ran.";
  outcome.finish_reason = "length";
  outcome.prompt_tokens = 5;
  outcome.completion_tokens = 4;
  outcome.seed = 9;
  outcome.cache.policy = "h2o:budget=8";
  outcome.cache.relative_cache = 0.5;
  const ResponseHeader header{"cmpl-1", 1700000000, "stories260K"};

  CompletionRequest completion = Parsed(Endpoint::kCompletions, R"({"model": "stories260K", "prompt": "x"})");
  const json whole = json::parse(completion_response(completion, header, outcome));
  EXPECT_EQ(whole["object"], "text_completion");
  EXPECT_EQ(whole["choices"][0]["text"], "Lily ran.");
  EXPECT_EQ(whole["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(whole["usage"], json({{"prompt_tokens", 5}, {"completion_tokens", 4}, {"total_tokens", 9}}));
  EXPECT_EQ(whole["namm"]["policy"], "h2o:budget=8");
  EXPECT_EQ(whole["namm"]["seed"], 9);
  EXPECT_EQ(whole["namm"]["cache"]["relative_cache"], 0.5);

  CompletionRequest chat = Parsed(Endpoint::kChatCompletions,
                                  R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": true,
                                      "stream_options": {"include_usage": true}})");
  const json message = json::parse(completion_response(chat, header, outcome));
  EXPECT_EQ(message["object"], "chat.completion");
  EXPECT_EQ(message["choices"][0]["message"], json({{"role", "assistant"}, {"content", "Lily ran."}}));

  const json first = json::parse(stream_text_chunk(chat, header, "", true));
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"], json({{"role", "assistant"}, {"content", ""}}));
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  const json piece = json::parse(stream_text_chunk(chat, header, "Lily", false));
  EXPECT_EQ(piece["choices"][0]["delta"], json({{"content", "Lily"}}));
  const std::vector<std::string> last = stream_final_chunks(chat, header, outcome);
  ASSERT_EQ(last.size(), 2u);  // the finish reason, then the usage (include_usage)
  EXPECT_EQ(json::parse(last[0])["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(json::parse(last[0])["choices"][0]["delta"], json::object());
  EXPECT_TRUE(json::parse(last[1])["choices"].empty());
  EXPECT_EQ(json::parse(last[1])["usage"]["total_tokens"], 9);
  // With include_usage every other chunk says usage: null (clients read chunk.usage on each); without, none does.
  for (const json& chunk : {first, piece, json::parse(last[0])}) {
    ASSERT_TRUE(chunk.contains("usage"));
    EXPECT_TRUE(chunk["usage"].is_null());
  }
  CompletionRequest plain = Parsed(Endpoint::kCompletions, R"({"model": "m", "prompt": "x", "stream": true})");
  EXPECT_FALSE(json::parse(stream_text_chunk(plain, header, "Lily", false)).contains("usage"));

  // Invalid UTF-8 from a client comes back replaced, not as an exception.
  outcome.text = "bad \xff byte";
  EXPECT_NE(completion_response(completion, header, outcome).find("bad \xEF\xBF\xBD byte"), std::string::npos);
}

}  // namespace
}  // namespace namm::server
