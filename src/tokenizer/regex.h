// PCRE2 (8-bit, UTF + UCP, JIT where available) regular expressions for the tokenizer, with the
// matching semantics of Hugging Face `tokenizers`, whose patterns are written for Oniguruma.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

namespace mtpx::tokenizer_internal {

// Rewrites an Oniguruma (Ruby syntax, UTF-8) pattern into a PCRE2 pattern with the same meaning where
// the two differ on the shorthand classes: Oniguruma's \s is exactly White_Space (PCRE2's also has
// U+180E), its \w is [\p{L}\p{M}\p{N}\p{Pc}] and its \h is a hexadecimal digit.
std::string onig_to_pcre2(std::string_view pattern);

class Regex {
 public:
  enum class Syntax { kOniguruma, kPcre2, kLiteral };
  // Throws std::invalid_argument with PCRE2's message if the pattern does not compile.
  Regex(std::string_view pattern, Syntax syntax);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Per-call match state (a regex is shared between threads, match data is not).
  class Scratch {
   public:
    explicit Scratch(const Regex& regex);
    ~Scratch();
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;

   private:
    friend class Regex;
    void* match_data_;
  };

  // Searches text (well-formed UTF-8) from byte offset `from`; sets [start, end) of the first match.
  bool search(std::string_view text, size_t from, Scratch& scratch, size_t& start, size_t& end,
              bool anchored = false) const;

  // Calls f(start, end) for every match, left to right and non-overlapping, as the `onig` crate's
  // find_iter does: an empty match right where the previous match ended is skipped.
  template <typename F>
  void for_each_match(std::string_view text, Scratch& scratch, F&& f) const {
    size_t from = 0;
    size_t last_end = std::string_view::npos;
    while (from <= text.size()) {
      size_t start = 0, end = 0;
      if (!search(text, from, scratch, start, end)) return;
      if (start == end && end == last_end) {
        from = next_char(text, from);
        continue;
      }
      f(start, end);
      from = end;
      last_end = end;
    }
  }

 private:
  static size_t next_char(std::string_view text, size_t pos);
  void* code_ = nullptr;
};

}  // namespace mtpx::tokenizer_internal
