// Regression tests for what fuzzing found (RELIABILITY.md): every input that once crashed, hung or ran out
// of memory now ends in a result or a one-line mtpx::Error. The inputs are the files
// fuzz/corpus/<target>/finding-*, which the fuzz targets also start from; ReplayEveryFinding runs each
// through the code its target exercises, and the other tests check the error each one gets. Under
// scripts/test_sanitized.sh the replay also checks them for memory errors and undefined behaviour.
#include <gtest/gtest.h>

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <sstream>
#include <string>

#include "io/model_config.h"
#include "io/safetensors.h"
#include "server/chat_template.h"
#include "server/jinja/limits.h"
#include "server/openai_api.h"
#include "server/tool_calls.h"
#include "test_paths.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace mtpx {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

using test_paths::kSource;

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

const Tokenizer& shipped_tokenizer() {
  static const Tokenizer t = Tokenizer::from_file(kSource / "models" / "default" / "tokenizer.json");
  return t;
}

const server::ChatTemplate& qwen35_template() {
  static const server::ChatTemplate t(
      read_file(kSource / "tests" / "fixtures" / "chat_template" / "qwen35_style.jinja"),
      ordered_json{{"eos_token", "<|im_end|>"}});
  return t;
}

server::ServingDefaults serving_defaults() {
  server::ServingDefaults d;
  d.model_id = "default";
  d.mtp_available = true;
  d.context = 8192;
  d.vocab_limit = shipped_tokenizer().vocab_size();
  return d;
}

// The message of the mtpx::Error that `f` throws ("" when it returns).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string repeat(std::string_view text, int times) {
  std::string out;
  for (int i = 0; i < times; ++i) out += text;
  return out;
}

std::string render(std::string_view source) {
  const server::ChatTemplate t(source, ordered_json::object());
  const ordered_json messages = ordered_json::parse(R"([{"role": "user", "content": "hi"}])");
  return t.apply(messages, nullptr, ordered_json::object(), true);
}

// What each fuzz target runs on its input (fuzz/fuzz_<target>.cpp), without its extra invariant checks.
const std::map<std::string, std::function<void(const std::string&)>>& targets() {
  static const std::map<std::string, std::function<void(const std::string&)>> t = {
      {"fuzz_safetensors",
       [](const std::string& in) {
         (void)parse_safetensors(std::as_bytes(std::span(in.data(), in.size())), "finding.safetensors");
       }},
      {"fuzz_safetensors_index",
       [](const std::string& in) { (void)parse_safetensors_index(in, "index.json"); }},
      {"fuzz_model_config",
       [](const std::string& in) {
         const nlohmann::json root = parse_json_text(in, "config.json");
         (void)error_of([&] { (void)parse_generation_config(root, "generation_config.json"); });
         (void)parse_model_config(root, "config.json");
       }},
      {"fuzz_tokenizer_load",
       [](const std::string& in) { (void)Tokenizer::from_json(in, "tokenizer.json").encode("Hello!"); }},
      {"fuzz_tokenizer_encode",
       [](const std::string& in) { (void)shipped_tokenizer().decode(shipped_tokenizer().encode(in)); }},
      {"fuzz_chat_template", [](const std::string& in) { (void)render(in); }},
      {"fuzz_openai_request",
       [](const std::string& in) {
         const ordered_json body = server::parse_request_body(in);
         const server::ChatRequest chat = server::parse_chat_request(body, serving_defaults());
         (void)qwen35_template().apply(chat.messages, chat.tools, chat.template_kwargs, true);
       }},
      {"fuzz_tool_calls",
       [](const std::string& in) {
         for (const auto& call : server::extract_tool_calls(in).tool_calls)
           EXPECT_TRUE(nlohmann::json::parse(call.arguments, nullptr, false).is_object()) << call.arguments;
       }},
  };
  return t;
}

TEST(FuzzFindings, ReplayEveryFinding) {
  int replayed = 0;
  for (const auto& target_dir : fs::directory_iterator(kSource / "fuzz" / "corpus")) {
    const std::string target = target_dir.path().filename().string();
    for (const auto& file : fs::directory_iterator(target_dir.path())) {
      if (file.path().filename().string().rfind("finding-", 0) != 0) continue;
      SCOPED_TRACE(target + "/" + file.path().filename().string());
      ASSERT_TRUE(targets().count(target)) << "no replay for " << target;
      const std::string input = read_file(file.path());
      try {
        targets().at(target)(input);
      } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "a one-line message: " << e.what();
      }
      ++replayed;
    }
  }
  EXPECT_GE(replayed, 30);
}

TEST(FuzzFindings, JsonNumbersBeyondDoubleAreInvalidInput) {
  // nlohmann throws out_of_range (not parse_error) for 1e400: it escaped as an HTTP 500 / a crash.
  EXPECT_NE(error_of([] {
              (void)server::parse_request_body(R"({"max_tokens": 1e400})");
            }).find("request body is not valid JSON"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              (void)parse_json_text(R"({"vocab_size": -1e999})", "config.json");
            }).find("'config.json': not valid JSON"),
            std::string::npos);
}

TEST(FuzzFindings, DeeplyNestedRequestBodiesAreRefusedWhileParsing) {
  // A message holding 200000 nested arrays overflowed the stack when the request was copied.
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  const std::string body = R"({"messages": [{"role": "user", "content": "hi", "extra": )" + deep + "}]}";
  EXPECT_NE(error_of([&] { (void)server::parse_request_body(body); }).find("nests deeper than 64 levels"),
            std::string::npos);
  const std::string ok = std::string(60, '[') + std::string(60, ']');
  EXPECT_EQ(error_of([&] { (void)server::parse_request_body(ok); }), "");
}

TEST(FuzzFindings, NonStringTypesAreUnsupportedPartsNotCrashes) {
  // A content part whose "type" was an object made nlohmann's value("type", "") throw type_error.
  const auto chat = [](const std::string& body) {
    return error_of(
        [&] { (void)server::parse_chat_request(server::parse_request_body(body), serving_defaults()); });
  };
  EXPECT_NE(chat(R"({"messages": [{"role": "user", "content": [{"type": {"url": "x"}}]}]})")
                .find("only text parts"),
            std::string::npos);
  EXPECT_NE(chat(R"({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": 1}})")
                .find("'response_format' other than"),
            std::string::npos);
  EXPECT_NE(chat(R"({"messages": [{"role": "user", "content": "hi"}],
                     "tools": [{"type": [], "function": {"name": "f"}}]})")
                .find("'tools[0]' must be"),
            std::string::npos);
  // Well-formed ones still pass: a text part, and a tool without "type" (function is the default).
  EXPECT_EQ(chat(R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                     "tools": [{"function": {"name": "f"}}]})"),
            "");
}

TEST(FuzzFindings, ConfigIntegersBeyondInt64AreOutOfRange) {
  // 9.2e20 (and 2^64 - 1) went through a float-to-int64 conversion that is undefined behaviour.
  const auto config = [](const std::string& top_k) {
    return parse_json_text(R"({"top_k": )" + top_k + "}", "generation_config.json");
  };
  for (const std::string value : {"922337203685477580820", "9.3e18", "18446744073709551615", "-1e300"}) {
    SCOPED_TRACE(value);
    EXPECT_NE(error_of([&] {
                (void)parse_generation_config(config(value), "generation_config.json");
              }).find("'top_k' = "),
              std::string::npos);
  }
  EXPECT_EQ(parse_generation_config(config("20.0"), "generation_config.json").top_k, 20);
}

TEST(FuzzFindings, TokenizerIdsAreBounded) {
  // One id of 2^30 - 1 made the loader allocate tables for a billion ids (32 GB).
  const std::string tokenizer =
      R"({"model": {"type": "BPE", "vocab": {"a": 1073741823}, "merges": []},
          "pre_tokenizer": {"type": "ByteLevel"}, "decoder": {"type": "ByteLevel"}})";
  EXPECT_NE(error_of([&] {
              (void)Tokenizer::from_json(tokenizer, "tokenizer.json");
            }).find("expected an integer in [0, 4194304)"),
            std::string::npos);
}

TEST(FuzzFindings, ToolCallArgumentsAreAlwaysJsonObjects) {
  // Bytes that are not UTF-8 in an XML parameter made nlohmann throw from dump().
  const auto xml = server::extract_tool_calls(
      "<tool_call>\n<function=run>\n<parameter=code>\nx = "
      "'\x87\xd8'\n</parameter>\n</function>\n</tool_call>");
  ASSERT_EQ(xml.tool_calls.size(), 1u);
  EXPECT_EQ(nlohmann::json::parse(xml.tool_calls[0].arguments)["code"], "x = '\xef\xbf\xbd\xef\xbf\xbd'");
  // String arguments that do not hold an object are not a call: the block stays text.
  const auto bad =
      server::extract_tool_calls(R"(<tool_call>{"name": "f", "arguments": "{\"a\": _1}"}</tool_call>)");
  EXPECT_TRUE(bad.tool_calls.empty());
  EXPECT_NE(bad.content.find("<tool_call>"), std::string::npos);
  const auto good =
      server::extract_tool_calls(R"(<tool_call>{"name": "f", "arguments": "{\"a\": 1}"}</tool_call>)");
  ASSERT_EQ(good.tool_calls.size(), 1u);
  EXPECT_EQ(good.tool_calls[0].arguments, R"({"a": 1})");
}

TEST(FuzzFindings, TemplateLiteralsAndEscapes) {
  // std::stod / std::stoul threw std::out_of_range / std::invalid_argument out of the lexer.
  EXPECT_EQ(render("{{ 1e400 }} {{ 1e-400 }}"), "inf 0.0");
  EXPECT_NE(error_of([] { render("{{ 99999999999999999999 }}"); }).find("does not fit in 64 bits"),
            std::string::npos);
  EXPECT_NE(error_of([] { render(R"({{ "\xZZ" }})"); }).find("truncated \\x escape"), std::string::npos);
  EXPECT_NE(error_of([] { render(R"({{ "\U00110000" }})"); }).find("not a Unicode character"),
            std::string::npos);
  EXPECT_EQ(render(R"({{ "\x41\u00e9\U0001F600" }})"), "A\xc3\xa9\xf0\x9f\x98\x80");
}

TEST(FuzzFindings, TemplateIntegerArithmeticNeverOverflows) {
  for (const std::string expression :
       {"9223372036854775807 + 1", "-9223372036854775807 - 2", "9223372036854775807 * 2", "2 ** 64",
        "(-9223372036854775807 - 1) // -1", "-(-9223372036854775807 - 1)",
        "(-9223372036854775807 - 1)|abs"}) {
    SCOPED_TRACE(expression);
    EXPECT_NE(error_of([&] { render("{{ " + expression + " }}"); }).find("integer overflow"),
              std::string::npos);
  }
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) % -1 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 3 ** 3 }} {{ 1 ** "
                   "9223372036854775807 }}"),
            "0 -4 2 27 1");
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) is divisibleby(-1) }}"), "True");
  EXPECT_EQ(render("{{ range(-9223372036854775807 - 1, 9223372036854775807, 4611686018427387904)|length }}"),
            "4");
  EXPECT_EQ(render("{{ range(10)[3::9223372036854775807] }}"), "[3]");
  EXPECT_NE(error_of([] { render("{{ 1e308|int }}"); }).find("cannot convert float"), std::string::npos);
  EXPECT_EQ(error_of([] { render(R"({{ [[7]]|map(attribute="99999999999999999999")|list }})"); }), "");
}

TEST(FuzzFindings, TemplateNestingIsBounded) {
  // Each of these overflowed the stack (parser, evaluator or destructor).
  const std::vector<std::string> deep = {
      "{{ " + repeat("(", 100000) + "1" + repeat(")", 100000) + " }}",
      "{{ 1" + repeat("|e", 100000) + " }}",
      "{{ 1" + repeat(" + 1", 100000) + " }}",
      repeat("{% if 1 %}", 100000) + repeat("{% endif %}", 100000),
      "{{ " + repeat("-", 100000) + "1 }}",
  };
  for (const std::string& source : deep) {
    SCOPED_TRACE(source.substr(0, 30));
    EXPECT_NE(error_of([&] { render(source); }).find("nested deeper than 64 levels"), std::string::npos);
  }
  // A conversation nested deeper than lists may be, and a chain of namespace assignments.
  EXPECT_NE(
      error_of([] {
        render("{% set ns = namespace(x=1) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}");
      }).find("nested deeper than 128 levels"),
      std::string::npos);
  // 64 nested blocks around 64-deep expressions in 64 nested macro calls: the deepest the limits allow.
  const std::string body =
      repeat("{% if 1 %}", 60) + "{{ f(n)" + repeat(" + 1", 62) + " }}" + repeat("{% endif %}", 60);
  EXPECT_NE(error_of([&] {
              render("{% macro f(n) %}" + body + "{% endmacro %}{{ f(0) }}");
            }).find("macro calls nested too deeply"),
            std::string::npos);
}

TEST(FuzzFindings, TemplateWorkAndSizeAreBounded) {
  const std::string too_much_work = "more than " + std::to_string(jinja::kMaxWork) + " steps";
  const std::string too_big = "more than " + std::to_string(jinja::kMaxBytes >> 20) + " MiB";
  const std::map<std::string, std::string> runaway = {
      {"{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", too_much_work},
      {"{{ range(100000)|unique|list|length }}", too_much_work},
      {R"({% set ns = namespace(a=["xx"]) %}{% for i in range(40) %}{% set ns.a = [ns.a, ns.a] %}{% endfor %})"
       "{{ ns.a }}",
       too_much_work},
      {R"({{ "a" * 10000000000 }})", too_big},
      {"{{ [1, 2, 3] * 9223372036854775807 }}", too_big},
      {R"({% set a = ["x" * 1000000] %}{% set b = a * 200 %}{% set c = b * 2 %})", too_big},
      {R"({{ ("x" * 1000)|replace("x", "y" * 1000000) }})", too_big},
      {R"({{ "a"|indent(10000000000) }})", "indent width 10000000000 is out of range"},
      {"{{ [1]|tojson(indent=100000) }}", "tojson indent 100000 is too large"},
  };
  for (const auto& [source, error] : runaway) {
    SCOPED_TRACE(source);
    EXPECT_NE(error_of([&] { render(source); }).find(error), std::string::npos);
  }
  EXPECT_EQ(render(R"({{ ([] * 1000000000000000000)|length }}{{ "" * 1000000000000000000 }}.)"), "0.");
}

TEST(FuzzFindings, TemplateNamespacesCannotMakeCycles) {
  // ns.a = ns printed forever (stack overflow); a function holding the dict that holds ns leaked it.
  for (const std::string source :
       {"{% set ns = namespace(a=1) %}{% set ns.a = ns %}{{ ns }}",
        R"({% set ns = namespace(a=1) %}{% set d = {"k": ns} %}{% set ns.f = d.items %})",
        "{% set ns = namespace(a=1) %}{% set ns.a = [1, [ns]] %}"}) {
    SCOPED_TRACE(source);
    EXPECT_NE(error_of([&] { render(source); }).find("may not hold a namespace or a function"),
              std::string::npos);
  }
  EXPECT_EQ(render("{% set ns = namespace(a=1) %}{% set ns.a = [ns.a, {'k': 2}] %}{{ ns.a }}"),
            "[1, {'k': 2}]");
}

}  // namespace
}  // namespace mtpx
