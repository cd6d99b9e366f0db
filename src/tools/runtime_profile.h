// The runtime profile `mtpx tune` saves per model and machine (mtpx_runtime.json, in the user's cache
// directory): the draft depth K and
// draft vocabulary that measured fastest here, with the evidence. `generate`, `bench` and `serve` take
// them from it by default. A
// profile made on other hardware or by another mtpx version is reported as stale and not used.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace mtpx {
class Model;
}

namespace mtpx::tools {

inline constexpr const char* kRuntimeProfileName = "mtpx_runtime.json";

// Profiles are per device: `device` is "cpu" or the GPU's description (DeviceExecutor::description()),
// and the CPU and CUDA profiles live in separate files (mtpx_runtime.json, mtpx_runtime.cuda.json).
std::string profile_device(const Model& model);

// What identifies "this machine" for a profile: CPU model, logical cores, SIMD path, worker threads,
// and the GPU when the device is one.
nlohmann::json hardware_fingerprint(const std::string& device = "cpu");

// Where the profile of `model_dir` lives: $XDG_CACHE_HOME/mtpx/profiles/<name>-<hash of the canonical
// path>/ (default ~/.cache), never the model directory itself, which is often a git checkout (the shipped
// model) or a read-only download cache. The chart beside it has the same name with .svg.
std::filesystem::path runtime_profile_path(const std::filesystem::path& model_dir,
                                           const std::string& device = "cpu");

// Writes `profile` (adding version, hardware and date) atomically; returns the path written.
std::filesystem::path save_runtime_profile(const std::filesystem::path& model_dir, nlohmann::json profile,
                                           const std::string& device = "cpu");

// {"present", "path", "status": "valid"|"stale"|"invalid", "reason", "draft", "draft_vocab", "summary"}.
nlohmann::json describe_runtime_profile(const std::filesystem::path& model_dir,
                                        const std::string& device = "cpu");

// What a valid profile chose: the draft depth (0 = plain decoding was fastest) and the draft vocabulary
// (GenerateOptions::draft_vocab; 0 = the whole vocabulary, also for profiles older than the field).
struct TunedDecoding {
  int64_t draft = 0;
  int64_t draft_vocab = 0;
};
std::optional<TunedDecoding> tuned_decoding(const std::filesystem::path& model_dir,
                                            const std::string& device = "cpu");
// The one rule generate, bench and serve follow when no flag says: the profile's K and draft vocabulary
// where it chose MTP, else kDefaultDraft (decode/generate.h) and the whole vocabulary.
TunedDecoding decoding_or_default(const std::optional<TunedDecoding>& tuned);

}  // namespace mtpx::tools
