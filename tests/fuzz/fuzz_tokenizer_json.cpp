// Fuzz target: Hugging Face tokenizer.json (namm-worker --tokenizer). A tokenizer that loads must encode and decode.
#include <cstddef>
#include <cstdint>
#include <string>

#include "namm/worker/hf_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::string json(reinterpret_cast<const char*>(data), size);
  auto tokenizer = namm::worker::HfTokenizer::FromJson(json, "", "fuzz");
  if (!tokenizer.ok()) return 0;
  const std::vector<int64_t> ids = (*tokenizer)->Encode("Hello, wörld 123 \xe4\xbd\xa0\xe5\xa5\xbd!");
  (void)(*tokenizer)->Decode(ids);
  return 0;
}
