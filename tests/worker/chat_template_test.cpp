#include "namm/worker/chat_template.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "../temp_path.h"

namespace namm::worker {
namespace {

using Messages = std::vector<ChatMessage>;
using Json = nlohmann::ordered_json;

// Renders `source` and returns the text, or "PARSE ERROR: <message>" / "ERROR: <message>".
std::string Render(const std::string& source, const Messages& messages = {},
                   bool add_generation_prompt = false, const Json& variables = Json::object()) {
  auto parsed = ChatTemplate::Parse(source);
  if (!parsed.ok()) return "PARSE ERROR: " + parsed.status().message();
  auto rendered = parsed->Render(messages, add_generation_prompt, variables);
  return rendered.ok() ? *rendered : "ERROR: " + rendered.status().message();
}

// The InvalidArgument message of a template that must not parse.
std::string ParseError(const std::string& source) {
  auto parsed = ChatTemplate::Parse(source);
  EXPECT_FALSE(parsed.ok()) << "parsed: " << source;
  if (parsed.ok()) return "";
  EXPECT_EQ(parsed.status().code(), Status::Code::kInvalidArgument);
  return parsed.status().message();
}

// ---- Families: templates written for these tests with the constructs of each family's own -----------------

// Llama 3: header-delimited turns, trimmed content, bos before the first turn.
constexpr char kLlama3[] =
    "{% for message in messages %}"
    "{% set header = '<|start_header_id|>' ~ message.role ~ '<|end_header_id|>\\n\\n' %}"
    "{% if loop.first %}{{ bos_token }}{% endif %}"
    "{{ header ~ (message.content | trim) ~ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

TEST(ChatTemplateFamilies, Llama3) {
  const Json bos = {{"bos_token", "<|begin_of_text|>"}};
  EXPECT_EQ(Render(kLlama3, {{"system", "You are terse."}, {"user", "  What is 2+2?\n"}}, true, bos),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(Render(kLlama3, {{"user", "Hi"}}, false, bos),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
}

// Llama 3.1: multi-line, relying on {%- / {{- and trim_blocks; an always-present system turn, the system
// message lifted out of `messages`, and a default for a variable the caller may leave undefined.
constexpr char kLlama31[] = R"({{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "01 Jan 2025" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
)";

TEST(ChatTemplateFamilies, Llama31) {
  const Json tokens = {{"bos_token", "<|begin_of_text|>"}, {"eos_token", "<|eot_id|>"}};
  EXPECT_EQ(Render(kLlama31, {{"system", " Be brief. "}, {"user", "Name a color."}}, true, tokens),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nToday Date: 01 Jan 2025\n\n"
            "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nName a color.<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  Json with_date = tokens;
  with_date["date_string"] = "02 Feb 2026";
  EXPECT_EQ(Render(kLlama31, {{"user", "Hi"}}, false, with_date),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nToday Date: 02 Feb 2026\n\n"
            "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
}

// Mistral instruct: [INST] turns, the system prompt folded into the first user turn, and raise_exception
// when the roles do not alternate.
constexpr char kMistral[] = R"({%- if messages[0]['role'] == 'system' %}
    {%- set system_prompt = messages[0]['content'] %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_prompt = none %}
    {%- set turns = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in turns %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_prompt is not none %}
            {{- '[INST] ' + system_prompt + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}
)";

TEST(ChatTemplateFamilies, Mistral) {
  const Json tokens = {{"bos_token", "<s>"}, {"eos_token", "</s>"}};
  const Messages messages = {{"user", "Hi"}, {"assistant", "Hello!"}, {"user", "Add 2 and 2."}};
  EXPECT_EQ(Render(kMistral, messages, true, tokens),
            "<s>[INST] Hi [/INST] Hello!</s>[INST] Add 2 and 2. [/INST]");
  EXPECT_EQ(Render(kMistral, {{"system", "Answer in French."}, {"user", "Hi"}}, true, tokens),
            "<s>[INST] Answer in French.\n\nHi [/INST]");
}

TEST(ChatTemplateFamilies, MistralRefusesRolesThatDoNotAlternate) {
  auto parsed = ChatTemplate::Parse(kMistral);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  auto rendered = parsed->Render({{"user", "a"}, {"user", "b"}}, true, {{"bos_token", "<s>"}});
  ASSERT_FALSE(rendered.ok());
  EXPECT_EQ(rendered.status().code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(rendered.status().message(),
            "chat template: Conversation roles must alternate user/assistant/user/assistant/...");
  EXPECT_EQ(Render(kMistral, {{"user", "x"}, {"tool", "y"}}),
            "ERROR: chat template: Only user and assistant roles are supported!");
}

// Mistral v0.3 style: roles checked with a namespace counter, tool turns skipped with rejectattr, and the
// system prompt before the last user turn (found with selectattr); [INST] without inner spaces.
constexpr char kMistralV3[] = R"({%- if messages[0]["role"] == "system" %}
    {%- set system_prompt = messages[0]["content"] %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set turns = messages %}
{%- endif %}
{%- set user_turns = turns | selectattr("role", "equalto", "user") | list %}
{%- set ns = namespace() %}
{%- set ns.count = 0 %}
{%- for message in turns | rejectattr("role", "equalto", "tool") %}
    {%- if (message["role"] == "user") != (ns.count % 2 == 0) %}
        {{- raise_exception("roles must alternate after the system message") }}
    {%- endif %}
    {%- set ns.count = ns.count + 1 %}
{%- endfor %}
{{- bos_token }}
{%- for message in turns %}
    {%- if message["role"] == "user" %}
        {%- if message == user_turns[-1] and system_prompt is defined %}
            {{- "[INST]" + system_prompt + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST]" + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"] | trim + eos_token }}
    {%- endif %}
{%- endfor %}
)";

TEST(ChatTemplateFamilies, MistralV3) {
  const Json tokens = {{"bos_token", "<s>"}, {"eos_token", "</s>"}};
  const Messages messages = {
      {"system", "Be brief."}, {"user", "Hi"}, {"assistant", " Hello! "}, {"user", "Bye"}};
  EXPECT_EQ(Render(kMistralV3, messages, true, tokens),
            "<s>[INST]Hi[/INST] Hello!</s>[INST]Be brief.\n\nBye[/INST]");
  EXPECT_EQ(Render(kMistralV3, {{"assistant", "x"}}, true, tokens),
            "ERROR: chat template: roles must alternate after the system message");
}

// Qwen2.5 / ChatML: <|im_start|> turns, with a default system turn when the conversation has none.
constexpr char kQwen25[] = R"({%- set ns = namespace(has_system=false) %}
{%- for message in messages %}
    {%- if loop.first and message.role == 'system' %}
        {%- set ns.has_system = true %}
    {%- endif %}
{%- endfor %}
{%- if not ns.has_system %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' ~ message.role ~ '\n' ~ message.content ~ '<|im_end|>' ~ '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
)";

TEST(ChatTemplateFamilies, Qwen25) {
  EXPECT_EQ(Render(kQwen25, {{"user", "Hello"}}, true),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(Render(kQwen25, {{"system", "You are a poet."}, {"user", "Rhyme."}}, true),
            "<|im_start|>system\nYou are a poet.<|im_end|>\n<|im_start|>user\nRhyme.<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(Render(kQwen25, {{"user", "Hello"}}, false),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHello<|im_end|>\n");
}

// Qwen3: ChatML, earlier assistant turns without their reasoning, and an empty think block when the caller
// turns thinking off (enable_thinking is usually not defined at all).
constexpr char kQwen3[] = R"({%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
)";

TEST(ChatTemplateFamilies, Qwen3) {
  const Messages messages = {
      {"user", "2+2?"}, {"assistant", "<think>\nadd them\n</think>\n\n4"}, {"user", "3+3?"}};
  const std::string history = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
                              "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n";
  EXPECT_EQ(Render(kQwen3, messages, true), history);
  EXPECT_EQ(Render(kQwen3, messages, true, {{"enable_thinking", true}}), history);
  EXPECT_EQ(Render(kQwen3, messages, true, {{"enable_thinking", false}}),
            history + "<think>\n\n</think>\n\n");
}

// ---- Whitespace -------------------------------------------------------------------------------------------

TEST(ChatTemplateWhitespace, TrimBlocksDropsTheNewlineAfterABlockOrComment) {
  EXPECT_EQ(Render("{% if true %}\nA\n{% endif %}\nB"), "A\nB");
  EXPECT_EQ(Render("a\n{# note #}\nb"), "a\nb");
  EXPECT_EQ(Render("{{ 'x' }}\ny"), "x\ny");                  // not after {{ }}
  EXPECT_EQ(Render("{% if true %}\n\nA{% endif %}"), "\nA");  // one newline only
}

TEST(ChatTemplateWhitespace, LstripBlocksDropsIndentationBeforeABlockTag) {
  EXPECT_EQ(Render("  {% if true %}\n  x\n  {% endif %}\n"), "  x\n");
  EXPECT_EQ(Render("a\n\t {# c #}\nb"), "a\nb");
  EXPECT_EQ(Render("  {{ 'a' }}"), "  a");                          // not before {{ }}
  EXPECT_EQ(Render("x  {% if true %}y{% endif %}"), "x  y");        // not after text on the line
  EXPECT_EQ(Render("{{ 1 }}  {% if true %}y{% endif %}"), "1  y");  // nor after an expression on it
}

TEST(ChatTemplateWhitespace, MinusStripsAllWhitespaceOnItsSide) {
  EXPECT_EQ(Render("a  \n  {%- if true -%}  \n  b  {%- endif %}"), "ab");
  EXPECT_EQ(Render("a \n {{- 'b' -}} \n c"), "abc");
  EXPECT_EQ(Render("a \n {#- comment -#} \n c"), "ac");
}

TEST(ChatTemplateWhitespace, PlusKeepsWhitespace) {
  EXPECT_EQ(Render("  {%+ if true +%}\nx{% endif %}"), "  \nx");
}

TEST(ChatTemplateWhitespace, SourceNewlines) {
  EXPECT_EQ(Render("x\n"), "x");  // one trailing newline is dropped, as Jinja does
  EXPECT_EQ(Render("x\n\n"), "x\n");
  EXPECT_EQ(Render("a\r\n{% if true %}\r\nb{% endif %}"), "a\nb");
}

// ---- Expressions ------------------------------------------------------------------------------------------

TEST(ChatTemplateExpressions, Arithmetic) {
  EXPECT_EQ(Render("{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 * 3 + 1 }} "
                   "{{ (1 + 2) * 3 }}"),
            "3 -4 1 2 3.5 7 9");
  EXPECT_EQ(Render("{{ 'a' ~ 1 ~ none ~ true }} {{ 'ab' * 2 }} {{ 'x' + 'y' }} {{ [1] + [2] }} "
                   "{{ 1 + 2.5 }}"),
            "a1NoneTrue abab xy [1, 2] 3.5");
  EXPECT_EQ(Render("{{ 1e16 }} {{ 0.1 + 0.2 }} {{ 100.0 }} {{ 1.5e-5 }} {{ -0.5 }} {{ 1e3 }}"),
            "1e+16 0.30000000000000004 100.0 1.5e-05 -0.5 1000.0");
}

TEST(ChatTemplateExpressions, ComparisonsAndLogic) {
  EXPECT_EQ(Render("{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 == 1.0 }} {{ 'a' != 'b' }} {{ 'b' >= 'a' }}"),
            "True False True True True");
  EXPECT_EQ(Render("{{ 'a' in 'cat' }} {{ 3 not in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'z' in nothing }}"),
            "True True True False");
  EXPECT_EQ(Render("{{ none or 'x' }} {{ 0 and 1 }} {{ not [] }} {{ not 'a' == 'a' }} {{ 1 and 'y' }}"),
            "x 0 True False y");
  EXPECT_EQ(Render("{{ 'y' if 1 else 'n' }}|{{ 'y' if 0 }}|{{ 'a' if false else 'b' if true else 'c' }}"),
            "y||b");
}

TEST(ChatTemplateExpressions, LiteralsAndPrinting) {
  EXPECT_EQ(Render("{{ [1, 'a', none, true, {'k': 2.5}, \"it's\", nothing] }}"),
            "[1, 'a', None, True, {'k': 2.5}, \"it's\", Undefined]");
  EXPECT_EQ(Render(R"({{ 'a\'b' ~ "c\"d" ~ '\\' ~ '\u00e9\x41' ~ '\q' }})"), "a'bc\"d\\\xC3\xA9" "A\\q");
  EXPECT_EQ(Render("{{ 'con' 'cat' }} {{ True }} {{ None }} {{ False is false }}"), "concat True None True");
}

TEST(ChatTemplateExpressions, SubscriptsAndSlices) {
  const Messages messages = {{"system", "S"}, {"user", "U1"}, {"user", "U2"}};
  EXPECT_EQ(Render("{{ messages[0]['role'] }} {{ messages[-1].content }} {{ messages[1:] | length }} "
                   "{{ messages.1.content }} {{ messages[5] is defined }}",
                   messages),
            "system U2 2 U1 False");
  EXPECT_EQ(Render("{{ 'hello'[::-1] }} {{ [1, 2, 3, 4][1:3] }} {{ [1, 2, 3, 4][::2] }} {{ 'abc'[-1] }} "
                   "{{ [1, 2, 3][-2:] }} {{ [1, 2, 3][:-1] }} {{ [1, 2, 3][5:] }}"),
            "olleh [2, 3] [1, 3] c [2, 3] [1, 2] []");
  // By code point: "été".
  EXPECT_EQ(Render("{% set s = '\xC3\xA9t\xC3\xA9' %}{{ s[1:] }} {{ s | length }} {{ s[0] }}"),
            "t\xC3\xA9 3 \xC3\xA9");
}

TEST(ChatTemplateExpressions, UndefinedIsEmptyAndFalse) {
  EXPECT_EQ(Render("[{{ nothing }}|{{ nothing.attr.deeper }}|{{ nothing['x'] }}|{{ nothing is defined }}|"
                   "{{ nothing is undefined }}|{{ nothing | length }}|{% for x in nothing %}x{% endfor %}|"
                   "{{ 'y' if nothing else 'n' }}|{{ nothing == nothing }}]"),
            "[|||False|True|0||n|True]");
  EXPECT_EQ(Render("{{ messages[0].missing is defined }} {{ tools is none }} {{ documents is defined }}",
                   {{"user", "x"}}),
            "False True True");
}

TEST(ChatTemplateExpressions, Filters) {
  EXPECT_EQ(Render("{{ '  x  ' | trim }}|{{ 'xxyxx' | trim('x') }}|{{ [1, 2, 3] | length }}|"
                   "{{ 'abc' | upper }}|{{ 'ABC' | lower() }}|{{ [1, 2] | first }}|{{ [1, 2] | last }}|"
                   "{{ 'ab' | count }}"),
            "x|y|3|ABC|abc|1|2|2");
  EXPECT_EQ(Render("{{ nothing | default('d') }}|{{ '' | default('d') }}|{{ '' | d('d', true) }}|"
                   "{{ [1, 2] | join(', ') }}|{{ 'ab' | join('-') }}|{{ 42 | string ~ '!' }}|"
                   "{{ 'a-b-c' | replace('-', '+', 1) }}|{{ 'x' | safe }}|{{ 'ab' | list }}"),
            "d||d|1, 2|a-b|42!|a+b-c|x|['a', 'b']");
  EXPECT_EQ(Render("{{ {'a': 1, 'b': 2} | items }} {{ nothing | items | length }}"),
            "[['a', 1], ['b', 2]] 0");
  EXPECT_EQ(Render("{{ '  a ' | trim | upper | length }} {{ 'a' + 'b ' | trim }}"), "1 ab");
}

TEST(ChatTemplateExpressions, ToJson) {
  EXPECT_EQ(Render(R"({{ {'a': [1, 2.0, none, true], 'b': 'q"\n' ~ '\u00e9\t<&>'} | tojson }})"),
            "{\"a\": [1, 2.0, null, true], \"b\": \"q\\\"\\n\xC3\xA9\\t<&>\"}");
  EXPECT_EQ(Render("{{ {'a': [1], 'b': {}, 'c': []} | tojson(indent=2) }}"),
            "{\n  \"a\": [\n    1\n  ],\n  \"b\": {},\n  \"c\": []\n}");
  EXPECT_EQ(Render("{{ messages | tojson }}", {{"user", "hi"}}),
            "[{\"role\": \"user\", \"content\": \"hi\"}]");
  // Objects keep the order they were given in, as Python's dicts do.
  EXPECT_EQ(Render("{{ tools | tojson }}", {}, false, {{"tools", {{{"name", "f"}, {"n", 1.5}}}}}),
            "[{\"name\": \"f\", \"n\": 1.5}]");
  EXPECT_EQ(Render("{{ nothing | tojson }}"),
            "ERROR: chat template line 1, column 14: Object of type undefined is not JSON serializable");
}

TEST(ChatTemplateExpressions, Methods) {
  EXPECT_EQ(Render("{{ '  x '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ '\\n\\nhi\\n'.lstrip('\\n') }}|"
                   "{{ 'hi  '.rstrip() }}|{{ 'hello'.startswith('he') }}|{{ 'hello'.endswith('x') }}|"
                   "{{ 'AbC'.upper() }}{{ 'AbC'.lower() }}"),
            "x|hi|hi\n|hi|True|False|ABCabc");
  EXPECT_EQ(Render("{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a b c'.split(' ', 1) }} "
                   "{{ 'a b c'.split(maxsplit=1) }} {{ 'aXbX'.replace('X', '-') }}"),
            "['a', 'b', '', 'c'] ['a', 'b'] ['a', 'b c'] ['a', 'b c'] a-b-");
  EXPECT_EQ(Render("{% set d = {'a': 1, 'b': none} %}{{ d.get('a') }} {{ d.get('z', 0) }} {{ d.get('z') }} "
                   "{{ d.keys() }} {{ d.values() }}{% for k, v in d.items() %} {{ k }}={{ v }}{% endfor %}"),
            "1 0 None ['a', 'b'] [1, None] a=1 b=None");
  EXPECT_EQ(Render("{{ 'x'.nope() }}"),
            "ERROR: chat template line 1, column 7: 'str' object has no method 'nope'");
}

TEST(ChatTemplateExpressions, SelectAttr) {
  const Messages messages = {{"system", "S"}, {"user", "U1"}, {"assistant", "A"}, {"user", "U2"}};
  EXPECT_EQ(Render("{% for m in messages | selectattr('role', 'equalto', 'user') %}{{ m.content }}"
                   "{% endfor %}|"
                   "{% for m in messages | rejectattr('role', 'ne', 'user') %}{{ m.content }}{% endfor %}|"
                   "{{ messages | rejectattr('role', 'equalto', 'user') | list | length }}|"
                   "{{ messages | selectattr('missing', 'undefined') | list | length }}|"
                   "{{ messages | selectattr('content') | list | length }}|"
                   "{{ none | selectattr('x') | list }}",
                   messages),
            "U1U2|U1U2|2|4|4|[]");
  EXPECT_EQ(Render("{{ [1] | selectattr('x', 'frob') | list }}"),
            "ERROR: chat template line 1, column 10: selectattr(): unknown test 'frob'");
}

TEST(ChatTemplateExpressions, Tests) {
  EXPECT_EQ(Render("{% set d = {} %}{{ 'x' is string }}{{ 1 is number }}{{ 1.5 is float }}{{ 1 is integer }}"
                   "{{ d is mapping }}{{ none is none }}{{ [] is iterable }}{{ [] is sequence }}"
                   "{{ false is false }}{{ true is true }}{{ true is boolean }}{{ 1 is not string }}"
                   "{{ d is not mapping }}"),
            "TrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueFalse");
  EXPECT_EQ(Render("{{ 1 is eq 1 }}{{ 1 is ne(1) }}{{ 'a' is equalto 'b' }}{{ 'a' is not eq 'b' }}"),
            "TrueFalseFalseTrue");
}

// ---- Statements -------------------------------------------------------------------------------------------

TEST(ChatTemplateStatements, LoopVariables) {
  EXPECT_EQ(Render("{% for x in ['a', 'b', 'c'] %}{{ x }}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}"
                   "{{ loop.revindex0 }}{{ loop.length }}{{ 'F' if loop.first }}{{ 'L' if loop.last }};"
                   "{% endfor %}"),
            "a10323F;b21213;c32103L;");
  EXPECT_EQ(Render("{% for x in range(10) if x % 3 == 0 %}{{ x }}/{{ loop.index }}/{{ loop.length }} "
                   "{% endfor %}"),
            "0/1/4 3/2/4 6/3/4 9/4/4 ");
  EXPECT_EQ(Render("{% for c in 'ab' %}{{ c }}.{% endfor %}"
                   "{% for k in {'p': 1, 'q': 2} %}{{ k }}{% endfor %}"),
            "a.b.pq");
  EXPECT_EQ(Render("{% for a in [1, 2] %}{% for b in [3, 4] %}{{ a }}{{ b }}{{ loop.index }} {% endfor %}"
                   "{% endfor %}"),
            "131 142 231 242 ");
}

TEST(ChatTemplateStatements, ScopingAndNamespaces) {
  EXPECT_EQ(Render("{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}"), "21");
  // Each iteration starts from the enclosing scope: what one iteration sets, the next does not see.
  EXPECT_EQ(Render("{% set y = 'o' %}{% for i in [1, 2] %}[{{ y }}{% set y = i %}{{ y }}]{% endfor %}"
                   "{{ y }}"),
            "[o1][o2]o");
  EXPECT_EQ(Render("{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}"), "2");
  EXPECT_EQ(Render("{% set ns = namespace(x=1, y='a') %}{% for i in [1, 2] %}{% set ns.x = ns.x + i %}"
                   "{% endfor %}{{ ns.x }}{{ ns.y }}"),
            "4a");
  EXPECT_EQ(Render("{% set x = 1 %}{% set x.a = 2 %}"),
            "ERROR: chat template line 1, column 19: cannot set x.a: 'x' is not a namespace");
}

TEST(ChatTemplateStatements, RangeAndGeneration) {
  EXPECT_EQ(Render("{{ range(3) }}{{ range(1, 7, 2) }}{{ range(5, 0, -2) }}{{ range(0) }}"),
            "[0, 1, 2][1, 3, 5][5, 3, 1][]");
  EXPECT_EQ(Render("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}",
                   {{"assistant", "x"}}),
            "[x]");
}

// ---- Errors -----------------------------------------------------------------------------------------------

TEST(ChatTemplateErrors, SyntaxErrorsNameThePlaceAndWhatWasExpected) {
  EXPECT_EQ(ParseError("a\n{% if x %}b"),
            "chat template line 2, column 12: unexpected end of template: expected {% elif %}, {% else %} or "
            "{% endif %} to close the {% if %} on line 2");
  EXPECT_EQ(ParseError("{{ x | frobnicate }}"),
            "chat template line 1, column 8: unknown filter 'frobnicate'");
  EXPECT_EQ(ParseError("{{ x is odd }}"), "chat template line 1, column 9: unknown test 'odd'");
  EXPECT_EQ(ParseError("{% for x in y %}{% endif %}"),
            "chat template line 1, column 20: unexpected {% endif %}: expected {% endfor %}");
  EXPECT_EQ(ParseError("{% for x in y %}{% else %}{% endfor %}"),
            "chat template line 1, column 20: unexpected {% else %}: expected {% endfor %}");
  EXPECT_EQ(ParseError("{% include 'x' %}"), "chat template line 1, column 4: unknown tag 'include'");
  EXPECT_EQ(ParseError("{% macro m() %}{% endmacro %}"),
            "chat template line 1, column 4: unknown tag 'macro'");
  EXPECT_EQ(ParseError("{{ 'abc }}"), "chat template line 1, column 4: unclosed string");
  EXPECT_EQ(ParseError("x {{ y "), "chat template line 1, column 3: unclosed tag: missing '}}'");
  EXPECT_EQ(ParseError("{# x"), "chat template line 1, column 1: unclosed comment: missing '#}'");
  EXPECT_EQ(ParseError("{{ (1 }}"), "chat template line 1, column 7: unexpected '}'");
  EXPECT_EQ(ParseError("{{ 1 + }}"), "chat template line 1, column 8: expected an expression, got '}}'");
  EXPECT_EQ(ParseError("{% set x 1 %}"), "chat template line 1, column 10: expected '=', got a number");
  EXPECT_EQ(ParseError("{{ a ! b }}"), "chat template line 1, column 6: unexpected character '!'");
  EXPECT_EQ(ParseError("{{ '\\x4' }}"),
            "chat template line 1, column 5: invalid \\x escape: expected 2 hex digits");
  EXPECT_EQ(ParseError("{{ f(a=1, 2) }}"),
            "chat template line 1, column 11: positional argument after keyword arguments");
  EXPECT_EQ(ParseError("{{ 99999999999999999999 }}"),
            "chat template line 1, column 4: number out of range: 99999999999999999999");
  // As in Jinja: an if's condition is no inline if, and only calls may follow a filter.
  EXPECT_EQ(ParseError("{% if 1 if 2 else 3 %}{% endif %}"),
            "chat template line 1, column 9: expected '%}', got 'if'");
  EXPECT_EQ(ParseError("{{ x | first[0] }}"), "chat template line 1, column 13: expected '}}', got '['");
}

TEST(ChatTemplateErrors, UnknownFiltersInConditionalsFailOnlyWhenRun) {
  // As in Jinja: inside an if or inline if (but not in a loop within it), only when they run.
  EXPECT_EQ(Render("{% if x %}{{ y | frobnicate }}{% endif %}{{ y is odd if x }}ok"), "ok");
  EXPECT_EQ(Render("{% if x %}{{ y | frobnicate }}{% endif %}", {}, false, {{"x", true}}),
            "ERROR: chat template line 1, column 18: unknown filter 'frobnicate'");
  EXPECT_EQ(ParseError("{% if x %}{% for i in y %}{{ i | frobnicate }}{% endfor %}{% endif %}"),
            "chat template line 1, column 34: unknown filter 'frobnicate'");
}

TEST(ChatTemplateErrors, RuntimeErrors) {
  EXPECT_EQ(Render("{{ raise_exception('boom ' ~ 1) }}"), "ERROR: chat template: boom 1");
  EXPECT_EQ(Render("\n{{ strftime_now('%Y') }}"),
            "ERROR: chat template line 2, column 4: 'strftime_now' is undefined");
  EXPECT_EQ(Render("{{ 1 + 'a' }}"),
            "ERROR: chat template line 1, column 6: unsupported operand types for +: 'int' and 'str'");
  EXPECT_EQ(Render("{{ bos_token + 'a' }}"),
            "ERROR: chat template line 1, column 14: 'bos_token' is undefined");
  EXPECT_EQ(Render("{{ 1 // 0 }}"), "ERROR: chat template line 1, column 6: division by zero");
  EXPECT_EQ(Render("{{ 9223372036854775807 + 1 }}"),
            "ERROR: chat template line 1, column 24: integer overflow in +");
  EXPECT_EQ(Render("{{ 1 < 'a' }}"),
            "ERROR: chat template line 1, column 6: '<' is not supported between 'int' and 'str'");
  EXPECT_EQ(Render("{% for x in 3 %}{% endfor %}"),
            "ERROR: chat template line 1, column 13: 'int' object is not iterable");
  EXPECT_EQ(Render("{{ 'a'.strip(1, 2) }}"),
            "ERROR: chat template line 1, column 7: strip() takes at most 1 argument(s) (2 given)");
  EXPECT_EQ(Render("{{ 'a' | replace('a') }}"),
            "ERROR: chat template line 1, column 10: replace() is missing its argument 'new'");
  EXPECT_EQ(Render("{{ 'a' | trim(x=1) }}"),
            "ERROR: chat template line 1, column 10: trim() got an unexpected keyword argument 'x'");
  EXPECT_EQ(Render("{{ tools[1:] }}"),
            "ERROR: chat template line 1, column 9: 'NoneType' object cannot be sliced");
  EXPECT_EQ(Render("{{ 1() }}"), "ERROR: chat template line 1, column 4: 'int' object is not callable");
  EXPECT_EQ(Render("{% set ns = namespace() %}{{ [ns] }}"),
            "ERROR: chat template line 1, column 31: "
            "a namespace cannot be stored in a list, dict or namespace");

  auto parsed = ChatTemplate::Parse("x");
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->Render({}, false, Json::array()).status().message(),
            "chat template variables must be a JSON object");
  EXPECT_EQ(parsed->Render({}, false, {{"messages", 1}}).status().message(),
            "chat template variables must not set 'messages': it is an argument");
}

TEST(ChatTemplateErrors, LimitsStopPathologicalTemplates) {
  const auto refused = [](const std::string& error, const std::string& what) {
    return error.find(what) != std::string::npos;
  };
  const std::string parens = std::string(200, '(') + "1" + std::string(200, ')');
  EXPECT_TRUE(refused(ParseError("{{ " + parens + " }}"), "nests more than 100 levels"));
  EXPECT_TRUE(refused(ParseError("{{ " + std::string(100000, '-') + "1 }}"), "nests more than 100 levels"));
  std::string chain = "{{ 1";
  for (int k = 0; k < 200; ++k) chain += " + 1";
  EXPECT_TRUE(refused(ParseError(chain + " }}"), "expression nested more than 100 levels deep"));
  std::string blocks;
  for (int k = 0; k < 200; ++k) blocks += "{% if true %}";
  EXPECT_TRUE(refused(ParseError(blocks), "nests more than 100 levels"));

  // Iterations are counted across loops (and when filtering a loop).
  EXPECT_TRUE(refused(Render("{% for i in range(1048576) if false %}{% endfor %}"
                             "{% for i in [1] %}{% endfor %}"),
                      "more than 1048576 loop iterations"));
  EXPECT_TRUE(refused(Render("{% set s = 'x' * 1000000 %}{% for i in range(100) %}{{ s }}{% endfor %}"),
                      "the rendered text exceeds 64 MiB"));
  EXPECT_TRUE(refused(Render("{{ 'x' * 100000000 }}"), "longer than 64 MiB"));
  EXPECT_TRUE(refused(Render("{{ range(2000000) }}"), "range() of more than 1048576 numbers"));
  EXPECT_TRUE(refused(Render("{% set ns = namespace(l=[1]) %}{% for i in range(30) %}"
                             "{% set ns.l = ns.l + ns.l %}{% endfor %}"),
                      "a list of more than 1048576 items"));
  EXPECT_TRUE(refused(Render("{% set ns = namespace(l=[]) %}{% for i in range(200) %}{% set ns.l = [ns.l] %}"
                             "{% endfor %}"),
                      "values nested more than 100 levels deep"));
  EXPECT_TRUE(refused(Render("{% set s = 'abcdefghij' * 6000000 %}{% for i in range(100) %}{% set y = s %}"
                             "{% endfor %}"),
                      "too much work"));
}

// Lists share their items, so {% set a = [a, a] %} doubles what printing or comparing `a` walks while its
// memory grows by one list: sixty of them made a value of 2^60 items. A value of more than 64 Mi items and
// string bytes (counting an item each time it appears) is refused when built.
TEST(ChatTemplateErrors, SharedValuesThatDoubleAreRefusedWhenBuilt) {
  std::string doubling = "{% set a = [1] %}";
  for (int k = 0; k < 60; ++k) doubling += "{% set a = [a, a] %}";
  for (const char* use : {"{{ a }}", "{{ a == a }}", "{{ a in [a] }}", "{{ a | join }}", "{{ a ~ '' }}"}) {
    const std::string rendered = Render(doubling + use);
    EXPECT_NE(rendered.find("the template built a value of more than 64 Mi items and string bytes"),
              std::string::npos)
        << use << ": " << rendered;
  }
}

// Below that limit, each walk over a whole value is charged its expanded size to the render's work (a shared
// value compared with itself is not walked, but is charged all the same): 100 comparisons of a
// 12-million-item value are refused.
TEST(ChatTemplateErrors, ComparingOrPrintingSharedValuesIsChargedInFull) {
  std::string doubling = "{% set a = [1] %}";
  for (int k = 0; k < 22; ++k) doubling += "{% set a = [a, a] %}";
  for (const char* use :
       {"{% for i in range(100) %}{% if a == a %}{% endif %}{% endfor %}",
        "{% for i in range(100) %}{% if a is eq(a) %}{% endif %}{% endfor %}",
        "{% for i in range(100) %}{{ [a] | selectattr('x') | list | length }}{% endfor %}"}) {
    const std::string rendered = Render(doubling + use);
    EXPECT_NE(rendered.find("too much work"), std::string::npos) << use << ": " << rendered.substr(0, 200);
  }
}

// Searching a long string for a long needle is linear (memmem), where std::string::find took |haystack| x
// |needle| steps: here 10^12.
TEST(ChatTemplateExpressions, SubstringSearchIsLinear) {
  const std::string strings = "{% set h = 'a' * 2000000 %}{% set n = 'a' * 1000000 ~ 'b' %}";
  EXPECT_EQ(Render(strings + "{{ n in h }} {{ (h ~ 'b') is string and n in (h ~ 'b') }}"), "False True");
  EXPECT_EQ(Render(strings + "{{ h.split(n) | length }} {{ (h ~ 'b').split(n) | length }}"), "1 2");
  EXPECT_EQ(Render(strings + "{{ (h ~ 'b').replace(n, 'x') | length }}"), "1000001");
}

// ---- Loading ----------------------------------------------------------------------------------------------

class LoadChatTemplateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = namm::testing::TempPath(::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void Write(const std::string& name, const std::string& text) const {
    std::ofstream(dir_ + "/" + name) << text;
  }
  void WriteConfig(const nlohmann::json& config) const { Write("tokenizer_config.json", config.dump()); }

  std::string dir_;
};

TEST_F(LoadChatTemplateTest, StringTemplateAndSpecialTokens) {
  WriteConfig({{"chat_template", "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}"
                                 "{{ eos_token }}"},
               {"bos_token", {{"__type", "AddedToken"}, {"content", "<s>"}, {"lstrip", false}}},
               {"eos_token", "</s>"},
               {"pad_token", nullptr},
               {"model_max_length", 4096}});
  auto loaded = load_chat_template(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->variables, (Json{{"bos_token", "<s>"}, {"eos_token", "</s>"}}));
  auto rendered = loaded->chat_template.Render({{"user", "hi"}}, true, loaded->variables);
  ASSERT_TRUE(rendered.ok()) << rendered.status().ToString();
  EXPECT_EQ(*rendered, "<s>[hi]</s>");
}

TEST_F(LoadChatTemplateTest, SpecialTokensMapOverridesTheConfig) {
  WriteConfig({{"chat_template", "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}"},
               {"bos_token", "<s>"},
               {"eos_token", "</s>"},
               {"pad_token", "<pad>"}});
  Write("special_tokens_map.json", R"({"eos_token": {"content": "<|im_end|>"}, "pad_token": null})");
  auto loaded = load_chat_template(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(*loaded->chat_template.Render({}, false, loaded->variables), "<s>|<|im_end|>|");
}

TEST_F(LoadChatTemplateTest, NamedTemplatesUseTheDefault) {
  const nlohmann::json tool_use = {{"name", "tool_use"}, {"template", "T"}};
  WriteConfig({{"chat_template", {tool_use, {{"name", "default"}, {"template", "D"}}}}});
  auto loaded = load_chat_template(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(*loaded->chat_template.Render({}, false), "D");
  EXPECT_EQ(loaded->variables, Json::object());

  WriteConfig({{"chat_template", {tool_use, {{"name", "rag"}, {"template", "R"}}}}});
  loaded = load_chat_template(dir_);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), Status::Code::kNotFound);
  EXPECT_EQ(loaded.status().message(),
            dir_ + "/tokenizer_config.json: "
                   "chat_template has no template named \"default\" (only: tool_use, rag)");
}

TEST_F(LoadChatTemplateTest, ChatTemplateJinjaWinsOverTheConfig) {
  WriteConfig({{"chat_template", "config"}, {"eos_token", "</s>"}});
  Write("chat_template.jinja", "file{{ eos_token }}\n");
  auto loaded = load_chat_template(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(*loaded->chat_template.Render({}, false, loaded->variables), "file</s>");
}

TEST_F(LoadChatTemplateTest, MissingTemplateIsNotFound) {
  auto loaded = load_chat_template(dir_);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), Status::Code::kNotFound);
  EXPECT_EQ(loaded.status().message(),
            dir_ + ": no tokenizer_config.json or chat_template.jinja, so no chat template");

  WriteConfig({{"bos_token", "<s>"}});
  loaded = load_chat_template(dir_);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), Status::Code::kNotFound);
  EXPECT_EQ(loaded.status().message(),
            dir_ + "/tokenizer_config.json: no chat_template (a base model rather than a chat model?)");
}

TEST_F(LoadChatTemplateTest, BadConfigs) {
  Write("tokenizer_config.json", "{not json");
  EXPECT_EQ(load_chat_template(dir_).status().code(), Status::Code::kCorruption);
  WriteConfig({{"chat_template", 3}});
  EXPECT_EQ(load_chat_template(dir_).status().code(), Status::Code::kCorruption);
  WriteConfig({{"chat_template", "x"}, {"eos_token", 3}});
  EXPECT_EQ(load_chat_template(dir_).status().code(), Status::Code::kCorruption);
  WriteConfig({{"chat_template", "{% if %}"}});
  const Status status = load_chat_template(dir_).status();
  EXPECT_EQ(status.code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(status.message(),
            dir_ + "/tokenizer_config.json: "
                   "chat template line 1, column 7: expected an expression, got '%}'");
}

}  // namespace
}  // namespace namm::worker
