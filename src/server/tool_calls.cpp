#include "server/tool_calls.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <random>

#include "server/text_stream.h"

namespace mtpx::server {
namespace {

constexpr std::string_view kOpen = "<tool_call>";
constexpr std::string_view kClose = "</tool_call>";

std::string new_call_id() {
  thread_local std::mt19937_64 rng(
      std::random_device{}() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  return fmt::format("call_{:016x}{:08x}", rng(), static_cast<uint32_t>(rng()));
}

std::string_view trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

// {"name": ..., "arguments": {...}} (arguments may also be a JSON string holding an object).
std::optional<ToolCall> parse_json_call(std::string_view body) {
  const auto json = nlohmann::ordered_json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object() || !json.contains("name") || !json["name"].is_string()) return std::nullopt;
  ToolCall call;
  call.name = json["name"];
  const auto arguments = json.contains("arguments") ? json["arguments"] : nlohmann::ordered_json::object();
  if (arguments.is_string()) {
    // Passed on as written, but only when it holds an object: tool_calls promise JSON object text.
    call.arguments = arguments.get<std::string>();
    if (!nlohmann::ordered_json::parse(call.arguments, nullptr, /*allow_exceptions=*/false).is_object())
      return std::nullopt;
  } else if (arguments.is_object()) {
    call.arguments = arguments.dump();
  } else {
    return std::nullopt;
  }
  call.id = new_call_id();
  return call;
}

// <function=name><parameter=key>value</parameter>...</function>; a value that parses as JSON keeps its
// type (numbers, booleans, objects), anything else is a string.
std::optional<ToolCall> parse_xml_call(std::string_view body) {
  constexpr std::string_view kFunction = "<function=";
  const size_t f = body.find(kFunction);
  if (f == std::string_view::npos) return std::nullopt;
  const size_t name_end = body.find('>', f);
  if (name_end == std::string_view::npos) return std::nullopt;
  ToolCall call;
  call.name = std::string(trim(body.substr(f + kFunction.size(), name_end - f - kFunction.size())));
  if (call.name.empty()) return std::nullopt;
  nlohmann::ordered_json arguments = nlohmann::ordered_json::object();
  constexpr std::string_view kParameter = "<parameter=", kParameterEnd = "</parameter>";
  size_t pos = name_end + 1;
  while (true) {
    const size_t p = body.find(kParameter, pos);
    if (p == std::string_view::npos) break;
    const size_t key_end = body.find('>', p);
    const size_t value_end = body.find(kParameterEnd, key_end == std::string_view::npos ? p : key_end);
    if (key_end == std::string_view::npos || value_end == std::string_view::npos) return std::nullopt;
    std::string_view value = body.substr(key_end + 1, value_end - key_end - 1);
    if (!value.empty() && value.front() == '\n') value.remove_prefix(1);
    if (!value.empty() && value.back() == '\n') value.remove_suffix(1);
    const std::string key(trim(body.substr(p + kParameter.size(), key_end - p - kParameter.size())));
    auto parsed = nlohmann::ordered_json::parse(value, nullptr, /*allow_exceptions=*/false);
    arguments[key] = parsed.is_discarded() ? nlohmann::ordered_json(std::string(value)) : parsed;
    pos = value_end + kParameterEnd.size();
  }
  // Keys and values are raw model text: bytes that are not UTF-8 become U+FFFD instead of a throw.
  call.arguments = arguments.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  call.id = new_call_id();
  return call;
}

}  // namespace

std::optional<ToolCall> parse_tool_call(std::string_view body) {
  const std::string_view inner = trim(body);
  if (!inner.empty() && inner.front() == '{') return parse_json_call(inner);
  return parse_xml_call(inner);
}

ContentAndToolCalls extract_tool_calls(std::string_view text) {
  ToolCallStream stream;
  std::vector<ToolCallStream::Piece> pieces = stream.push(text);
  for (auto& piece : stream.finish()) pieces.push_back(std::move(piece));
  ContentAndToolCalls out;
  for (auto& piece : pieces) {
    if (piece.call) {
      out.tool_calls.push_back(std::move(*piece.call));
    } else {
      out.content += piece.content;
    }
  }
  out.content = std::string(trim(out.content));
  return out;
}

void ToolCallStream::emit_content(std::string text, std::vector<Piece>& out) {
  // Trailing whitespace waits: it is sent only if more content follows (not a call, not the end).
  const size_t end = text.find_last_not_of(" \t\r\n");
  if (end == std::string::npos) {
    pending_whitespace_ += text;
    return;
  }
  std::string body = std::move(pending_whitespace_) + text.substr(0, end + 1);
  pending_whitespace_ = text.substr(end + 1);
  out.push_back(Piece{std::move(body), std::nullopt});
}

std::vector<ToolCallStream::Piece> ToolCallStream::push(std::string_view text) {
  std::vector<Piece> out;
  buffer_ += text;
  while (true) {
    if (!inside_block_) {
      const size_t open = buffer_.find(kOpen);
      if (open == std::string::npos) {
        const size_t keep = partial_stop_suffix(buffer_, {std::string(kOpen)});
        emit_content(buffer_.substr(0, buffer_.size() - keep), out);
        buffer_.erase(0, buffer_.size() - keep);
        return out;
      }
      emit_content(buffer_.substr(0, open), out);
      buffer_.erase(0, open + kOpen.size());
      inside_block_ = true;
    }
    const size_t close = buffer_.find(kClose);
    if (close == std::string::npos) return out;  // the block is still being written
    std::optional<ToolCall> call = parse_tool_call(std::string_view(buffer_).substr(0, close));
    if (call) {
      pending_whitespace_.clear();
      out.push_back(Piece{"", std::move(call)});
      saw_tool_call_ = true;
    } else {
      emit_content(std::string(kOpen) + buffer_.substr(0, close + kClose.size()), out);
    }
    buffer_.erase(0, close + kClose.size());
    inside_block_ = false;
  }
}

std::vector<ToolCallStream::Piece> ToolCallStream::finish() {
  std::vector<Piece> out;
  std::string rest = inside_block_ ? std::string(kOpen) + buffer_ : buffer_;
  buffer_.clear();
  inside_block_ = false;
  emit_content(std::move(rest), out);
  pending_whitespace_.clear();
  return out;
}

}  // namespace mtpx::server
