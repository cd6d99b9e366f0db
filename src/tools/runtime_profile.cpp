#include "tools/runtime_profile.h"

#include <fmt/core.h>
#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <ctime>
#include <fstream>

#include "backend/cpu/matmul.h"
#include "decode/generate.h"
#include "io/model_config.h"
#include "model/qwen35.h"
#include "tools/checkpoint.h"
#include "util/error.h"

namespace mtpx::tools {
namespace {

using nlohmann::json;

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(" \t", colon + 1));
    }
  return "unknown";
}

}  // namespace

std::string profile_device(const Model& model) {
  return model.executor() ? model.executor()->description() : "cpu";
}

json hardware_fingerprint(const std::string& device) {
  return {{"device", device},
          {"cpu", cpu_model_name()},
          {"logical_cores", static_cast<int64_t>(::sysconf(_SC_NPROCESSORS_ONLN))},
          {"simd", cpu::simd_path()},
          {"threads", omp_get_max_threads()}};
}

std::filesystem::path runtime_profile_path(const std::filesystem::path& model_dir,
                                           const std::string& device) {
  const std::string name = device == "cpu" ? kRuntimeProfileName : "mtpx_runtime.cuda.json";
  std::filesystem::path cache;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0')
    cache = xdg;
  else if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0')
    cache = std::filesystem::path(home) / ".cache";
  else
    cache = std::filesystem::temp_directory_path();
  std::error_code ec;
  auto canonical = std::filesystem::weakly_canonical(model_dir, ec);
  if (ec) canonical = std::filesystem::absolute(model_dir);
  // FNV-1a, not std::hash: the directory name must not change between builds or standard libraries.
  uint64_t hash = 1469598103934665603ull;
  for (const unsigned char c : canonical.string()) hash = (hash ^ c) * 1099511628211ull;
  return cache / "mtpx" / "profiles" / fmt::format("{}-{:016x}", canonical.filename().string(), hash) / name;
}

std::filesystem::path save_runtime_profile(const std::filesystem::path& model_dir, json profile,
                                           const std::string& device) {
  const auto path = runtime_profile_path(model_dir, device);
  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  if (ec) invalid_input("cannot create '{}': {}", path.parent_path().string(), ec.message());
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  profile["mtpx_version"] = MTPX_VERSION;
  profile["hardware"] = hardware_fingerprint(device);
  profile["date"] = date;
  write_json_file(path, profile);
  return path;
}

json describe_runtime_profile(const std::filesystem::path& model_dir, const std::string& device) {
  const auto path = runtime_profile_path(model_dir, device);
  json out = {{"present", false}, {"path", path.string()}, {"summary", "none (run mtpx tune)"}};
  if (!std::filesystem::exists(path)) return out;
  out["present"] = true;
  json p;
  try {
    p = read_json_file(path);
  } catch (const Error& e) {
    out["status"] = "invalid";
    out["reason"] = e.what();
    out["summary"] = fmt::format("invalid ({})", e.what());
    return out;
  }
  if (!p.is_object() || !p.contains("draft") || !p["draft"].is_number_integer() ||
      p["draft"].get<int64_t>() < 0 || p["draft"].get<int64_t>() > 8) {
    out["status"] = "invalid";
    out["reason"] = "no valid 'draft'";
    out["summary"] = "invalid (no valid 'draft')";
    return out;
  }
  if (p.contains("draft_vocab") &&
      (!p["draft_vocab"].is_number_integer() || p["draft_vocab"].get<int64_t>() < 0)) {
    out["status"] = "invalid";
    out["reason"] = "'draft_vocab' is not a count";
    out["summary"] = "invalid ('draft_vocab' is not a count)";
    return out;
  }
  const int64_t draft = p["draft"].get<int64_t>(), draft_vocab = p.value("draft_vocab", int64_t{0});
  out["draft"] = draft;
  out["draft_vocab"] = draft_vocab;
  out["date"] = p.value("date", "");
  std::string stale;
  if (p.value("mtpx_version", "") != MTPX_VERSION)
    stale = fmt::format("made by mtpx {}, this is {}", p.value("mtpx_version", "?"), MTPX_VERSION);
  else if (!p.contains("hardware") || p["hardware"] != hardware_fingerprint(device))
    stale = "made on other hardware or with another thread count";
  if (!stale.empty()) {
    out["status"] = "stale";
    out["reason"] = stale;
    out["summary"] = fmt::format("stale, not used ({}): re-run mtpx tune", stale);
    return out;
  }
  out["status"] = "valid";
  out["summary"] =
      fmt::format("{} ({}, {})",
                  draft == 0         ? std::string("plain decoding")
                  : draft_vocab == 0 ? fmt::format("MTP K={}", draft)
                                     : fmt::format("MTP K={}, draft vocabulary {}", draft, draft_vocab),
                  p.value("sampler", "?"), p.value("date", "?"));
  return out;
}

std::optional<TunedDecoding> tuned_decoding(const std::filesystem::path& model_dir,
                                            const std::string& device) {
  const json d = describe_runtime_profile(model_dir, device);
  if (d.value("status", "") != "valid") return std::nullopt;
  return TunedDecoding{d["draft"].get<int64_t>(), d["draft_vocab"].get<int64_t>()};
}

TunedDecoding decoding_or_default(const std::optional<TunedDecoding>& tuned) {
  if (tuned && tuned->draft > 0) return *tuned;
  return {kDefaultDraft, 0};
}

}  // namespace mtpx::tools
