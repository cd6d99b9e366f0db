#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

#include "io/json_file.h"
#include "util/error.h"

namespace mtpx {

namespace {

using nlohmann::json;

// The reference implementation allows 100 MB; real checkpoint shards have headers under 2 MB. Parsing
// costs ~15 bytes of memory per header byte (JSON DOM, then the tensor table), so 16 MiB keeps a
// hostile header's peak near 250 MB instead of 1.5 GB.
constexpr uint64_t kMaxHeaderBytes = 16ull * 1024 * 1024;
// Weights have 1 to 4 dimensions; a longer shape is not a weight (and would make messages huge).
constexpr size_t kMaxRank = 16;
constexpr const char* kIndexName = "model.safetensors.index.json";

constexpr std::pair<DType, std::string_view> kDTypeNames[] = {
    {DType::kF32, "F32"}, {DType::kF16, "F16"}, {DType::kBF16, "BF16"}, {DType::kF64, "F64"},
    {DType::kI64, "I64"}, {DType::kI32, "I32"}, {DType::kI16, "I16"},   {DType::kI8, "I8"},
    {DType::kU8, "U8"},   {DType::kU32, "U32"}, {DType::kBool, "BOOL"},
};

std::string printable_path(const std::filesystem::path& path) {
  return printable(std::string_view(path.native()));
}

[[noreturn]] void bad_file(const std::filesystem::path& file, std::string_view what) {
  invalid_input("invalid safetensors file '{}': {}", printable_path(file), what);
}

[[noreturn]] void bad_tensor(const std::filesystem::path& file, std::string_view name,
                             std::string_view what) {
  invalid_input("invalid safetensors file '{}': tensor '{}': {}", printable_path(file), printable(name),
                what);
}

// A JSON value for an error message, cut to a readable length.
std::string short_dump(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return printable(text);
}

bool parse_dtype(std::string_view text, DType* dtype) {
  for (const auto& [value, name] : kDTypeNames) {
    if (name == text) {
      *dtype = value;
      return true;
    }
  }
  return false;
}

// A JSON value as a non-negative integer (rejects negative numbers, floats and everything else).
bool as_unsigned(const json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return true;
  }
  if (value.is_number_integer()) {
    const auto signed_value = value.get<int64_t>();
    if (signed_value < 0) return false;
    *out = static_cast<uint64_t>(signed_value);
    return true;
  }
  return false;
}

bool is_inside(const std::filesystem::path& dir, const std::filesystem::path& path) {
  auto [dir_it, path_it] = std::mismatch(dir.begin(), dir.end(), path.begin(), path.end());
  // A trailing empty component (from "dir/") counts as a match.
  return dir_it == dir.end() || (std::next(dir_it) == dir.end() && dir_it->empty());
}

std::filesystem::path resolved(const std::filesystem::path& path) {
  std::error_code ec;
  auto result = std::filesystem::weakly_canonical(path, ec);
  if (ec) invalid_input("cannot resolve '{}': {}", printable_path(path), ec.message());
  return result;
}

// A shard name from the index must be a plain file name inside the model directory.
bool is_plain_file_name(std::string_view name) {
  return !name.empty() && name.front() != '.' && name.find('/') == std::string_view::npos &&
         name.find('\\') == std::string_view::npos && name.find('\0') == std::string_view::npos;
}

class FileCloser {
 public:
  explicit FileCloser(std::FILE* file) : file_(file) {}
  ~FileCloser() {
    if (file_ != nullptr) std::fclose(file_);
  }
  FileCloser(const FileCloser&) = delete;
  FileCloser& operator=(const FileCloser&) = delete;
  std::FILE* release() { return std::exchange(file_, nullptr); }

 private:
  std::FILE* file_;
};

}  // namespace

std::string_view dtype_name(DType dtype) {
  for (const auto& [value, name] : kDTypeNames) {
    if (value == dtype) return name;
  }
  return "?";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kF32:
    case DType::kI32:
    case DType::kU32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
    case DType::kI16:
      return 2;
    case DType::kI8:
    case DType::kU8:
    case DType::kBool:
      return 1;
  }
  return 0;
}

int64_t TensorView::numel() const {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  return count;
}

int64_t count_non_finite(const TensorView& t) {
  // An all-ones exponent is NaN or Inf in every IEEE-style format; count by bits, 16 or 32 at a time.
  auto count = [&](auto word, auto exponent_mask) {
    using Word = decltype(word);
    const size_t n = t.nbytes / sizeof(Word);
    int64_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      Word bits;
      std::memcpy(&bits, t.data + i * sizeof(Word), sizeof(Word));
      bad += (bits & exponent_mask) == exponent_mask;
    }
    return bad;
  };
  switch (t.dtype) {
    case DType::kF32:
      return count(uint32_t{}, uint32_t{0x7f800000u});
    case DType::kF16:
      return count(uint16_t{}, uint16_t{0x7c00u});
    case DType::kBF16:
      return count(uint16_t{}, uint16_t{0x7f80u});
    case DType::kF64:
      return count(uint64_t{}, uint64_t{0x7ff0000000000000ull});
    default:
      return 0;
  }
}

// ---------------------------------------------------------------------------------------------------
// MappedFile

MappedFile::MappedFile(const std::filesystem::path& path) : path_(path) {
  // O_NONBLOCK: opening a FIFO would otherwise wait for a writer forever (fstat then refuses it).
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    fail(err == ENOENT ? ErrorKind::kNotFound : ErrorKind::kInvalidInput, "cannot open '{}': {}",
         printable_path(path), std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    invalid_input("cannot stat '{}': {}", printable_path(path), std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    invalid_input("cannot open '{}': not a regular file", printable_path(path));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* mapping = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapping == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      invalid_input("cannot map '{}': {}", printable_path(path), std::strerror(err));
    }
    data_ = static_cast<const std::byte*>(mapping);
  }
  ::close(fd);  // the mapping stays valid without the descriptor
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
}

void MappedFile::release_pages() const {
  // A read-only file mapping: dropped pages are read back from the file on the next access.
  if (data_ != nullptr) ::madvise(const_cast<std::byte*>(data_), size_, MADV_DONTNEED);
}

// ---------------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsTable parse_safetensors(std::span<const std::byte> bytes, const std::filesystem::path& path) {
  SafetensorsTable table;
  const size_t file_size = bytes.size();
  if (file_size < 8) {
    bad_file(path, fmt::format("file is {} bytes, shorter than the 8-byte header length", file_size));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  if (header_len > kMaxHeaderBytes) {
    bad_file(path,
             fmt::format("header length {} exceeds the limit of {} bytes", header_len, kMaxHeaderBytes));
  }
  if (header_len > file_size - 8) {
    bad_file(path, fmt::format("header length {} exceeds the {} bytes after the length field", header_len,
                               file_size - 8));
  }
  const auto* header_begin = reinterpret_cast<const char*>(bytes.data() + 8);
  json header = parse_json_strict(std::string_view(header_begin, header_len),
                                  fmt::format("invalid safetensors file '{}': header", printable_path(path)));
  if (!header.is_object()) bad_file(path, "header is not a JSON object");

  table.data_offset = 8 + header_len;
  const std::byte* data_section = bytes.data() + table.data_offset;
  const uint64_t data_size = file_size - 8 - header_len;

  struct Range {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;

  // Each entry leaves the JSON document once it is a TensorView: the two never both hold every tensor
  // (a header of many tensors costs half the peak memory).
  auto& entries = header.get_ref<json::object_t&>();
  for (auto entry_it = entries.begin(); entry_it != entries.end(); entry_it = entries.erase(entry_it)) {
    const std::string& name = entry_it->first;
    const json& entry = entry_it->second;
    if (name == "__metadata__") {
      if (!entry.is_object()) bad_file(path, "__metadata__ is not a JSON object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          bad_file(path, fmt::format("__metadata__ value for '{}' is not a string", printable(key)));
        }
        table.metadata.emplace(key, value.get<std::string>());
      }
      continue;
    }
    if (!entry.is_object()) bad_tensor(path, name, "entry is not a JSON object");

    TensorView view;
    view.name = name;
    view.file = path;

    const auto dtype_it = entry.find("dtype");
    if (dtype_it == entry.end() || !dtype_it->is_string())
      bad_tensor(path, name, "dtype missing or not a string");
    const auto& dtype_text = dtype_it->get_ref<const std::string&>();
    if (!parse_dtype(dtype_text, &view.dtype)) {
      bad_tensor(path, name, fmt::format("unknown dtype '{}'", printable(dtype_text)));
    }

    const auto shape_it = entry.find("shape");
    if (shape_it == entry.end() || !shape_it->is_array())
      bad_tensor(path, name, "shape missing or not an array");
    if (shape_it->size() > kMaxRank)
      bad_tensor(path, name,
                 fmt::format("shape has {} dimensions, more than {}", shape_it->size(), kMaxRank));
    uint64_t numel = 1;
    bool overflow = false;
    for (const auto& dim_json : *shape_it) {
      uint64_t dim = 0;
      if (!as_unsigned(dim_json, &dim) || dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        bad_tensor(path, name,
                   fmt::format("shape {} is not an array of non-negative integers", short_dump(*shape_it)));
      }
      view.shape.push_back(static_cast<int64_t>(dim));
      overflow = overflow || __builtin_mul_overflow(numel, dim, &numel);
    }
    uint64_t nbytes = 0;
    overflow =
        overflow || __builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(view.dtype)), &nbytes);
    if (overflow) bad_tensor(path, name, fmt::format("size of shape {} overflows", short_dump(*shape_it)));

    const auto offsets_it = entry.find("data_offsets");
    uint64_t begin = 0;
    uint64_t end = 0;
    if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
        !as_unsigned((*offsets_it)[0], &begin) || !as_unsigned((*offsets_it)[1], &end) || begin > end) {
      bad_tensor(path, name,
                 fmt::format("data_offsets {} is not [begin, end] with 0 <= begin <= end",
                             offsets_it == entry.end() ? std::string("(missing)") : short_dump(*offsets_it)));
    }
    if (end - begin != nbytes) {
      bad_tensor(path, name,
                 fmt::format("size mismatch: {} {} needs {} bytes but data_offsets [{}, {}] span {}",
                             dtype_text, short_dump(*shape_it), nbytes, begin, end, end - begin));
    }
    if (end > data_size) {
      bad_tensor(
          path, name,
          fmt::format("data_offsets [{}, {}] extend beyond the {}-byte data section", begin, end, data_size));
    }
    view.data = data_section + begin;
    view.nbytes = static_cast<size_t>(nbytes);
    auto [it, inserted] = table.tensors.emplace(name, std::move(view));
    if (!inserted) bad_tensor(path, name, "duplicate tensor name");  // unreachable: duplicates rejected above
    if (begin != end) ranges.push_back({begin, end, &it->first});
  }

  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].begin < ranges[i - 1].end) {
      bad_tensor(
          path, *ranges[i].name,
          fmt::format("data_offsets [{}, {}] overlap tensor '{}' at [{}, {}]", ranges[i].begin, ranges[i].end,
                      printable(*ranges[i - 1].name), ranges[i - 1].begin, ranges[i - 1].end));
    }
  }
  return table;
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path)
    : file_(std::make_unique<MappedFile>(path)) {
  SafetensorsTable table = parse_safetensors({file_->data(), file_->size()}, path);
  tensors_ = std::move(table.tensors);
  metadata_ = std::move(table.metadata);
  // A header whose length is not padded to a multiple of 8 bytes (the safetensors reference writer pads it;
  // mlx 0.32's mx.save_safetensors does not) leaves every tensor off its element alignment: an odd address
  // for bf16. The kernels read elements with ordinary loads, undefined at such addresses. Such a file is
  // read into a buffer whose data section starts on a 64-byte boundary, and the mapping is released: the
  // tensors then cost resident memory instead of page cache (no copy is made of an aligned file).
  const bool misaligned = std::any_of(tensors_.begin(), tensors_.end(), [](const auto& entry) {
    return reinterpret_cast<uintptr_t>(entry.second.data) % dtype_size(entry.second.dtype) != 0;
  });
  if (!misaligned) return;
  const std::byte* section = file_->data() + table.data_offset;
  const size_t section_bytes = file_->size() - table.data_offset;
  const size_t bytes = std::max<size_t>(64, (section_bytes + 63) / 64 * 64);
  aligned_copy_.reset(static_cast<std::byte*>(std::aligned_alloc(64, bytes)));
  if (!aligned_copy_)
    fail(ErrorKind::kInternal, "out of memory reading '{}' ({} bytes)", path.string(), bytes);
  std::memcpy(aligned_copy_.get(), section, section_bytes);
  for (auto& [name, view] : tensors_) view.data = aligned_copy_.get() + (view.data - section);
  file_->release_pages();
}

const TensorView* SafetensorsFile::find(std::string_view name) const {
  const auto it = tensors_.find(std::string(name));
  return it == tensors_.end() ? nullptr : &it->second;
}

// ---------------------------------------------------------------------------------------------------
// TensorStore

std::map<std::string, std::vector<std::string>> parse_safetensors_index(
    std::string_view text, const std::filesystem::path& index_path) {
  const std::string describe = fmt::format("invalid index '{}'", printable_path(index_path));
  const json index = parse_json_strict(text, describe);
  if (!index.is_object()) invalid_input("{}: not a JSON object", describe);
  const auto map_it = index.find("weight_map");
  if (map_it == index.end() || !map_it->is_object()) {
    invalid_input("{}: \"weight_map\" missing or not an object", describe);
  }
  if (map_it->empty()) invalid_input("{}: \"weight_map\" is empty", describe);

  std::map<std::string, std::vector<std::string>> by_shard;
  for (const auto& [name, shard_json] : map_it->items()) {
    if (!shard_json.is_string()) {
      invalid_input("{}: shard of tensor '{}' is not a string", describe, printable(name));
    }
    const auto& shard = shard_json.get_ref<const std::string&>();
    if (!is_plain_file_name(shard)) {
      invalid_input("{}: shard name '{}' (tensor '{}') is not a plain file name in the directory", describe,
                    printable(shard), printable(name));
    }
    by_shard[shard].push_back(name);
  }
  return by_shard;
}

TensorStore TensorStore::open_directory(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto dir_status = fs::status(dir, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) {
    invalid_input("cannot access model directory '{}': {}", printable_path(dir), ec.message());
  }
  if (!fs::exists(dir_status)) {
    fail(ErrorKind::kNotFound, "model directory '{}' does not exist", printable_path(dir));
  }
  if (!fs::is_directory(dir_status)) invalid_input("model path '{}' is not a directory", printable_path(dir));

  TensorStore store;
  store.dir_ = dir;
  const fs::path canonical_dir = resolved(dir);

  // Opens a file of the directory, refusing one that (through symlinks) lives elsewhere.
  auto add_local = [&](const std::string& file_name) -> const SafetensorsFile& {
    const fs::path file = dir / file_name;
    if (!is_inside(canonical_dir, resolved(file))) {
      invalid_input("'{}' resolves to '{}', outside the model directory '{}'", printable_path(file),
                    printable_path(resolved(file)), printable_path(canonical_dir));
    }
    store.add_file(file);
    return *store.files_.back();
  };

  const fs::path index_path = dir / kIndexName;
  if (fs::exists(index_path, ec)) {
    const auto by_shard =
        parse_safetensors_index(read_small_file(index_path, kMaxConfigFileBytes), index_path);
    for (const auto& [shard, names] : by_shard) {
      if (!fs::is_regular_file(dir / shard, ec)) {
        invalid_input("shard '{}' listed in {} does not exist in '{}'", printable(shard), kIndexName,
                      printable_path(dir));
      }
      const SafetensorsFile& file = add_local(shard);
      for (const auto& name : names) {
        if (file.find(name) == nullptr) {
          invalid_input("tensor '{}' listed in {} is missing from shard '{}'", printable(name), kIndexName,
                        printable(shard));
        }
      }
    }
  } else if (fs::exists(dir / "model.safetensors", ec)) {
    add_local("model.safetensors");
  } else {
    std::vector<std::string> candidates;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      std::error_code entry_ec;
      // mtp.safetensors is an MTP sidecar (mtpx graft), added by the model loader, not a weights file.
      if (entry.path().extension() == ".safetensors" && entry.path().filename() != "mtp.safetensors" &&
          entry.is_regular_file(entry_ec)) {
        candidates.push_back(entry.path().filename().string());
      }
    }
    if (ec) invalid_input("cannot list '{}': {}", printable_path(dir), ec.message());
    if (candidates.empty()) invalid_input("no *.safetensors files in '{}'", printable_path(dir));
    if (candidates.size() > 1) {
      std::sort(candidates.begin(), candidates.end());
      invalid_input("{} *.safetensors files in '{}' but no model.safetensors or {} to choose",
                    candidates.size(), printable_path(dir), kIndexName);
    }
    add_local(candidates.front());
  }
  return store;
}

void TensorStore::add_file(const std::filesystem::path& path) {
  auto file = std::make_unique<SafetensorsFile>(path);
  for (const auto& [name, view] : file->tensors()) {
    const auto it = index_.find(name);
    if (it != index_.end()) {
      invalid_input("tensor '{}' is in both '{}' and '{}'", printable(name), printable_path(it->second->file),
                    printable_path(path));
    }
  }
  for (const auto& [name, view] : file->tensors()) index_.emplace(name, &view);
  files_.push_back(std::move(file));
}

const TensorView* TensorStore::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

const TensorView& TensorStore::get(std::string_view name) const {
  const TensorView* view = find(name);
  if (view == nullptr) invalid_input("missing tensor '{}' in '{}'", printable(name), printable_path(dir_));
  return *view;
}

void TensorStore::release_pages() const {
  for (const auto& f : files_) f->release_pages();
}

int64_t TensorStore::mapped_bytes() const {
  int64_t bytes = 0;
  for (const auto& f : files_) bytes += static_cast<int64_t>(f->size());
  return bytes;
}

std::vector<std::string> TensorStore::names() const {
  std::vector<std::string> result;
  result.reserve(index_.size());
  for (const auto& [name, view] : index_) result.push_back(name);
  return result;
}

// ---------------------------------------------------------------------------------------------------
// Writing

void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& tensor : tensors) {
    if (tensor.name == "__metadata__" || header.contains(tensor.name)) {
      fail(ErrorKind::kInternal, "write_safetensors '{}': duplicate or reserved tensor name '{}'",
           printable_path(path), printable(tensor.name));
    }
    uint64_t numel = 1;
    bool overflow = false;
    for (int64_t dim : tensor.shape) {
      if (dim < 0) {
        fail(ErrorKind::kInternal, "write_safetensors '{}': tensor '{}' has a negative dimension",
             printable_path(path), printable(tensor.name));
      }
      overflow = overflow || __builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel);
    }
    uint64_t nbytes = 0;
    overflow =
        overflow || __builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(tensor.dtype)), &nbytes);
    if (overflow || nbytes != tensor.bytes.size()) {
      fail(ErrorKind::kInternal,
           "write_safetensors '{}': tensor '{}' has {} bytes, its dtype and shape need {}",
           printable_path(path), printable(tensor.name), tensor.bytes.size(),
           overflow ? std::string("more than 2^64") : std::to_string(nbytes));
    }
    header[tensor.name] = {{"dtype", std::string(dtype_name(tensor.dtype))},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;

  std::string header_text;
  try {
    header_text = header.dump();  // keys sorted (nlohmann::json uses std::map)
  } catch (const json::exception& e) {
    fail(ErrorKind::kInternal, "write_safetensors '{}': cannot encode the header: {}", printable_path(path),
         e.what());
  }
  header_text.append((8 - (8 + header_text.size()) % 8) % 8, ' ');
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(uint64_t{header_text.size()} >> (8 * i));

  const std::filesystem::path tmp_path = path.string() + ".tmp-" + std::to_string(::getpid());
  std::FILE* raw = std::fopen(tmp_path.c_str(), "wb");
  if (raw == nullptr) {
    const int err = errno;
    fail(err == ENOENT || err == EACCES || err == EROFS || err == ENOTDIR ? ErrorKind::kInvalidInput
                                                                          : ErrorKind::kInternal,
         "cannot create '{}': {}", printable_path(tmp_path), std::strerror(err));
  }
  FileCloser closer(raw);
  try {
    auto write = [&](const void* data, size_t size) {
      if (size > 0 && std::fwrite(data, 1, size, raw) != size) {
        fail(ErrorKind::kInternal, "cannot write '{}': {}", printable_path(tmp_path), std::strerror(errno));
      }
    };
    write(length, sizeof(length));
    write(header_text.data(), header_text.size());
    for (const auto& tensor : tensors) write(tensor.bytes.data(), tensor.bytes.size());
    if (std::fflush(raw) != 0 || ::fsync(::fileno(raw)) != 0) {
      fail(ErrorKind::kInternal, "cannot flush '{}': {}", printable_path(tmp_path), std::strerror(errno));
    }
    if (std::fclose(closer.release()) != 0) {
      fail(ErrorKind::kInternal, "cannot close '{}': {}", printable_path(tmp_path), std::strerror(errno));
    }
    if (std::rename(tmp_path.c_str(), path.c_str()) != 0) {
      fail(ErrorKind::kInternal, "cannot rename '{}' to '{}': {}", printable_path(tmp_path),
           printable_path(path), std::strerror(errno));
    }
  } catch (...) {
    if (FILE* still_open = closer.release()) std::fclose(still_open);
    std::error_code ignored;
    std::filesystem::remove(tmp_path, ignored);
    throw;
  }
  // Make the rename itself durable (best effort).
  const std::filesystem::path parent = path.parent_path().empty() ? "." : path.parent_path();
  const int dir_fd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

}  // namespace mtpx
