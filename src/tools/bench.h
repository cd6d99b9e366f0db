// Measuring decoding speed the same way everywhere (`mtpx bench`, `mtpx tune`, bench/): every case
// (plain decoding and MTP at each K, greedy and sampled) runs on the same prompts in every run, the
// cases interleaved within a run so that all of them see the same machine; after one warm-up, N runs
// and the median with its spread. tok/s counts the tokens after the first (which comes from prefill)
// per second of decoding.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "decode/generate.h"
#include "model/qwen35.h"

namespace mtpx::tools {

struct BenchCase {
  std::string sampler_name;  // "greedy", "default", ...
  SamplerParams sampler;
  int64_t draft = 0;        // 0: plain decoding
  int64_t draft_vocab = 0;  // GenerateOptions::draft_vocab (0: the whole vocabulary)
};

struct BenchProtocol {
  std::vector<std::vector<int32_t>> prompts;
  int64_t max_tokens = 400;
  int runs = 3;
  // More than `runs`: after `runs` runs, keep going until every case's median tok/s has moved by at most
  // `settle_tolerance` (relative) with each of the last two runs, or `max_runs` runs are done.
  int max_runs = 0;
  double settle_tolerance = 0.01;
  bool warmup = true;
  uint64_t seed = 0;
  // >= 0: the head's drafts are replaced by the trunk's own greedy continuation with probability A per
  // position (else by a wrong token), to measure speculative speed at a chosen acceptance on models
  // whose head is random (as vLLM's synthetic mode). Greedy cases only.
  double synthetic_acceptance = -1.0;
  std::vector<int32_t> stop_ids;
};

struct BenchResult {
  BenchCase spec;
  std::vector<double> tok_s;  // one per run
  double median_tok_s = 0.0, min_tok_s = 0.0, max_tok_s = 0.0;
  MtpStats mtp;                      // summed over the first run's prompts
  int64_t draws_below = 0;           // likewise (GenerateStats::draws_below)
  int64_t logit_rows_fetched = 0;    // likewise (GenerateStats::logit_rows_fetched)
  int64_t logit_values_fetched = 0;  // likewise (GenerateStats::logit_values_fetched)
  double tokens_per_step = 1.0;      // generated tokens per forward pass of the trunk (decode phase)
  ExpertTraffic decode_experts;      // a MoE trunk's decode passes, first run (GenerateStats)
  std::vector<double> acceptance_by_position;
};

// Runs every case of the protocol; `progress` (may be empty) is told the fraction done.
std::vector<BenchResult> run_bench(const Model& model, const BenchProtocol& protocol,
                                   const std::vector<BenchCase>& cases,
                                   const std::function<void(double)>& progress = {});

// The median of a non-empty list.
double median_of(std::vector<double> values);

}  // namespace mtpx::tools
