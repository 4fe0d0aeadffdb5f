#include "namm/worker/tokenizer.h"

#include <algorithm>

#include "namm/file_util.h"
#include "namm/worker/hf_tokenizer.h"
#include "namm/worker/llama2c_tokenizer.h"

namespace namm::worker {

Result<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& path) {
  if (!path_exists(path)) return Status::NotFound(path + ": no such file or directory");
  const bool json = is_directory(path) || (path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0);
  if (json) {
    NAMM_ASSIGN_OR_RETURN(std::unique_ptr<HfTokenizer> tokenizer, HfTokenizer::Load(path));
    return std::unique_ptr<Tokenizer>(std::move(tokenizer));
  }
  NAMM_ASSIGN_OR_RETURN(std::unique_ptr<Llama2cTokenizer> tokenizer, Llama2cTokenizer::Load(path));
  return std::unique_ptr<Tokenizer>(std::move(tokenizer));
}

Result<std::vector<int64_t>> encode_truncated_middle(const Tokenizer& tokenizer, const std::string& text,
                                                     int64_t max_tokens) {
  NAMM_ASSIGN_OR_RETURN(const std::vector<int64_t> ids, tokenizer.Encode(text));
  if (static_cast<int64_t>(ids.size()) <= max_tokens) return tokenizer.EncodeForModel(text);
  const auto half = static_cast<std::ptrdiff_t>(max_tokens / 2);
  const std::string head = tokenizer.Decode(std::vector<int64_t>(ids.begin(), ids.begin() + half));
  const std::string tail = tokenizer.Decode(std::vector<int64_t>(ids.end() - half, ids.end()));
  return tokenizer.EncodeForModel(head + tail);
}

Result<ContextPrompt> truncate_to_context(const Tokenizer& tokenizer, const std::string& text, int64_t context,
                                         int64_t max_new_tokens) {
  const int64_t budget = context - max_new_tokens;
  if (budget <= 0) {
    return Status::InvalidArgument(std::to_string(max_new_tokens) + " new tokens leave no room for a prompt in a context of " +
                                   std::to_string(context));
  }
  ContextPrompt out;
  NAMM_ASSIGN_OR_RETURN(out.ids, encode_truncated_middle(tokenizer, text, budget));
  out.context = context + std::max<int64_t>(0, static_cast<int64_t>(out.ids.size()) - budget);
  return out;
}

std::string decode_continuation(const Tokenizer& tokenizer, const std::vector<int64_t>& context,
                                const std::vector<int64_t>& ids) {
  if (context.empty()) return tokenizer.Decode(ids);
  std::vector<int64_t> joined = context;
  joined.insert(joined.end(), ids.begin(), ids.end());
  const std::string before = tokenizer.Decode(context), whole = tokenizer.Decode(joined);
  if (whole.compare(0, before.size(), before) != 0) return tokenizer.Decode(ids);
  return whole.substr(before.size());
}

}  // namespace namm::worker
