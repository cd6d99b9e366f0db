// Plain autoregressive generation: prefill the prompt, then one token per forward pass.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "decode/sampler.h"
#include "model/qwen35.h"

namespace mtpx {

struct GenerateOptions {
  int64_t max_tokens = 128;
  SamplerParams sampler;
  uint64_t seed = 0;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these
  int64_t vocab_limit = 0;        // 0: the model's vocabulary; else only ids below it are sampled
};

struct GenerateStats {
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  double prefill_seconds = 0.0;  // prompt forward pass (includes the first sampled token)
  double decode_seconds = 0.0;   // the remaining forward passes
  int64_t decode_steps = 0;

  double prefill_tok_s() const { return prefill_seconds > 0 ? static_cast<double>(prompt_tokens) / prefill_seconds : 0.0; }
  double decode_tok_s() const { return decode_seconds > 0 ? static_cast<double>(decode_steps) / decode_seconds : 0.0; }
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids (a final stop id included)
  std::string finish_reason;    // "stop" or "length"
  GenerateStats stats;
};

// Calls on_token for each generated id as soon as it is known (for streaming).
GenerateResult generate(const Model& model, std::span<const int32_t> prompt, const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token = {});

}  // namespace mtpx
