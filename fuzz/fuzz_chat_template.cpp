// libFuzzer target: the Jinja chat-template interpreter. The input is a template's source; it is parsed
// (lexer, parser) and rendered (interpreter, builtins, values) with a fixed conversation that has a system
// prompt, tools, an assistant tool call with reasoning, a tool result and template switches, as the
// server passes them. Syntax errors, runtime errors and raise_exception() must come back as mtpx::Error;
// runaway templates (deep nesting, huge repetition, endless loops) must be stopped the same way.
#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "server/chat_template.h"
#include "util/error.h"

namespace {

using nlohmann::ordered_json;

struct Conversation {
  ordered_json messages, tools, kwargs, special_tokens;
};

const Conversation& conversation() {
  static const Conversation c{
      ordered_json::parse(R"([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris? ünï 你好"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
         "tool_calls": [{"type": "function", "id": "call_1",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21.5}"},
        {"role": "user", "content": [1, 2.5, null, true]}
      ])"),
      ordered_json::parse(R"([{"type": "function", "function": {"name": "get_weather",
        "description": "Weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}])"),
      ordered_json::parse(R"({"enable_thinking": false, "bos_token": "<s>"})"),
      ordered_json::parse(R"({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})")};
  return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Conversation& c = conversation();
  try {
    const mtpx::server::ChatTemplate chat_template(mtpx::fuzz::as_text(data, size), c.special_tokens);
    (void)chat_template.apply(c.messages, c.tools, c.kwargs, /*add_generation_prompt=*/true);
  } catch (const mtpx::Error&) {
  }
  return 0;
}
