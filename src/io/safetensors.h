// Reading and writing safetensors files (https://github.com/huggingface/safetensors):
// an 8-byte little-endian header length N, N bytes of JSON header
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {...}},
// then the raw little-endian tensor bytes. Files are memory-mapped; tensors are views into the
// mapping (weights stay in their stored dtype: no copies).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mtpx {

enum class DType { kF32, kF16, kBF16, kF64, kI64, kI32, kI16, kI8, kU8, kU32, kBool };

std::string_view dtype_name(DType dtype);  // "F32", "BF16", ... (the safetensors spelling)
size_t dtype_size(DType dtype);            // bytes per element

// One tensor inside a mapped file. `data` stays valid while the owning file is alive.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;
  size_t nbytes = 0;
  std::filesystem::path file;  // the file it lives in (for error messages)

  int64_t numel() const;
};

// How many elements of a floating-point tensor (F32, F16, BF16, F64) are NaN or +-Inf; 0 for integer
// dtypes. Reads every byte of the tensor.
int64_t count_non_finite(const TensorView& tensor);

// A read-only memory-mapped file (RAII).
class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);  // throws mtpx::Error naming the path
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }
  // Drops the file's pages from this process's resident memory (the mapping stays valid).
  void release_pages() const;

 private:
  std::filesystem::path path_;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// The tensor table of a safetensors file's bytes, validated: header length bounded (<= 100 MiB) and
// inside the file, header is a JSON object, every entry has a known dtype, a shape of non-negative dims
// whose element count times the dtype size equals end-begin (no overflow), offsets inside the data
// section, no two tensors overlapping, no duplicate names. Any violation throws mtpx::Error
// (kInvalidInput) with a one-line message naming `file` and the tensor. The views point into `bytes`.
struct SafetensorsTable {
  std::map<std::string, TensorView> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;  // where the data section starts in the file: 8 + the header's length
};
SafetensorsTable parse_safetensors(std::span<const std::byte> bytes, const std::filesystem::path& file);

// One safetensors file, memory-mapped and validated by parse_safetensors when opened.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::filesystem::path& path);
  const std::filesystem::path& path() const { return file_->path(); }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorView* find(std::string_view name) const;
  void release_pages() const { file_->release_pages(); }
  size_t size() const { return file_->size(); }
  // Whether the tensors live in a copy of the file rather than its mapping (a header that leaves them
  // misaligned; see the constructor).
  bool copied_for_alignment() const { return aligned_copy_ != nullptr; }

 private:
  struct FreeAligned {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<MappedFile> file_;
  std::unique_ptr<std::byte, FreeAligned> aligned_copy_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a model directory: either `model.safetensors` (or the single *.safetensors file), or
// the shards listed by `model.safetensors.index.json` ({"weight_map": {name: shard file}}). Every tensor
// named in the index must be in the shard it names; shard names must be plain file names inside the
// directory (no path separators, no ".."). Extra *.safetensors files that the caller names (e.g. an MTP
// sidecar `mtp.safetensors`) can be added with add_file(); a name present twice is an error.
class TensorStore {
 public:
  static TensorStore open_directory(const std::filesystem::path& dir);
  void add_file(const std::filesystem::path& path);

  const TensorView* find(std::string_view name) const;  // nullptr when absent
  const TensorView& get(std::string_view name) const;   // throws kInvalidInput "missing tensor 'x' in DIR"
  std::vector<std::string> names() const;               // sorted
  const std::filesystem::path& directory() const { return dir_; }
  // Drops every file's pages from resident memory (after the weights were copied to a device).
  void release_pages() const;
  // Bytes of all the mapped files.
  int64_t mapped_bytes() const;

 private:
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*, std::less<>> index_;
};

// The weight_map of a model.safetensors.index.json text ({"weight_map": {tensor: shard file}}), grouped
// as shard -> the tensor names it must hold. Shard names must be plain file names (no path separators,
// no leading '.'). Throws mtpx::Error (kInvalidInput) naming `index_path` for anything else.
std::map<std::string, std::vector<std::string>> parse_safetensors_index(
    std::string_view text, const std::filesystem::path& index_path);

// A tensor to write: raw little-endian bytes of `dtype` with `shape`.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;
};

// Writes a safetensors file atomically: to `path + ".tmp-<pid>"` in the same directory, fsync, rename.
// An interrupted write leaves no file at `path` (or the previous one untouched). Tensors are written in the
// given order, header entries sorted by name, data 8-byte aligned after the header (header padded with
// spaces).
void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace mtpx
