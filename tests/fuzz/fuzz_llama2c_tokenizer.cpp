// Fuzz target: llama2.c tokenizer.bin files (namm-worker --tokenizer FILE.bin). The input becomes an in-memory
// file; a tokenizer that loads must encode and decode, whatever its pieces and scores (NaN, duplicates, empty).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "memory_file.h"
#include "namm/worker/llama2c_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const namm::fuzz::MemoryFile file("tokenizer_bin", data, size);
  if (!file.ok()) return 0;
  const auto tokenizer = namm::worker::Llama2cTokenizer::Load(file.path());
  if (!tokenizer.ok()) return 0;
  const auto ids = (*tokenizer)->EncodeForModel("Once upon a time, wörld 123 \xe4\xbd\xa0\xe5\xa5\xbd \xff!");
  if (ids.ok()) (void)(*tokenizer)->Decode(*ids, /*skip_special_tokens=*/false);
  std::vector<int64_t> every;
  for (int64_t id = -1; id <= (*tokenizer)->vocab_size(); ++id) every.push_back(id);
  (void)(*tokenizer)->Decode(every, /*skip_special_tokens=*/false);
  return 0;
}
