// config.json and generation_config.json of a Qwen3.5/Qwen3.6 checkpoint, parsed once into plain
// structs (spec ../shared/reference/qwen35_arch.md §1, §8). Nothing downstream reads raw JSON.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "io/json_file.h"

namespace mtpx {

enum class LayerType { kLinearAttention, kFullAttention };

struct ModelConfig {
  std::string architecture;   // "Qwen3_5[Moe]ForConditionalGeneration" or "Qwen3_5[Moe]ForCausalLM"
  std::string tensor_prefix;  // "model.language_model." (multimodal wrapper) or "model." (text-only)

  int64_t vocab_size = 0;              // V: rows of embed_tokens / lm_head
  int64_t hidden_size = 0;             // H
  int64_t intermediate_size = 0;       // I (dense SwiGLU; 0 in a mixture-of-experts model)
  int64_t num_layers = 0;              // L
  std::vector<LayerType> layer_types;  // [L]

  // Gated full attention (§3).
  int64_t num_attention_heads = 0;  // nq
  int64_t num_kv_heads = 0;         // nkv
  int64_t head_dim = 0;             // D
  int64_t rotary_dim = 0;           // int(D * partial_rotary_factor), even
  double rope_theta = 1e7;
  double partial_rotary_factor = 0.25;
  bool attn_output_gate = true;

  // Gated DeltaNet (§4).
  int64_t linear_num_key_heads = 0;    // Hk
  int64_t linear_num_value_heads = 0;  // Hv
  int64_t linear_key_head_dim = 0;     // Dk
  int64_t linear_value_head_dim = 0;   // Dv
  int64_t linear_conv_kernel_dim = 0;  // Kc

  // Mixture of experts (qwen3_5_moe, spec §5 and §10): every decoder layer's MLP, the MTP head's included,
  // is a router over num_experts SwiGLU experts of moe_intermediate_size, of which each token runs
  // num_experts_per_tok, plus one shared expert of shared_expert_intermediate_size. 0 experts: dense.
  // transformers 5.17 always renormalizes the chosen experts' weights to sum 1 (it reads no norm_topk_prob).
  int64_t num_experts = 0;                      // E
  int64_t num_experts_per_tok = 0;              // k
  int64_t moe_intermediate_size = 0;            // I_moe
  int64_t shared_expert_intermediate_size = 0;  // I_shared

  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;  // from config; the loader also checks whether lm_head.weight exists
  int64_t mtp_num_hidden_layers = 0;
  int64_t max_position_embeddings = 0;
  std::vector<int32_t> eos_token_ids;

  int64_t conv_dim() const {
    return 2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads * linear_value_head_dim;
  }
  bool is_moe() const { return num_experts > 0; }
  int64_t num_full_attention_layers() const;
  int64_t num_linear_attention_layers() const { return num_layers - num_full_attention_layers(); }
};

// Parses and validates a config.json object (both layouts, both rope spellings). `source` names the file
// in error messages. Throws mtpx::Error (kInvalidInput / kUnsupported) with a one-line message.
ModelConfig parse_model_config(const nlohmann::json& config, const std::string& source);
ModelConfig load_model_config(const std::filesystem::path& config_json);

// The sampler defaults a checkpoint ships (generation_config.json). Absent keys keep these defaults,
// which are Hugging Face's (temperature 1, no truncation); do_sample=false means greedy.
struct GenerationConfig {
  bool do_sample = false;
  double temperature = 1.0;
  int64_t top_k = 0;   // 0: off
  double top_p = 1.0;  // 1: off
  double min_p = 0.0;  // 0: off
  std::vector<int32_t> eos_token_ids;
};

GenerationConfig parse_generation_config(const nlohmann::json& config, const std::string& source);
// Missing file: defaults (greedy). Malformed file: error naming it.
GenerationConfig load_generation_config(const std::filesystem::path& generation_config_json);

}  // namespace mtpx
