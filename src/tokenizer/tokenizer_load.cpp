// Reading a Hugging Face tokenizer.json into mtpx::Tokenizer. Everything that could change the ids the
// reference implementation produces and that is not implemented here is rejected with an error naming
// the file and the field.
#include <algorithm>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "io/json_file.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/utf8.h"
#include "util/error.h"

namespace mtpx {

using json = nlohmann::json;
using namespace tokenizer_internal;

namespace {

// Ids index tables of every id up to the largest: a bound keeps one absurd id from allocating gigabytes.
// The same bound as config.json's vocab_size (4M; Qwen3.5 has 248k).
constexpr int64_t kMaxTokenId = int64_t{1} << 22;

// The GPT-2 pre-tokenization regex of ByteLevel(use_regex=true).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class Loader {
 public:
  explicit Loader(const std::filesystem::path& path) : path_(path) {}

  template <typename... Args>
  [[noreturn]] void fail(std::string_view field, fmt::format_string<Args...> format, Args&&... args) const {
    invalid_input("tokenizer file {}: {}: {}", path_.string(), field,
                  fmt::format(format, std::forward<Args>(args)...));
  }

  std::string type_of(const json& node, std::string_view field) const {
    if (!node.is_object()) fail(field, "expected an object, found {}", node.type_name());
    auto it = node.find("type");
    if (it == node.end() || !it->is_string()) fail(field, "missing \"type\"");
    return it->get<std::string>();
  }

  bool get_bool(const json& obj, const char* key, bool fallback, std::string_view field) const {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return fallback;
    if (!it->is_boolean()) fail(fmt::format("{}.{}", field, key), "expected true or false");
    return it->get<bool>();
  }

  // A field that may be absent, null or an empty string only.
  void require_empty_string(const json& obj, const char* key, std::string_view field) const {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return;
    if (!it->is_string() || !it->get<std::string>().empty()) {
      fail(fmt::format("{}.{}", field, key), "{} is not supported", it->dump());
    }
  }

  void load(std::string_view text, TokenizerData& impl);

 private:
  void load_model(const json& model, TokenizerData& impl);
  void load_added_tokens(const json& root, TokenizerData& impl);
  void load_normalizer(const json& node, std::string_view field, TokenizerData& impl);
  void load_pre_tokenizer(const json& node, std::string_view field, TokenizerData& impl, bool& byte_level);
  void check_decoder(const json& node, std::string_view field);
  std::unique_ptr<Regex> compile(std::string_view pattern, Regex::Syntax syntax,
                                 std::string_view field) const {
    try {
      return std::make_unique<Regex>(pattern, syntax);
    } catch (const std::invalid_argument& e) {
      fail(field, "cannot compile the pattern: {}", e.what());
    }
  }

  std::filesystem::path path_;
};

void Loader::load(std::string_view text, TokenizerData& impl) {
  const json root = parse_json_strict(text, fmt::format("tokenizer file {}", printable(path_.native())));
  if (!root.is_object()) fail("(top level)", "expected a JSON object, found {}", root.type_name());

  impl.path = path_;

  if (auto it = root.find("truncation"); it != root.end() && !it->is_null()) {
    fail("truncation", "truncation is not supported (it must be null)");
  }
  if (auto it = root.find("padding"); it != root.end() && !it->is_null()) {
    // Padding only changes a single encoding when its length is fixed.
    if (it->is_object() && it->contains("strategy") && (*it)["strategy"].is_object()) {
      fail("padding", "fixed-length padding is not supported");
    }
  }

  auto model = root.find("model");
  if (model == root.end() || model->is_null()) fail("model", "missing");
  auto normalizer = root.find("normalizer");
  if (normalizer != root.end()) load_normalizer(*normalizer, "normalizer", impl);
  load_model(*model, impl);
  load_added_tokens(root, impl);

  bool byte_level = false;
  auto pre_tokenizer = root.find("pre_tokenizer");
  if (pre_tokenizer == root.end() || pre_tokenizer->is_null()) {
    fail("pre_tokenizer", "missing (a ByteLevel pre-tokenizer is required)");
  }
  load_pre_tokenizer(*pre_tokenizer, "pre_tokenizer", impl, byte_level);
  if (!byte_level) fail("pre_tokenizer", "no ByteLevel pre-tokenizer (only byte-level BPE is supported)");

  auto decoder = root.find("decoder");
  if (decoder == root.end() || decoder->is_null())
    fail("decoder", "missing (a ByteLevel decoder is required)");
  check_decoder(*decoder, "decoder");
  // post_processor only adds tokens when special tokens are requested, which mtpx never does.
}

void Loader::load_model(const json& model, TokenizerData& impl) {
  if (!model.is_object()) fail("model", "expected an object, found {}", model.type_name());
  if (auto it = model.find("type"); it != model.end()) {
    if (!it->is_string()) fail("model.type", "expected a string");
    if (it->get<std::string>() != "BPE")
      fail("model.type", "\"{}\" is not supported (only BPE)", it->get<std::string>());
  }
  if (auto it = model.find("dropout"); it != model.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() != 0.0) fail("model.dropout", "BPE dropout is not supported");
  }
  require_empty_string(model, "continuing_subword_prefix", "model");
  require_empty_string(model, "end_of_word_suffix", "model");
  if (get_bool(model, "byte_fallback", false, "model"))
    fail("model.byte_fallback", "byte fallback is not supported");

  auto vocab_it = model.find("vocab");
  if (vocab_it == model.end() || !vocab_it->is_object()) fail("model.vocab", "missing or not an object");
  std::unordered_map<std::string, int32_t> vocab;
  vocab.reserve(vocab_it->size());
  int64_t max_id = -1;
  for (const auto& [piece, id] : vocab_it->items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= kMaxTokenId) {
      fail("model.vocab", "\"{}\" has id {}, expected an integer in [0, {})", piece, id.dump(), kMaxTokenId);
    }
    vocab.emplace(piece, static_cast<int32_t>(id.get<int64_t>()));
    max_id = std::max(max_id, id.get<int64_t>());
  }

  auto merges_it = model.find("merges");
  if (merges_it == model.end() || !merges_it->is_array()) fail("model.merges", "missing or not an array");
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(merges_it->size());
  for (size_t i = 0; i < merges_it->size(); ++i) {
    const json& merge = (*merges_it)[i];
    if (merge.is_string()) {  // legacy "a b"
      const std::string& s = merge.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos) fail(fmt::format("model.merges[{}]", i), "\"{}\" is not two pieces", s);
      merges.emplace_back(s.substr(0, space), s.substr(space + 1));
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
    } else {
      fail(fmt::format("model.merges[{}]", i), "expected \"a b\" or [\"a\", \"b\"], found {}", merge.dump());
    }
  }

  BpeModel::Options options;
  if (auto it = model.find("unk_token"); it != model.end() && !it->is_null()) {
    if (!it->is_string()) fail("model.unk_token", "expected a string or null");
    auto unk = vocab.find(it->get<std::string>());
    if (unk == vocab.end()) fail("model.unk_token", "\"{}\" is not in model.vocab", it->get<std::string>());
    options.unk_id = unk->second;
  }
  options.fuse_unk = get_bool(model, "fuse_unk", false, "model");
  options.ignore_merges = get_bool(model, "ignore_merges", false, "model");

  impl.kinds.assign(static_cast<size_t>(max_id + 1), TokenizerData::Kind::kNone);
  impl.pieces.assign(impl.kinds.size(), std::string());
  impl.bytes.assign(impl.kinds.size(), std::string());
  const ByteLevelAlphabet& alphabet = byte_level_alphabet();
  for (const auto& [piece, id] : vocab) {
    const auto index = static_cast<size_t>(id);
    if (impl.kinds[index] != TokenizerData::Kind::kNone) {
      fail("model.vocab", "id {} is used by both \"{}\" and \"{}\"", id, impl.pieces[index], piece);
    }
    impl.kinds[index] = TokenizerData::Kind::kModel;
    impl.pieces[index] = piece;
    // The ByteLevel decoder: every character back to its byte, or the piece as is if any character is
    // outside the byte-level alphabet.
    std::string decoded;
    bool all_mapped = find_invalid_utf8(piece) == piece.size();
    for (size_t pos = 0; all_mapped && pos < piece.size();) {
      size_t len = 0;
      const char32_t cp = decode_utf8(piece, pos, len);
      if (cp >= alphabet.cp_to_byte.size() || alphabet.cp_to_byte[cp] < 0) {
        all_mapped = false;
      } else {
        decoded += static_cast<char>(alphabet.cp_to_byte[cp]);
      }
      pos += len;
    }
    impl.bytes[index] = all_mapped ? std::move(decoded) : piece;
  }

  try {
    impl.model = std::make_unique<BpeModel>(std::move(vocab), merges, options);
  } catch (const std::invalid_argument& e) {
    fail("model.merges", "{}", e.what());
  }
}

void Loader::load_added_tokens(const json& root, TokenizerData& impl) {
  auto it = root.find("added_tokens");
  if (it == root.end() || it->is_null()) return;
  if (!it->is_array()) fail("added_tokens", "expected an array");
  for (size_t i = 0; i < it->size(); ++i) {
    const json& entry = (*it)[i];
    const std::string field = fmt::format("added_tokens[{}]", i);
    if (!entry.is_object()) fail(field, "expected an object");
    AddedToken token;
    auto id = entry.find("id");
    if (id == entry.end() || !id->is_number_integer() || id->get<int64_t>() < 0 ||
        id->get<int64_t>() >= kMaxTokenId) {
      fail(field + ".id", "missing or not an integer in [0, {})", kMaxTokenId);
    }
    token.id = static_cast<int32_t>(id->get<int64_t>());
    auto content = entry.find("content");
    if (content == entry.end() || !content->is_string()) fail(field + ".content", "missing or not a string");
    token.content = content->get<std::string>();
    if (find_invalid_utf8(token.content) != token.content.size()) fail(field + ".content", "not valid UTF-8");
    token.special = get_bool(entry, "special", false, field);
    token.single_word = get_bool(entry, "single_word", false, field);
    token.lstrip = get_bool(entry, "lstrip", false, field);
    token.rstrip = get_bool(entry, "rstrip", false, field);
    token.normalized = get_bool(entry, "normalized", true, field);
    impl.added_tokens.push_back(std::move(token));
  }

  for (const AddedToken& token : impl.added_tokens) {
    const auto index = static_cast<size_t>(token.id);
    if (index >= impl.kinds.size()) {
      impl.kinds.resize(index + 1, TokenizerData::Kind::kNone);
      impl.pieces.resize(index + 1);
      impl.bytes.resize(index + 1);
    }
    impl.kinds[index] = TokenizerData::Kind::kAdded;
    impl.added_by_content[token.content] = token.id;
  }
  impl.special.assign(impl.kinds.size(), false);
  for (AddedToken& token : impl.added_tokens) {
    const auto index = static_cast<size_t>(token.id);
    impl.special[index] = token.special;
    // Tokens with normalized=true are looked for in the normalized text, in their normalized form, and
    // (as in the reference implementation) that is also the form they decode to.
    if (token.normalized && impl.nfc) token.content = nfc(token.content);
    impl.pieces[index] = token.content;
    impl.bytes[index] = token.content;
  }
  bool single_word = false;
  for (const AddedToken& token : impl.added_tokens) {
    (token.normalized ? impl.normalized_matcher : impl.raw_matcher).add(&token);
    single_word = single_word || token.single_word;
  }
  if (single_word)
    impl.word_char = compile(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}])", Regex::Syntax::kPcre2,
                             "added_tokens");
}

void Loader::load_normalizer(const json& node, std::string_view field, TokenizerData& impl) {
  if (node.is_null()) return;
  const std::string type = type_of(node, field);
  if (type == "NFC") {
    impl.nfc = true;
  } else if (type == "Sequence") {
    auto list = node.find("normalizers");
    if (list == node.end() || !list->is_array()) fail(field, "Sequence without a \"normalizers\" array");
    for (size_t i = 0; i < list->size(); ++i)
      load_normalizer((*list)[i], fmt::format("{}.normalizers[{}]", field, i), impl);
  } else {
    fail(field, "normalizer \"{}\" is not supported (only NFC)", type);
  }
}

void Loader::load_pre_tokenizer(const json& node, std::string_view field, TokenizerData& impl,
                                bool& byte_level) {
  const std::string type = type_of(node, field);
  if (type == "Sequence") {
    auto list = node.find("pretokenizers");
    if (list == node.end() || !list->is_array()) fail(field, "Sequence without a \"pretokenizers\" array");
    for (size_t i = 0; i < list->size(); ++i) {
      load_pre_tokenizer((*list)[i], fmt::format("{}.pretokenizers[{}]", field, i), impl, byte_level);
    }
    return;
  }
  if (byte_level) fail(field, "a pre-tokenizer after ByteLevel is not supported");
  if (type == "Split") {
    auto behavior = node.find("behavior");
    if (behavior == node.end() || !behavior->is_string() || behavior->get<std::string>() != "Isolated") {
      fail(fmt::format("{}.behavior", field), "{} is not supported (only \"Isolated\")",
           behavior == node.end() ? "a missing behavior" : behavior->dump());
    }
    if (get_bool(node, "invert", false, field))
      fail(fmt::format("{}.invert", field), "invert is not supported");
    auto pattern = node.find("pattern");
    if (pattern == node.end() || !pattern->is_object()) fail(fmt::format("{}.pattern", field), "missing");
    const std::string pattern_field = fmt::format("{}.pattern", field);
    if (auto regex = pattern->find("Regex"); regex != pattern->end() && regex->is_string()) {
      impl.splits.push_back(compile(regex->get<std::string>(), Regex::Syntax::kOniguruma, pattern_field));
    } else if (auto literal = pattern->find("String"); literal != pattern->end() && literal->is_string()) {
      impl.splits.push_back(compile(literal->get<std::string>(), Regex::Syntax::kLiteral, pattern_field));
    } else {
      fail(pattern_field, "expected {{\"Regex\": ...}} or {{\"String\": ...}}");
    }
  } else if (type == "ByteLevel") {
    byte_level = true;
    impl.add_prefix_space = get_bool(node, "add_prefix_space", true, field);
    if (get_bool(node, "use_regex", true, field)) {
      impl.byte_level_regex = compile(kGpt2Pattern, Regex::Syntax::kOniguruma, field);
    }
  } else {
    fail(field, "pre-tokenizer \"{}\" is not supported (only Split and ByteLevel)", type);
  }
}

void Loader::check_decoder(const json& node, std::string_view field) {
  const std::string type = type_of(node, field);
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    auto list = node.find("decoders");
    if (list == node.end() || !list->is_array() || list->empty()) fail(field, "Sequence without decoders");
    for (size_t i = 0; i < list->size(); ++i)
      check_decoder((*list)[i], fmt::format("{}.decoders[{}]", field, i));
    return;
  }
  fail(field, "decoder \"{}\" is not supported (only ByteLevel)", type);
}

}  // namespace

Tokenizer Tokenizer::from_file(const std::filesystem::path& tokenizer_json) {
  return from_json(read_small_file(tokenizer_json, kMaxTokenizerFileBytes), tokenizer_json);
}

Tokenizer Tokenizer::from_json(std::string_view json_text, const std::filesystem::path& source) {
  auto impl = std::make_unique<Impl>();
  Loader(source).load(json_text, *impl);
  return Tokenizer(std::move(impl));
}

}  // namespace mtpx
