// Qwen tool calls in generated text -> OpenAI tool_calls. Qwen models write a call as
//   <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>
// (Qwen3) or, in the XML style of Qwen3-Coder / Qwen3.5 templates,
//   <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>
// A block that parses as neither stays in the text.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mtpx::server {

struct ToolCall {
  std::string id;  // "call_..." (unique per call)
  std::string name;
  std::string arguments;  // a JSON object, as text (OpenAI's function.arguments)
};

// The call written inside one <tool_call>...</tool_call> block, or nullopt.
std::optional<ToolCall> parse_tool_call(std::string_view body);

// Splits a whole generated text into the content outside the blocks (trimmed) and the calls.
struct ContentAndToolCalls {
  std::string content;
  std::vector<ToolCall> tool_calls;
};
ContentAndToolCalls extract_tool_calls(std::string_view text);

// The same split for streamed text: content is passed on as it comes, except a tail that could be the
// start of "<tool_call>" (held back) and a block (held until it closes, then emitted as one call).
// Whitespace before a call or at the end is dropped, as the whole-text split trims it.
class ToolCallStream {
 public:
  struct Piece {
    std::string content;  // text for the client, or empty when this is a call
    std::optional<ToolCall> call;
  };
  std::vector<Piece> push(std::string_view text);
  std::vector<Piece> finish();  // what was held back (an unclosed block is content)
  bool saw_tool_call() const { return saw_tool_call_; }

 private:
  void emit_content(std::string text, std::vector<Piece>& out);

  std::string buffer_;              // text not emitted yet
  std::string pending_whitespace_;  // whitespace-only content held until it is known to matter
  bool inside_block_ = false;
  bool saw_tool_call_ = false;
};

}  // namespace mtpx::server
