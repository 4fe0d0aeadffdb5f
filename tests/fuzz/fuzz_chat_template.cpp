// Fuzz target: chat templates (namm-worker --chat reads them from tokenizer_config.json). A template that parses
// must render a conversation, or fail with a Status, within the renderer's limits.
#include <cstddef>
#include <cstdint>
#include <string>

#include "namm/worker/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::string source(reinterpret_cast<const char*>(data), size);
  auto parsed = namm::worker::ChatTemplate::Parse(source);
  if (!parsed.ok()) return 0;
  const nlohmann::ordered_json variables = {{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"enable_thinking", false}};
  (void)parsed->Render({{"system", "Be brief."}, {"user", "Where is the key? <think>x</think>"},
                        {"assistant", "Under the mat."}, {"user", "Thanks, wörld"}},
                       /*add_generation_prompt=*/true, variables);
  return 0;
}
