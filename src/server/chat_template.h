// A model's chat template: messages (+ tools, + template switches such as enable_thinking) -> the prompt
// text, exactly as transformers' tokenizer.apply_chat_template(..., tokenize=False) writes it.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "server/jinja/template.h"

namespace mtpx::server {

class ChatTemplate {
 public:
  // The template of a Hugging Face model directory: chat_template.jinja, else tokenizer_config.json's
  // "chat_template" (a string, or a list of named templates, of which "default"), with the named special
  // tokens of tokenizer_config.json (bos_token, eos_token, ...). nullopt when the model has no template.
  static std::optional<ChatTemplate> from_model_dir(const std::filesystem::path& dir);

  // `special_tokens`: {"eos_token": "<|im_end|>", ...}, passed to the template as transformers does.
  ChatTemplate(std::string_view source, nlohmann::ordered_json special_tokens);

  // messages: a JSON array of message objects (role, content, tool_calls, ...); tools: an array, or null
  // for none; template_kwargs: an object of extra variables (chat_template_kwargs, e.g. enable_thinking).
  // Throws mtpx::Error (kInvalidInput) when the template fails or raises.
  std::string apply(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                    const nlohmann::ordered_json& template_kwargs, bool add_generation_prompt) const;

  const std::string& source() const { return source_; }

 private:
  std::string source_;
  jinja::Template template_;
  nlohmann::ordered_json special_tokens_;
};

}  // namespace mtpx::server
