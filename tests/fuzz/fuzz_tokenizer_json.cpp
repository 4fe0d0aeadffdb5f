// Fuzz target: Hugging Face tokenizer.json (namm-worker --tokenizer). A tokenizer that loads must encode and decode.
#include <cstddef>
#include <cstdint>
#include <string>

#include "namm/worker/hf_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::string json(reinterpret_cast<const char*>(data), size);
  auto tokenizer = namm::worker::HfTokenizer::FromJson(json, "", "fuzz");
  if (!tokenizer.ok()) return 0;
  // A fuzzed pattern may backtrack past PCRE2's limits: an error, never a crash or a partial result.
  const auto ids = (*tokenizer)->Encode("Hello, wörld 123 \xe4\xbd\xa0\xe5\xa5\xbd!");
  if (ids.ok()) (void)(*tokenizer)->Decode(*ids);
  return 0;
}
