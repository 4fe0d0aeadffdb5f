#include "namm/worker/chat_encoding.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "namm/utf8.h"

namespace namm::worker {

namespace {

// A marker's end (U+E000; its opening starts with that character or a later one).
const char kMarkerClosing[] = "\xEE\x80\x80";

// Whether `text` writes a special token of the tokenizer (its ids differ when such tokens stay text).
Result<bool> SpellsSpecialToken(const Tokenizer& tokenizer, const std::string& text) {
  NAMM_ASSIGN_OR_RETURN(const std::vector<int64_t> as_text, tokenizer.EncodeControlled(text, {}, /*for_model=*/false));
  NAMM_ASSIGN_OR_RETURN(const std::vector<int64_t> as_written, tokenizer.Encode(text));
  return as_text != as_written;
}

// The whitespace the template's trim and strip() remove (chat_template.cpp).
bool IsTemplateSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// What a template may have made of a content: itself, or stripped of whitespace on both sides, the left or the
// right (trim, strip(), lstrip(), rstrip()). Most likely first.
std::vector<std::string> ContentForms(const std::string& content) {
  std::size_t begin = 0, end = content.size();
  while (begin < end && IsTemplateSpace(content[begin])) ++begin;
  while (end > begin && IsTemplateSpace(content[end - 1])) --end;
  std::vector<std::string> forms = {content, content.substr(begin, end - begin), content.substr(begin),
                                    content.substr(0, end)};
  std::vector<std::string> distinct;
  for (std::string& f : forms) {
    if (std::find(distinct.begin(), distinct.end(), f) == distinct.end()) distinct.push_back(std::move(f));
  }
  return distinct;
}

// A marker's opening: the first private-use character that no content has before "namm-content-" (so that a
// content cannot forge a marker), found in one pass over the contents.
std::string MarkerOpening(const std::vector<ChatMessage>& messages) {
  const std::string tag = "namm-content-";
  std::vector<uint32_t> taken;
  for (const ChatMessage& m : messages) {
    for (std::size_t at = m.content.find(tag); at != std::string::npos; at = m.content.find(tag, at + 1)) {
      // U+E000..U+FFFF take 3 bytes led by 0xEE or 0xEF (contents are well-formed UTF-8 here).
      const auto lead = at >= 3 ? static_cast<unsigned char>(m.content[at - 3]) : 0;
      if (lead == 0xEE || lead == 0xEF) taken.push_back(utf8_decode(m.content.substr(at - 3, 3)));
    }
  }
  std::sort(taken.begin(), taken.end());
  uint32_t code_point = 0xE000;
  for (uint32_t t : taken) {
    if (t == code_point) ++code_point;
  }
  return utf8_encode(code_point) + tag;  // at most U+E000 + the number of tags: private use up to U+F8FF
}

// The template's own text in `rendered` (the spans outside the contents), aligning it with `marked` (the same
// conversation rendered with content k replaced by opening + k + opening's end). nullopt when they cannot be
// aligned.
std::optional<Tokenizer::Spans> TemplateSpans(const std::string& rendered, const std::string& marked,
                                              const std::string& opening, const std::vector<ChatMessage>& messages) {
  const std::string closing = kMarkerClosing;
  Tokenizer::Spans spans;
  std::size_t at = 0, pos = 0;  // in marked, in rendered
  // Template text marked[at, end) must stand at rendered[pos...].
  const auto template_text = [&](std::size_t end) {
    const std::size_t n = end - at;
    if (rendered.compare(pos, n, marked, at, n) != 0) return false;
    if (n > 0) spans.emplace_back(pos, pos + n);
    pos += n;
    return true;
  };
  for (;;) {
    const std::size_t marker = marked.find(opening, at);
    if (marker == std::string::npos) break;
    if (!template_text(marker)) return std::nullopt;
    const std::size_t digits = marker + opening.size();
    const std::size_t digits_end = marked.find(closing, digits);
    if (digits_end == std::string::npos || digits_end == digits || digits_end - digits > 9) return std::nullopt;
    const std::string index = marked.substr(digits, digits_end - digits);
    if (!std::all_of(index.begin(), index.end(), [](char c) { return c >= '0' && c <= '9'; })) return std::nullopt;
    const std::size_t k = std::stoul(index);
    if (k >= messages.size()) return std::nullopt;
    at = digits_end + closing.size();
    // The content in one of its forms, followed by what the template writes next (up to the next marker).
    const std::size_t next = std::min(marked.find(opening, at), marked.size());
    bool placed = false;
    for (const std::string& form : ContentForms(messages[k].content)) {
      if (rendered.compare(pos, form.size(), form) == 0 &&
          rendered.compare(pos + form.size(), next - at, marked, at, next - at) == 0) {
        pos += form.size();
        placed = true;
        break;
      }
    }
    if (!placed) return std::nullopt;
  }
  if (!template_text(marked.size()) || pos != rendered.size()) return std::nullopt;
  return spans;
}

}  // namespace

Result<std::vector<int64_t>> encode_chat(const Tokenizer& tokenizer, const ChatTemplate& chat_template,
                                         std::vector<ChatMessage> messages, bool add_generation_prompt,
                                         const nlohmann::ordered_json& variables, bool for_model) {
  for (ChatMessage& m : messages) {
    m.content = sanitize_utf8(m.content);
    m.role = sanitize_utf8(m.role);
  }
  // Roles are the template's to test and write, so they stay text only by spelling no special token.
  for (std::size_t k = 0; k < messages.size(); ++k) {
    NAMM_ASSIGN_OR_RETURN(const bool spells, SpellsSpecialToken(tokenizer, messages[k].role));
    if (spells) {
      return Status::InvalidArgument("message " + std::to_string(k) + "'s role writes a special token of the tokenizer");
    }
  }
  NAMM_ASSIGN_OR_RETURN(const std::string rendered, chat_template.Render(messages, add_generation_prompt, variables));
  const std::string opening = MarkerOpening(messages);
  std::vector<ChatMessage> marked_messages = messages;
  for (std::size_t k = 0; k < marked_messages.size(); ++k) {
    marked_messages[k].content = opening + std::to_string(k) + kMarkerClosing;
  }
  // A template that refuses a marker (it inspects contents) leaves the conversation unaligned, not refused.
  Result<std::string> marked = chat_template.Render(marked_messages, add_generation_prompt, variables);
  std::optional<Tokenizer::Spans> spans;
  if (marked.ok()) spans = TemplateSpans(rendered, *marked, opening, messages);
  if (spans) return tokenizer.EncodeControlled(rendered, *spans, for_model);
  for (std::size_t k = 0; k < messages.size(); ++k) {
    NAMM_ASSIGN_OR_RETURN(const bool spells, SpellsSpecialToken(tokenizer, messages[k].content));
    if (spells) {
      return Status::InvalidArgument("message " + std::to_string(k) + " (" + messages[k].role +
                                     ") writes a special token of the tokenizer as text, and this chat template "
                                     "changes or inspects contents, so that it cannot be kept apart from the "
                                     "template's own tokens: leave the special token out of the message");
    }
  }
  return for_model ? tokenizer.EncodeForModel(rendered) : tokenizer.Encode(rendered);
}

}  // namespace namm::worker
