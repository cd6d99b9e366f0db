#include "model/shapes.h"

#include "util/error.h"

namespace mtpx {

std::vector<std::string> shape_names() { return {"tiny", "0.8B", "2B", "4B", "9B", "27B"}; }

ModelConfig shape_config(const std::string& shape) {
  struct Shape {
    const char* name;
    int64_t hidden, layers, nq, nkv, hv, intermediate;
    bool tied;
  };
  // Spec §9. All: head_dim 256, Dk = Dv = 128, Hk = 16, Kc = 4, full attention every 4th layer, vocab 248320.
  static const Shape kShapes[] = {
      {"0.8B", 1024, 24, 8, 2, 16, 3584, true},   {"2B", 2048, 24, 8, 2, 16, 6144, true},
      {"4B", 2560, 32, 16, 4, 32, 9216, true},    {"9B", 4096, 32, 16, 4, 32, 12288, false},
      {"27B", 5120, 64, 24, 4, 48, 17408, false},
  };
  ModelConfig c;
  c.architecture = "Qwen3_5ForCausalLM";
  c.tensor_prefix = "model.";
  c.linear_conv_kernel_dim = 4;
  c.rope_theta = 1e7;
  c.partial_rotary_factor = 0.25;
  c.mtp_num_hidden_layers = 1;
  if (shape == "tiny") {
    c.vocab_size = 4096, c.hidden_size = 256, c.intermediate_size = 768, c.num_layers = 4;
    c.num_attention_heads = 4, c.num_kv_heads = 2, c.head_dim = 64;
    c.linear_num_key_heads = 2, c.linear_num_value_heads = 4, c.linear_key_head_dim = 64,
    c.linear_value_head_dim = 64;
    c.tie_word_embeddings = true;
  } else {
    const Shape* s = nullptr;
    for (const Shape& x : kShapes)
      if (shape == x.name) s = &x;
    if (s == nullptr)
      invalid_input("unknown shape '{}' (expected tiny, 0.8B, 2B, 4B, 9B, 27B or a config.json)", shape);
    c.vocab_size = 248320, c.hidden_size = s->hidden, c.intermediate_size = s->intermediate,
    c.num_layers = s->layers;
    c.num_attention_heads = s->nq, c.num_kv_heads = s->nkv, c.head_dim = 256;
    c.linear_num_key_heads = 16, c.linear_num_value_heads = s->hv, c.linear_key_head_dim = 128,
    c.linear_value_head_dim = 128;
    c.tie_word_embeddings = s->tied;
  }
  c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * c.partial_rotary_factor);
  for (int64_t i = 0; i < c.num_layers; ++i)
    c.layer_types.push_back((i + 1) % 4 == 0 ? LayerType::kFullAttention : LayerType::kLinearAttention);
  return c;
}

}  // namespace mtpx
