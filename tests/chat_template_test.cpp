// The Jinja-subset interpreter against transformers: every golden in tests/fixtures/chat_template/
// goldens.json (scripts/make_chat_template_goldens.py) must render byte for byte, or fail where
// transformers failed.
#include "server/chat_template.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "server/jinja/template.h"
#include "test_paths.h"
#include "util/error.h"

namespace fs = std::filesystem;

namespace mtpx::server {
namespace {

const fs::path kTemplateFixtures = test_paths::kFixtures / "chat_template";

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

const nlohmann::ordered_json& goldens() {
  static const nlohmann::ordered_json g =
      nlohmann::ordered_json::parse(read_file(kTemplateFixtures / "goldens.json"));
  return g;
}

ChatTemplate template_named(const std::string& name) {
  if (name == "default") return *ChatTemplate::from_model_dir(test_paths::kDefaultModel);
  return ChatTemplate(read_file(kTemplateFixtures / (name + ".jinja")), goldens()["special_tokens"]);
}

TEST(ChatTemplate, ConversationsMatchTransformers) {
  int rendered = 0, failed_as_expected = 0;
  for (const auto& c : goldens()["cases"]) {
    const std::string label = c["template"].get<std::string>() + "/" + c["name"].get<std::string>();
    SCOPED_TRACE(label);
    const ChatTemplate t = template_named(c["template"]);
    if (c.contains("error")) {
      try {
        t.apply(c["messages"], c["tools"], c["kwargs"], true);
        ADD_FAILURE() << "expected the error: " << c["error"];
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(c["error"].get<std::string>()), std::string::npos) << e.what();
        ++failed_as_expected;
      }
      continue;
    }
    EXPECT_EQ(t.apply(c["messages"], c["tools"], c["kwargs"], true), c["expected"].get<std::string>());
    ++rendered;
  }
  EXPECT_GE(rendered, 25);
  EXPECT_GE(failed_as_expected, 3);
}

TEST(ChatTemplate, SnippetsMatchTransformersJinja) {
  for (const auto& s : goldens()["snippets"]) {
    const std::string source = s["source"];
    SCOPED_TRACE(source);
    const jinja::Value variables = jinja::Value::from_json(s["variables"]);
    try {
      const std::string out = jinja::Template::parse(source).render(variables.as_dict());
      if (s.contains("error")) {
        ADD_FAILURE() << "expected the error: " << s["error"] << ", got: " << out;
      } else {
        EXPECT_EQ(out, s["expected"].get<std::string>());
      }
    } catch (const Error& e) {
      EXPECT_TRUE(s.contains("error")) << e.what();
    }
  }
}

TEST(ChatTemplate, SyntaxErrorsNameTheLine) {
  for (const char* bad : {"{% if x %}never closed", "line\n{{ 1 + }}", "{% for %}{% endfor %}", "{{ 'open }}",
                          "{% include 'x' %}", "{{ (1 }}"}) {
    SCOPED_TRACE(bad);
    try {
      jinja::Template::parse(bad);
      ADD_FAILURE() << "parsed";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
      EXPECT_NE(std::string(e.what()).find("chat template line"), std::string::npos) << e.what();
    }
  }
}

TEST(ChatTemplate, ModelWithoutTemplateHasNone) {
  EXPECT_FALSE(ChatTemplate::from_model_dir(test_paths::kFixtures / "causal_f16_interval2").has_value());
  EXPECT_TRUE(ChatTemplate::from_model_dir(test_paths::kDefaultModel).has_value());
}

// A list of named templates whose entries are not all {"name": string, "template": string} objects: the
// well-formed default is found, and without one a one-line error (value() threw nlohmann's type_error).
TEST(ChatTemplate, MalformedNamedTemplateListsAreOneLineErrors) {
  const fs::path dir = fs::temp_directory_path() / ("mtpx_named_templates_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  auto load_with = [&](const std::string& list) {
    std::ofstream(dir / "tokenizer_config.json") << R"({"chat_template": )" << list << "}";
    return ChatTemplate::from_model_dir(dir);
  };
  const auto found = load_with(R"([1, {"name": {}}, {"name": "default", "template": "x"}])");
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->source(), "x");
  try {
    load_with(R"([1, "default", {"name": ["default"], "template": "x"}])");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("neither a string nor a list with a \"default\" template"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace mtpx::server
