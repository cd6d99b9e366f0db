// A small Jinja interpreter for chat templates: the subset that Hugging Face chat templates (Qwen's
// ChatML with tools and thinking, and similar) use, rendered the way transformers' apply_chat_template
// renders them (trim_blocks, lstrip_blocks, loop controls, its tojson and raise_exception).
//
// Supported: text, {{ expressions }}, {# comments #}, whitespace control (-, +); if/elif/else, for (with
// else, an `if` filter, tuple unpacking, loop.index/index0/first/last/length/revindex/previtem/nextitem/
// cycle), break/continue, set (names, tuples, namespace attributes, blocks), macro, filter blocks,
// generation blocks; literals, lists, dicts, tuples, attribute/subscript/slice access, calls with keyword
// arguments, `if`-`else` expressions, arithmetic, ~, comparisons, in / not in, and / or / not, filters
// and tests (builtins.h). Not supported: include/import/extends/blocks, recursive loops, call blocks.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "server/jinja/value.h"

namespace mtpx::jinja {

struct ParsedTemplate;

class Template {
 public:
  // Throws mtpx::Error (kInvalidInput) naming the line of a syntax error.
  static Template parse(std::string_view source);
  // Renders with `variables` (messages, tools, add_generation_prompt, ...) over the global functions.
  // Throws mtpx::Error (kInvalidInput) for a runtime error, including the template's raise_exception().
  std::string render(const Dict& variables) const;

 private:
  std::shared_ptr<const ParsedTemplate> parsed_;
};

}  // namespace mtpx::jinja
