#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include <nlohmann/json.hpp>

#include "namm/file_util.h"
#include "namm/worker/hf_tokenizer.h"
#include "namm/worker/llama2c_tokenizer.h"
#include "namm/worker/tokenizer.h"
#include "shared_data.h"

namespace namm::worker {
namespace {

using testing::SharedPath;
using Ids = std::vector<int64_t>;

std::unique_ptr<Tokenizer> Load(const std::string& relative) {
  auto tokenizer = load_tokenizer(SharedPath(relative));
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  return tokenizer.ok() ? std::move(tokenizer).value() : nullptr;
}

TEST(Llama2cTokenizer, EncodesTheKnownStoriesPrompt) {
  NAMM_REQUIRE_SHARED(testing::kStoriesTokenizer);
  auto tokenizer = Load(testing::kStoriesTokenizer);
  EXPECT_EQ(tokenizer->EncodeForModel("Once upon a time").value(), (Ids{1, 403, 407, 261, 378}));
  EXPECT_EQ(tokenizer->Decode({1, 403, 407, 261, 378}), "Once upon a time");
  EXPECT_EQ(tokenizer->vocab_size(), 512);
  EXPECT_EQ(tokenizer->eos_ids(), (Ids{2}));
  EXPECT_TRUE(tokenizer->Encode("").value().empty());
}

TEST(Llama2cTokenizer, FallsBackToBytesForUnknownCharacters) {
  NAMM_REQUIRE_SHARED(testing::kStoriesTokenizer);
  auto tokenizer = Load(testing::kStoriesTokenizer);
  // "中" (E4 B8 AD) has no token in this 512-piece vocabulary: three byte tokens 3 + byte.
  const Ids ids = tokenizer->Encode("\xE4\xB8\xAD").value();
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(Ids(ids.end() - 3, ids.end()), (Ids{3 + 0xE4, 3 + 0xB8, 3 + 0xAD}));
  EXPECT_EQ(tokenizer->Decode(ids), "\xE4\xB8\xAD");
}

TEST(Gpt2Tokenizer, KnownEncodings) {
  NAMM_REQUIRE_SHARED(testing::kGpt2Tokenizer);
  auto tokenizer = Load(testing::kGpt2Tokenizer);
  EXPECT_EQ(tokenizer->Encode("Hello world").value(), (Ids{15496, 995}));
  EXPECT_EQ(tokenizer->Encode(" Hello").value(), (Ids{18435}));
  EXPECT_EQ(tokenizer->Encode("Hello, world!").value(), (Ids{15496, 11, 995, 0}));
  // The special token is recognized inside text, kept on request and skipped by default when decoding.
  const Ids with_special = tokenizer->Encode("Hello<|endoftext|> world").value();
  EXPECT_EQ(with_special, (Ids{15496, 50256, 995}));
  EXPECT_EQ(tokenizer->Decode(with_special), "Hello world");
  EXPECT_EQ(tokenizer->Decode(with_special, /*skip_special_tokens=*/false), "Hello<|endoftext|> world");
  EXPECT_EQ(tokenizer->EncodeForModel("Hello world").value(), (Ids{15496, 995}));  // GPT-2's template adds nothing
  EXPECT_EQ(tokenizer->eos_ids(), (Ids{50256}));
}

// Random text from a mix of scripts, emoji, digits, punctuation and whitespace runs.
std::string RandomUnicodeText(std::mt19937_64& gen) {
  static const std::vector<std::string> atoms = {
      "a", "Z", "the", " ", "  ", "\n", "\t", "\r\n", "7", "42", "3.14", ",", "!", "'s", "'ll", "\xC3\xA9",
      "\xC3\x9F", "\xD0\x96", "\xCE\xA9", "\xE4\xB8\xAD", "\xE6\x96\x87", "\xE3\x81\x82", "\xED\x95\x9C",
      "\xD8\xB9", "\xF0\x9F\x98\x80", "\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD", "\xE2\x82\xAC", "\xE2\x80\x94", "<|", "|>",
      "\xC2\xA0", "\xE2\x80\x8B"};
  std::uniform_int_distribution<std::size_t> pick(0, atoms.size() - 1), length(0, 40);
  std::string text;
  for (std::size_t i = 0, n = length(gen); i < n; ++i) text += atoms[pick(gen)];
  return text;
}

TEST(Gpt2Tokenizer, DecodeInvertsEncodeOnUnicodeText) {
  NAMM_REQUIRE_SHARED(testing::kGpt2Tokenizer);
  // tokenizer.json alone: the tokenizers library's decode, without transformers' clean-up of spaces.
  auto json = read_file(SharedPath(testing::kGpt2Tokenizer));
  ASSERT_TRUE(json.ok());
  auto loaded = HfTokenizer::FromJson(*json, "", "gpt2");
  ASSERT_TRUE(loaded.ok());
  const auto& tokenizer = *loaded;
  std::mt19937_64 gen(2024);
  for (int trial = 0; trial < 300; ++trial) {
    const std::string text = RandomUnicodeText(gen);
    const Ids ids = tokenizer->Encode(text).value();
    EXPECT_EQ(tokenizer->Decode(ids), text) << "trial " << trial;
    for (int64_t id : ids) ASSERT_TRUE(id >= 0 && id < tokenizer->vocab_size());
  }
}

TEST(Gpt2Tokenizer, TransformersCleansUpSpacesWhenTheConfigSaysSo) {
  NAMM_REQUIRE_SHARED(testing::kGpt2Tokenizer);
  auto tokenizer = Load(testing::kGpt2Tokenizer);  // tokenizer_config.json: clean_up_tokenization_spaces true
  EXPECT_EQ(tokenizer->Decode(tokenizer->Encode("Hello , world ! It 's done .").value()), "Hello, world! It's done.");
}

// A decoder of one ByteLevel step decodes from each token's bytes worked out at load; the same decoder followed by
// a Replace step that never matches takes the general path. Both give the same text for random ids (single byte
// tokens that make invalid UTF-8, the special token, out-of-range ids), with and without special tokens, and with
// transformers' clean-up of spaces.
TEST(Gpt2Tokenizer, TheByteLevelFastPathDecodesAsTheGeneralPipeline) {
  NAMM_REQUIRE_SHARED(testing::kGpt2Tokenizer);
  auto json = read_file(SharedPath(testing::kGpt2Tokenizer));
  ASSERT_TRUE(json.ok());
  nlohmann::json file = nlohmann::json::parse(*json);
  ASSERT_EQ(file["decoder"]["type"], "ByteLevel");
  file["decoder"] = nlohmann::json::parse(R"({"type": "Sequence", "decoders": [{"type": "ByteLevel"},
      {"type": "Replace", "pattern": {"String": "\u0001\u0002\u0003"}, "content": "x"}]})");
  const std::string general = file.dump();
  for (const std::string config : {"", R"({"clean_up_tokenization_spaces": true})"}) {
    auto fast = HfTokenizer::FromJson(*json, config, "gpt2");
    auto slow = HfTokenizer::FromJson(general, config, "gpt2-general");
    ASSERT_TRUE(fast.ok() && slow.ok());
    std::mt19937_64 gen(7);
    std::uniform_int_distribution<int64_t> any(-2, 50258), byte_token(0, 255);
    for (int trial = 0; trial < 500; ++trial) {
      Ids ids;
      for (int i = 0; i < 60; ++i) ids.push_back(trial % 3 == 0 ? byte_token(gen) : any(gen));  // 0-255: single bytes
      if (trial % 5 == 0) ids.push_back(50256);
      for (const bool skip : {true, false}) {
        const std::string text = (*fast)->Decode(ids, skip);
        EXPECT_EQ(text, (*slow)->Decode(ids, skip)) << "trial " << trial << " skip " << skip;
        if (trial % 3 == 0) {
          EXPECT_NE(text.find("\xEF\xBF\xBD"), std::string::npos) << "trial " << trial;  // invalid bytes met
        }
      }
    }
    EXPECT_EQ((*fast)->Decode((*fast)->Encode("Hello , world !").value()),
              config.empty() ? "Hello , world !" : "Hello, world!");
  }
}

TEST(Utf8, InvalidBytesBecomeOneReplacementPerMaximalSubpart) {
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(sanitize_utf8("a\xFF" "b"), "a" + fffd + "b");
  EXPECT_EQ(sanitize_utf8("\xE2\x82"), fffd);                // truncated 3-byte sequence: one
  EXPECT_EQ(sanitize_utf8("\xE2\x82" "A"), fffd + "A");
  EXPECT_EQ(sanitize_utf8("\xED\xA0\x80"), fffd + fffd + fffd);  // a surrogate: ED then two stray bytes
  EXPECT_EQ(sanitize_utf8("\xF0\x9F\x98\x80"), "\xF0\x9F\x98\x80");
  EXPECT_EQ(sanitize_utf8("\xC0\xAF"), fffd + fffd);            // overlong
}

// A tiny SentencePiece-style tokenizer.json (the Llama 2 layout): "▁" replaces spaces and is prepended,
// merges build "▁a", "▁ab", "ab"; unknown characters fall back to byte tokens; BOS from the template.
constexpr const char* kSentencePieceJson = R"({
  "added_tokens": [{"id": 0, "content": "<unk>", "special": true}, {"id": 1, "content": "<s>", "special": true},
                   {"id": 2, "content": "</s>", "special": true}],
  "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                 {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
  "pre_tokenizer": null,
  "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {"<s>": {"id": "<s>", "ids": [1]}}},
  "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
              {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
  "model": {"type": "BPE", "byte_fallback": true, "fuse_unk": true, "unk_token": "<unk>",
            "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "<0xE2>": 3, "<0x82>": 4, "<0xAC>": 5,
                      "▁": 6, "a": 7, "b": 8, "▁a": 9, "ab": 10, "▁ab": 11},
            "merges": ["▁ a", "a b", "▁a b"]}
})";

TEST(HfTokenizer, SentencePieceStyleBpeWithByteFallback) {
  auto tokenizer = HfTokenizer::FromJson(kSentencePieceJson, "", "inline");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  // "ab ab": normalized "▁ab▁ab"; merges (by rank) "▁ a" -> "▁a", then "▁a b" -> "▁ab".
  EXPECT_EQ((*tokenizer)->Encode("ab ab").value(), (Ids{11, 11}));
  // "ba": "▁" "b" "a": no merge applies to "▁ b" or "b a".
  EXPECT_EQ((*tokenizer)->Encode("ba").value(), (Ids{6, 8, 7}));
  // "€" has no token: its three bytes.
  EXPECT_EQ((*tokenizer)->Encode("a€").value(), (Ids{9, 3, 4, 5}));
  EXPECT_EQ((*tokenizer)->EncodeForModel("ab").value(), (Ids{1, 11}));
  EXPECT_EQ((*tokenizer)->Decode({1, 11, 11, 3, 4, 5}), "ab ab€");
  // A lone continuation byte decodes to U+FFFD.
  EXPECT_EQ((*tokenizer)->Decode({9, 4}), "a\xEF\xBF\xBD");
}

TEST(HfTokenizer, LlamaThreeRegexSplitsBeforeByteLevelMerges) {
  // Byte-level BPE over Llama 3's Split regex: a merge "1 2" exists, but digits are split in groups of at
  // most three, and letters never merge with a preceding space-less punctuation run.
  std::string vocab = "{";
  for (int b = 0; b < 256; ++b) {
    // Byte-level characters of bytes '!'..'~' are the bytes themselves; include those plus "Ġ" (space).
    if (b >= '!' && b <= '~' && b != '"' && b != '\\') vocab += "\"" + std::string(1, static_cast<char>(b)) + "\": " + std::to_string(b) + ", ";
  }
  vocab += R"("Ġ": 300, "12": 301, "123": 302, "Ġa": 303, "Ġab": 304, "ab": 305})";
  const std::string json = std::string(R"({"model": {"type": "BPE", "ignore_merges": true, "vocab": )") + vocab +
      R"(, "merges": ["1 2", "12 3", "Ġ a", "Ġa b", "a b"]},
      "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
         "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
      "decoder": {"type": "ByteLevel"}})";
  auto tokenizer = HfTokenizer::FromJson(json, "", "inline");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  // "123123" -> "123" "123"; " ab" -> "Ġab" (whole word in vocab: ignore_merges); "1212" -> "121" "2" -> "12" "1", "2".
  EXPECT_EQ((*tokenizer)->Encode("123123 ab").value(), (Ids{302, 302, 304}));
  EXPECT_EQ((*tokenizer)->Encode("1212").value(), (Ids{301, '1', '2'}));
  EXPECT_EQ((*tokenizer)->Decode({302, 304}), "123 ab");
}

// A text its pre-tokenizer's regex cannot match within PCRE2's limits is an error: tokenizing it whole or not at
// all (earlier, the limit counted as "no more matches" and the rest of the text was silently left out).
TEST(HfTokenizer, ARegexLimitIsAnErrorNotATruncatedText) {
  const std::string json = R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, " ": 2}, "merges": []},
      "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": false}})";
  auto tokenizer = HfTokenizer::FromJson(json, "", "inline");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  EXPECT_EQ((*tokenizer)->Encode("ab aa").value(), (Ids{0, 1, 2, 0, 0}));
  const auto ids = (*tokenizer)->Encode("b " + std::string(40, 'a') + "b");
  ASSERT_FALSE(ids.ok());
  EXPECT_NE(ids.status().message().find("tokenizing a text of 43 bytes: a regex match"), std::string::npos)
      << ids.status().ToString();
  EXPECT_NE(ids.status().message().find("match limit exceeded"), std::string::npos);
}

TEST(HfTokenizer, AddedTokenAttributesAndMetaspace) {
  // Metaspace pre-tokenizer and decoder (newer Llama 2 layout), an lstrip special token, a single_word token.
  const std::string json = R"({
    "added_tokens": [{"id": 0, "content": "<eot>", "special": true, "lstrip": true, "normalized": false},
                     {"id": 1, "content": "ab", "special": false, "single_word": true, "normalized": false}],
    "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true},
    "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"},
    "model": {"type": "BPE", "vocab": {"▁": 2, "a": 3, "b": 4, "c": 5, "▁c": 6}, "merges": ["▁ c"]}})";
  auto tokenizer = HfTokenizer::FromJson(json, "", "inline");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  // "c <eot>": lstrip swallows the space before <eot>; "c" is the first word, so it gets the prefix "▁c".
  EXPECT_EQ((*tokenizer)->Encode("c <eot>").value(), (Ids{6, 0}));
  // "ab" alone is a word: the added token; inside "cab" it is not.
  EXPECT_EQ((*tokenizer)->Encode("ab").value(), (Ids{1}));
  EXPECT_EQ((*tokenizer)->Encode("cab").value(), (Ids{6, 3, 4}));
  // The first token's "▁" is dropped, later ones become spaces.
  EXPECT_EQ((*tokenizer)->Decode({6, 6, 3}), "c ca");
}

TEST(HfTokenizer, WithoutADecoderTokensAreJoinedWithSpaces) {
  auto tokenizer = HfTokenizer::FromJson(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []}})", "",
                                         "inline");
  ASSERT_TRUE(tokenizer.ok());
  EXPECT_EQ((*tokenizer)->Decode({0, 1}), "a b");
}

TEST(HfTokenizer, MalformedFilesAreErrorsNotExceptions) {
  for (const char* json : {R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [["a", 1]]}})",
                           R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "added_tokens": [{"id": "x"}]})",
                           R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "pre_tokenizer": {"type": 7}})",
                           R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], "dropout": 0.1}})"}) {
    auto tokenizer = HfTokenizer::FromJson(json, "", "bad.json");
    EXPECT_FALSE(tokenizer.ok()) << json;
    if (!tokenizer.ok()) {
      EXPECT_NE(tokenizer.status().message().find("bad.json"), std::string::npos);
    }
  }
}

TEST(HfTokenizer, RefusesWhatItDoesNotImplement) {
  auto wordpiece = HfTokenizer::FromJson(R"({"model": {"type": "WordPiece", "vocab": {}}})", "", "x.json");
  ASSERT_FALSE(wordpiece.ok());
  EXPECT_NE(wordpiece.status().message().find("model"), std::string::npos);
  auto nfkc = HfTokenizer::FromJson(R"({"model": {"type": "BPE", "vocab": {}, "merges": []},
                                        "normalizer": {"type": "NFKC"}})", "", "x.json");
  ASSERT_FALSE(nfkc.ok());
  EXPECT_NE(nfkc.status().message().find("NFKC"), std::string::npos);
  EXPECT_FALSE(load_tokenizer("/nonexistent/tokenizer.json").ok());
}

// A minimal byte-level tokenizer.json with `fields` (",\n"-joined JSON members) added to its model.
std::string TinyTokenizerJson(const std::string& fields) {
  return R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, " ": 2}, "merges": []})" +
         (fields.empty() ? "" : ", " + fields) + "}";
}

// A Metaspace step with an empty replacement split at "" forever (s.find("", pos) is pos); it is refused.
TEST(HfTokenizer, RefusesAnEmptyMetaspaceReplacement) {
  for (const char* field : {R"("pre_tokenizer": {"type": "Metaspace", "replacement": ""})",
                            R"("decoder": {"type": "Metaspace", "replacement": ""})"}) {
    auto tokenizer = HfTokenizer::FromJson(TinyTokenizerJson(field), "", "x.json");
    ASSERT_FALSE(tokenizer.ok()) << field;
    EXPECT_NE(tokenizer.status().message().find("Metaspace 'replacement' must not be empty"),
              std::string::npos)
        << tokenizer.status().ToString();
  }
}

// Chained steps that double the text (Replace "a" -> "aa" sixteen times) would make 65536 bytes of each byte:
// the normalizer and the pre-tokenizer stop at 4x their input + 1 KiB, with an error.
TEST(HfTokenizer, StepsThatMultiplyTheTextAreAnErrorNotAnExplosion) {
  std::string doubling, byte_level;
  for (int k = 0; k < 15; ++k) {
    doubling +=
        std::string(k ? ", " : "") + R"({"type": "Replace", "pattern": {"String": "a"}, "content": "aa"})";
    byte_level += std::string(k ? ", " : "") + R"({"type": "ByteLevel", "use_regex": false})";
  }
  const std::string normalizer = R"("normalizer": {"type": "Sequence", "normalizers": [)" + doubling + "]}";
  const std::string pre_tokenizer =
      R"("pre_tokenizer": {"type": "Sequence", "pretokenizers": [)" + byte_level + "]}";
  const std::string metaspace =
      R"("pre_tokenizer": {"type": "Metaspace", "replacement": ")" + std::string(300, 'b') + "\"}";
  for (const std::string& field : {normalizer, pre_tokenizer, metaspace}) {
    auto tokenizer = HfTokenizer::FromJson(TinyTokenizerJson(field), "", "x.json");
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
    const auto ids = (*tokenizer)->Encode(std::string(10000, 'a') + std::string(1000, ' '));
    ASSERT_FALSE(ids.ok()) << field;
    EXPECT_NE(
        ids.status().message().find("would make more than 45024 bytes (4x + 1 KiB) of a 11000-byte text"),
        std::string::npos)
        << ids.status().ToString();
  }
}

// A decoder's Replace steps are bounded when loading (Decode cannot fail): a text at most 4x longer.
TEST(HfTokenizer, RefusesDecoderReplacementsThatMultiplyTheText) {
  const std::string replace = R"({"type": "Replace", "pattern": {"String": "a"}, "content": "aaa"})";
  auto ok = HfTokenizer::FromJson(TinyTokenizerJson(R"("decoder": )" + replace), "", "x.json");
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
  auto tokenizer = HfTokenizer::FromJson(
      TinyTokenizerJson(R"("decoder": {"type": "Sequence", "decoders": [)" + replace + ", " + replace + "]}"),
      "", "x.json");
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_NE(
      tokenizer.status().message().find("Replace steps could make a text 9 times longer (the limit is 4)"),
      std::string::npos)
      << tokenizer.status().ToString();
}

// Every Sequence counts, nested ones included: at most 16 nodes per pipeline (real files have up to 5), which
// also bounds the parser's recursion.
TEST(HfTokenizer, RefusesPipelinesOfMoreThanSixteenSteps) {
  std::string nested = "null";
  for (int k = 0; k < 17; ++k) nested = R"({"type": "Sequence", "decoders": [)" + nested + "]}";
  auto tokenizer = HfTokenizer::FromJson(TinyTokenizerJson(R"("decoder": )" + nested), "", "x.json");
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_NE(tokenizer.status().message().find("the decoder has more than 16 steps"), std::string::npos)
      << tokenizer.status().ToString();
}

// A Strip decoder with empty content stripped it start (2^31 - 1) times from every token; a float start was
// converted to int with undefined behaviour. Both are refused, as is anything beyond 64.
TEST(HfTokenizer, RefusesStripDecodersThatCouldLoopOrOverflow) {
  for (const char* strip : {R"({"type": "Strip", "content": "", "start": 1, "stop": 0})",
                            R"({"type": "Strip", "content": " ", "start": 1e300, "stop": 0})",
                            R"({"type": "Strip", "content": " ", "start": 0, "stop": 65})",
                            R"({"type": "Strip", "content": " ", "start": -1, "stop": 0})"}) {
    auto tokenizer =
        HfTokenizer::FromJson(TinyTokenizerJson(std::string(R"("decoder": )") + strip), "", "x.json");
    ASSERT_FALSE(tokenizer.ok()) << strip;
    EXPECT_NE(tokenizer.status().message().find("Strip"), std::string::npos) << tokenizer.status().ToString();
  }
  auto tokenizer = HfTokenizer::FromJson(
      TinyTokenizerJson(R"("decoder": {"type": "Strip", "content": "a", "start": 64, "stop": 1})"), "",
      "x.json");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  EXPECT_EQ((*tokenizer)->Decode({0, 0, 1, 0}), "b");  // each token loses its leading a's and one trailing a
}

// Token ids index a table allocated up front: one id of 16777215 allocated 16 million strings. Ids must stay
// below twice the tokens defined + 1024.
TEST(HfTokenizer, RefusesTokenIdsFarBeyondTheVocabulary) {
  auto tokenizer = HfTokenizer::FromJson(
      R"({"model": {"type": "BPE", "vocab": {"a": 16777215}, "merges": []}})", "", "x.json");
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_NE(tokenizer.status().message().find("token id 16777215 (of \"a\") is beyond the limit of 1026"),
            std::string::npos)
      << tokenizer.status().ToString();
  auto added = HfTokenizer::FromJson(
      TinyTokenizerJson(R"("added_tokens": [{"id": 5000, "content": "<s>", "special": true}])"), "",
      "x.json");
  ASSERT_FALSE(added.ok());
  EXPECT_NE(added.status().message().find("token id 5000"), std::string::npos) << added.status().ToString();
  auto near = HfTokenizer::FromJson(
      TinyTokenizerJson(R"("added_tokens": [{"id": 1000, "content": "<s>", "special": true}])"), "",
      "x.json");
  EXPECT_TRUE(near.ok()) << near.status().ToString();
}

// tokenizer.json nesting is bounded before any tree is built: deeper than 64 levels is refused, naming the
// limit (a copy, a dump or a walk of a deeper value would recurse once per level).
TEST(HfTokenizer, RefusesDeeplyNestedFiles) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  auto tokenizer = HfTokenizer::FromJson(
      TinyTokenizerJson(R"("normalizer": {"type": "X", "x": )" + deep + "}"), "", "x.json");
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_NE(
      tokenizer.status().message().find("x.json: JSON nests arrays and objects more than 64 levels deep"),
      std::string::npos)
      << tokenizer.status().ToString();
}

// A pattern from the file that backtracks catastrophically fails the encoding with PCRE2's match limit (1
// million steps per attempt), instead of running for seconds per start position.
TEST(HfTokenizer, ACatastrophicPatternFailsTheEncodingQuickly) {
  auto tokenizer = HfTokenizer::FromJson(
      TinyTokenizerJson(
          R"("pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated"})"),
      "", "x.json");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  const auto ids = (*tokenizer)->Encode(std::string(21, 'a') + "b");
  ASSERT_FALSE(ids.ok());
  EXPECT_NE(ids.status().message().find("match limit exceeded"), std::string::npos)
      << ids.status().ToString();
}

// run.c's encoder, written out as it is there: rescan every adjacent pair after each merge.
Ids RunCEncode(const std::string& text) {
  auto bytes = read_file(SharedPath(testing::kStoriesTokenizer));
  std::vector<std::string> pieces;
  std::vector<float> scores;
  for (std::size_t off = 4; off < bytes->size();) {
    float score;
    int32_t len;
    std::memcpy(&score, bytes->data() + off, 4);
    std::memcpy(&len, bytes->data() + off + 4, 4);
    pieces.push_back(bytes->substr(off + 8, static_cast<std::size_t>(len)));
    scores.push_back(score);
    off += 8 + static_cast<std::size_t>(len);
  }
  auto lookup = [&](const std::string& piece) -> int64_t {
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      if (pieces[i] == piece) return static_cast<int64_t>(i);
    }
    return -1;
  };
  Ids tokens = {lookup(" ")};
  for (std::size_t i = 0; i < text.size();) {  // ASCII test texts: one byte per character
    tokens.push_back(lookup(text.substr(i, 1)));
    ++i;
  }
  while (true) {
    float best = -1e10f;
    int64_t best_id = -1;
    std::size_t best_at = 0;
    for (std::size_t i = 0; i + 1 < tokens.size(); ++i) {
      const int64_t id = lookup(pieces[static_cast<std::size_t>(tokens[i])] + pieces[static_cast<std::size_t>(tokens[i + 1])]);
      if (id >= 0 && scores[static_cast<std::size_t>(id)] > best) {
        best = scores[static_cast<std::size_t>(id)];
        best_id = id;
        best_at = i;
      }
    }
    if (best_id < 0) break;
    tokens[best_at] = best_id;
    tokens.erase(tokens.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
  }
  return tokens;
}

TEST(Llama2cTokenizer, MergesExactlyAsRunC) {
  NAMM_REQUIRE_SHARED(testing::kStoriesTokenizer);
  auto tokenizer = Load(testing::kStoriesTokenizer);
  std::mt19937_64 gen(7);
  const std::string alphabet = "abcdefghijklmnopqrstuvwxyz      .,!?'ABCLT";
  std::uniform_int_distribution<std::size_t> pick(0, alphabet.size() - 1), length(1, 60);
  for (int trial = 0; trial < 200; ++trial) {
    std::string text;
    for (std::size_t i = 0, n = length(gen); i < n; ++i) text += alphabet[pick(gen)];
    EXPECT_EQ(tokenizer->Encode(text).value(), RunCEncode(text)) << "'" << text << "'";
  }
  EXPECT_EQ(tokenizer->Encode("Once upon a time, there was a little girl.").value(), RunCEncode("Once upon a time, there was a little girl."));
}

TEST(Llama2cTokenizer, LongTextsRoundTrip) {
  NAMM_REQUIRE_SHARED(testing::kStoriesTokenizer);
  auto tokenizer = Load(testing::kStoriesTokenizer);
  std::string text;
  for (int i = 0; i < 2000; ++i) text += "Once upon a time, there was a little girl named Lily. ";
  const Ids ids = tokenizer->Encode(text).value();  // ~110k characters in one merge pass
  EXPECT_EQ(tokenizer->Decode(ids), text);
}

TEST(MiddleTruncation, KeepsTheHeadAndTheTail) {
  NAMM_REQUIRE_SHARED(testing::kGpt2Tokenizer);
  auto tokenizer = Load(testing::kGpt2Tokenizer);
  std::string text = "BEGIN ";
  for (int i = 0; i < 300; ++i) text += "word" + std::to_string(i) + " ";
  text += "END";
  const Ids ids = encode_truncated_middle(*tokenizer, text, 100).value();
  EXPECT_LE(std::abs(static_cast<int64_t>(ids.size()) - 100), 3);
  const std::string kept = tokenizer->Decode(ids);
  EXPECT_EQ(kept.rfind("BEGIN", 0), 0u);
  EXPECT_EQ(kept.substr(kept.size() - 3), "END");
  EXPECT_EQ(kept.find("word150 "), std::string::npos);
  // Short texts are untouched.
  EXPECT_EQ(encode_truncated_middle(*tokenizer, "Hello world", 100).value(), (Ids{15496, 995}));
}

}  // namespace
}  // namespace namm::worker
