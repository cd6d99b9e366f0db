// The BPE model of a byte-level tokenizer: merges by rank over the bytes of one pre-tokenized word,
// exactly as Hugging Face `tokenizers` (models/bpe/word.rs) applies them.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mtpx::tokenizer_internal {

class BpeModel {
 public:
  struct Options {
    std::optional<int32_t> unk_id;  // model.unk_token's id
    bool fuse_unk = false;
    bool ignore_merges = false;
  };

  // vocab: piece -> id (pieces in the byte-level alphabet); merges: pairs of pieces, by rank.
  // Throws std::invalid_argument naming the offending merge (index and pieces) if a merge uses a piece
  // that is not in the vocabulary or produces one that is not.
  BpeModel(std::unordered_map<std::string, int32_t> vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, Options options);

  // Appends the ids of one pre-tokenized word given as raw bytes (before the byte-level mapping).
  // Throws mtpx::Error (kInvalidInput) for a byte whose piece is missing when there is no unk token.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  const std::unordered_map<std::string, int32_t>& vocab() const { return vocab_; }

 private:
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> vocab_;
  struct MergeValue {
    uint32_t rank;
    int32_t new_id;
  };
  std::unordered_map<uint64_t, MergeValue> merges_;  // key: (left id << 32) | right id
  std::array<int32_t, 256> byte_ids_{};              // id of each byte's one-character piece, or -1
  Options options_;

  static constexpr size_t kCacheMaxWordBytes = 256;
  static constexpr size_t kCacheCapacity = 200000;
  mutable std::shared_mutex cache_mutex_;
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

}  // namespace mtpx::tokenizer_internal
