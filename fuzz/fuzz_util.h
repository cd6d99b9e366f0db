// Helpers shared by the libFuzzer targets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace mtpx::fuzz {

// The input as text (any bytes; parsers must cope with invalid UTF-8 and NULs).
inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// A file of the source tree (fixed inputs such as the shipped model's tokenizer), read once at start-up.
inline std::string read_source_file(const std::string& relative) {
  std::ifstream in(std::filesystem::path(MTPX_SOURCE_DIR) / relative, std::ios::binary);
  if (!in) throw std::runtime_error("fuzz target: cannot read " + relative);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace mtpx::fuzz
