#include "tokenizer/utf8.h"

#include <utf8proc.h>

#include <cstdlib>
#include <cstring>
#include <memory>

#include "util/error.h"

namespace mtpx::tokenizer_internal {
namespace {

// For a lead byte: the number of continuation bytes and the allowed range of the first one
// (Unicode Table 3-7, well-formed UTF-8 byte sequences). n < 0 marks a byte that cannot start one.
struct LeadInfo {
  int n;
  uint8_t lo, hi;
};

LeadInfo lead_info(uint8_t b) {
  if (b < 0x80) return {0, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {1, 0x80, 0xBF};
  if (b == 0xE0) return {2, 0xA0, 0xBF};
  if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) return {2, 0x80, 0xBF};
  if (b == 0xED) return {2, 0x80, 0x9F};
  if (b == 0xF0) return {3, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {3, 0x80, 0xBF};
  if (b == 0xF4) return {3, 0x80, 0x8F};
  return {-1, 0, 0};
}

// Length of the well-formed sequence at text[pos] (> 0), or -(bytes of the maximal ill-formed subpart)
// when it is ill-formed, or 0 when text ends in the middle of a so-far valid sequence.
int sequence_at(std::string_view text, size_t pos) {
  const auto b = static_cast<uint8_t>(text[pos]);
  const LeadInfo info = lead_info(b);
  if (info.n == 0) return 1;
  if (info.n < 0) return -1;
  for (int i = 1; i <= info.n; ++i) {
    if (pos + i >= text.size()) return 0;
    const auto c = static_cast<uint8_t>(text[pos + i]);
    const uint8_t lo = i == 1 ? info.lo : 0x80;
    const uint8_t hi = i == 1 ? info.hi : 0xBF;
    if (c < lo || c > hi) return -i;
  }
  return info.n + 1;
}

}  // namespace

size_t find_invalid_utf8(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    // ASCII fast path, eight bytes at a time.
    while (pos + 8 <= text.size()) {
      uint64_t word;
      std::memcpy(&word, text.data() + pos, 8);
      if (word & 0x8080808080808080ULL) break;
      pos += 8;
    }
    if (pos >= text.size()) break;
    const int len = sequence_at(text, pos);
    if (len <= 0) return pos;
    pos += static_cast<size_t>(len);
  }
  return text.size();
}

char32_t decode_utf8(std::string_view text, size_t pos, size_t& len) {
  const auto b = static_cast<uint8_t>(text[pos]);
  if (b < 0x80) {
    len = 1;
    return b;
  }
  int n;
  char32_t cp;
  if (b < 0xE0) {
    n = 1;
    cp = b & 0x1F;
  } else if (b < 0xF0) {
    n = 2;
    cp = b & 0x0F;
  } else {
    n = 3;
    cp = b & 0x07;
  }
  for (int i = 1; i <= n; ++i) cp = (cp << 6) | (static_cast<uint8_t>(text[pos + i]) & 0x3F);
  len = static_cast<size_t>(n) + 1;
  return cp;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string nfc(std::string_view text) {
  bool ascii = true;
  for (char c : text) {
    if (static_cast<uint8_t>(c) >= 0x80) {
      ascii = false;
      break;
    }
  }
  if (ascii) return std::string(text);
  // utf8proc 2.8 wrongly composes a Hangul LV syllable with U+11A7 (which is no trailing consonant) and
  // drops it. U+11A7 is a starter that composes with nothing, so normalizing around it is exact.
  constexpr std::string_view kU11A7 = "\xE1\x86\xA7";
  if (const size_t at = text.find(kU11A7); at != std::string_view::npos) {
    std::string out = nfc(text.substr(0, at));
    out += kU11A7;
    out += nfc(text.substr(at + kU11A7.size()));
    return out;
  }
  // utf8proc_map with an explicit length (utf8proc_NFC stops at the first NUL byte).
  utf8proc_uint8_t* mapped = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          static_cast<utf8proc_ssize_t>(text.size()), &mapped,
                                          static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owner(mapped, &std::free);
  if (n < 0) invalid_input("cannot NFC-normalize the text: {}", utf8proc_errmsg(n));
  return std::string(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n));
}

size_t append_lossy_utf8(std::string_view bytes, bool final, std::string& out) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    const int len = sequence_at(bytes, pos);
    if (len > 0) {
      out.append(bytes.data() + pos, static_cast<size_t>(len));
      pos += static_cast<size_t>(len);
    } else if (len < 0) {
      out += "\xEF\xBF\xBD";
      pos += static_cast<size_t>(-len);
    } else {  // a valid but incomplete sequence at the end
      if (!final) return pos;
      out += "\xEF\xBF\xBD";
      pos = bytes.size();
    }
  }
  return pos;
}

bool is_unicode_whitespace(char32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  if (cp < 0x85) return false;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
         cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

const ByteLevelAlphabet& byte_level_alphabet() {
  static const ByteLevelAlphabet alphabet = [] {
    ByteLevelAlphabet a;
    a.cp_to_byte.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t cp = printable ? static_cast<char32_t>(b) : next++;
      a.byte_to_cp[b] = cp;
      append_utf8(a.byte_to_utf8[b], cp);
      a.cp_to_byte[cp] = static_cast<int16_t>(b);
    }
    return a;
  }();
  return alphabet;
}

}  // namespace mtpx::tokenizer_internal
