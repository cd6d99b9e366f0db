// libFuzzer target: model.safetensors.index.json text through parse_safetensors_index (the part of
// TensorStore::open_directory that reads the index; opening the shards it names is file-system work).
// Every shard name accepted must be a plain file name: a path that could leave the model directory is a
// finding even without a crash.
#include <cstdlib>

#include "fuzz_util.h"
#include "io/safetensors.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto shards =
        mtpx::parse_safetensors_index(mtpx::fuzz::as_text(data, size), "model.safetensors.index.json");
    for (const auto& [shard, names] : shards) {
      const std::filesystem::path path(shard);
      if (shard.empty() || path.has_parent_path() || shard.front() == '.' || names.empty()) std::abort();
    }
  } catch (const mtpx::Error&) {
  }
  return 0;
}
