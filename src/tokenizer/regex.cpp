#include "tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <stdexcept>

#include "util/error.h"

namespace mtpx::tokenizer_internal {
namespace {

// Oniguruma's \s for UTF-8: the White_Space code points.
constexpr std::string_view kSpaceItems =
    R"(\t\n\x{0B}\f\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
constexpr std::string_view kWordItems = R"(\p{L}\p{M}\p{N}\p{Pc})";
constexpr std::string_view kHexItems = "0-9a-fA-F";

pcre2_code* as_code(void* p) { return static_cast<pcre2_code*>(p); }
pcre2_match_data* as_match_data(void* p) { return static_cast<pcre2_match_data*>(p); }

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  const int n = pcre2_get_error_message(code, buffer, sizeof(buffer));
  return n < 0 ? fmt::format("PCRE2 error {}", code) : std::string(reinterpret_cast<const char*>(buffer));
}

// A per-thread match context with a JIT stack large enough for long whitespace runs.
struct ThreadMatchContext {
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  ThreadMatchContext() {
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, nullptr);
    if (context != nullptr && stack != nullptr) pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~ThreadMatchContext() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
  }
};

pcre2_match_context* thread_match_context() {
  thread_local ThreadMatchContext tmc;
  return tmc.context;
}

}  // namespace

std::string onig_to_pcre2(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() * 2);
  bool in_class = false;
  size_t i = 0;
  while (i < pattern.size()) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[i + 1];
      std::string_view items;
      bool negated = false;
      switch (e) {
        case 's':
          items = kSpaceItems;
          break;
        case 'S':
          items = kSpaceItems, negated = true;
          break;
        case 'w':
          items = kWordItems;
          break;
        case 'W':
          items = kWordItems, negated = true;
          break;
        case 'h':
          items = kHexItems;
          break;
        case 'H':
          items = kHexItems, negated = true;
          break;
        default:
          break;
      }
      if (items.empty() || (in_class && negated)) {
        // Copied as written (a negated shorthand inside a class cannot be spelled out in PCRE2; it keeps
        // PCRE2's meaning).
        out.append(pattern.substr(i, 2));
      } else if (in_class) {
        out.append(items);
      } else {
        out += negated ? "[^" : "[";
        out.append(items);
        out += ']';
      }
      i += 2;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      ++i;
      if (i < pattern.size() && pattern[i] == '^') out += pattern[i++];
      if (i < pattern.size() && pattern[i] == ']') out += pattern[i++];  // a literal ] first in the class
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      const size_t close = pattern.find(":]", i + 2);
      if (close != std::string_view::npos) {
        out.append(pattern.substr(i, close + 2 - i));
        i = close + 2;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
    ++i;
  }
  return out;
}

Regex::Regex(std::string_view pattern, Syntax syntax) {
  std::string translated;
  if (syntax == Syntax::kOniguruma) {
    translated = onig_to_pcre2(pattern);
    pattern = translated;
  }
  uint32_t options = PCRE2_UTF | PCRE2_UCP;
  if (syntax == Syntax::kLiteral) options |= PCRE2_LITERAL;
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options,
                                   &error, &offset, nullptr);
  if (code == nullptr) {
    throw std::invalid_argument(fmt::format("{} at offset {}", pcre2_message(error), offset));
  }
  // Without JIT (unsupported platform or failure) pcre2_match interprets the pattern.
  (void)pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(as_code(code_)); }

Regex::Scratch::Scratch(const Regex& regex)
    : match_data_(pcre2_match_data_create_from_pattern(as_code(regex.code_), nullptr)) {
  if (match_data_ == nullptr) throw std::bad_alloc();
}

Regex::Scratch::~Scratch() { pcre2_match_data_free(as_match_data(match_data_)); }

bool Regex::search(std::string_view text, size_t from, Scratch& scratch, size_t& start, size_t& end,
                   bool anchored) const {
  pcre2_match_data* md = as_match_data(scratch.match_data_);
  const uint32_t options = PCRE2_NO_UTF_CHECK | (anchored ? PCRE2_ANCHORED : 0);
  const int rc = pcre2_match(as_code(code_), reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), from,
                             options, md, thread_match_context());
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) invalid_input("regular expression matching failed: {}", pcre2_message(rc));
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(md);
  start = ovector[0];
  end = ovector[1];
  return true;
}

size_t Regex::next_char(std::string_view text, size_t pos) {
  if (pos >= text.size()) return pos + 1;
  ++pos;
  while (pos < text.size() && (static_cast<uint8_t>(text[pos]) & 0xC0) == 0x80) ++pos;
  return pos;
}

}  // namespace mtpx::tokenizer_internal
