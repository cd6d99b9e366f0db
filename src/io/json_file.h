// Reading the small files of a model directory (config.json, the index, tokenizer.json, templates) without
// trusting them: only regular files (a FIFO would block the open, /dev/zero would never end), at most a
// given size (read before anything is parsed), and JSON that is neither ambiguous (duplicate keys) nor
// nested deep enough to exhaust the stack of a recursive consumer.
#pragma once

#include <cstddef>
#include <filesystem>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

namespace mtpx {

// Sizes well above what real checkpoints ship (config.json: a few KB, the index: ~100 KB, the
// tokenizer.json of a 250k-token vocabulary: ~10-20 MB) and far below what would make parsing them an
// allocation storm.
constexpr size_t kMaxConfigFileBytes = size_t{16} << 20;
constexpr size_t kMaxTokenizerFileBytes = size_t{128} << 20;
// Real model files nest JSON 6 levels deep at most.
constexpr int kMaxJsonDepth = 64;

// The whole content of a regular file of at most `max_bytes`. Errors (kNotFound when absent, else
// kInvalidInput) name the file: not a regular file, too large, unreadable.
std::string read_small_file(const std::filesystem::path& path, size_t max_bytes);

// Parses JSON text, rejecting duplicate keys in any object (nlohmann::json would keep the last one
// silently, Python's json module too, so two readers could see two different models) and nesting
// deeper than kMaxJsonDepth. `describe` starts every error message ("invalid index 'x.json'").
nlohmann::json parse_json_strict(std::string_view text, const std::string& describe);

// parse_json_strict for text read from `source` (a file name): messages start "'source': ".
nlohmann::json parse_json_text(std::string_view text, const std::string& source);

// read_small_file + parse_json_text, with kMaxConfigFileBytes; messages name the file.
nlohmann::json read_json_file(const std::filesystem::path& path);

// Text for an error message, kept on one line and short: control bytes are written as \xNN, and text
// beyond 512 bytes (a hostile tensor name can be megabytes long) is cut and ends in "...".
std::string printable(std::string_view text);

}  // namespace mtpx
