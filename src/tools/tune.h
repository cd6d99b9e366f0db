// `mtpx tune`: measures plain decoding and MTP at K = 1..max on this machine (tools/bench.h protocol,
// built-in prompt suite), each K also with every candidate draft vocabulary, picks the fastest (K, draft
// vocabulary) only when it beats plain decoding by a margin, and saves the choice with its evidence as the
// model's runtime profile plus an SVG chart next to it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

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
  // Draft vocabularies to try beside the whole one (GenerateOptions::draft_vocab); unset: the default
  // candidates for the model (default_draft_vocabularies).
  std::optional<std::vector<int64_t>> draft_vocabs;
};

// 32768 for vocabularies of at least 4 x 32768 ids (Qwen's 248320): there the head's lm_head pass is most
// of a draft step, and the first 32768 merges hold most text. Half the vocabulary for smaller ones of at
// least 2048 ids: on a model whose weights stay in cache the lm_head is a large part of every pass (the
// shipped model on the 2-core Xeon: K=1 1.16x with all 8192 ids, 1.23x with 4096; BENCHMARKS.md session 8).
std::vector<int64_t> default_draft_vocabularies(int64_t vocab_size);

// Measures and decides; returns the profile (also written with save_runtime_profile by the caller).
nlohmann::json tune_draft_depth(const Model& model, const std::vector<std::vector<int32_t>>& prompts,
                                const TuneOptions& options, const std::function<void(double)>& progress = {});

// An SVG chart of tok/s (bars) and acceptance of the first draft position (line) against K.
std::string tune_chart_svg(const nlohmann::json& profile);

}  // namespace mtpx::tools
