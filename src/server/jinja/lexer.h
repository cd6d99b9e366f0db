// Splits a template into text and tags, with the whitespace rules of transformers' Jinja environment
// (trim_blocks and lstrip_blocks on, `-` and `+` modifiers, one trailing newline dropped), and tokenizes
// the inside of each {{ ... }} and {% ... %} tag. Comments disappear here.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace mtpx::jinja {

struct Token {
  enum class Kind { kName, kString, kInt, kFloat, kOperator, kEnd };
  Kind kind = Kind::kEnd;
  std::string text;  // the name, the string's value (escapes resolved) or the operator
  int64_t int_value = 0;
  double float_value = 0.0;
  int line = 0;
};

struct Segment {
  enum class Kind { kText, kOutput, kStatement };  // text, {{ expression }}, {% statement %}
  Kind kind = Kind::kText;
  std::string text;           // kText
  std::vector<Token> tokens;  // kOutput / kStatement, ending with a kEnd token
  int line = 0;
};

// Throws mtpx::Error (kInvalidInput) naming the line for an unterminated tag or string.
std::vector<Segment> lex(std::string_view source);

}  // namespace mtpx::jinja
