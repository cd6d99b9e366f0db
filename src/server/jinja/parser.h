// Segments -> syntax tree, with Jinja's operator precedence (filters and tests bind tighter than any
// arithmetic: `messages|length - 1` is `(messages|length) - 1`).
#pragma once

#include <vector>

#include "server/jinja/ast.h"
#include "server/jinja/lexer.h"

namespace mtpx::jinja {

// Throws mtpx::Error (kInvalidInput) naming the line for a syntax error or an unsupported tag.
Body parse(const std::vector<Segment>& segments);

}  // namespace mtpx::jinja
