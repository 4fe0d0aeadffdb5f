// Hugging Face chat templates: the Jinja2 program in a tokenizer's `chat_template` that turns a conversation
// into the model's prompt. Rendering matches transformers' `tokenizer.apply_chat_template(messages,
// tokenize=False, add_generation_prompt=...)`: Jinja2 with trim_blocks and lstrip_blocks, `tools` and
// `documents` set to none, and the tokenizer's special tokens as variables.
//
// The Jinja subset is what the templates of Llama 2/3/3.1, Mistral/Mixtral instruct and Qwen2/2.5/3 use:
//   tags:        {{ }}, {% %}, {# #}, whitespace control (-, +); if/elif/else; for, also `for a, b in` and
//                `for x in xs if cond`, with loop.index/index0/revindex/revindex0/first/last/length; set,
//                also `set ns.attr = ...` on a namespace; generation/endgeneration (rendered as content)
//   expressions: literals (strings with Python's escapes, ints, floats, true/false/none in either case,
//                lists, dicts), a.b, a['b'], a[-1], a[1:], a[::-1], + - * / // % ~, comparisons (chained),
//                in, not in, and/or/not, `x if c else y`, calls with keyword arguments
//   filters:     trim, length (count), tojson (indent=), string, upper, lower, first, last, default (d),
//                join, items, list, replace, safe, selectattr and rejectattr (attribute[, test[, argument]])
//   tests:       defined, undefined, none, string, number, integer, float, boolean, mapping, iterable,
//                sequence, true, false; equalto (eq) and ne, with an argument: `x is eq 1`, `x is ne(y)`
//   methods:     strings: strip, lstrip, rstrip, startswith, endswith, split, replace, upper, lower;
//                dicts: get, items, keys, values
//   functions:   raise_exception(msg), namespace(k=v, ...), range(...)
// Anything else (macro, break, for-else, map, ...) is refused when parsing, except that, as in Jinja, an
// unknown filter or test inside an if (or an inline if) is refused only if it runs. Semantics follow Jinja
// (each loop iteration has its own scope: what it sets is gone by the next) and Python (// and % round
// down, 1 == 1.0, str() and repr() of values, strings indexed, sliced and counted by code point), with these
// differences: indexing, slicing or taking an attribute of an undefined value gives undefined (Jinja raises,
// so templates that work in Jinja render the same); strftime_now is not defined, so that prompts do not
// change with the date (templates then use their fixed default date); upper and lower change ASCII letters
// only.
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "namm/status.h"

namespace namm::worker {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", ...
  std::string content;
};

// A parsed chat template. Immutable, cheap to copy, and safe to render from several threads at once.
class ChatTemplate {
 public:
  // Parses Jinja source. Syntax errors (an unclosed {% if %}, an unknown filter or tag, nesting deeper than
  // 100 levels, ...) return InvalidArgument naming the line and column and what was expected there.
  static Result<ChatTemplate> Parse(const std::string& source);

  // Renders the prompt for `messages` (each a {role, content} dict in the template). `variables` is a JSON
  // object of further top-level variables: the special tokens (bos_token, eos_token, ...), template switches
  // such as Qwen3's enable_thinking, or tools (a list of JSON schemas). It is an ordered_json so that objects
  // keep their key order, as Python's dicts do (tojson prints them in that order); a nlohmann::json converts
  // to it implicitly, with its keys sorted. It must not set `messages` or `add_generation_prompt`. Errors are
  // InvalidArgument: "chat template: <message>" for the template's own raise_exception(message), and
  // "chat template line L, column C: <what>" for anything else (calling something undefined, a type error,
  // more than 2^20 loop iterations, a string or result over 64 MiB, a value of more than 64 Mi items and
  // string bytes when written out, too much work in total).
  Result<std::string> Render(
      const std::vector<ChatMessage>& messages, bool add_generation_prompt,
      const nlohmann::ordered_json& variables = nlohmann::ordered_json::object()) const;

 private:
  struct Program;
  explicit ChatTemplate(std::shared_ptr<const Program> program) : program_(std::move(program)) {}
  std::shared_ptr<const Program> program_;
};

// A model's chat template and the variables transformers renders it with.
struct LoadedChatTemplate {
  ChatTemplate chat_template;
  // The tokenizer's special tokens as strings, by name: bos_token, eos_token, unk_token, pad_token,
  // sep_token, cls_token, mask_token, each where the tokenizer files set it. Add to a copy to pass more.
  nlohmann::ordered_json variables;
};

// Loads the chat template of a model or tokenizer directory, as transformers does: <dir>/chat_template.jinja
// if present, else `chat_template` in <dir>/tokenizer_config.json (a string, or a list of {"name",
// "template"} objects, of which the one named "default" is used). The special tokens come from
// tokenizer_config.json, overridden by special_tokens_map.json where present (each a string or an object
// with "content"). NotFound, naming the directory, when there is neither tokenizer_config.json nor
// chat_template.jinja, or the config has no chat template; Corruption when a file is not valid JSON or a
// field has the wrong type; InvalidArgument (naming the file) when the template does not parse.
Result<LoadedChatTemplate> load_chat_template(const std::string& model_or_tokenizer_dir);

}  // namespace namm::worker
