// UTF-8 and Unicode helpers of the tokenizer: validation, NFC, lossy decoding, the GPT-2 byte-level
// alphabet and the whitespace set that Oniguruma (the regex engine of Hugging Face `tokenizers`) and
// Rust's char::is_whitespace use.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mtpx::tokenizer_internal {

// The byte offset of the first byte that is not part of well-formed UTF-8 (Unicode 3.9, D92: no
// overlongs, surrogates or code points above U+10FFFF), or text.size() if all of it is well formed.
size_t find_invalid_utf8(std::string_view text);

// Decodes the code point starting at text[pos] of well-formed UTF-8 and sets `len` to its byte length.
char32_t decode_utf8(std::string_view text, size_t pos, size_t& len);
void append_utf8(std::string& out, char32_t cp);

// Unicode Normalization Form C of well-formed UTF-8 (ASCII passes through untouched).
std::string nfc(std::string_view text);

// Appends the well-formed characters of `bytes` to `out`, each maximal ill-formed subpart replaced by
// U+FFFD (as Rust's String::from_utf8_lossy and Python's errors="replace" do). Unless `final`, an
// incomplete but so far valid sequence at the end is left unconsumed. Returns the bytes consumed.
size_t append_lossy_utf8(std::string_view bytes, bool final, std::string& out);

// White_Space code points (Rust's char::is_whitespace; also Oniguruma's \s for UTF-8).
bool is_unicode_whitespace(char32_t cp);

// GPT-2's bytes_to_unicode(): each byte maps to one printable code point.
struct ByteLevelAlphabet {
  std::array<char32_t, 256> byte_to_cp{};
  std::array<std::string, 256> byte_to_utf8{};
  // Indexed by code point (all mapped code points are below 324); -1 where no byte maps to it.
  std::array<int16_t, 324> cp_to_byte{};
};
const ByteLevelAlphabet& byte_level_alphabet();

}  // namespace mtpx::tokenizer_internal
