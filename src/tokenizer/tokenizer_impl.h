// The state behind mtpx::Tokenizer (its Impl), shared by tokenizer.cpp (encoding, decoding) and
// tokenizer_load.cpp (reading tokenizer.json).
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/bpe.h"
#include "tokenizer/regex.h"
#include "tokenizer/tokenizer.h"

namespace mtpx {
namespace tokenizer_internal {

// An entry of tokenizer.json's added_tokens.
struct AddedToken {
  int32_t id = 0;
  std::string content;  // NFC-normalized if `normalized` and the tokenizer normalizes
  bool special = false;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
};

// Finds added tokens in text: leftmost match first, the longest one at that position, non-overlapping
// (the aho-corasick LeftmostLongest semantics of the reference implementation).
class AddedTokenMatcher {
 public:
  void add(const AddedToken* token);
  bool empty() const { return count_ == 0; }
  struct Match {
    size_t start;
    size_t end;
    const AddedToken* token;
  };
  void find_all(std::string_view text, std::vector<Match>& matches) const;

 private:
  std::array<std::vector<const AddedToken*>, 256> by_first_byte_;  // longest first
  size_t count_ = 0;
};

struct TokenizerData {
  std::filesystem::path path;

  std::unique_ptr<BpeModel> model;
  std::vector<AddedToken> added_tokens;
  AddedTokenMatcher raw_matcher;         // added tokens with normalized=false
  AddedTokenMatcher normalized_matcher;  // added tokens with normalized=true
  std::unordered_map<std::string, int32_t> added_by_content;
  // \w of Rust's regex crate (Alphabetic, M, Nd, Pc, Join_Control): a word character next to a
  // single_word added token.
  std::unique_ptr<Regex> word_char;

  bool nfc = false;

  // Pre-tokenizer: the Split regexes (behavior Isolated) in order, then ByteLevel.
  std::vector<std::unique_ptr<Regex>> splits;
  bool add_prefix_space = false;
  std::unique_ptr<Regex> byte_level_regex;  // set when ByteLevel has use_regex

  // By id.
  enum class Kind : uint8_t { kNone, kModel, kAdded };
  std::vector<Kind> kinds;
  std::vector<std::string> pieces;  // as written in tokenizer.json
  std::vector<std::string> bytes;   // what the id decodes to
  std::vector<bool> special;

  void encode_segment(std::string_view text, std::vector<int32_t>& out) const;
  void check_id(int32_t id) const;
};

}  // namespace tokenizer_internal

struct Tokenizer::Impl : tokenizer_internal::TokenizerData {};

}  // namespace mtpx
