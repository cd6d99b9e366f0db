// libFuzzer target: tool calls in generated text (Qwen's <tool_call> blocks, JSON and XML forms) -> OpenAI
// tool_calls, whole (extract_tool_calls) and streamed (ToolCallStream, the input cut into pieces at the
// positions its first bytes choose). Model output is text the server does not control. Both splits must
// agree on the calls, and every call's arguments must be a JSON object.
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "server/tool_calls.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = mtpx::fuzz::as_text(data, size);
  const mtpx::server::ContentAndToolCalls whole = mtpx::server::extract_tool_calls(text);
  for (const auto& call : whole.tool_calls) {
    if (!nlohmann::json::parse(call.arguments, nullptr, false).is_object()) std::abort();
  }

  mtpx::server::ToolCallStream stream;
  std::vector<mtpx::server::ToolCall> streamed;
  auto take = [&](std::vector<mtpx::server::ToolCallStream::Piece> pieces) {
    for (auto& piece : pieces)
      if (piece.call) streamed.push_back(std::move(*piece.call));
  };
  size_t pos = 0, step = 0;
  while (pos < text.size()) {
    const size_t length = 1 + static_cast<uint8_t>(text[step++ % text.size()]) % 16;
    take(stream.push(text.substr(pos, length)));
    pos += length;
  }
  take(stream.finish());
  if (streamed.size() != whole.tool_calls.size()) std::abort();
  for (size_t i = 0; i < streamed.size(); ++i) {
    if (streamed[i].name != whole.tool_calls[i].name ||
        streamed[i].arguments != whole.tool_calls[i].arguments)
      std::abort();
  }
  return 0;
}
