// The tensors of a Qwen3.5 text model, resolved from a checkpoint by name with their shapes checked
// (the tensor manifest). Matrices are views into the memory-mapped files (or into buffers a synthetic
// model owns): one copy of every weight. Norm vectors and the other per-channel parameters are small and
// are widened to float32 at load, with the zero-centered norms' "+1" folded in.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/cpu/matmul.h"
#include "io/model_config.h"

namespace mtpx {

class TensorStore;

// Gated full attention (§3).
struct AttentionWeights {
  cpu::WeightMatrix q_proj;   // [nq * 2D, H]  per head [query(D) | gate(D)]
  cpu::WeightMatrix k_proj;   // [nkv * D, H]
  cpu::WeightMatrix v_proj;   // [nkv * D, H]
  cpu::WeightMatrix o_proj;   // [H, nq * D]
  std::vector<float> q_norm;  // [D]  1 + w
  std::vector<float> k_norm;  // [D]  1 + w
};

// Gated DeltaNet (§4).
struct DeltaNetWeights {
  cpu::WeightMatrix in_proj_qkv;     // [conv_dim, H]  rows [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]
  cpu::WeightMatrix in_proj_z;       // [Hv * Dv, H]
  cpu::WeightMatrix in_proj_b;       // [Hv, H]
  cpu::WeightMatrix in_proj_a;       // [Hv, H]
  cpu::WeightMatrix out_proj;        // [H, Hv * Dv]
  std::vector<float> conv1d;         // [conv_dim, Kc]  depthwise; [c][Kc-1] multiplies the current token
  std::vector<float> conv1d_by_tap;  // [Kc, conv_dim]  the same taps tap-major, for the CPU conv's loop over
                                     // contiguous channels (made once at load: set_conv_taps)
  std::vector<float> a_log;          // [Hv]
  std::vector<float> dt_bias;        // [Hv]
  std::vector<float> norm;           // [Dv]  plain w (RMSNormGated)
};

// Fills d.conv1d_by_tap from d.conv1d.
void set_conv_taps(DeltaNetWeights& d, int64_t conv_dim, int64_t kernel);

// SwiGLU MLP (§5).
struct MlpWeights {
  cpu::WeightMatrix gate_proj;  // [I, H]
  cpu::WeightMatrix up_proj;    // [I, H]
  cpu::WeightMatrix down_proj;  // [H, I]
};

// A mixture-of-experts MLP (transformers 5.17's Qwen3_5MoeSparseMoeBlock, spec §5): a router picks k of the
// E experts per token, and a shared expert, scaled by a sigmoid gate, runs on every token. Each expert's
// matrices are views into the stored tensors, whichever layout holds them (fused [E, 2I, H] / [E, H, I],
// one tensor per expert, or MLX's stacked switch_mlp): nothing is copied.
struct MoeWeights {
  cpu::WeightMatrix router;              // [E, H]  mlp.gate.weight
  std::vector<MlpWeights> experts;       // [E]  gate/up [I_moe, H], down [H, I_moe]
  MlpWeights shared_expert;              // gate/up [I_shared, H], down [H, I_shared]
  cpu::WeightMatrix shared_expert_gate;  // [1, H]
  int64_t experts_per_token = 0;         // k
};

struct LayerWeights {
  LayerType type = LayerType::kLinearAttention;
  std::vector<float> input_norm;              // [H]  1 + w
  std::vector<float> post_attn_norm;          // [H]  1 + w
  std::optional<AttentionWeights> attention;  // full-attention layers
  std::optional<DeltaNetWeights> delta_net;   // linear-attention layers
  MlpWeights mlp;                             // dense models
  std::optional<MoeWeights> moe;              // mixture-of-experts models (mlp is then empty)
};

// Every matrix of one layer that a forward pass multiplies by, the routed experts included.
template <typename F>
void for_each_matrix(const LayerWeights& l, F f) {
  if (l.attention)
    for (const cpu::WeightMatrix* w :
         {&l.attention->q_proj, &l.attention->k_proj, &l.attention->v_proj, &l.attention->o_proj})
      f(*w);
  if (l.delta_net)
    for (const cpu::WeightMatrix* w :
         {&l.delta_net->in_proj_qkv, &l.delta_net->in_proj_z, &l.delta_net->in_proj_b,
          &l.delta_net->in_proj_a, &l.delta_net->out_proj})
      f(*w);
  if (l.moe) {
    f(l.moe->router);
    f(l.moe->shared_expert_gate);
    for (const MlpWeights* m : {&l.moe->shared_expert})
      for (const cpu::WeightMatrix* w : {&m->gate_proj, &m->up_proj, &m->down_proj}) f(*w);
    for (const MlpWeights& m : l.moe->experts)
      for (const cpu::WeightMatrix* w : {&m.gate_proj, &m.up_proj, &m.down_proj}) f(*w);
  } else {
    for (const cpu::WeightMatrix* w : {&l.mlp.gate_proj, &l.mlp.up_proj, &l.mlp.down_proj}) f(*w);
  }
}

struct ModelWeights {
  cpu::WeightMatrix embed_tokens;  // [V, H]
  cpu::WeightMatrix lm_head;       // [V, H]  == embed_tokens when tied
  bool tied = false;
  std::vector<float> final_norm;  // [H]  1 + w
  std::vector<LayerWeights> layers;
  int64_t matrix_bytes = 0;  // bytes of all matrices (each counted once)
};

// The native MTP head (spec §6.1): fc over [norm(embedding) ; norm(hidden)], one full-attention decoder
// layer with its own KV cache, a final norm; embed_tokens and lm_head are the trunk's (shared, not copied).
struct MtpWeights {
  cpu::WeightMatrix fc;                      // [H, 2H]  input order: embedding first, hidden second
  std::vector<float> pre_fc_norm_embedding;  // [H]  1 + w
  std::vector<float> pre_fc_norm_hidden;     // [H]  1 + w
  std::vector<float> norm;                   // [H]  1 + w  (mtp.norm)
  LayerWeights layer;                        // mtp.layers.0: full attention + MLP
  int64_t matrix_bytes = 0;
};

// What a checkpoint holds of the MTP head.
struct MtpStatus {
  enum class Kind { kPresent, kAbsent, kIncomplete, kIncompatible } kind = Kind::kAbsent;
  std::string detail;  // missing tensor names or the shape mismatch; empty when present
};

// How a checkpoint stores things: the tensor-name prefix of the trunk ("model.language_model." official,
// "model." text-only, "language_model.model." MLX) and what its zero-centered norms need added (1 when
// stored as w, as Hugging Face does; 0 when stored as 1 + w, as MLX conversions do).
struct CheckpointConvention {
  std::string tensor_prefix;
  float norm_offset = 1.0f;
};
CheckpointConvention detect_checkpoint_convention(const TensorStore& store, const ModelConfig& config);

// Resolves every tensor of the trunk from `store` and checks its shape and dtype against `config`.
// Errors name the tensor, the expected and the found shape. `norm_offset` is what the checkpoint's
// zero-centered norms need added (1 for Hugging Face checkpoints).
ModelWeights load_model_weights(const TensorStore& store, const ModelConfig& config,
                                float norm_offset = 1.0f);

// Resolves the `mtp.*` tensors when the checkpoint has them. Never throws for a missing or mismatched head:
// the status says what is wrong (with the tensor names), and the caller decides whether that is an error.
std::optional<MtpWeights> load_mtp_weights(const TensorStore& store, const ModelConfig& config,
                                           MtpStatus& status, float norm_offset = 1.0f);

// Random weights with `config`'s shapes (bf16 matrices), for benchmarks at real scale without a download.
// The returned buffers own the data the views point into.
struct SyntheticStorage {
  std::vector<std::unique_ptr<uint16_t[]>> buffers;
};
ModelWeights make_synthetic_weights(const ModelConfig& config, uint64_t seed, SyntheticStorage& storage);
MtpWeights make_synthetic_mtp_weights(const ModelConfig& config, uint64_t seed, SyntheticStorage& storage);

}  // namespace mtpx
