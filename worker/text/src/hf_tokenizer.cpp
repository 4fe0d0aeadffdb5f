#include "namm/worker/hf_tokenizer.h"

#include <algorithm>
#include <map>
#include <cctype>
#include <cstdio>
#include <array>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "namm/file_util.h"
#include "namm/json_util.h"
#include "pair_merges.h"
#include "namm/regex.h"
#include "utf8.h"

namespace namm::worker {

namespace {

// Token ids index a table: ids beyond any real vocabulary (the largest have ~256k tokens) are refused, not
// allocated (found by tests/fuzz).
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// Nodes of one pipeline (normalizer, pre-tokenizer, decoder or post-processor), a Sequence counting as one as
// well as each of its steps: real files have up to 5. Bounds the parsers' recursion and how often a text is
// rewritten.
constexpr int kMaxPipelineNodes = 16;

// The decoder's Replace steps may make a text at most this much longer (Decode cannot fail, so this is
// checked when loading); real decoders only shorten it.
constexpr double kMaxDecoderGrowth = 4;

using Json = nlohmann::json;

// The pattern GPT-2's ByteLevel pre-tokenizer splits with (use_regex = true).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes map to themselves, the
// others to U+0100 onwards, in byte order.
struct ByteMap {
  std::array<std::string, 256> to_char;
  std::unordered_map<std::string, unsigned char> to_byte;
};

const ByteMap& GetByteMap() {
  static const ByteMap map = [] {
    ByteMap m;
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const std::string c = utf8_encode(printable ? b : next++);
      m.to_char[b] = c;
      m.to_byte[c] = static_cast<unsigned char>(b);
    }
    return m;
  }();
  return map;
}

struct NormalizerStep {
  enum class Kind { kPrepend, kReplace } kind;
  std::string text;     // kPrepend: the prefix; kReplace: the literal pattern (when no regex)
  std::optional<Regex> regex;
  std::string content;  // kReplace: the replacement
};

struct PreTokenizerStep {
  enum class Kind { kByteLevel, kSplit, kMetaspace } kind;
  bool add_prefix_space = false;  // kByteLevel
  std::optional<Regex> regex;     // kByteLevel (use_regex) and kSplit
  bool remove_matches = false;    // kSplit with behavior Removed: the matches are dropped
  std::string literal;            // kSplit on a String pattern
  std::string replacement;        // kMetaspace
  enum class Prepend { kAlways, kFirst, kNever } prepend = Prepend::kAlways;
  bool split = true;              // kMetaspace
};

struct DecoderStep {
  enum class Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
  std::string pattern, content;  // kReplace; kStrip uses content; kMetaspace uses content as the replacement
  int start = 0, stop = 0;       // kStrip
  bool prepend = true;           // kMetaspace: the first token's leading space is dropped
};

struct AddedToken {
  std::string content;
  int64_t id;
  bool special;
  bool normalized;   // matched in the normalized text (against its normalized content), else in the raw text
  bool lstrip, rstrip;  // the match absorbs the whitespace on its left / right
  bool single_word;  // only matches when not inside a word
  std::string match;  // what is searched for: content, normalized when `normalized`
};

bool IsWordByte(char c) {
  const auto u = static_cast<unsigned char>(c);
  return u >= 0x80 || std::isalnum(u) || c == '_';
}

bool IsSpaceByte(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// j[key] without copying it (j.value(key, default) copies the whole subtree), or null when j is not an object
// or has no such key.
const Json& Member(const Json& j, const char* key) {
  static const Json kNull;
  if (!j.is_object()) return kNull;
  const auto it = j.find(key);
  return it == j.end() ? kNull : *it;
}

// "<source>: <what> <j> is not supported", naming j by its "type" where it has one (j may be large: it is
// summarized, not dumped).
Status Unsupported(const std::string& source, const std::string& what, const Json& j) {
  const Json& type = Member(j, "type");
  return Status::Unimplemented(source + ": " + what + " " + json_summary(type.is_string() ? type : j) +
                               " is not supported");
}

// A String or Regex pattern object: {"String": "..."} or {"Regex": "..."}.
Status ParsePattern(const Json& j, std::string* literal, std::optional<Regex>* regex, const std::string& source) {
  if (const Json& string = Member(j, "String"); string.is_string()) {
    *literal = string.get<std::string>();
    return Status::Ok();
  }
  if (const Json& pattern = Member(j, "Regex"); pattern.is_string()) {
    auto compiled = Regex::Compile(pattern.get<std::string>());
    if (!compiled.ok()) return compiled.status().WithContext(source);
    *regex = std::move(compiled).value();
    return Status::Ok();
  }
  return Unsupported(source, "pattern", j);
}

// Splits `s` around the regex or literal matches: matches and gaps in order (Isolated), or gaps only (Removed).
Result<std::vector<std::string>> SplitAround(const std::string& s, const std::optional<Regex>& regex,
                                             const std::string& literal, bool remove_matches) {
  std::vector<std::pair<std::size_t, std::size_t>> matches;
  if (regex) {
    NAMM_ASSIGN_OR_RETURN(matches, regex->FindAll(s));
  } else if (!literal.empty()) {
    for (std::size_t pos = s.find(literal); pos != std::string::npos; pos = s.find(literal, pos + literal.size())) {
      matches.emplace_back(pos, pos + literal.size());
    }
  }
  std::vector<std::string> pieces;
  std::size_t cursor = 0;
  for (const auto& [begin, end] : matches) {
    if (begin > cursor) pieces.push_back(s.substr(cursor, begin - cursor));
    if (!remove_matches) pieces.push_back(s.substr(begin, end - begin));
    cursor = end;
  }
  if (cursor < s.size()) pieces.push_back(s.substr(cursor));
  return pieces;
}

// Appends `s` with every `from` replaced by `to` (left to right) to *out; false, with *out partly written, as
// soon as *out would pass `max_size` bytes.
bool AppendReplaced(const std::string& s, const std::string& from, const std::string& to,
                    std::size_t max_size, std::string* out) {
  std::size_t cursor = 0;
  for (std::size_t pos = from.empty() ? std::string::npos : s.find(from); pos != std::string::npos;
       pos = s.find(from, cursor)) {
    if (out->size() + (pos - cursor) + to.size() > max_size) return false;
    out->append(s, cursor, pos - cursor).append(to);
    cursor = pos + from.size();
  }
  if (out->size() + (s.size() - cursor) > max_size) return false;
  out->append(s, cursor, std::string::npos);
  return true;
}

std::string ReplaceAll(const std::string& s, const std::string& from, const std::string& to) {
  std::string out;
  AppendReplaced(s, from, to, std::string::npos, &out);
  return out;
}

// The most the normalizer or the pre-tokenizer may make of an `input_size`-byte text. Real ones grow it at
// most 3x (Metaspace's 3-byte "▁" for each space, ByteLevel's 2-byte characters); the chained steps of a
// hostile file (Replace "a" -> "aa", again and again) would multiply it.
std::size_t MaxOutputSize(std::size_t input_size) { return 4 * input_size + 1024; }

Status OutputTooLarge(const char* pipeline, std::size_t input_size) {
  return Status::FailedPrecondition(std::string("the tokenizer's ") + pipeline + " would make more than " +
                                    std::to_string(MaxOutputSize(input_size)) + " bytes (4x + 1 KiB) of a " +
                                    std::to_string(input_size) + "-byte text");
}

// transformers' clean_up_tokenization, applied when tokenizer_config.json sets clean_up_tokenization_spaces.
std::string CleanUpTokenizationSpaces(std::string s) {
  static const std::pair<const char*, const char*> kRules[] = {
      {" .", "."}, {" ?", "?"}, {" !", "!"}, {" ,", ","}, {" ' ", "'"},
      {" n't", "n't"}, {" 'm", "'m"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  for (const auto& [from, to] : kRules) s = ReplaceAll(s, from, to);
  return s;
}

bool StartsWith(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

std::string TokenContent(const Json& j) {
  if (j.is_string()) return j.get<std::string>();
  const Json& content = Member(j, "content");
  return content.is_string() ? content.get<std::string>() : "";
}

// The integer `key` of step j, from 0 to `max` (0 when absent); other numbers are refused, not converted.
Result<int> SmallCount(const Json& j, const char* key, int max, const std::string& source) {
  const Json& v = Member(j, key);
  if (v.is_null()) return 0;
  if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > max) {
    return Status::Corruption(source + ": " + j.value("type", "") + " '" + key +
                              "' must be an integer from 0 to " + std::to_string(max) + ", not " +
                              json_summary(v));
  }
  return static_cast<int>(v.get<int64_t>());
}

// Metaspace's replacement for spaces, which must not be empty (splitting at an empty string never advances).
Result<std::string> MetaspaceReplacement(const Json& j, const std::string& source) {
  std::string replacement = j.value("replacement", "\xE2\x96\x81");
  if (replacement.empty()) return Status::Corruption(source + ": Metaspace 'replacement' must not be empty");
  return replacement;
}

// How much longer the decoder's Replace steps can make a text: the product of their content-to-pattern
// length ratios over 1.
double DecoderGrowth(const std::vector<DecoderStep>& decoder) {
  double growth = 1;
  for (const DecoderStep& step : decoder) {
    if (step.kind == DecoderStep::Kind::kReplace && !step.pattern.empty()) {
      const double ratio = static_cast<double>(step.content.size()) / static_cast<double>(step.pattern.size());
      growth *= std::max(1.0, ratio);
    }
  }
  return growth;
}

}  // namespace

struct HfTokenizer::Impl {
  std::string source;
  std::unordered_map<std::string, int64_t> vocab;
  std::vector<std::string> id_to_token;
  // With a decoder of one ByteLevel step (GPT-2's, Llama 3's): each token's bytes as that step decodes it, worked
  // out once at load, so that Decode joins them (a streamed answer is decoded whole at every step). Empty otherwise.
  std::vector<std::string> id_to_bytes;
  std::unordered_map<uint64_t, std::pair<int32_t, int64_t>> merges;  // (left, right) -> (rank, merged id)
  bool byte_fallback = false, fuse_unk = false, ignore_merges = false;
  int64_t unk_id = -1;
  std::array<int64_t, 256> byte_token{};  // id of "<0xXX>", or -1
  std::vector<NormalizerStep> normalizer;
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<DecoderStep> decoder;
  std::vector<AddedToken> added;  // longest first
  std::array<bool, 256> added_first_byte{};  // bytes an added token's match string can start with
  bool clean_up_spaces = false;
  std::unordered_set<int64_t> special_ids;
  std::vector<int64_t> prefix, suffix;
  std::vector<int64_t> eos;

  static uint64_t PairKey(int64_t a, int64_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint64_t>(b); }

  int64_t IdOf(const std::string& token) const {
    auto it = vocab.find(token);
    return it == vocab.end() ? -1 : it->second;
  }

  // id_to_token is allocated up to the largest id: ids are refused beyond twice the tokens defined (real
  // files number theirs from 0, leaving at most a few unused), so that one entry cannot allocate millions.
  Status CheckIdsAreDense() const {
    const std::size_t limit = 2 * (vocab.size() + added.size()) + 1024;
    for (const auto& [token, id] : vocab) {
      if (static_cast<std::size_t>(id) >= limit) {
        return Status::Corruption(source + ": token id " + std::to_string(id) + " (of " +
                                  json_summary(Json(token)) + ") is beyond the limit of " +
                                  std::to_string(limit) + " = 2 x (" + std::to_string(vocab.size()) +
                                  " tokens + " + std::to_string(added.size()) + " added tokens) + 1024");
      }
    }
    return Status::Ok();
  }

  // Parses pipeline node j, a step (with parse_step) or a Sequence of nodes under `list_key`; *nodes counts
  // them all against kMaxPipelineNodes.
  template <typename ParseStep>
  Status ParsePipeline(const Json& j, const char* pipeline, const char* list_key, int* nodes,
                       const ParseStep& parse_step) {
    if (j.is_null()) return Status::Ok();
    if (++*nodes > kMaxPipelineNodes) {
      return Status::Corruption(source + ": the " + pipeline + " has more than " +
                                std::to_string(kMaxPipelineNodes) + " steps (each Sequence counts as one too)");
    }
    if (j.value("type", "") != "Sequence") return parse_step(j);
    const Json& steps = Member(j, list_key);
    if (!steps.is_array() && !steps.is_null()) {
      return Status::Corruption(source + ": " + pipeline + " Sequence's '" + list_key + "' is not a list");
    }
    for (const Json& step : steps) {
      NAMM_RETURN_IF_ERROR(ParsePipeline(step, pipeline, list_key, nodes, parse_step));
    }
    return Status::Ok();
  }

  Status ParseNormalizer(const Json& j) {
    const std::string type = j.value("type", "");
    if (type == "Prepend") {
      normalizer.push_back({NormalizerStep::Kind::kPrepend, j.value("prepend", ""), std::nullopt, ""});
    } else if (type == "Replace") {
      NormalizerStep step{NormalizerStep::Kind::kReplace, "", std::nullopt, j.value("content", "")};
      NAMM_RETURN_IF_ERROR(ParsePattern(Member(j, "pattern"), &step.text, &step.regex, source));
      normalizer.push_back(std::move(step));
    } else {
      return Unsupported(source, "normalizer", j);
    }
    return Status::Ok();
  }

  Status ParsePreTokenizer(const Json& j) {
    const std::string type = j.value("type", "");
    PreTokenizerStep step;
    if (type == "ByteLevel") {
      step.kind = PreTokenizerStep::Kind::kByteLevel;
      step.add_prefix_space = j.value("add_prefix_space", false);
      if (j.value("use_regex", true)) {
        auto compiled = Regex::Compile(kGpt2Pattern);
        if (!compiled.ok()) return compiled.status();
        step.regex = std::move(compiled).value();
      }
    } else if (type == "Split") {
      step.kind = PreTokenizerStep::Kind::kSplit;
      const std::string behavior = j.value("behavior", "Isolated");
      if (j.value("invert", false) || (behavior != "Isolated" && behavior != "Removed")) {
        return Unsupported(source, "Split pre-tokenizer (invert, or behavior other than Isolated/Removed)",
                           Member(j, "behavior"));
      }
      step.remove_matches = behavior == "Removed";
      NAMM_RETURN_IF_ERROR(ParsePattern(Member(j, "pattern"), &step.literal, &step.regex, source));
    } else if (type == "Metaspace") {
      step.kind = PreTokenizerStep::Kind::kMetaspace;
      NAMM_ASSIGN_OR_RETURN(step.replacement, MetaspaceReplacement(j, source));
      step.split = j.value("split", true);
      const std::string scheme = j.value("prepend_scheme", j.value("add_prefix_space", true) ? "always" : "never");
      step.prepend = scheme == "first"   ? PreTokenizerStep::Prepend::kFirst
                     : scheme == "never" ? PreTokenizerStep::Prepend::kNever
                                         : PreTokenizerStep::Prepend::kAlways;
    } else {
      return Unsupported(source, "pre-tokenizer", j);
    }
    pre_tokenizer.push_back(std::move(step));
    return Status::Ok();
  }

  Status ParseDecoder(const Json& j) {
    const std::string type = j.value("type", "");
    DecoderStep step;
    if (type == "ByteLevel") {
      step.kind = DecoderStep::Kind::kByteLevel;
    } else if (type == "Replace") {
      step.kind = DecoderStep::Kind::kReplace;
      std::optional<Regex> regex;
      NAMM_RETURN_IF_ERROR(ParsePattern(Member(j, "pattern"), &step.pattern, &regex, source));
      if (regex) return Unsupported(source, "Replace decoder with a regex", Member(j, "pattern"));
      step.content = j.value("content", "");
    } else if (type == "ByteFallback") {
      step.kind = DecoderStep::Kind::kByteFallback;
    } else if (type == "Fuse") {
      step.kind = DecoderStep::Kind::kFuse;
    } else if (type == "Strip") {
      step.kind = DecoderStep::Kind::kStrip;
      step.content = j.value("content", " ");
      if (step.content.empty()) {
        return Status::Corruption(source + ": Strip decoder's 'content' must not be empty");
      }
      // Real decoders strip one character; the bound keeps a file from making Decode loop for long.
      NAMM_ASSIGN_OR_RETURN(step.start, SmallCount(j, "start", 64, source));
      NAMM_ASSIGN_OR_RETURN(step.stop, SmallCount(j, "stop", 64, source));
    } else if (type == "Metaspace") {
      step.kind = DecoderStep::Kind::kMetaspace;
      NAMM_ASSIGN_OR_RETURN(step.content, MetaspaceReplacement(j, source));
      const std::string scheme = j.value("prepend_scheme", j.value("add_prefix_space", true) ? "always" : "never");
      step.prepend = scheme != "never";
    } else {
      return Unsupported(source, "decoder", j);
    }
    decoder.push_back(std::move(step));
    return Status::Ok();
  }

  Status ParsePostProcessor(const Json& j) {
    const std::string type = j.value("type", "");
    if (type == "ByteLevel") {
      // Only adjusts offsets.
    } else if (type == "TemplateProcessing") {
      const Json& specials = Member(j, "special_tokens");
      bool after_sequence = false;
      for (const auto& item : Member(j, "single")) {
        if (item.contains("Sequence")) {
          after_sequence = true;
        } else if (item.contains("SpecialToken")) {
          const std::string name = item["SpecialToken"].value("id", "");
          if (!specials.contains(name)) {
            return Status::Corruption(source + ": template token '" + name + "' is not in special_tokens");
          }
          for (const auto& id : Member(specials[name], "ids")) {
            (after_sequence ? suffix : prefix).push_back(id.get<int64_t>());
          }
        }
      }
    } else {
      return Unsupported(source, "post-processor", j);
    }
    return Status::Ok();
  }

  // The normalizer, pre-tokenizer, decoder and post-processor of tokenizer.json `j`.
  Status ParsePipelines(const Json& j) {
    const auto parse = [&](const char* key, const char* pipeline, const char* list_key,
                           const auto& parse_step) {
      int nodes = 0;
      return ParsePipeline(Member(j, key), pipeline, list_key, &nodes, parse_step);
    };
    NAMM_RETURN_IF_ERROR(parse("normalizer", "normalizer", "normalizers",
                               [this](const Json& step) { return ParseNormalizer(step); }));
    NAMM_RETURN_IF_ERROR(parse("pre_tokenizer", "pre-tokenizer", "pretokenizers",
                               [this](const Json& step) { return ParsePreTokenizer(step); }));
    NAMM_RETURN_IF_ERROR(
        parse("decoder", "decoder", "decoders", [this](const Json& step) { return ParseDecoder(step); }));
    if (const double growth = DecoderGrowth(decoder); growth > kMaxDecoderGrowth) {
      char times[32];
      std::snprintf(times, sizeof times, "%g", growth);
      return Status::Corruption(source + ": the decoder's Replace steps could make a text " + times +
                                " times longer (the limit is 4)");
    }
    return parse("post_processor", "post-processor", "processors",
                 [this](const Json& step) { return ParsePostProcessor(step); });
  }

  Status ParseModel(const Json& m) {
    if (m.value("type", "BPE") != "BPE") return Unsupported(source, "model", Json(m.value("type", "")));
    if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() > 0) {
      return Unsupported(source, "BPE dropout (random merges at encoding time)", m["dropout"]);
    }
    for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      const Json& value = Member(m, affix);
      if (!value.is_null() && value != "") return Unsupported(source, std::string("BPE ") + affix, value);
    }
    if (!m.contains("vocab") || !m["vocab"].is_object()) return Status::Corruption(source + ": model has no vocab");
    for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
      if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > kMaxTokenId) {
        return Status::Corruption(source + ": vocab id of '" + it.key() + "' is not an integer in [0, " +
                                  std::to_string(kMaxTokenId) + "]");
      }
      vocab[it.key()] = it->get<int64_t>();
    }
    byte_fallback = m.value("byte_fallback", false);
    fuse_unk = m.value("fuse_unk", false);
    ignore_merges = m.value("ignore_merges", false);
    if (m.contains("unk_token") && m["unk_token"].is_string()) unk_id = IdOf(m["unk_token"].get<std::string>());
    int32_t rank = 0;
    for (const auto& merge : Member(m, "merges")) {
      std::string left, right;
      if (merge.is_string()) {  // "left right"
        const std::string s = merge.get<std::string>();
        const auto space = s.find(' ', 1);
        if (space == std::string::npos) return Status::Corruption(source + ": malformed merge '" + s + "'");
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else if (merge.is_array() && merge.size() == 2) {
        left = merge[0].get<std::string>();
        right = merge[1].get<std::string>();
      } else {
        return Status::Corruption(source + ": malformed merge " + json_summary(merge));
      }
      const int64_t a = IdOf(left), b = IdOf(right), merged = IdOf(left + right);
      if (a < 0 || b < 0 || merged < 0) {
        return Status::Corruption(source + ": merge '" + left + " " + right + "' uses tokens missing from the vocab");
      }
      merges[PairKey(a, b)] = std::make_pair(rank++, merged);  // a repeated merge takes its last rank, as in HF
    }
    for (int b = 0; b < 256; ++b) {
      static const char* hex = "0123456789ABCDEF";
      byte_token[static_cast<std::size_t>(b)] = IdOf(std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">");
    }
    return Status::Ok();
  }

  Result<std::string> Normalize(std::string s) const {
    const std::size_t input_size = s.size(), max_size = MaxOutputSize(input_size);
    for (const auto& step : normalizer) {
      if (step.kind == NormalizerStep::Kind::kPrepend) {
        if (!s.empty()) s = step.text + s;
      } else if (step.regex) {
        std::string out;
        std::size_t cursor = 0;
        NAMM_ASSIGN_OR_RETURN(const auto matches, step.regex->FindAll(s));
        for (const auto& [begin, end] : matches) {
          out.append(s, cursor, begin - cursor).append(step.content);
          if (out.size() > max_size) return OutputTooLarge("normalizer", input_size);
          cursor = end;
        }
        s = out.append(s, cursor, std::string::npos);
      } else {
        std::string out;
        if (!AppendReplaced(s, step.text, step.content, max_size, &out)) {
          return OutputTooLarge("normalizer", input_size);
        }
        s = std::move(out);
      }
      if (s.size() > max_size) return OutputTooLarge("normalizer", input_size);
    }
    return s;
  }

  // Words of a normalized segment; at_input_start: the segment begins the whole input (Metaspace "first").
  Result<std::vector<std::string>> PreTokenize(const std::string& text, bool at_input_start) const {
    std::vector<std::string> splits = {text};
    const ByteMap& bytes = GetByteMap();
    const std::size_t max_size = MaxOutputSize(text.size());
    for (const auto& step : pre_tokenizer) {
      std::vector<std::string> next;
      std::size_t next_size = 0;  // bytes in `next`
      const auto emit = [&](std::string piece) {
        next_size += piece.size();
        next.push_back(std::move(piece));
      };
      for (std::size_t i = 0; i < splits.size(); ++i) {
        std::string s = splits[i];
        switch (step.kind) {
          case PreTokenizerStep::Kind::kByteLevel: {
            if (step.add_prefix_space && !StartsWith(s, " ")) s = " " + s;
            std::vector<std::string> pieces = {s};
            if (step.regex) {
              NAMM_ASSIGN_OR_RETURN(pieces, SplitAround(s, step.regex, "", false));
            }
            for (const std::string& piece : pieces) {
              std::string mapped;
              for (unsigned char b : piece) mapped += bytes.to_char[b];
              emit(std::move(mapped));
            }
            break;
          }
          case PreTokenizerStep::Kind::kSplit: {
            NAMM_ASSIGN_OR_RETURN(std::vector<std::string> pieces,
                                  SplitAround(s, step.regex, step.literal, step.remove_matches));
            for (auto& piece : pieces) emit(std::move(piece));
            break;
          }
          case PreTokenizerStep::Kind::kMetaspace: {
            std::string replaced;
            const std::size_t room = max_size - std::min(max_size, next_size);
            if (!AppendReplaced(s, " ", step.replacement, room, &replaced)) {
              return OutputTooLarge("pre-tokenizer", text.size());
            }
            s = std::move(replaced);
            const bool prepend = step.prepend == PreTokenizerStep::Prepend::kAlways ||
                                 (step.prepend == PreTokenizerStep::Prepend::kFirst && i == 0 && at_input_start);
            if (prepend && !StartsWith(s, step.replacement)) s = step.replacement + s;
            if (!step.split) {
              emit(std::move(s));
              break;
            }
            // Each word keeps the replacement character that precedes it.
            std::size_t begin = 0;
            for (std::size_t pos = s.find(step.replacement, 1); pos != std::string::npos;
                 pos = s.find(step.replacement, pos + step.replacement.size())) {
              emit(s.substr(begin, pos - begin));
              begin = pos;
            }
            emit(s.substr(begin));
            break;
          }
        }
        if (next_size > max_size) return OutputTooLarge("pre-tokenizer", text.size());
      }
      splits = std::move(next);
    }
    splits.erase(std::remove(splits.begin(), splits.end(), std::string()), splits.end());
    return splits;
  }

  // Byte-pair encoding of one word: merges applied lowest rank first, leftmost first among equal ranks.
  void Bpe(const std::string& word, std::vector<int64_t>* out) const {
    if (ignore_merges) {
      const int64_t whole = IdOf(word);
      if (whole >= 0) {
        out->push_back(whole);
        return;
      }
    }
    std::vector<int64_t> ids;
    for (const std::string& c : utf8::Characters(word)) {
      const int64_t id = IdOf(c);
      if (id >= 0) {
        ids.push_back(id);
      } else if (byte_fallback && std::all_of(c.begin(), c.end(), [&](char b) {
                   return byte_token[static_cast<unsigned char>(b)] >= 0;
                 })) {
        for (unsigned char b : c) ids.push_back(byte_token[b]);
      } else if (unk_id >= 0) {
        if (!(fuse_unk && !ids.empty() && ids.back() == unk_id)) ids.push_back(unk_id);
      }
    }
    MergePairs(ids, [this](int64_t left, int64_t right) -> std::optional<std::pair<double, int64_t>> {
      auto it = merges.find(PairKey(left, right));
      if (it == merges.end()) return std::nullopt;
      return std::make_pair(static_cast<double>(it->second.first), it->second.second);
    });
    out->insert(out->end(), ids.begin(), ids.end());
  }

  // ByteLevel's decoding of one token: its characters mapped back to bytes, or the token as it is if one of them
  // is not in the byte map (an added token).
  static std::string ByteLevelBytes(const std::string& token) {
    const ByteMap& bytes = GetByteMap();
    std::string decoded;
    for (const std::string& c : utf8::Characters(token)) {
      auto it = bytes.to_byte.find(c);
      if (it == bytes.to_byte.end()) return token;
      decoded += static_cast<char>(it->second);
    }
    return decoded;
  }

  std::vector<std::string> Decode(std::vector<std::string> tokens) const {
    for (const auto& step : decoder) {
      std::vector<std::string> next;
      switch (step.kind) {
        case DecoderStep::Kind::kByteLevel: {
          std::string raw;
          for (const auto& token : tokens) raw += ByteLevelBytes(token);
          next.push_back(sanitize_utf8(raw));
          break;
        }
        case DecoderStep::Kind::kReplace:
          for (auto& token : tokens) next.push_back(ReplaceAll(token, step.pattern, step.content));
          break;
        case DecoderStep::Kind::kByteFallback: {
          std::string pending;
          auto flush = [&] {
            if (pending.empty()) return;
            if (sanitize_utf8(pending) == pending) {
              next.push_back(pending);
            } else {
              for (std::size_t i = 0; i < pending.size(); ++i) next.push_back("\xEF\xBF\xBD");
            }
            pending.clear();
          };
          for (auto& token : tokens) {
            const int b = utf8::ByteTokenValue(token);
            if (b >= 0) {
              pending += static_cast<char>(b);
            } else {
              flush();
              next.push_back(token);
            }
          }
          flush();
          break;
        }
        case DecoderStep::Kind::kFuse: {
          std::string joined;
          for (auto& token : tokens) joined += token;
          next.push_back(std::move(joined));
          break;
        }
        case DecoderStep::Kind::kStrip:
          for (auto token : tokens) {
            for (int k = 0; k < step.start && StartsWith(token, step.content); ++k) token.erase(0, step.content.size());
            for (int k = 0; k < step.stop && token.size() >= step.content.size() &&
                            token.compare(token.size() - step.content.size(), step.content.size(), step.content) == 0;
                 ++k) {
              token.resize(token.size() - step.content.size());
            }
            next.push_back(token);
          }
          break;
        case DecoderStep::Kind::kMetaspace:
          // As tokenizers does: the replacement becomes a space, except in the first token, where it is dropped.
          for (std::size_t i = 0; i < tokens.size(); ++i) {
            next.push_back(ReplaceAll(tokens[i], step.content, i == 0 && step.prepend ? "" : " "));
          }
          break;
      }
      tokens = std::move(next);
    }
    return tokens;
  }

  // `body` between the template's tokens (prefix: BOS, ...; suffix).
  std::vector<int64_t> WithTemplate(std::vector<int64_t> body) const {
    std::vector<int64_t> ids = prefix;
    ids.insert(ids.end(), body.begin(), body.end());
    ids.insert(ids.end(), suffix.begin(), suffix.end());
    return ids;
  }

  // Splits `text` at the added tokens whose `normalized` flag equals `normalized_tokens` (leftmost, longest
  // first): on_text(begin, end) for the text between them, on_token(id) for each token. A special token matches
  // only where special_here(token, begin, end) says it may.
  template <typename OnText, typename OnToken, typename SpecialHere>
  void SplitAtAddedTokens(const std::string& text, bool normalized_tokens, const OnText& on_text,
                          const OnToken& on_token, const SpecialHere& special_here) const {
    std::size_t segment_start = 0;
    for (std::size_t pos = 0; pos < text.size(); ++pos) {
      if (!added_first_byte[static_cast<unsigned char>(text[pos])]) continue;
      const AddedToken* match = nullptr;
      for (const auto& token : added) {
        if (token.normalized != normalized_tokens || text.compare(pos, token.match.size(), token.match) != 0) continue;
        if (token.special && !special_here(token, pos, pos + token.match.size())) continue;
        const std::size_t end = pos + token.match.size();
        if (token.single_word && ((pos > 0 && IsWordByte(text[pos - 1])) || (end < text.size() && IsWordByte(text[end])))) {
          continue;
        }
        match = &token;
        break;
      }
      if (match == nullptr) continue;
      std::size_t begin = pos, end = pos + match->match.size();
      if (match->lstrip) {
        while (begin > segment_start && IsSpaceByte(text[begin - 1])) --begin;
      }
      if (match->rstrip) {
        while (end < text.size() && IsSpaceByte(text[end])) ++end;
      }
      on_text(segment_start, begin);
      on_token(match->id);
      segment_start = end;
      pos = end - 1;
    }
    on_text(segment_start, text.size());
  }
};

HfTokenizer::HfTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HfTokenizer::~HfTokenizer() = default;

Result<std::unique_ptr<HfTokenizer>> HfTokenizer::Load(const std::string& path) {
  const bool is_dir = is_directory(path);
  const std::string dir = is_dir ? path : parent_directory(path);
  const std::string file = is_dir ? path + "/tokenizer.json" : path;
  NAMM_ASSIGN_OR_RETURN(std::string tokenizer_json, read_file(file));
  auto config = read_file(dir + "/tokenizer_config.json");
  return FromJson(tokenizer_json, config.ok() ? *config : "", file);
}

Result<std::unique_ptr<HfTokenizer>> HfTokenizer::FromJson(const std::string& tokenizer_json,
                                                           const std::string& config_json, const std::string& source) {
  // Fields of the wrong JSON type make nlohmann throw; they are malformed files, reported as such.
  try {
    return Parse(tokenizer_json, config_json, source);
  } catch (const Json::exception& e) {
    return Status::Corruption(source + ": malformed tokenizer files: " + e.what());
  }
}

Result<std::unique_ptr<HfTokenizer>> HfTokenizer::Parse(const std::string& tokenizer_json,
                                                        const std::string& config_json, const std::string& source) {
  NAMM_ASSIGN_OR_RETURN(const Json j, parse_json_bounded(tokenizer_json, source));
  if (!j.is_object() || !j.contains("model")) return Status::Corruption(source + ": not a tokenizer.json (no 'model')");
  auto impl = std::make_unique<Impl>();
  impl->source = source;
  NAMM_RETURN_IF_ERROR(impl->ParseModel(j["model"]));
  NAMM_RETURN_IF_ERROR(impl->ParsePipelines(j));
  for (const auto& token : Member(j, "added_tokens")) {
    AddedToken added{token.value("content", ""),         token.value("id", int64_t{-1}),
                     token.value("special", false),       token.value("normalized", !token.value("special", false)),
                     token.value("lstrip", false),        token.value("rstrip", false),
                     token.value("single_word", false),   ""};
    if (added.content.empty() || added.id < 0 || added.id > kMaxTokenId) {
      return Status::Corruption(source + ": malformed added token " + json_summary(token));
    }
    if (added.normalized) {
      NAMM_ASSIGN_OR_RETURN(added.match, impl->Normalize(added.content));
    } else {
      added.match = added.content;
    }
    impl->vocab[added.content] = added.id;
    if (added.special) impl->special_ids.insert(added.id);
    impl->added_first_byte[static_cast<unsigned char>(added.match[0])] = true;
    impl->added.push_back(std::move(added));
  }
  std::stable_sort(impl->added.begin(), impl->added.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.match.size() > b.match.size(); });
  NAMM_RETURN_IF_ERROR(impl->CheckIdsAreDense());
  int64_t max_id = -1;
  for (const auto& [token, id] : impl->vocab) max_id = std::max(max_id, id);
  impl->id_to_token.assign(static_cast<std::size_t>(max_id + 1), "");
  for (const auto& [token, id] : impl->vocab) impl->id_to_token[static_cast<std::size_t>(id)] = token;
  if (impl->decoder.size() == 1 && impl->decoder[0].kind == DecoderStep::Kind::kByteLevel) {
    impl->id_to_bytes.reserve(impl->id_to_token.size());
    for (const std::string& token : impl->id_to_token) impl->id_to_bytes.push_back(Impl::ByteLevelBytes(token));
  }

  if (!config_json.empty()) {
    NAMM_ASSIGN_OR_RETURN(const Json c, parse_json_bounded(config_json, source + ": tokenizer_config.json"));
    if (!c.is_object()) return Status::Corruption(source + ": tokenizer_config.json is not a JSON object");
    const int64_t bos = c.contains("bos_token") ? impl->IdOf(TokenContent(c["bos_token"])) : -1;
    const int64_t eos = c.contains("eos_token") ? impl->IdOf(TokenContent(c["eos_token"])) : -1;
    if (eos >= 0) impl->eos.push_back(eos);
    impl->clean_up_spaces = c.value("clean_up_tokenization_spaces", false);
    // LlamaTokenizerFast rebuilds its template from these two flags.
    if (c.value("tokenizer_class", "").find("Llama") != std::string::npos &&
        (c.contains("add_bos_token") || c.contains("add_eos_token"))) {
      impl->prefix.clear();
      impl->suffix.clear();
      if (c.value("add_bos_token", true) && bos >= 0) impl->prefix.push_back(bos);
      if (c.value("add_eos_token", false) && eos >= 0) impl->suffix.push_back(eos);
    }
  }
  return std::unique_ptr<HfTokenizer>(new HfTokenizer(std::move(impl)));
}

Result<std::vector<int64_t>> HfTokenizer::Encode(const std::string& raw) const {
  return EncodeText(sanitize_utf8(raw), nullptr);
}

Result<std::vector<int64_t>> HfTokenizer::EncodeText(const std::string& text, const Spans* control) const {
  std::vector<int64_t> ids;
  Status failed;  // the first segment that could not be tokenized; the rest is skipped
  auto push_token = [&](int64_t id) { ids.push_back(id); };
  const auto in_control = [&](std::size_t begin, std::size_t end) {
    return control == nullptr || std::any_of(control->begin(), control->end(), [&](const auto& span) {
             return span.first <= begin && end <= span.second;
           });
  };
  const auto raw_here = [&](const AddedToken&, std::size_t begin, std::size_t end) { return in_control(begin, end); };
  // As tokenizers does: split at raw (non-normalized) added tokens, normalize each piece, split that at the
  // normalized added tokens, then pre-tokenize and run BPE. A normalized special token (GPT-2's <|endoftext|>)
  // is matched in the normalized piece: where normalizing changed nothing (no normalizer) its offsets are the
  // text's; elsewhere its k-th match is taken for the k-th occurrence of its content in the raw piece
  // (normalizers rewrite characters and spaces, not such tokens), and when they do not pair up, it counts if its
  // whole piece may.
  impl_->SplitAtAddedTokens(text, /*normalized_tokens=*/false, [&](std::size_t begin, std::size_t end) {
    if (end <= begin || !failed.ok()) return;
    Result<std::string> normalized = impl_->Normalize(text.substr(begin, end - begin));
    if (!normalized.ok()) {
      failed = normalized.status();
      return;
    }
    const bool unchanged = normalized->size() == end - begin && text.compare(begin, end - begin, *normalized) == 0;
    const bool piece_in_control = in_control(begin, end);
    std::map<const AddedToken*, std::pair<std::vector<std::size_t>, std::vector<std::size_t>>> occurrences;
    const auto normalized_here = [&](const AddedToken& token, std::size_t b, std::size_t e) {
      if (unchanged || control == nullptr) return in_control(begin + b, begin + e);
      auto& [in_normalized, in_raw] = occurrences[&token];
      if (in_normalized.empty()) {
        for (std::size_t p = normalized->find(token.match); p != std::string::npos; p = normalized->find(token.match, p + 1)) {
          in_normalized.push_back(p);
        }
        for (std::size_t p = text.find(token.content, begin); p != std::string::npos && p + token.content.size() <= end;
             p = text.find(token.content, p + 1)) {
          in_raw.push_back(p);
        }
      }
      const auto k = static_cast<std::size_t>(std::find(in_normalized.begin(), in_normalized.end(), b) - in_normalized.begin());
      if (in_normalized.size() != in_raw.size() || k >= in_raw.size()) return piece_in_control;
      return in_control(in_raw[k], in_raw[k] + token.content.size());
    };
    impl_->SplitAtAddedTokens(*normalized, /*normalized_tokens=*/true, [&](std::size_t b, std::size_t e) {
      if (e <= b || !failed.ok()) return;
      Result<std::vector<std::string>> words = impl_->PreTokenize(normalized->substr(b, e - b), begin == 0 && b == 0);
      if (!words.ok()) {
        failed = words.status();
        return;
      }
      for (const std::string& word : *words) impl_->Bpe(word, &ids);
    }, push_token, normalized_here);
  }, push_token, raw_here);
  if (!failed.ok()) return failed.WithContext("tokenizing a text of " + std::to_string(text.size()) + " bytes");
  return ids;
}

Result<std::vector<int64_t>> HfTokenizer::EncodeForModel(const std::string& text) const {
  NAMM_ASSIGN_OR_RETURN(std::vector<int64_t> body, Encode(text));
  return impl_->WithTemplate(std::move(body));
}

Result<std::vector<int64_t>> HfTokenizer::EncodeControlled(const std::string& text, const Spans& control,
                                                           bool for_model) const {
  if (sanitize_utf8(text) != text) return Status::InvalidArgument("a text encoded with control spans is not valid UTF-8");
  NAMM_ASSIGN_OR_RETURN(std::vector<int64_t> body, EncodeText(text, &control));
  return for_model ? impl_->WithTemplate(std::move(body)) : body;
}

std::string HfTokenizer::Decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  const auto kept = [&](int64_t id) {
    return id >= 0 && id < static_cast<int64_t>(impl_->id_to_token.size()) &&
           !(skip_special_tokens && impl_->special_ids.count(id));
  };
  std::string text;
  if (!impl_->id_to_bytes.empty()) {  // a ByteLevel step alone: its pieces, worked out at load, joined
    for (int64_t id : ids) {
      if (kept(id)) text += impl_->id_to_bytes[static_cast<std::size_t>(id)];
    }
  } else {
    std::vector<std::string> tokens;
    for (int64_t id : ids) {
      if (kept(id)) tokens.push_back(impl_->id_to_token[static_cast<std::size_t>(id)]);
    }
    if (impl_->decoder.empty()) {  // tokenizers joins undecoded tokens with spaces
      for (std::size_t i = 0; i < tokens.size(); ++i) text += (i ? " " : "") + tokens[i];
    } else {
      for (const auto& piece : impl_->Decode(std::move(tokens))) text += piece;
    }
  }
  text = sanitize_utf8(text);
  return impl_->clean_up_spaces ? CleanUpTokenizationSpaces(std::move(text)) : text;
}

int64_t HfTokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_to_token.size()); }

std::vector<int64_t> HfTokenizer::eos_ids() const { return impl_->eos; }

}  // namespace namm::worker
