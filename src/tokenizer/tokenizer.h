// Byte-level BPE tokenizer read from a Hugging Face tokenizer.json (the Qwen2/Qwen3/Qwen3.5 family):
// NFC normalization -> split out added/special tokens -> regex pre-tokenization (pattern read from the
// file) -> GPT-2 byte-to-unicode mapping -> BPE merges by rank. Decoding maps ids back to bytes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mtpx {

class Tokenizer {
 public:
  // Throws mtpx::Error (kInvalidInput) naming the file and the problem for anything it cannot use.
  static Tokenizer from_file(const std::filesystem::path& tokenizer_json);
  // The same from the file's text; `source` names it in error messages.
  static Tokenizer from_json(std::string_view json_text, const std::filesystem::path& source);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Encodes text as Hugging Face `tokenizers` does with add_special_tokens=false: added/special tokens
  // appearing in the text are recognized as single ids.
  std::vector<int32_t> encode(std::string_view text) const;
  // Decodes ids to bytes (UTF-8 text; may end in a partial character for a prefix of a sequence).
  // Special tokens are included as their content. Throws kInvalidInput for an id outside the vocabulary.
  std::string decode(std::span<const int32_t> ids) const;
  // The raw bytes one id stands for.
  std::string token_bytes(int32_t id) const;
  // The token's string as written in tokenizer.json (e.g. "Ġhello").
  std::string token_piece(int32_t id) const;
  std::optional<int32_t> token_to_id(std::string_view piece) const;
  bool is_special(int32_t id) const;
  // One more than the largest id the tokenizer knows (model embeddings may have more rows).
  int32_t vocab_size() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Turns a stream of ids into text that is emitted only at UTF-8 character boundaries, so that a
// character split across tokens is printed once, whole.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer) : tokenizer_(&tokenizer) {}
  std::string push(int32_t id);  // the newly completed text (possibly empty)
  std::string flush();           // whatever is pending (invalid bytes replaced by U+FFFD)

 private:
  const Tokenizer* tokenizer_;
  std::string pending_;
};

}  // namespace mtpx
