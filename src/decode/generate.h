// Plain autoregressive generation: prefill the prompt, then one token per forward pass.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "decode/sampler.h"
#include "model/mtp_head.h"
#include "model/qwen35.h"

namespace mtpx {

struct GenerateOptions {
  int64_t max_tokens = 128;
  SamplerParams sampler;
  uint64_t seed = 0;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these
  int64_t vocab_limit = 0;        // 0: the model's vocabulary; else only ids below it are sampled
  int64_t draft = 0;              // MTP draft depth K (1..8); 0: plain autoregressive decoding
  // MTP drafts only from ids below this (0: the whole vocabulary). The head's lm_head pass then reads
  // only those rows (BPE ids come in merge order, so low ids are the frequent tokens). Lossless at any
  // value: the draft distribution is exactly what the drafts are sampled from (see speculative.cpp).
  int64_t draft_vocab = 0;
  // Test and benchmark hook: may replace the head's drafts (given the committed context). A replaced
  // draft is proposed with a one-hot draft distribution, which keeps the output exact.
  std::function<void(std::span<const int32_t> context, std::vector<int32_t>& drafts)> draft_hook;
  // Asked before every forward pass after the first token (so between steps, never inside one); true
  // ends generation early with finish_reason "cancelled" (a server's client went away or a stop string
  // matched). Unset: generation runs to a stop id or max_tokens, as before.
  std::function<bool()> cancelled;
  // Runs the trunk's passes (the prompt, decode rows, verify windows) instead of model.forward(): a server
  // gathers the passes of all its requests into one Model::forward_batch (server/scheduler.cpp), whose
  // results are bit-identical to forward()'s. Unset: model.forward().
  std::function<void(const SequenceForward&)> run_forward;
  // The same for the MTP head's passes (its prompt, each chained draft row, the commit of accepted rows):
  // mtp_forward_batch in a server. Unset: mtp_forward().
  std::function<void(const MtpSequenceForward&)> run_head_forward;
};

// The head pass of `f`: through options.run_head_forward when set, else mtp_forward().
inline void head_forward(const Model& model, const GenerateOptions& options, const MtpSequenceForward& f) {
  if (options.run_head_forward)
    options.run_head_forward(f);
  else
    mtp_forward(model, f);
}

// The trunk pass of `f`: through options.run_forward when set, else model.forward().
inline void trunk_forward(const Model& model, const GenerateOptions& options, const SequenceForward& f) {
  if (options.run_forward)
    options.run_forward(f);
  else
    model.forward(f);
}

inline constexpr int64_t kMaxDraft = 8;
// The draft depth every command uses when neither a flag nor `mtpx tune`'s profile for this machine says
// (one rule for generate, bench and serve): K = 2 was the best or within noise of it on the CPU machines
// (the shipped model, BENCHMARKS.md "mtpx tune"); GPUs prefer deeper drafts, which tune finds.
inline constexpr int64_t kDefaultDraft = 2;

// Speculative decoding counters (all zero without MTP).
struct MtpStats {
  int64_t draft = 0;                          // K
  int64_t draft_vocab = 0;                    // drafts from ids below this (0: the whole vocabulary)
  int64_t steps = 0;                          // verify passes
  int64_t drafted = 0;                        // draft tokens proposed
  int64_t accepted = 0;                       // draft tokens accepted
  std::vector<int64_t> drafted_by_position;   // [K]
  std::vector<int64_t> accepted_by_position;  // [K]

  double acceptance() const {
    return drafted > 0 ? static_cast<double>(accepted) / static_cast<double>(drafted) : 0.0;
  }
  // accepted / drafted at each draft position (0 where nothing was drafted).
  std::vector<double> acceptance_by_position() const {
    std::vector<double> out;
    for (size_t i = 0; i < drafted_by_position.size(); ++i)
      out.push_back(drafted_by_position[i] > 0 ? static_cast<double>(accepted_by_position[i]) /
                                                     static_cast<double>(drafted_by_position[i])
                                               : 0.0);
    return out;
  }
  double mean_accepted_per_step() const {
    return steps > 0 ? static_cast<double>(accepted) / static_cast<double>(steps) : 0.0;
  }
};

struct GenerateStats {
  // A mixture-of-experts trunk: the distinct experts the decode passes (not the prompt's) read per MoE
  // block: k per plain decode row, more for a verify window whose rows route apart.
  ExpertTraffic decode_experts;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  double prefill_seconds = 0.0;  // prompt forward pass (includes the first sampled token)
  double decode_seconds = 0.0;   // the remaining forward passes
  int64_t decode_steps = 0;
  // Sampling on a device (rows listed in part, sampler.h): the draws that landed below a row's top ids
  // (drawn there on the device), the rows that came back whole (a row its candidates did not decide, such
  // as a flat one under top-p; speculative decoding: also a residual whose proposals gave up) and the single
  // logits fetched (speculative decoding: one id's probability below a row's top ids).
  int64_t draws_below = 0;
  int64_t logit_rows_fetched = 0;
  int64_t logit_values_fetched = 0;
  MtpStats mtp;

  double prefill_tok_s() const {
    return prefill_seconds > 0 ? static_cast<double>(prompt_tokens) / prefill_seconds : 0.0;
  }
  // Tokens produced after the first one, per second of decoding (the first comes out of the prefill).
  double decode_tok_s() const {
    return decode_seconds > 0 && generated_tokens > 1
               ? static_cast<double>(generated_tokens - 1) / decode_seconds
               : 0.0;
  }
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids (a final stop id included)
  std::string finish_reason;    // "stop", "length" or "cancelled"
  GenerateStats stats;
};

// Calls on_token for each generated id as soon as it is known (for streaming). With options.draft > 0
// the model's MTP head drafts and the trunk verifies (decode/speculative.h): the output is the same
// (greedy: token for token; sampled: in distribution).
GenerateResult generate(const Model& model, std::span<const int32_t> prompt, const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token = {});

}  // namespace mtpx
