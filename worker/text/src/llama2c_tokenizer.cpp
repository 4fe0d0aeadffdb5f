#include "namm/worker/llama2c_tokenizer.h"

#include <cstring>

#include "namm/file_util.h"
#include "pair_merges.h"
#include "utf8.h"

namespace namm::worker {


Result<std::unique_ptr<Llama2cTokenizer>> Llama2cTokenizer::Load(const std::string& path) {
  NAMM_ASSIGN_OR_RETURN(std::string bytes, read_file(path));
  auto corrupt = [&](const std::string& what) { return Status::Corruption(path + ": " + what); };
  auto tokenizer = std::unique_ptr<Llama2cTokenizer>(new Llama2cTokenizer());
  if (bytes.size() < 4) return corrupt("too short for a llama2.c tokenizer");
  std::size_t offset = 4;  // max_token_length: not needed
  while (offset < bytes.size()) {
    if (bytes.size() - offset < 8) return corrupt("truncated entry " + std::to_string(tokenizer->pieces_.size()));
    float score;
    int32_t length;
    std::memcpy(&score, bytes.data() + offset, 4);
    std::memcpy(&length, bytes.data() + offset + 4, 4);
    offset += 8;
    if (length < 0 || static_cast<std::size_t>(length) > bytes.size() - offset) {
      return corrupt("entry " + std::to_string(tokenizer->pieces_.size()) + " has an invalid length " +
                     std::to_string(length));
    }
    std::string piece = bytes.substr(offset, static_cast<std::size_t>(length));
    offset += static_cast<std::size_t>(length);
    tokenizer->ids_.emplace(piece, static_cast<int64_t>(tokenizer->pieces_.size()));  // first wins on duplicates
    tokenizer->pieces_.push_back(std::move(piece));
    tokenizer->scores_.push_back(score);
  }
  if (tokenizer->pieces_.size() < 3 + 256) return corrupt("fewer than 259 tokens (3 specials + 256 bytes)");
  return tokenizer;
}

Result<std::vector<int64_t>> Llama2cTokenizer::Encode(const std::string& raw) const {
  const std::string text = sanitize_utf8(raw);
  std::vector<int64_t> tokens;
  if (text.empty()) return tokens;
  auto space = ids_.find(" ");
  if (space != ids_.end()) tokens.push_back(space->second);
  for (const std::string& c : utf8::Characters(text)) {
    auto it = ids_.find(c);
    if (it != ids_.end()) {
      tokens.push_back(it->second);
    } else {
      for (unsigned char b : c) tokens.push_back(3 + static_cast<int64_t>(b));
    }
  }
  // run.c rescans all pairs after every merge for the highest score (leftmost on ties); a priority queue on
  // minus the score gives the same merges in O(n log n).
  MergePairs(tokens, [this](int64_t left, int64_t right) -> std::optional<std::pair<double, int64_t>> {
    auto it = ids_.find(pieces_[static_cast<std::size_t>(left)] + pieces_[static_cast<std::size_t>(right)]);
    if (it == ids_.end()) return std::nullopt;
    return std::make_pair(-static_cast<double>(scores_[static_cast<std::size_t>(it->second)]), it->second);
  });
  return tokens;
}

Result<std::vector<int64_t>> Llama2cTokenizer::EncodeForModel(const std::string& text) const {
  std::vector<int64_t> ids = {kBos};
  NAMM_ASSIGN_OR_RETURN(const std::vector<int64_t> body, Encode(text));
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

std::string Llama2cTokenizer::Decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  std::string bytes;
  for (int64_t id : ids) {
    if (id < 0 || id >= vocab_size()) continue;
    if (skip_special_tokens && id <= kEos) continue;
    const std::string& piece = pieces_[static_cast<std::size_t>(id)];
    const int byte = utf8::ByteTokenValue(piece);
    if (byte >= 0) {
      bytes += static_cast<char>(byte);
    } else {
      bytes += piece;
    }
  }
  if (!bytes.empty() && bytes[0] == ' ') bytes.erase(0, 1);
  return sanitize_utf8(bytes);
}

}  // namespace namm::worker
