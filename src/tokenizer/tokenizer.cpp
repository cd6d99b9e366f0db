// Encoding and decoding of mtpx::Tokenizer (reading tokenizer.json is in tokenizer_load.cpp). The
// steps follow Hugging Face `tokenizers` (Tokenizer::encode with add_special_tokens=false):
//   1. split out added tokens with normalized=false, on the raw text;
//   2. normalize (NFC) each remaining segment and split out added tokens with normalized=true;
//   3. pre-tokenize the rest: Split regexes (Isolated), then ByteLevel (optional prefix space, optional
//      GPT-2 regex, bytes -> printable code points);
//   4. BPE each pre-tokenized word.
#include <algorithm>
#include <cstring>

#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/utf8.h"
#include "util/error.h"

namespace mtpx {
namespace tokenizer_internal {

void AddedTokenMatcher::add(const AddedToken* token) {
  if (token->content.empty()) return;
  auto& list = by_first_byte_[static_cast<uint8_t>(token->content[0])];
  list.push_back(token);
  std::stable_sort(list.begin(), list.end(), [](const AddedToken* a, const AddedToken* b) {
    return a->content.size() > b->content.size();
  });
  ++count_;
}

void AddedTokenMatcher::find_all(std::string_view text, std::vector<Match>& matches) const {
  matches.clear();
  if (count_ == 0) return;
  size_t pos = 0;
  while (pos < text.size()) {
    const auto& candidates = by_first_byte_[static_cast<uint8_t>(text[pos])];
    const AddedToken* found = nullptr;
    for (const AddedToken* token : candidates) {
      const std::string& c = token->content;
      if (c.size() <= text.size() - pos && std::memcmp(text.data() + pos, c.data(), c.size()) == 0) {
        found = token;
        break;
      }
    }
    if (found == nullptr) {
      ++pos;
      continue;
    }
    matches.push_back(Match{pos, pos + found->content.size(), found});
    pos += found->content.size();
  }
}

namespace {

// Start of the last character of text (well-formed UTF-8, not empty).
size_t last_char_start(std::string_view text) {
  size_t pos = text.size() - 1;
  while (pos > 0 && (static_cast<uint8_t>(text[pos]) & 0xC0) == 0x80) --pos;
  return pos;
}

// The byte offset just past the last non-whitespace character (0 if all whitespace).
size_t space_leftmost_at_end(std::string_view text) {
  size_t end = text.size();
  while (end > 0) {
    const size_t start = last_char_start(text.substr(0, end));
    size_t len = 0;
    if (!is_unicode_whitespace(decode_utf8(text, start, len))) return end;
    end = start;
  }
  return 0;
}

// The byte length of the leading whitespace.
size_t space_rightmost_at_start(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t len = 0;
    if (!is_unicode_whitespace(decode_utf8(text, pos, len))) break;
    pos += len;
  }
  return pos;
}

// Splits text at the added tokens found by `matcher` (HF AddedVocabulary::find_matches): ids of the
// tokens go to `out`, the text between them to on_gap.
template <typename OnGap>
void split_added_tokens(const TokenizerData& impl, std::string_view text, const AddedTokenMatcher& matcher,
                        std::vector<int32_t>& out, OnGap&& on_gap) {
  if (text.empty()) return;
  if (matcher.empty()) {
    on_gap(text);
    return;
  }
  std::vector<AddedTokenMatcher::Match> matches;
  matcher.find_all(text, matches);
  std::unique_ptr<Regex::Scratch> word_scratch;
  const auto is_word_char_at = [&](size_t pos) {
    if (!word_scratch) word_scratch = std::make_unique<Regex::Scratch>(*impl.word_char);
    size_t s = 0, e = 0;
    return impl.word_char->search(text, pos, *word_scratch, s, e, /*anchored=*/true);
  };
  size_t start_offset = 0;
  for (const auto& match : matches) {
    size_t start = match.start;
    size_t stop = match.end;
    const AddedToken& token = *match.token;
    if (token.single_word) {
      const bool start_space = start == 0 || !is_word_char_at(last_char_start(text.substr(0, start)));
      const bool stop_space = stop == text.size() || !is_word_char_at(stop);
      if (!start_space || !stop_space) continue;
    }
    if (token.lstrip) start = std::max(space_leftmost_at_end(text.substr(0, start)), start_offset);
    if (token.rstrip) stop += space_rightmost_at_start(text.substr(stop));
    if (start_offset < start) on_gap(text.substr(start_offset, start - start_offset));
    out.push_back(token.id);
    start_offset = stop;
  }
  if (start_offset < text.size()) on_gap(text.substr(start_offset));
}

// Calls f on each piece of an Isolated split: every match and every gap between matches (non-empty).
template <typename F>
void split_isolated(const Regex& regex, Regex::Scratch& scratch, std::string_view text, F&& f) {
  size_t prev = 0;
  regex.for_each_match(text, scratch, [&](size_t start, size_t end) {
    if (prev < start) f(text.substr(prev, start - prev));
    if (start < end) f(text.substr(start, end - start));
    prev = end;
  });
  if (prev < text.size()) f(text.substr(prev));
}

struct PreTokenizeState {
  const TokenizerData& impl;
  std::vector<std::unique_ptr<Regex::Scratch>> split_scratch;
  std::unique_ptr<Regex::Scratch> byte_level_scratch;
  std::vector<int32_t>& out;

  PreTokenizeState(const TokenizerData& i, std::vector<int32_t>& o) : impl(i), out(o) {
    for (const auto& regex : impl.splits) split_scratch.push_back(std::make_unique<Regex::Scratch>(*regex));
    if (impl.byte_level_regex) byte_level_scratch = std::make_unique<Regex::Scratch>(*impl.byte_level_regex);
  }

  void run(std::string_view piece, size_t step) {
    if (piece.empty()) return;
    if (step < impl.splits.size()) {
      split_isolated(*impl.splits[step], *split_scratch[step], piece,
                     [&](std::string_view sub) { run(sub, step + 1); });
      return;
    }
    // ByteLevel.
    std::string prefixed;
    if (impl.add_prefix_space && piece[0] != ' ') {
      prefixed.reserve(piece.size() + 1);
      prefixed += ' ';
      prefixed += piece;
      piece = prefixed;
    }
    if (impl.byte_level_regex) {
      split_isolated(*impl.byte_level_regex, *byte_level_scratch, piece,
                     [&](std::string_view word) { impl.model->tokenize(word, out); });
    } else {
      impl.model->tokenize(piece, out);
    }
  }
};

}  // namespace
}  // namespace tokenizer_internal

using namespace tokenizer_internal;

void TokenizerData::encode_segment(std::string_view text, std::vector<int32_t>& out) const {
  PreTokenizeState state(*this, out);
  split_added_tokens(*this, text, raw_matcher, out, [&](std::string_view raw) {
    const std::string normalized = nfc ? tokenizer_internal::nfc(raw) : std::string(raw);
    split_added_tokens(*this, normalized, normalized_matcher, out,
                       [&](std::string_view piece) { state.run(piece, 0); });
  });
}

void TokenizerData::check_id(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= kinds.size()) {
    invalid_input("token id {} is outside the vocabulary (size {})", id, kinds.size());
  }
  if (kinds[static_cast<size_t>(id)] == Kind::kNone) {
    invalid_input("token id {} is not assigned to any token (vocabulary size {})", id, kinds.size());
  }
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  const size_t bad = find_invalid_utf8(text);
  if (bad != text.size())
    invalid_input("the text to encode is not valid UTF-8 (ill-formed byte at offset {})", bad);
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  impl_->encode_segment(text, ids);
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) {
    impl_->check_id(id);
    out += impl_->bytes[static_cast<size_t>(id)];
  }
  return out;
}

std::string Tokenizer::token_bytes(int32_t id) const {
  impl_->check_id(id);
  return impl_->bytes[static_cast<size_t>(id)];
}

std::string Tokenizer::token_piece(int32_t id) const {
  impl_->check_id(id);
  return impl_->pieces[static_cast<size_t>(id)];
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view piece) const {
  const std::string key(piece);
  if (auto it = impl_->added_by_content.find(key); it != impl_->added_by_content.end()) return it->second;
  const auto& vocab = impl_->model->vocab();
  if (auto it = vocab.find(key); it != vocab.end()) return it->second;
  return std::nullopt;
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->special.size() &&
         impl_->special[static_cast<size_t>(id)];
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->kinds.size()); }

std::string StreamDecoder::push(int32_t id) {
  pending_ += tokenizer_->token_bytes(id);
  std::string out;
  const size_t used = append_lossy_utf8(pending_, /*final=*/false, out);
  pending_.erase(0, used);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  append_lossy_utf8(pending_, /*final=*/true, out);
  pending_.clear();
  return out;
}

}  // namespace mtpx
