#include "server/chat_template.h"

#include "io/model_config.h"
#include "util/error.h"

namespace mtpx::server {

std::optional<ChatTemplate> ChatTemplate::from_model_dir(const std::filesystem::path& dir) {
  nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object();
  nlohmann::json config;
  const auto config_path = dir / "tokenizer_config.json";
  if (std::filesystem::exists(config_path)) config = read_json_file(config_path);
  // transformers passes the named special tokens that are set (its special_tokens_map).
  for (const char* name :
       {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    if (!config.contains(name)) continue;
    const auto& token = config[name];
    if (token.is_string()) special_tokens[name] = token.get<std::string>();
    if (token.is_object() && token.contains("content") && token["content"].is_string())
      special_tokens[name] = token["content"].get<std::string>();
  }

  const auto jinja_path = dir / "chat_template.jinja";
  if (std::filesystem::exists(jinja_path)) {
    return ChatTemplate(read_small_file(jinja_path, kMaxConfigFileBytes), special_tokens);
  }
  if (!config.contains("chat_template")) return std::nullopt;
  const auto& templates = config["chat_template"];
  if (templates.is_string()) return ChatTemplate(templates.get<std::string>(), special_tokens);
  if (templates.is_array())
    for (const auto& named : templates)
      if (named.is_object() && named.contains("name") && named["name"] == "default" &&
          named.contains("template") && named["template"].is_string())
        return ChatTemplate(named["template"].get<std::string>(), special_tokens);
  invalid_input("{}: \"chat_template\" is neither a string nor a list with a \"default\" template",
                config_path.string());
}

ChatTemplate::ChatTemplate(std::string_view source, nlohmann::ordered_json special_tokens)
    : source_(source),
      template_(jinja::Template::parse(source)),
      special_tokens_(std::move(special_tokens)) {}

std::string ChatTemplate::apply(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                const nlohmann::ordered_json& template_kwargs,
                                bool add_generation_prompt) const {
  // The variables of transformers' render call: special tokens, overridden by the caller's kwargs, then
  // the fixed arguments.
  jinja::Dict variables;
  auto set = [&](const std::string& name, jinja::Value value) {
    for (auto& [key, existing] : variables)
      if (key == name) {
        existing = std::move(value);
        return;
      }
    variables.emplace_back(name, std::move(value));
  };
  for (const auto& [name, value] : special_tokens_.items()) set(name, jinja::Value::from_json(value));
  if (template_kwargs.is_object())
    for (const auto& [name, value] : template_kwargs.items()) set(name, jinja::Value::from_json(value));
  set("messages", jinja::Value::from_json(messages));
  set("tools", tools.is_null() ? jinja::Value::none() : jinja::Value::from_json(tools));
  set("documents", jinja::Value::none());
  set("add_generation_prompt", jinja::Value(add_generation_prompt));
  return template_.render(variables);
}

}  // namespace mtpx::server
