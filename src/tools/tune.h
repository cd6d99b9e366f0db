// `mtpx tune`: measures plain decoding and MTP at K = 1..max on this machine (tools/bench.h protocol,
// built-in prompt suite), picks the fastest K only when it beats plain decoding by a margin, and saves
// the choice with its evidence as the model's runtime profile plus an SVG chart next to it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "model/qwen35.h"
#include "tools/bench.h"

namespace mtpx::tools {

struct TuneOptions {
  int64_t max_draft = 4;
  std::string sampler_name = "greedy";  // "greedy" or "default" (the model's generation_config sampler)
  SamplerParams sampler;
  int64_t max_tokens = 128;
  int runs = 3;
  double margin = 0.05;  // K must beat plain decoding by this fraction to be chosen
  size_t prompts = 4;
  double synthetic_acceptance = -1.0;
};

// Measures and decides; returns the profile (also written with save_runtime_profile by the caller).
nlohmann::json tune_draft_depth(const Model& model, const std::vector<std::vector<int32_t>>& prompts,
                                const TuneOptions& options, const std::function<void(double)>& progress = {});

// An SVG chart of tok/s (bars) and acceptance of the first draft position (line) against K.
std::string tune_chart_svg(const nlohmann::json& profile);

}  // namespace mtpx::tools
