// Parity of mtpx::Tokenizer with Hugging Face `tokenizers`: the goldens under tests/data/tokenizers/
// come from scripts/make_tokenizer_goldens.py (the real library encoding a multilingual corpus with
// small Qwen-style byte-level BPE tokenizers).
#include "tokenizer/tokenizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "util/error.h"

namespace mtpx {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const fs::path kDataDir = fs::path(MTPX_SOURCE_DIR) / "tests" / "data" / "tokenizers";

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

const json& goldens() {
  static const json data = json::parse(read_file(kDataDir / "goldens.json"));
  return data;
}

const std::vector<std::string>& corpus() {
  static const std::vector<std::string> texts = json::parse(read_file(kDataDir / "corpus.json"));
  return texts;
}

const json& golden_for(const std::string& name) {
  for (const json& entry : goldens()["tokenizers"]) {
    if (entry["name"] == name) return entry;
  }
  throw std::runtime_error("no goldens for " + name);
}

const Tokenizer& tokenizer_named(const std::string& name) {
  static std::map<std::string, Tokenizer> cache;
  auto it = cache.find(name);
  if (it == cache.end()) {
    it = cache.emplace(name, Tokenizer::from_file(kDataDir / golden_for(name)["file"].get<std::string>()))
             .first;
  }
  return it->second;
}

// Well-formed UTF-8 check, written independently of the library's.
bool is_valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    int n;
    char32_t cp;
    if (b < 0x80) {
      ++i;
      continue;
    } else if ((b & 0xE0) == 0xC0) {
      n = 1, cp = b & 0x1F;
    } else if ((b & 0xF0) == 0xE0) {
      n = 2, cp = b & 0x0F;
    } else if ((b & 0xF8) == 0xF0) {
      n = 3, cp = b & 0x07;
    } else {
      return false;
    }
    for (int k = 1; k <= n; ++k) {
      if (i + k >= s.size()) return false;
      const auto c = static_cast<unsigned char>(s[i + k]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3F);
    }
    static constexpr char32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += static_cast<size_t>(n) + 1;
  }
  return true;
}

std::string excerpt(const std::string& text) {
  std::string out = json(text.substr(0, 80)).dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 80) out += "...";
  return out;
}

std::vector<std::string> tokenizer_names() {
  std::vector<std::string> names;
  for (const json& entry : goldens()["tokenizers"]) names.push_back(entry["name"].get<std::string>());
  return names;
}

class TokenizerGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerGoldenTest, IdsMatchReference) {
  const Tokenizer& tok = tokenizer_named(GetParam());
  const json& results = golden_for(GetParam())["results"];
  ASSERT_EQ(results.size(), corpus().size());
  int failures = 0;
  for (size_t i = 0; i < corpus().size(); ++i) {
    const std::string& text = corpus()[i];
    const std::vector<int32_t> expected = results[i]["ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> actual = tok.encode(text);
    if (actual == expected) continue;
    size_t diff = 0;
    while (diff < actual.size() && diff < expected.size() && actual[diff] == expected[diff]) ++diff;
    ADD_FAILURE() << GetParam() << ": text " << i << " " << excerpt(text)
                  << ": first difference at id position " << diff << " of " << expected.size()
                  << " (expected " << (diff < expected.size() ? std::to_string(expected[diff]) : "end")
                  << ", got " << (diff < actual.size() ? std::to_string(actual[diff]) : "end") << ")";
    if (++failures >= 10) break;
  }
}

TEST_P(TokenizerGoldenTest, DecodeMatchesReference) {
  const Tokenizer& tok = tokenizer_named(GetParam());
  const json& golden = golden_for(GetParam());
  const json& results = golden["results"];
  const bool nfc = golden["normalizer_nfc"].get<bool>();
  size_t round_trips = 0;
  for (size_t i = 0; i < corpus().size(); ++i) {
    const std::vector<int32_t> ids = results[i]["ids"].get<std::vector<int32_t>>();
    const std::string decoded = tok.decode(ids);
    EXPECT_EQ(decoded, results[i]["decoded"].get<std::string>()) << GetParam() << ": text " << i;
    // Where the reference decodes back to the (normalized) text, so must we, from our own encoding.
    const std::string expected = nfc ? goldens()["nfc"][i].get<std::string>() : corpus()[i];
    if (results[i]["decoded"].get<std::string>() == expected) {
      EXPECT_EQ(tok.decode(tok.encode(corpus()[i])), expected) << GetParam() << ": text " << i;
      ++round_trips;
    }
  }
  // Only the tokenizer that adds a prefix space never round-trips.
  if (GetParam().find("prefix") == std::string::npos) {
    EXPECT_GT(round_trips, corpus().size() * 3 / 4);
  }
}

TEST_P(TokenizerGoldenTest, StreamDecoderEmitsWholeCharacters) {
  const Tokenizer& tok = tokenizer_named(GetParam());
  const json& results = golden_for(GetParam())["results"];
  for (size_t i = 0; i < corpus().size(); ++i) {
    const std::vector<int32_t> ids = results[i]["ids"].get<std::vector<int32_t>>();
    StreamDecoder stream(tok);
    std::string joined;
    for (int32_t id : ids) {
      const std::string chunk = stream.push(id);
      ASSERT_TRUE(is_valid_utf8(chunk)) << GetParam() << ": text " << i << " chunk " << excerpt(chunk);
      joined += chunk;
    }
    const std::string rest = stream.flush();
    EXPECT_TRUE(rest.empty()) << GetParam() << ": text " << i;
    joined += rest;
    EXPECT_EQ(joined, tok.decode(ids)) << GetParam() << ": text " << i;
  }
}

TEST_P(TokenizerGoldenTest, VocabularyQueries) {
  const Tokenizer& tok = tokenizer_named(GetParam());
  EXPECT_EQ(tok.vocab_size(), golden_for(GetParam())["vocab_size"].get<int32_t>());
  for (const char* special : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    const auto id = tok.token_to_id(special);
    ASSERT_TRUE(id.has_value()) << special;
    EXPECT_TRUE(tok.is_special(*id));
    EXPECT_EQ(tok.token_piece(*id), special);
    EXPECT_EQ(tok.token_bytes(*id), special);
    EXPECT_EQ(tok.encode(special), std::vector<int32_t>{*id});
  }
  const auto space_h = tok.token_to_id("Ġ");
  ASSERT_TRUE(space_h.has_value());
  EXPECT_EQ(tok.token_bytes(*space_h), " ");
  EXPECT_FALSE(tok.is_special(*space_h));
  EXPECT_FALSE(tok.token_to_id("no such piece here").has_value());
  EXPECT_FALSE(tok.is_special(-1));
  EXPECT_FALSE(tok.is_special(tok.vocab_size()));
}

INSTANTIATE_TEST_SUITE_P(Tokenizer, TokenizerGoldenTest, ::testing::ValuesIn(tokenizer_names()),
                         [](const auto& param_info) { return param_info.param; });

TEST(TokenizerStreamTest, CharacterSplitAcrossTokensIsEmittedOnce) {
  const Tokenizer& tok = tokenizer_named("qwen35_4k");
  const std::string text = "👩‍💻🔥漢字テスト😀𝐀👍🏽";
  const std::vector<int32_t> ids = tok.encode(text);
  size_t partial_tokens = 0;
  for (int32_t id : ids) partial_tokens += is_valid_utf8(tok.token_bytes(id)) ? 0 : 1;
  ASSERT_GT(partial_tokens, 0u) << "the test text should have tokens that split a character";
  StreamDecoder stream(tok);
  std::string joined;
  size_t empty_pushes = 0;
  for (int32_t id : ids) {
    const std::string chunk = stream.push(id);
    ASSERT_TRUE(is_valid_utf8(chunk));
    empty_pushes += chunk.empty() ? 1 : 0;
    joined += chunk;
  }
  joined += stream.flush();
  EXPECT_GT(empty_pushes, 0u);
  EXPECT_EQ(joined, text);
}

TEST(TokenizerStreamTest, InvalidAndIncompleteBytesBecomeReplacementCharacters) {
  const Tokenizer& tok = tokenizer_named("qwen35_4k");
  // Byte-level pieces of single bytes: "ÿ" is 0xFF, "ä" is 0xE4 (a 3-byte lead), "a" is 'a'.
  const int32_t ff = tok.token_to_id("ÿ").value();
  const int32_t e4 = tok.token_to_id("ä").value();
  const int32_t b8 = tok.token_to_id("¸").value();  // 0xB8, a continuation byte
  const int32_t a = tok.token_to_id("a").value();
  const std::string fffd = "\xEF\xBF\xBD";
  {
    StreamDecoder stream(tok);
    EXPECT_EQ(stream.push(ff), fffd);  // can never be valid: emitted at once
    EXPECT_EQ(stream.push(a), "a");
    EXPECT_EQ(stream.push(e4), "");  // may still complete
    EXPECT_EQ(stream.push(b8), "");
    EXPECT_EQ(stream.flush(), fffd);  // incomplete at the end
    EXPECT_EQ(stream.flush(), "");
  }
  {
    StreamDecoder stream(tok);
    EXPECT_EQ(stream.push(e4), "");
    EXPECT_EQ(stream.push(a), fffd + "a");  // the lead byte cannot complete any more
  }
  {
    StreamDecoder stream(tok);
    EXPECT_EQ(stream.push(e4), "");
    EXPECT_EQ(stream.push(b8), "");
    const int32_t ad = tok.token_to_id("Ń").value();  // byte 0xAD is not printable: mapped to U+0143
    EXPECT_EQ(stream.push(ad), "中");                 // E4 B8 AD
    EXPECT_EQ(stream.flush(), "");
  }
}

TEST(TokenizerDecodeTest, OutOfRangeIdIsAnError) {
  const Tokenizer& tok = tokenizer_named("qwen2_2k");
  const int32_t n = tok.vocab_size();
  for (int32_t id : {n, n + 100, -1}) {
    const std::vector<int32_t> ids{1, id};
    try {
      (void)tok.decode(ids);
      FAIL() << "no error for id " << id;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
      EXPECT_EQ(std::string(e.what()), "token id " + std::to_string(id) +
                                           " is outside the vocabulary (size " + std::to_string(n) + ")");
    }
    EXPECT_THROW((void)tok.token_bytes(id), Error);
    EXPECT_THROW((void)tok.token_piece(id), Error);
    StreamDecoder stream(tok);
    EXPECT_THROW((void)stream.push(id), Error);
  }
}

TEST(TokenizerEncodeTest, InvalidUtf8IsAnError) {
  const Tokenizer& tok = tokenizer_named("qwen2_2k");
  for (const std::string& bad : {std::string("abc\xFF"), std::string("\xE4\xB8"), std::string("\xED\xA0\x80"),
                                 std::string("\xC0\xAF")}) {
    try {
      (void)tok.encode(bad);
      FAIL() << "no error for " << excerpt(bad);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    }
  }
}

TEST(TokenizerEncodeTest, TokenizerIsMovable) {
  Tokenizer a = Tokenizer::from_file(kDataDir / "qwen2_2k.json");
  const std::vector<int32_t> ids = a.encode("Hello, world!");
  Tokenizer b = std::move(a);
  EXPECT_EQ(b.encode("Hello, world!"), ids);
  EXPECT_EQ(b.decode(ids), "Hello, world!");
}

TEST(TokenizerEncodeTest, Throughput) {
  // A fresh tokenizer (cold BPE cache) over ~1 MB of mixed text: the corpus, then source code.
  const Tokenizer tok = Tokenizer::from_file(kDataDir / "qwen35_4k.json");
  std::string text;
  for (const std::string& t : corpus()) text += t + "\n";
  for (const char* file :
       {"src/tokenizer/tokenizer.cpp", "src/tokenizer/tokenizer_load.cpp", "src/tokenizer/bpe.cpp",
        "tests/tokenizer_test.cpp", "scripts/make_tokenizer_goldens.py"}) {
    text += read_file(fs::path(MTPX_SOURCE_DIR) / file);
  }
  const std::string unit = text;
  while (text.size() < (1u << 20)) text += unit;
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = tok.encode(text);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double mb_per_s = static_cast<double>(text.size()) / 1e6 / seconds;
  std::printf("encoded %zu bytes into %zu ids in %.3f s: %.2f MB/s\n", text.size(), ids.size(), seconds,
              mb_per_s);
  RecordProperty("encode_mb_per_s", std::to_string(mb_per_s));
  EXPECT_GT(ids.size(), text.size() / 8);
}

// Bad tokenizer.json files: each is an mtpx::Error (kInvalidInput) naming the file and the field.
class TokenizerFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    dir_ = fs::temp_directory_path() /
           ("mtpx_tokenizer_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  // A valid small tokenizer, for editing.
  static json base() { return json::parse(read_file(kDataDir / "gpt2_500.json")); }

  fs::path write(const std::string& name, const std::string& content) {
    const fs::path path = dir_ / name;
    std::ofstream(path, std::ios::binary) << content;
    return path;
  }

  // Loads the file and checks the error names it and contains each of `needles`.
  void expect_error(const fs::path& path, std::initializer_list<std::string> needles,
                    ErrorKind kind = ErrorKind::kInvalidInput) {
    try {
      (void)Tokenizer::from_file(path);
      ADD_FAILURE() << "no error loading " << path;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), kind) << e.what();
      const std::string message = e.what();
      EXPECT_NE(message.find(path.string()), std::string::npos) << message;
      for (const std::string& needle : needles) EXPECT_NE(message.find(needle), std::string::npos) << message;
    }
  }

  fs::path dir_;
};

TEST_F(TokenizerFileTest, BaseFileLoads) {
  EXPECT_NO_THROW((void)Tokenizer::from_file(write("ok.json", base().dump())));
}

TEST_F(TokenizerFileTest, MissingFile) {
  expect_error(dir_ / "does_not_exist.json", {}, ErrorKind::kNotFound);
}

TEST_F(TokenizerFileTest, NotJson) {
  expect_error(write("a.json", "{\"model\": [1, 2"), {"JSON"});
  expect_error(write("b.json", ""), {"JSON"});
  expect_error(write("c.json", "[1, 2]"), {"object"});
}

TEST_F(TokenizerFileTest, MissingModel) {
  json j = base();
  j.erase("model");
  expect_error(write("t.json", j.dump()), {"model"});
}

TEST_F(TokenizerFileTest, UnigramModel) {
  json j = base();
  j["model"]["type"] = "Unigram";
  expect_error(write("t.json", j.dump()), {"model.type", "Unigram"});
}

TEST_F(TokenizerFileTest, MergeWithUnknownPiece) {
  json j = base();
  j["model"]["merges"].push_back(json::array({"Ġ", "nosuchpiece"}));
  expect_error(write("t.json", j.dump()), {"model.merges", "nosuchpiece"});
  json k = base();
  k["model"]["merges"].push_back("unknownleft t");
  expect_error(write("u.json", k.dump()), {"model.merges", "unknownleft"});
}

TEST_F(TokenizerFileTest, MalformedMerge) {
  json j = base();
  j["model"]["merges"].push_back("nospace");
  expect_error(write("t.json", j.dump()), {"model.merges["});
  json k = base();
  k["model"]["merges"].push_back(42);
  expect_error(write("u.json", k.dump()), {"model.merges["});
}

TEST_F(TokenizerFileTest, UnsupportedFeatures) {
  json j = base();
  j["model"]["byte_fallback"] = true;
  expect_error(write("byte_fallback.json", j.dump()), {"model.byte_fallback"});
  j = base();
  j["model"]["continuing_subword_prefix"] = "##";
  expect_error(write("prefix.json", j.dump()), {"model.continuing_subword_prefix"});
  j = base();
  j["normalizer"] = json{{"type", "Lowercase"}};
  expect_error(write("normalizer.json", j.dump()), {"normalizer", "Lowercase"});
  j = base();
  j["pre_tokenizer"] = json{{"type", "Whitespace"}};
  expect_error(write("pre_tokenizer.json", j.dump()), {"pre_tokenizer", "Whitespace"});
  j = base();
  j["pre_tokenizer"] =
      json{{"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Removed"}, {"invert", false}};
  expect_error(write("split.json", j.dump()), {"pre_tokenizer.behavior"});
  j = base();
  j["pre_tokenizer"] =
      json{{"type", "Sequence"},
           {"pretokenizers", json::array({json{{"type", "Split"},
                                               {"pattern", {{"Regex", "(unclosed"}}},
                                               {"behavior", "Isolated"},
                                               {"invert", false}},
                                          json{{"type", "ByteLevel"}, {"use_regex", false}}})}};
  expect_error(write("regex.json", j.dump()), {"pre_tokenizer.pretokenizers[0].pattern"});
  j = base();
  j["decoder"] = json{{"type", "WordPiece"}};
  expect_error(write("decoder.json", j.dump()), {"decoder", "WordPiece"});
  j = base();
  j["truncation"] = json{{"max_length", 10}};
  expect_error(write("truncation.json", j.dump()), {"truncation"});
  j = base();
  j["model"]["vocab"]["Ġ"] = "seven";
  expect_error(write("vocab.json", j.dump()), {"model.vocab"});
  j = base();
  j["added_tokens"][0].erase("content");
  expect_error(write("added.json", j.dump()), {"added_tokens[0].content"});
}

}  // namespace
}  // namespace mtpx
