#include "server/jinja/lexer.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>

#include "util/error.h"

namespace mtpx::jinja {
namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string rstrip(std::string_view s) {
  size_t end = s.size();
  while (end > 0 && is_space(s[end - 1])) --end;
  return std::string(s.substr(0, end));
}

// Jinja normalizes every line ending to "\n" and drops one final newline (keep_trailing_newline=False).
std::string normalize_newlines(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

// Reads tokens of one tag from source[pos] up to its closing delimiter ("}}" or "%}", optionally preceded
// by '-' or '+'), which is only recognized outside brackets (`{{ {'a': {}} }}`). Returns the position after
// the closer and the modifier found before it.
class TagTokenizer {
 public:
  TagTokenizer(const std::string& source, size_t pos, int line, char closer)
      : src_(source), pos_(pos), line_(line), closer_(closer) {}

  size_t run(std::vector<Token>& tokens, char& modifier) {
    std::vector<char> brackets;
    while (true) {
      skip_space();
      if (pos_ >= src_.size()) fail_here("unterminated tag");
      if (brackets.empty() && closes_at(pos_, modifier)) {
        tokens.push_back(Token{Token::Kind::kEnd, "", 0, 0.0, line_});
        return pos_ + (modifier ? 3 : 2);
      }
      const char c = src_[pos_];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t end = pos_;
        while (end < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[end])) || src_[end] == '_'))
          ++end;
        tokens.push_back(Token{Token::Kind::kName, src_.substr(pos_, end - pos_), 0, 0.0, line_});
        pos_ = end;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        tokens.push_back(number());
      } else if (c == '\'' || c == '"') {
        tokens.push_back(string_literal());
      } else {
        static const char* const kLong[] = {"//", "**", "==", "!=", ">=", "<="};
        std::string op(1, c);
        for (const char* candidate : kLong)
          if (src_.compare(pos_, 2, candidate) == 0) op = candidate;
        if (op.size() == 1 && std::string_view("+-*/%~|.,:()[]{}<>=").find(c) == std::string_view::npos)
          fail_here(std::string("unexpected character '") + c + "'");
        if (c == '(' || c == '[' || c == '{') brackets.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
        if ((c == ')' || c == ']' || c == '}') && op.size() == 1) {
          if (brackets.empty() || brackets.back() != c) fail_here(std::string("unexpected '") + c + "'");
          brackets.pop_back();
        }
        tokens.push_back(Token{Token::Kind::kOperator, op, 0, 0.0, line_});
        pos_ += op.size();
      }
    }
  }

  int line() const { return line_; }

 private:
  [[noreturn]] void fail_here(const std::string& what) const {
    invalid_input("chat template line {}: {}", line_, what);
  }

  void skip_space() {
    while (pos_ < src_.size() && is_space(src_[pos_])) {
      if (src_[pos_] == '\n') ++line_;
      ++pos_;
    }
  }

  bool closes_at(size_t p, char& modifier) const {
    modifier = 0;
    if ((src_[p] == '-' || src_[p] == '+') && p + 2 < src_.size() && src_[p + 1] == closer_ &&
        src_[p + 2] == '}') {
      modifier = src_[p];
      return true;
    }
    return p + 1 < src_.size() && src_[p] == closer_ && src_[p + 1] == '}';
  }

  Token number() {
    size_t end = pos_;
    bool is_float = false;
    auto digits = [&] {
      while (end < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[end])) || src_[end] == '_'))
        ++end;
    };
    digits();
    if (end + 1 < src_.size() && src_[end] == '.' &&
        std::isdigit(static_cast<unsigned char>(src_[end + 1]))) {
      is_float = true;
      ++end;
      digits();
    }
    if (end < src_.size() && (src_[end] == 'e' || src_[end] == 'E')) {
      size_t e = end + 1;
      if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) ++e;
      if (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) {
        is_float = true;
        end = e;
        digits();
      }
    }
    std::string text = src_.substr(pos_, end - pos_);
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    pos_ = end;
    Token t{is_float ? Token::Kind::kFloat : Token::Kind::kInt, text, 0, 0.0, line_};
    if (is_float) {
      // strtod, not stod: out-of-range literals become inf or 0 as in Python, instead of throwing.
      t.float_value = std::strtod(text.c_str(), nullptr);
    } else {
      const auto [end_of_number, error] =
          std::from_chars(text.data(), text.data() + text.size(), t.int_value);
      if (error != std::errc() || end_of_number != text.data() + text.size())
        fail_here("integer literal " + text.substr(0, 40) + " does not fit in 64 bits");
    }
    return t;
  }

  // Python string literal escapes (Jinja decodes literals with "unicode-escape").
  Token string_literal() {
    const char quote = src_[pos_++];
    const int start_line = line_;
    std::string value;
    while (true) {
      if (pos_ >= src_.size()) invalid_input("chat template line {}: unterminated string", start_line);
      const char c = src_[pos_++];
      if (c == quote) break;
      if (c == '\n') ++line_;
      if (c != '\\') {
        value += c;
        continue;
      }
      if (pos_ >= src_.size()) continue;
      const char e = src_[pos_++];
      switch (e) {
        case 'n':
          value += '\n';
          break;
        case 't':
          value += '\t';
          break;
        case 'r':
          value += '\r';
          break;
        case '0':
          value += '\0';
          break;
        case 'b':
          value += '\b';
          break;
        case 'f':
          value += '\f';
          break;
        case '\\':
        case '\'':
        case '"':
          value += e;
          break;
        case '\n':
          ++line_;  // line continuation
          break;
        case 'x':
        case 'u':
        case 'U': {
          // Exactly n hex digits (as Python reads them), naming a Unicode scalar value.
          const size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          uint32_t cp = 0;
          const char* digits = src_.data() + pos_;
          const auto [end, error] = std::from_chars(digits, digits + std::min(n, src_.size() - pos_), cp, 16);
          if (error != std::errc() || end != digits + n)
            fail_here(std::string("truncated \\") + e + " escape");
          if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            fail_here(fmt::format("\\{} escape of {:x} is not a Unicode character", e, cp));
          append_utf8(value, cp);
          pos_ += n;
          break;
        }
        default:
          value += '\\';  // unknown escapes stay as written, as in Python
          value += e;
      }
    }
    return Token{Token::Kind::kString, value, 0, 0.0, start_line};
  }

  const std::string& src_;
  size_t pos_;
  int line_;
  char closer_;
};

}  // namespace

std::vector<Segment> lex(std::string_view raw_source) {
  const std::string src = normalize_newlines(raw_source);
  std::vector<Segment> segments;
  size_t pos = 0;
  int line = 1;
  bool line_starting = true;  // the previous tag's match ended with a newline (or nothing came before)
  bool strip_next = false;    // the previous tag ended with '-'
  while (pos <= src.size()) {
    size_t tag = pos;
    while ((tag = src.find('{', tag)) != std::string::npos) {
      if (tag + 1 < src.size() && (src[tag + 1] == '{' || src[tag + 1] == '%' || src[tag + 1] == '#')) break;
      ++tag;
    }
    std::string text = src.substr(pos, (tag == std::string::npos ? src.size() : tag) - pos);
    if (strip_next) {
      size_t b = 0;
      while (b < text.size() && is_space(text[b])) ++b;
      text.erase(0, b);
    }
    const int text_line = line;
    line += static_cast<int>(std::count(
        src.begin() + static_cast<std::ptrdiff_t>(pos),
        src.begin() + static_cast<std::ptrdiff_t>(tag == std::string::npos ? src.size() : tag), '\n'));
    if (tag == std::string::npos) {
      if (!text.empty()) segments.push_back(Segment{Segment::Kind::kText, text, {}, text_line});
      break;
    }
    const char type = src[tag + 1];  // '{', '%' or '#'
    const char open_modifier =
        tag + 2 < src.size() && (src[tag + 2] == '-' || src[tag + 2] == '+') ? src[tag + 2] : 0;
    if (open_modifier == '-') {
      text = rstrip(text);
    } else if (open_modifier != '+' && type != '{') {
      // lstrip_blocks: a block or comment tag alone on its line takes the line's indentation with it.
      const size_t line_start = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
      if ((line_start > 0 || line_starting) && line_start < text.size() &&
          std::all_of(text.begin() + static_cast<std::ptrdiff_t>(line_start), text.end(), is_space))
        text.erase(line_start);
    }
    if (!text.empty()) segments.push_back(Segment{Segment::Kind::kText, text, {}, text_line});

    size_t after;
    char close_modifier = 0;
    const size_t content = tag + 2 + (open_modifier ? 1 : 0);
    if (type == '#') {
      size_t end = src.find("#}", content);
      if (end == std::string::npos) invalid_input("chat template line {}: unterminated comment", line);
      if (end > content && (src[end - 1] == '-' || src[end - 1] == '+')) close_modifier = src[end - 1];
      line += static_cast<int>(std::count(src.begin() + static_cast<std::ptrdiff_t>(tag),
                                          src.begin() + static_cast<std::ptrdiff_t>(end), '\n'));
      after = end + 2;
    } else {
      Segment segment{type == '{' ? Segment::Kind::kOutput : Segment::Kind::kStatement, "", {}, line};
      TagTokenizer tokenizer(src, content, line, type == '{' ? '}' : '%');
      after = tokenizer.run(segment.tokens, close_modifier);
      line = tokenizer.line();
      segments.push_back(std::move(segment));
    }
    strip_next = close_modifier == '-';
    // trim_blocks: the first newline after a block or comment tag goes.
    if (!close_modifier && type != '{' && after < src.size() && src[after] == '\n') {
      ++after;
      ++line;
      line_starting = true;
    } else {
      line_starting = false;
    }
    pos = after;
  }
  return segments;
}

}  // namespace mtpx::jinja
