#include "io/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "util/error.h"

namespace mtpx {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("mtpx_safetensors_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(counter++) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  fs::path dir_;
};

using SafetensorsFileTest = SafetensorsTest;
using SafetensorsStoreTest = SafetensorsTest;
using SafetensorsWriteTest = SafetensorsTest;

void write_bytes(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// A raw safetensors file: 8-byte little-endian length, header text, data bytes.
void write_raw(const fs::path& path, std::string_view header, std::string_view data = {},
               uint64_t declared_length = UINT64_MAX) {
  const uint64_t length = declared_length == UINT64_MAX ? header.size() : declared_length;
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes += static_cast<char>((length >> (8 * i)) & 0xff);
  bytes += header;
  bytes += data;
  write_bytes(path, bytes);
}

template <typename T>
std::span<const std::byte> as_bytes_of(const std::vector<T>& values) {
  return std::as_bytes(std::span<const T>(values));
}

std::string to_string(const TensorView& view) {
  return std::string(reinterpret_cast<const char*>(view.data), view.nbytes);
}

// Runs `action`, expecting an mtpx::Error of `kind` whose one-line message contains every one of `parts`.
void expect_error(const std::function<void()>& action, ErrorKind kind,
                  const std::vector<std::string>& parts) {
  try {
    action();
    ADD_FAILURE() << "no error thrown; expected one containing '" << parts.front() << "'";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(e.kind(), kind) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    for (const auto& part : parts)
      EXPECT_NE(message.find(part), std::string::npos) << message << " / " << part;
  }
}

void expect_invalid(const std::function<void()>& action, const std::vector<std::string>& parts) {
  expect_error(action, ErrorKind::kInvalidInput, parts);
}

// ---------------------------------------------------------------------------------------------------
// Basics

TEST(SafetensorsDTypeTest, NamesAndSizes) {
  EXPECT_EQ(dtype_name(DType::kBF16), "BF16");
  EXPECT_EQ(dtype_name(DType::kBool), "BOOL");
  EXPECT_EQ(dtype_name(DType::kU32), "U32");
  EXPECT_EQ(dtype_size(DType::kF64), 8u);
  EXPECT_EQ(dtype_size(DType::kI64), 8u);
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kU32), 4u);
  EXPECT_EQ(dtype_size(DType::kF16), 2u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kI16), 2u);
  EXPECT_EQ(dtype_size(DType::kI8), 1u);
  EXPECT_EQ(dtype_size(DType::kU8), 1u);
  EXPECT_EQ(dtype_size(DType::kBool), 1u);
}

TEST(SafetensorsDTypeTest, Numel) {
  TensorView view;
  EXPECT_EQ(view.numel(), 1);  // scalar
  view.shape = {2, 3, 4};
  EXPECT_EQ(view.numel(), 24);
  view.shape = {5, 0};
  EXPECT_EQ(view.numel(), 0);
}

TEST_F(SafetensorsFileTest, MappedFileReadsBytesAndHandlesEmptyFiles) {
  write_bytes(dir_ / "abc", "hello");
  const MappedFile file(dir_ / "abc");
  ASSERT_EQ(file.size(), 5u);
  EXPECT_EQ(std::memcmp(file.data(), "hello", 5), 0);
  EXPECT_EQ(file.path(), dir_ / "abc");

  write_bytes(dir_ / "empty", "");
  const MappedFile empty(dir_ / "empty");
  EXPECT_EQ(empty.size(), 0u);
  EXPECT_EQ(empty.data(), nullptr);

  expect_error([&] { MappedFile missing(dir_ / "missing.bin"); }, ErrorKind::kNotFound,
               {"cannot open", "missing.bin", "No such file"});
  expect_invalid([&] { MappedFile directory(dir_); }, {"cannot open", dir_.string()});
}

// ---------------------------------------------------------------------------------------------------
// Round trips

TEST_F(SafetensorsWriteTest, RoundTripSeveralDTypesAndShapes) {
  const std::vector<float> f32 = {1.0f, -2.5f, 3.25f, 0.0f, 1e30f, -1e-30f};
  const std::vector<uint16_t> bf16 = {0x3f80, 0xc000, 0x7f80, 0x0001};
  const std::vector<uint16_t> f16 = {0x3c00};
  const std::vector<double> f64 = {3.141592653589793};
  const std::vector<int64_t> i64 = {-1, INT64_MAX, INT64_MIN};
  const std::vector<int32_t> i32 = {7, -7};
  const std::vector<int16_t> i16 = {-300, 300};
  const std::vector<int8_t> i8 = {-128, 127, 0};
  const std::vector<uint8_t> u8 = {255, 0, 1, 2};
  const std::vector<uint32_t> u32 = {0xdeadbeef};
  const std::vector<uint8_t> boolean = {1, 0, 1};
  const std::vector<float> none;

  const std::vector<TensorToWrite> tensors = {
      {"z.f32", DType::kF32, {2, 3}, as_bytes_of(f32)},  {"bf16", DType::kBF16, {2, 2}, as_bytes_of(bf16)},
      {"f16", DType::kF16, {1}, as_bytes_of(f16)},       {"scalar.f64", DType::kF64, {}, as_bytes_of(f64)},
      {"i64", DType::kI64, {3}, as_bytes_of(i64)},       {"i32", DType::kI32, {2, 1}, as_bytes_of(i32)},
      {"i16", DType::kI16, {2}, as_bytes_of(i16)},       {"i8", DType::kI8, {3}, as_bytes_of(i8)},
      {"u8", DType::kU8, {2, 2}, as_bytes_of(u8)},       {"u32", DType::kU32, {1, 1, 1}, as_bytes_of(u32)},
      {"bool", DType::kBool, {3}, as_bytes_of(boolean)}, {"empty", DType::kF32, {4, 0, 2}, as_bytes_of(none)},
  };
  const fs::path path = dir_ / "model.safetensors";
  write_safetensors(path, tensors);

  const SafetensorsFile file(path);
  ASSERT_EQ(file.tensors().size(), tensors.size());
  EXPECT_TRUE(file.metadata().empty());
  EXPECT_EQ(file.path(), path);
  for (const auto& expected : tensors) {
    SCOPED_TRACE(expected.name);
    const TensorView* view = file.find(expected.name);
    ASSERT_NE(view, nullptr);
    EXPECT_EQ(view->name, expected.name);
    EXPECT_EQ(view->dtype, expected.dtype);
    EXPECT_EQ(view->shape, expected.shape);
    EXPECT_EQ(view->file, path);
    ASSERT_EQ(view->nbytes, expected.bytes.size());
    EXPECT_EQ(view->numel() * static_cast<int64_t>(dtype_size(view->dtype)),
              static_cast<int64_t>(view->nbytes));
    if (view->nbytes > 0) {
      EXPECT_EQ(std::memcmp(view->data, expected.bytes.data(), view->nbytes), 0);
    }
  }
  EXPECT_EQ(file.find("scalar.f64")->numel(), 1);
  EXPECT_EQ(file.find("empty")->numel(), 0);
  EXPECT_EQ(file.find("nope"), nullptr);
  double pi = 0;
  std::memcpy(&pi, file.find("scalar.f64")->data, sizeof(pi));
  EXPECT_EQ(pi, 3.141592653589793);
}

TEST_F(SafetensorsWriteTest, LayoutIsExact) {
  const std::vector<uint8_t> a = {1, 2, 3};
  const std::vector<uint8_t> b = {4, 5};
  const fs::path path = dir_ / "x.safetensors";
  // Data is laid out in the given order (b, a); header entries are sorted by name.
  write_safetensors(path, {{"b", DType::kU8, {2}, as_bytes_of(b)}, {"a", DType::kU8, {3}, as_bytes_of(a)}});

  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GE(bytes.size(), 8u);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  EXPECT_EQ((8 + header_len) % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + header_len + 5);
  const std::string header = bytes.substr(8, header_len);
  const std::string expected =
      R"({"a":{"data_offsets":[2,5],"dtype":"U8","shape":[3]},"b":{"data_offsets":[0,2],"dtype":"U8","shape":[2]}})";
  ASSERT_EQ(header.substr(0, expected.size()), expected);
  EXPECT_EQ(header.find_first_not_of(' ', expected.size()), std::string::npos);  // padded with spaces
  EXPECT_EQ(bytes.substr(8 + header_len), std::string("\x04\x05\x01\x02\x03", 5));
}

TEST_F(SafetensorsWriteTest, MetadataRoundTrip) {
  const std::vector<float> values = {1, 2};
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "ünïcode \"quoted\""}};
  const fs::path path = dir_ / "m.safetensors";
  write_safetensors(path, {{"w", DType::kF32, {2}, as_bytes_of(values)}}, metadata);
  const SafetensorsFile file(path);
  EXPECT_EQ(file.metadata(), metadata);
  ASSERT_NE(file.find("w"), nullptr);

  // No tensors at all, metadata only.
  write_safetensors(dir_ / "only_meta.safetensors", {}, {{"k", "v"}});
  const SafetensorsFile only_meta(dir_ / "only_meta.safetensors");
  EXPECT_TRUE(only_meta.tensors().empty());
  EXPECT_EQ(only_meta.metadata().at("k"), "v");
}

TEST_F(SafetensorsWriteTest, WriteIsAtomicAndLeavesNoTemporaries) {
  const std::vector<int32_t> first = {1, 2, 3};
  const std::vector<int32_t> second = {4, 5};
  const fs::path path = dir_ / "atomic.safetensors";
  write_safetensors(path, {{"t", DType::kI32, {3}, as_bytes_of(first)}});
  write_safetensors(path, {{"t", DType::kI32, {2}, as_bytes_of(second)}});  // replaces
  for (const auto& entry : fs::directory_iterator(dir_)) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);
  const SafetensorsFile file(path);
  EXPECT_EQ(file.find("t")->shape, std::vector<int64_t>{2});

  // A rejected write leaves the previous file untouched and no temporary behind.
  expect_error(
      [&] {
        write_safetensors(path, {{"t", DType::kI32, {3}, as_bytes_of(second)}});
      },
      ErrorKind::kInternal, {"'t'", "8 bytes", "12"});
  expect_error(
      [&] {
        write_safetensors(path, {{"t", DType::kI32, {2}, as_bytes_of(second)},
                                 {"t", DType::kI32, {2}, as_bytes_of(second)}});
      },
      ErrorKind::kInternal, {"duplicate"});
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);
  EXPECT_EQ(SafetensorsFile(path).find("t")->shape, std::vector<int64_t>{2});

  // Writing into a missing directory fails and leaves nothing.
  expect_error([&] { write_safetensors(dir_ / "no_such_dir" / "x.safetensors", {}); },
               ErrorKind::kInvalidInput, {"cannot create", "no_such_dir"});
}

// The exact bytes the Python `safetensors` package (0.8, safetensors.numpy.save) writes for
// {"a": float32 [1.5, -2], "b": int64 [1, 2, 3]} with metadata {"format": "pt"}: tensors ordered by
// alignment then name, header padded with spaces to a multiple of 8.
TEST_F(SafetensorsFileTest, ParsesBytesWrittenByPythonSafetensors) {
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"I64","shape":[3],"data_offsets":[0,24]},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[24,32]}}   )";
  ASSERT_EQ(header.size(), 0x90u);
  std::string bytes("\x90\x00\x00\x00\x00\x00\x00\x00", 8);
  bytes += header;
  bytes += std::string(
      "\x01\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00"
      "\x03\x00\x00\x00\x00\x00\x00\x00",
      24);
  bytes += std::string("\x00\x00\xc0\x3f\x00\x00\x00\xc0", 8);
  ASSERT_EQ(bytes.size(), 184u);
  write_bytes(dir_ / "py.safetensors", bytes);

  const SafetensorsFile file(dir_ / "py.safetensors");
  EXPECT_EQ(file.metadata().at("format"), "pt");
  const TensorView* a = file.find("a");
  const TensorView* b = file.find("b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(a->dtype, DType::kF32);
  EXPECT_EQ(a->shape, std::vector<int64_t>{2});
  EXPECT_EQ(b->dtype, DType::kI64);
  EXPECT_EQ(b->shape, std::vector<int64_t>{3});
  float a_values[2];
  int64_t b_values[3];
  ASSERT_EQ(a->nbytes, sizeof(a_values));
  ASSERT_EQ(b->nbytes, sizeof(b_values));
  std::memcpy(a_values, a->data, sizeof(a_values));
  std::memcpy(b_values, b->data, sizeof(b_values));
  EXPECT_EQ(a_values[0], 1.5f);
  EXPECT_EQ(a_values[1], -2.0f);
  EXPECT_EQ(b_values[0], 1);
  EXPECT_EQ(b_values[1], 2);
  EXPECT_EQ(b_values[2], 3);
}

// ---------------------------------------------------------------------------------------------------
// Validation of one file

TEST_F(SafetensorsFileTest, RejectsMalformedFiles) {
  const std::string name = "bad.safetensors";
  const fs::path path = dir_ / name;
  auto open = [&] { SafetensorsFile file(path); };
  auto check = [&](std::string_view header, std::string_view data, const std::vector<std::string>& words) {
    SCOPED_TRACE(std::string(header));
    write_raw(path, header, data);
    std::vector<std::string> parts = words;
    parts.push_back(name);
    expect_invalid(open, parts);
  };
  const std::string eight(8, '\0');

  // Too short.
  write_bytes(path, "1234567");
  expect_invalid(open, {name, "shorter"});
  write_bytes(path, "");
  expect_invalid(open, {name, "shorter"});
  // Header length beyond the limit / beyond the file.
  write_raw(path, "{}", "", 100ull * 1024 * 1024 + 1);
  expect_invalid(open, {name, "header length", "limit"});
  write_raw(path, "{}", "", 3);
  expect_invalid(open, {name, "header length", "exceeds"});
  write_raw(path, "{}", "", UINT64_MAX - 1);
  expect_invalid(open, {name, "header length"});
  // Not JSON; not an object.
  check("{\"a\":", "", {"JSON"});
  check("not json", "", {"JSON"});
  check("[1, 2]", "", {"object"});
  // Entry not an object.
  check(R"({"w": 5})", "", {"'w'", "object"});
  // Unknown / missing dtype.
  check(R"({"w": {"dtype": "F8", "shape": [1], "data_offsets": [0, 1]}})", "x", {"'w'", "dtype", "F8"});
  check(R"({"w": {"dtype": 4, "shape": [1], "data_offsets": [0, 1]}})", "x", {"'w'", "dtype"});
  check(R"({"w": {"shape": [1], "data_offsets": [0, 1]}})", "x", {"'w'", "dtype"});
  // Bad shapes.
  check(R"({"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}})", "x", {"'w'", "shape"});
  check(R"({"w": {"dtype": "U8", "shape": [1.5], "data_offsets": [0, 1]}})", "x", {"'w'", "shape"});
  check(R"({"w": {"dtype": "U8", "shape": ["1"], "data_offsets": [0, 1]}})", "x", {"'w'", "shape"});
  check(R"({"w": {"dtype": "U8", "shape": 1, "data_offsets": [0, 1]}})", "x", {"'w'", "shape"});
  check(R"({"w": {"dtype": "U8", "data_offsets": [0, 1]}})", "x", {"'w'", "shape"});
  check(R"({"w": {"dtype": "U8", "shape": [18446744073709551615], "data_offsets": [0, 1]}})", "x",
        {"'w'", "shape"});
  // Bad data_offsets.
  check(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 0]}})", "x", {"'w'", "data_offsets"});
  check(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0]}})", "x", {"'w'", "data_offsets"});
  check(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}})", "x", {"'w'", "data_offsets"});
  check(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [-1, 0]}})", "x", {"'w'", "data_offsets"});
  check(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": "0-1"}})", "x", {"'w'", "data_offsets"});
  check(R"({"w": {"dtype": "U8", "shape": [1]}})", "x", {"'w'", "data_offsets"});
  // Element count overflow; size mismatch.
  check(R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", "",
        {"'w'", "overflow"});
  check(R"({"w": {"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 0]}})", "",
        {"'w'", "overflow"});
  check(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})", eight, {"'w'", "size mismatch"});
  check(R"({"w": {"dtype": "F32", "shape": [], "data_offsets": [0, 8]}})", eight, {"'w'", "size mismatch"});
  // End beyond the data section.
  check(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}})", eight, {"'w'", "beyond"});
  check(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [8, 9]}})", eight, {"'w'", "beyond"});
  // Overlapping tensors.
  check(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "b": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]}})",
        eight, {"'b'", "'a'", "overlap"});
  check(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})",
        eight, {"overlap"});
  // Duplicate keys, at the top level and inside an entry.
  check(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})",
        eight, {"duplicate", "'w'"});
  check(R"({"w": {"dtype": "U8", "dtype": "I8", "shape": [1], "data_offsets": [0, 1]}})", eight,
        {"duplicate", "'dtype'"});
  // __metadata__ must map strings to strings.
  check(R"({"__metadata__": ["a"]})", "", {"__metadata__", "object"});
  check(R"({"__metadata__": {"a": 1}})", "", {"__metadata__", "'a'", "string"});
  check(R"({"__metadata__": {"a": {"b": "c"}}})", "", {"__metadata__", "string"});
}

TEST_F(SafetensorsFileTest, AcceptsEdgeCases) {
  // Empty header object; zero-size tensors sharing an offset with neighbours; gaps between tensors;
  // trailing whitespace in the header.
  write_raw(dir_ / "empty.safetensors", "{}");
  EXPECT_TRUE(SafetensorsFile(dir_ / "empty.safetensors").tensors().empty());

  write_raw(dir_ / "edge.safetensors",
            R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                "e": {"dtype": "F32", "shape": [0, 7], "data_offsets": [2, 2]},
                "f": {"dtype": "F32", "shape": [0], "data_offsets": [1, 1]},
                "b": {"dtype": "U8", "shape": [1, 1], "data_offsets": [4, 5]}}     )",
            std::string("\x0a\x0b\xff\xff\x0c\xff", 6));
  const SafetensorsFile file(dir_ / "edge.safetensors");
  EXPECT_EQ(file.tensors().size(), 4u);
  EXPECT_EQ(to_string(*file.find("a")), "\x0a\x0b");
  EXPECT_EQ(to_string(*file.find("b")), "\x0c");
  EXPECT_EQ(file.find("e")->nbytes, 0u);
  EXPECT_EQ(file.find("e")->numel(), 0);
}

TEST_F(SafetensorsFileTest, AHeaderThatMisalignsTheTensorsIsReadIntoAlignedMemory) {
  // mlx 0.32's writer does not pad the header to 8 bytes: with an odd header length every bf16 tensor sits
  // at an odd address in the mapping, where the kernels' element loads are undefined. Such a file's tensors
  // are read into memory whose data section starts on 64 bytes; a padded file stays mapped, uncopied.
  const std::string header = R"({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},)"
                             R"( "s": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})";
  const std::string data("\x80\x3f\x00\x40\x40\x40\xee\xee\x00\x00\x80\x3f", 12);
  const std::string odd_header = header.size() % 2 == 0 ? header + " " : header;      // 8 + length odd
  const std::string padded = header + std::string((8 - header.size() % 8) % 8, ' ');  // a multiple of 8
  for (const bool odd : {true, false}) {
    const std::string& h = odd ? odd_header : padded;
    write_raw(dir_ / "m.safetensors", h, data);
    const SafetensorsFile file(dir_ / "m.safetensors");
    EXPECT_EQ(file.copied_for_alignment(), odd) << h.size();
    for (const char* name : {"w", "s"}) {
      const TensorView& t = *file.find(name);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype), 0u) << name;
      if (odd) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(file.find("w")->data) % 64, 0u);
      }
    }
    EXPECT_EQ(to_string(*file.find("w")), data.substr(0, 6));
    EXPECT_EQ(to_string(*file.find("s")), data.substr(8, 4));
  }
}

// ---------------------------------------------------------------------------------------------------
// Model directories

void write_u8_tensors(const fs::path& path, const std::vector<std::string>& names) {
  std::vector<std::vector<uint8_t>> storage;
  storage.reserve(names.size());
  std::vector<TensorToWrite> tensors;
  for (size_t i = 0; i < names.size(); ++i) {
    storage.push_back({static_cast<uint8_t>(i), static_cast<uint8_t>(names[i].size())});
    tensors.push_back({names[i], DType::kU8, {2}, as_bytes_of(storage.back())});
  }
  write_safetensors(path, tensors);
}

void write_index(const fs::path& dir, const std::string& weight_map_json) {
  write_bytes(dir / "model.safetensors.index.json",
              R"({"metadata": {"total_size": 8}, "weight_map": )" + weight_map_json + "}");
}

TEST_F(SafetensorsStoreTest, ShardedDirectoryWithIndex) {
  write_u8_tensors(dir_ / "model-00001-of-00002.safetensors", {"embed", "layer.0.w"});
  write_u8_tensors(dir_ / "model-00002-of-00002.safetensors", {"layer.1.w", "lm_head", "extra"});
  write_index(dir_, R"({"embed": "model-00001-of-00002.safetensors",
                        "layer.0.w": "model-00001-of-00002.safetensors",
                        "layer.1.w": "model-00002-of-00002.safetensors",
                        "lm_head": "model-00002-of-00002.safetensors"})");
  write_u8_tensors(dir_ / "unrelated.safetensors", {"embed"});  // not in the index: ignored

  const TensorStore store = TensorStore::open_directory(dir_);
  EXPECT_EQ(store.directory(), dir_);
  EXPECT_EQ(store.names(), (std::vector<std::string>{"embed", "extra", "layer.0.w", "layer.1.w", "lm_head"}));
  EXPECT_EQ(store.get("embed").file, dir_ / "model-00001-of-00002.safetensors");
  EXPECT_EQ(store.get("lm_head").file, dir_ / "model-00002-of-00002.safetensors");
  EXPECT_EQ(to_string(store.get("lm_head")), std::string("\x01\x07", 2));
  ASSERT_NE(store.find("extra"), nullptr);  // in a shard but not in the index: still accessible
  EXPECT_EQ(store.find("nope"), nullptr);
  expect_invalid([&] { store.get("nope"); }, {"missing tensor 'nope'", dir_.string()});

  // The store can be moved; views stay valid.
  TensorStore moved = TensorStore::open_directory(dir_);
  const TensorView* embed = &moved.get("embed");
  TensorStore other = std::move(moved);
  EXPECT_EQ(&other.get("embed"), embed);
  EXPECT_EQ(to_string(*embed), std::string("\x00\x05", 2));
}

TEST_F(SafetensorsStoreTest, SingleFileDirectories) {
  // model.safetensors is preferred over other files.
  write_u8_tensors(dir_ / "model.safetensors", {"a"});
  write_u8_tensors(dir_ / "mtp.safetensors", {"a"});
  TensorStore store = TensorStore::open_directory(dir_);
  EXPECT_EQ(store.names(), std::vector<std::string>{"a"});
  EXPECT_EQ(store.get("a").file, dir_ / "model.safetensors");
  // add_file: extra names are added; a repeated name is an error.
  write_u8_tensors(dir_ / "sidecar.safetensors", {"mtp.fc"});
  store.add_file(dir_ / "sidecar.safetensors");
  EXPECT_NE(store.find("mtp.fc"), nullptr);
  expect_invalid([&] { store.add_file(dir_ / "mtp.safetensors"); },
                 {"'a'", "model.safetensors", "mtp.safetensors"});
  EXPECT_EQ(store.names(), (std::vector<std::string>{"a", "mtp.fc"}));

  // Without model.safetensors, the one *.safetensors file.
  const fs::path single = dir_ / "single";
  fs::create_directory(single);
  write_u8_tensors(single / "weights.safetensors", {"x", "y"});
  write_bytes(single / "config.json", "{}");
  EXPECT_EQ(TensorStore::open_directory(single).names(), (std::vector<std::string>{"x", "y"}));

  // Two candidates and nothing to choose between them.
  write_u8_tensors(single / "other.safetensors", {"z"});
  expect_invalid([&] { TensorStore::open_directory(single); }, {"2 *.safetensors files", single.string()});
}

TEST_F(SafetensorsStoreTest, DirectoryErrors) {
  expect_error([&] { TensorStore::open_directory(dir_ / "absent"); }, ErrorKind::kNotFound,
               {"absent", "does not exist"});
  write_bytes(dir_ / "file", "x");
  expect_invalid([&] { TensorStore::open_directory(dir_ / "file"); }, {"not a directory", "file"});
  const fs::path empty = dir_ / "empty";
  fs::create_directory(empty);
  write_bytes(empty / "config.json", "{}");
  expect_invalid([&] { TensorStore::open_directory(empty); }, {"no *.safetensors files", empty.string()});
  // An invalid file is reported through the store too.
  write_raw(empty / "model.safetensors", "[]");
  expect_invalid([&] { TensorStore::open_directory(empty); }, {"model.safetensors", "object"});
}

TEST_F(SafetensorsStoreTest, IndexErrors) {
  const std::string shard1 = "model-00001-of-00002.safetensors";
  const std::string shard2 = "model-00002-of-00002.safetensors";
  write_u8_tensors(dir_ / shard1, {"a", "b"});
  write_u8_tensors(dir_ / shard2, {"c"});
  auto open = [&] { TensorStore::open_directory(dir_); };

  // A shard that does not exist.
  write_index(dir_, R"({"a": ")" + shard1 + R"(", "c": "model-00003-of-00002.safetensors"})");
  expect_invalid(open, {"model-00003-of-00002.safetensors", "does not exist"});
  // A tensor missing from the shard the index names.
  write_index(dir_, R"({"a": ")" + shard1 + R"(", "c": ")" + shard1 + R"("})");
  expect_invalid(
      open, {"tensor 'c' listed in model.safetensors.index.json is missing from shard '" + shard1 + "'"});
  // Shard names that are not plain file names.
  for (const std::string& shard :
       {std::string("../") + shard1, std::string("sub/x.safetensors"), std::string("..\\x.safetensors"),
        std::string(".."), std::string(".hidden"), std::string(""), (dir_ / shard1).string()}) {
    SCOPED_TRACE(shard);
    write_index(dir_, R"({"a": )" + nlohmann::json(shard).dump() + "}");
    expect_invalid(open, {"model.safetensors.index.json", "plain file name"});
  }
  // The same tensor in two shards.
  write_u8_tensors(dir_ / shard2, {"c", "a"});
  write_index(dir_, R"({"a": ")" + shard1 + R"(", "c": ")" + shard2 + R"("})");
  expect_invalid(open, {"tensor 'a'", shard1, shard2});
  write_u8_tensors(dir_ / shard2, {"c"});
  // Malformed index files.
  write_bytes(dir_ / "model.safetensors.index.json", "{");
  expect_invalid(open, {"model.safetensors.index.json", "JSON"});
  write_bytes(dir_ / "model.safetensors.index.json", R"({"weights": {}})");
  expect_invalid(open, {"model.safetensors.index.json", "weight_map"});
  write_index(dir_, R"({"a": 1})");
  expect_invalid(open, {"model.safetensors.index.json", "'a'", "not a string"});
  write_index(dir_, R"({"a": ")" + shard1 + R"(", "a": ")" + shard1 + R"("})");
  expect_invalid(open, {"model.safetensors.index.json", "duplicate", "'a'"});
  // And the valid index works.
  write_index(dir_, R"({"a": ")" + shard1 + R"(", "c": ")" + shard2 + R"("})");
  EXPECT_EQ(TensorStore::open_directory(dir_).names(), (std::vector<std::string>{"a", "b", "c"}));
}

TEST_F(SafetensorsStoreTest, SymlinksMustStayInsideTheDirectory) {
  const fs::path model = dir_ / "model";
  const fs::path outside = dir_ / "outside";
  fs::create_directories(model);
  fs::create_directories(outside);
  write_u8_tensors(outside / "weights.safetensors", {"w"});
  write_u8_tensors(model / "real.safetensors", {"r"});

  // A link to a file inside the directory is fine.
  fs::create_symlink("real.safetensors", model / "model.safetensors");
  EXPECT_EQ(TensorStore::open_directory(model).names(), std::vector<std::string>{"r"});
  fs::remove(model / "model.safetensors");
  fs::remove(model / "real.safetensors");

  // A link leading out of it is not.
  fs::create_symlink(outside / "weights.safetensors", model / "model.safetensors");
  expect_invalid([&] { TensorStore::open_directory(model); },
                 {"outside the model directory", "model.safetensors"});
  fs::remove(model / "model.safetensors");
  fs::create_symlink("../outside/weights.safetensors", model / "shard.safetensors");
  write_index(model, R"({"w": "shard.safetensors"})");
  expect_invalid([&] { TensorStore::open_directory(model); },
                 {"outside the model directory", "shard.safetensors"});

  // The model directory itself may be reached through a link.
  fs::remove(model / "shard.safetensors");
  write_u8_tensors(model / "shard.safetensors", {"w"});
  fs::create_directory_symlink(model, dir_ / "link");
  EXPECT_EQ(TensorStore::open_directory(dir_ / "link").names(), std::vector<std::string>{"w"});
}

}  // namespace
}  // namespace mtpx
