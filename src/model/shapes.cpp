#include "model/shapes.h"

#include "util/error.h"

namespace mtpx {

std::vector<std::string> shape_names() {
  return {"tiny", "tiny-moe", "0.8B", "2B", "4B", "9B", "27B", "35B-A3B", "122B-A10B", "397B-A17B"};
}

ModelConfig shape_config(const std::string& shape, int64_t layers) {
  struct Shape {
    const char* name;
    int64_t hidden, layers, nq, nkv, hv, intermediate;
    bool tied;
    int64_t experts = 0, experts_per_tok = 0, moe_intermediate = 0, shared_intermediate = 0;
  };
  // Spec §9. All: head_dim 256, Dk = Dv = 128, Hk = 16, Kc = 4, full attention every 4th layer, vocab 248320.
  static const Shape kShapes[] = {
      {"0.8B", 1024, 24, 8, 2, 16, 3584, true},
      {"2B", 2048, 24, 8, 2, 16, 6144, true},
      {"4B", 2560, 32, 16, 4, 32, 9216, true},
      {"9B", 4096, 32, 16, 4, 32, 12288, false},
      {"27B", 5120, 64, 24, 4, 48, 17408, false},
      {"35B-A3B", 2048, 40, 16, 2, 32, 0, false, 256, 8, 512, 512},
      {"122B-A10B", 3072, 48, 32, 2, 64, 0, false, 256, 8, 1024, 1024},
      {"397B-A17B", 4096, 60, 32, 2, 64, 0, false, 512, 10, 1024, 1024},
  };
  ModelConfig c;
  c.architecture = "Qwen3_5ForCausalLM";
  c.tensor_prefix = "model.";
  c.linear_conv_kernel_dim = 4;
  c.rope_theta = 1e7;
  c.partial_rotary_factor = 0.25;
  c.mtp_num_hidden_layers = 1;
  if (shape == "tiny" || shape == "tiny-moe") {
    c.vocab_size = 4096, c.hidden_size = 256, c.intermediate_size = 768, c.num_layers = 4;
    c.num_attention_heads = 4, c.num_kv_heads = 2, c.head_dim = 64;
    c.linear_num_key_heads = 2, c.linear_num_value_heads = 4, c.linear_key_head_dim = 64,
    c.linear_value_head_dim = 64;
    c.tie_word_embeddings = true;
    if (shape == "tiny-moe") {
      c.intermediate_size = 0;
      c.num_experts = 16, c.num_experts_per_tok = 4, c.moe_intermediate_size = 128;
      c.shared_expert_intermediate_size = 192;
    }
  } else {
    const Shape* s = nullptr;
    for (const Shape& x : kShapes)
      if (shape == x.name) s = &x;
    if (s == nullptr)
      invalid_input(
          "unknown shape '{}' (expected one of tiny, tiny-moe, 0.8B, 2B, 4B, 9B, 27B, 35B-A3B, "
          "122B-A10B, 397B-A17B, or a config.json)",
          shape);
    c.vocab_size = 248320, c.hidden_size = s->hidden, c.intermediate_size = s->intermediate,
    c.num_layers = s->layers;
    c.num_attention_heads = s->nq, c.num_kv_heads = s->nkv, c.head_dim = 256;
    c.linear_num_key_heads = 16, c.linear_num_value_heads = s->hv, c.linear_key_head_dim = 128,
    c.linear_value_head_dim = 128;
    c.tie_word_embeddings = s->tied;
    c.num_experts = s->experts, c.num_experts_per_tok = s->experts_per_tok;
    c.moe_intermediate_size = s->moe_intermediate, c.shared_expert_intermediate_size = s->shared_intermediate;
  }
  if (c.is_moe()) c.architecture = "Qwen3_5MoeForCausalLM";
  if (layers > 0) {
    // A reduced-depth model of the shape (benchmarks on machines that cannot hold all of it): the same
    // layers, the same 3:1 pattern, fewer of them.
    if (layers > c.num_layers)
      invalid_input("--layers {}: the {} shape has {} layers", layers, shape, c.num_layers);
    c.num_layers = layers;
  }
  c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * c.partial_rotary_factor);
  for (int64_t i = 0; i < c.num_layers; ++i)
    c.layer_types.push_back((i + 1) % 4 == 0 ? LayerType::kFullAttention : LayerType::kLinearAttention);
  return c;
}

}  // namespace mtpx
