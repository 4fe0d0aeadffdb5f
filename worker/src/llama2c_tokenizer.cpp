#include "namm/worker/llama2c_tokenizer.h"

#include <cstring>

#include "namm/file_util.h"
#include "utf8.h"

namespace namm::worker {

namespace {
// The byte a "<0xXX>" piece stands for, or -1.
int FallbackByte(const std::string& piece) {
  if (piece.size() != 6 || piece.compare(0, 3, "<0x") != 0 || piece[5] != '>') return -1;
  unsigned value = 0;
  for (int i = 3; i < 5; ++i) {
    const char c = piece[static_cast<std::size_t>(i)];
    value = value * 16 + static_cast<unsigned>(c >= 'A' ? (c >= 'a' ? c - 'a' + 10 : c - 'A' + 10) : c - '0');
  }
  return static_cast<int>(value);
}
}  // namespace

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

std::vector<int64_t> Llama2cTokenizer::Encode(const std::string& raw) const {
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
  while (true) {
    float best_score = -1e10f;
    int64_t best_id = -1;
    std::size_t best_index = 0;
    for (std::size_t i = 0; i + 1 < tokens.size(); ++i) {
      auto it = ids_.find(pieces_[static_cast<std::size_t>(tokens[i])] + pieces_[static_cast<std::size_t>(tokens[i + 1])]);
      if (it != ids_.end() && scores_[static_cast<std::size_t>(it->second)] > best_score) {
        best_score = scores_[static_cast<std::size_t>(it->second)];
        best_id = it->second;
        best_index = i;
      }
    }
    if (best_id < 0) break;
    tokens[best_index] = best_id;
    tokens.erase(tokens.begin() + static_cast<std::ptrdiff_t>(best_index) + 1);
  }
  return tokens;
}

std::vector<int64_t> Llama2cTokenizer::EncodeForModel(const std::string& text) const {
  std::vector<int64_t> ids = {kBos};
  const std::vector<int64_t> body = Encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

std::string Llama2cTokenizer::Decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  std::string bytes;
  for (int64_t id : ids) {
    if (id < 0 || id >= vocab_size()) continue;
    if (skip_special_tokens && id <= kEos) continue;
    const std::string& piece = pieces_[static_cast<std::size_t>(id)];
    const int byte = FallbackByte(piece);
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
