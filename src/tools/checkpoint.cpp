#include "tools/checkpoint.h"

#include <fcntl.h>
#include <fmt/core.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "backend/cpu/quant_matmul.h"
#include "io/safetensors.h"
#include "util/bf16.h"
#include "util/error.h"

namespace mtpx::tools {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Manifest

struct ManifestBuilder {
  const ModelConfig& c;
  Layout layout;
  std::vector<CheckpointTensor> out;

  void add(std::string name, TensorRole role, std::vector<int64_t> shape, bool mtp,
           const cpu::WeightMatrix* matrix = nullptr, const std::vector<float>* values = nullptr) {
    out.push_back({std::move(name), role, std::move(shape), mtp, matrix, values, {}});
  }

  // A stack [E, rows, cols] of one matrix per expert (or two, interleaved, for a fused gate_up_proj).
  void stack(std::string name, std::vector<int64_t> shape, bool mtp, const MoeWeights* m,
             std::initializer_list<cpu::WeightMatrix MlpWeights::*> fields) {
    add(std::move(name), TensorRole::kMatrix, std::move(shape), mtp);
    if (m != nullptr)
      for (const MlpWeights& e : m->experts)
        for (auto field : fields) out.back().parts.push_back(&(e.*field));
  }

  void moe(const std::string& p, bool mtp, const MoeWeights* m) {
    const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
    add(p + "gate.weight", TensorRole::kMatrix, {E, H}, mtp, m ? &m->router : nullptr);
    if (layout == Layout::kHuggingFace) {
      stack(p + "experts.gate_up_proj", {E, 2 * I, H}, mtp, m,
            {&MlpWeights::gate_proj, &MlpWeights::up_proj});
      stack(p + "experts.down_proj", {E, H, I}, mtp, m, {&MlpWeights::down_proj});
    } else {
      stack(p + "switch_mlp.gate_proj.weight", {E, I, H}, mtp, m, {&MlpWeights::gate_proj});
      stack(p + "switch_mlp.up_proj.weight", {E, I, H}, mtp, m, {&MlpWeights::up_proj});
      stack(p + "switch_mlp.down_proj.weight", {E, H, I}, mtp, m, {&MlpWeights::down_proj});
    }
    mlp(p + "shared_expert.", mtp, m ? &m->shared_expert : nullptr, c.shared_expert_intermediate_size);
    add(p + "shared_expert_gate.weight", TensorRole::kMatrix, {1, H}, mtp,
        m ? &m->shared_expert_gate : nullptr);
  }

  void attention(const std::string& p, bool mtp, const AttentionWeights* a) {
    const int64_t H = c.hidden_size, D = c.head_dim, nq = c.num_attention_heads, nkv = c.num_kv_heads;
    add(p + "q_proj.weight", TensorRole::kMatrix, {nq * 2 * D, H}, mtp, a ? &a->q_proj : nullptr);
    add(p + "k_proj.weight", TensorRole::kMatrix, {nkv * D, H}, mtp, a ? &a->k_proj : nullptr);
    add(p + "v_proj.weight", TensorRole::kMatrix, {nkv * D, H}, mtp, a ? &a->v_proj : nullptr);
    add(p + "o_proj.weight", TensorRole::kMatrix, {H, nq * D}, mtp, a ? &a->o_proj : nullptr);
    add(p + "q_norm.weight", TensorRole::kNorm, {D}, mtp, nullptr, a ? &a->q_norm : nullptr);
    add(p + "k_norm.weight", TensorRole::kNorm, {D}, mtp, nullptr, a ? &a->k_norm : nullptr);
  }

  void delta_net(const std::string& p, const DeltaNetWeights* d) {
    const int64_t H = c.hidden_size, Hv = c.linear_num_value_heads, Dv = c.linear_value_head_dim;
    const int64_t C = c.conv_dim(), K = c.linear_conv_kernel_dim;
    add(p + "in_proj_qkv.weight", TensorRole::kMatrix, {C, H}, false, d ? &d->in_proj_qkv : nullptr);
    add(p + "in_proj_z.weight", TensorRole::kMatrix, {Hv * Dv, H}, false, d ? &d->in_proj_z : nullptr);
    add(p + "in_proj_b.weight", TensorRole::kMatrix, {Hv, H}, false, d ? &d->in_proj_b : nullptr);
    add(p + "in_proj_a.weight", TensorRole::kMatrix, {Hv, H}, false, d ? &d->in_proj_a : nullptr);
    add(p + "out_proj.weight", TensorRole::kMatrix, {H, Hv * Dv}, false, d ? &d->out_proj : nullptr);
    add(p + "conv1d.weight", TensorRole::kConv1d, {C, 1, K}, false, nullptr, d ? &d->conv1d : nullptr);
    add(p + "A_log", TensorRole::kVector, {Hv}, false, nullptr, d ? &d->a_log : nullptr);
    add(p + "dt_bias", TensorRole::kVector, {Hv}, false, nullptr, d ? &d->dt_bias : nullptr);
    add(p + "norm.weight", TensorRole::kPlainNorm, {Dv}, false, nullptr, d ? &d->norm : nullptr);
  }

  void mlp(const std::string& p, bool mtp, const MlpWeights* m, int64_t I) {
    const int64_t H = c.hidden_size;
    add(p + "gate_proj.weight", TensorRole::kMatrix, {I, H}, mtp, m ? &m->gate_proj : nullptr);
    add(p + "up_proj.weight", TensorRole::kMatrix, {I, H}, mtp, m ? &m->up_proj : nullptr);
    add(p + "down_proj.weight", TensorRole::kMatrix, {H, I}, mtp, m ? &m->down_proj : nullptr);
  }

  void layer(const std::string& p, LayerType type, bool mtp, const LayerWeights* l) {
    const int64_t H = c.hidden_size;
    add(p + "input_layernorm.weight", TensorRole::kNorm, {H}, mtp, nullptr, l ? &l->input_norm : nullptr);
    add(p + "post_attention_layernorm.weight", TensorRole::kNorm, {H}, mtp, nullptr,
        l ? &l->post_attn_norm : nullptr);
    if (type == LayerType::kFullAttention)
      attention(p + "self_attn.", mtp, l ? &*l->attention : nullptr);
    else
      delta_net(p + "linear_attn.", l ? &*l->delta_net : nullptr);
    if (c.is_moe())
      moe(p + "mlp.", mtp, l ? &*l->moe : nullptr);
    else
      mlp(p + "mlp.", mtp, l ? &l->mlp : nullptr, c.intermediate_size);
  }

  void trunk(const ModelWeights* w) {
    const int64_t H = c.hidden_size, V = c.vocab_size;
    const std::string P = "model.language_model.";
    add(P + "embed_tokens.weight", TensorRole::kMatrix, {V, H}, false, w ? &w->embed_tokens : nullptr);
    for (int64_t i = 0; i < c.num_layers; ++i)
      layer(P + "layers." + std::to_string(i) + ".", c.layer_types[static_cast<size_t>(i)], false,
            w ? &w->layers[static_cast<size_t>(i)] : nullptr);
    add(P + "norm.weight", TensorRole::kNorm, {H}, false, nullptr, w ? &w->final_norm : nullptr);
    const bool tied = w ? w->tied : c.tie_word_embeddings;
    if (!tied) add("lm_head.weight", TensorRole::kMatrix, {V, H}, false, w ? &w->lm_head : nullptr);
  }

  void head(const MtpWeights* m) {
    const int64_t H = c.hidden_size;
    add("mtp.fc.weight", TensorRole::kMatrix, {H, 2 * H}, true, m ? &m->fc : nullptr);
    add("mtp.pre_fc_norm_embedding.weight", TensorRole::kNorm, {H}, true, nullptr,
        m ? &m->pre_fc_norm_embedding : nullptr);
    add("mtp.pre_fc_norm_hidden.weight", TensorRole::kNorm, {H}, true, nullptr,
        m ? &m->pre_fc_norm_hidden : nullptr);
    layer("mtp.layers.0.", LayerType::kFullAttention, true, m ? &m->layer : nullptr);
    add("mtp.norm.weight", TensorRole::kNorm, {H}, true, nullptr, m ? &m->norm : nullptr);
  }
};

// The on-disk name of a canonical (Hugging Face) name in `layout`.
std::string layout_name(const std::string& name, Layout layout) {
  if (layout == Layout::kHuggingFace) return name;
  const std::string hf_prefix = "model.language_model.";
  if (name.rfind(hf_prefix, 0) == 0) return "language_model.model." + name.substr(hf_prefix.size());
  if (name == "lm_head.weight") return "language_model.lm_head.weight";
  return name;
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Bits a matrix is stored with under `spec` (16 = bf16). Matrices whose input dimension the group size
// does not divide stay bf16, as MLX leaves them.
int matrix_bits(const CheckpointTensor& t, const QuantSpec& spec) {
  const bool embedding = t.name.find("embed_tokens") != std::string::npos || t.name == "lm_head.weight";
  // A MoE router and shared-expert gate stay bf16: routing is sensitive (a rounded router logit changes
  // which experts run), and they are a few thousand weights a layer.
  const bool routing = t.name.ends_with("mlp.gate.weight") || t.name.ends_with("shared_expert_gate.weight");
  const int bits = t.name == "mtp.fc.weight"          ? spec.mtp_fc_bits
                   : embedding && spec.embed_bits > 0 ? spec.embed_bits
                   : routing                          ? 16
                                                      : spec.bits;
  if (bits >= 16) return 16;
  const int64_t cols = t.shape.back();
  if (cols % spec.group_size != 0 || (cols * bits) % 32 != 0) return 16;
  return bits;
}

// A deterministic stream of approximately normal values for one tensor of a synthetic checkpoint.
class RandomSource {
 public:
  RandomSource(uint64_t seed, const std::string& name)
      : seed_(seed ^ (std::hash<std::string>{}(name)*0x9E3779B97F4A7C15ull)) {}
  // Irwin-Hall(4) normal approximation, element i of the tensor (parallel-safe).
  float normal(int64_t i, float mean, float stddev) const {
    uint64_t z = seed_ + static_cast<uint64_t>(i) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float sum =
        static_cast<float>((z & 0xffff) + ((z >> 16) & 0xffff) + ((z >> 32) & 0xffff) + (z >> 48));
    return mean + (sum - 2.0f * 65535.0f) * (stddev * std::sqrt(3.0f) / 65536.0f);
  }

 private:
  uint64_t seed_;
};

// A matrix tensor's columns and rows ([E, rows, cols] stacks count E * rows rows).
int64_t matrix_cols(const CheckpointTensor& t) { return t.shape.back(); }
int64_t matrix_rows_total(const CheckpointTensor& t) { return numel(t.shape) / t.shape.back(); }

// Rows [r0, r0 + n) of a matrix tensor as float32.
void matrix_rows(const CheckpointTensor& t, uint64_t seed, int64_t r0, int64_t n, float* out) {
  const int64_t cols = matrix_cols(t);
  if (t.matrix != nullptr) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; ++r) cpu::weight_row_to_f32(*t.matrix, r0 + r, out + r * cols);
    return;
  }
  if (!t.parts.empty()) {
    const int64_t part_rows = t.parts[0]->rows;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; ++r)
      cpu::weight_row_to_f32(*t.parts[static_cast<size_t>((r0 + r) / part_rows)], (r0 + r) % part_rows,
                             out + r * cols);
    return;
  }
  // Random: embeddings ~ N(0, 1), linear layers ~ N(0, 1/cols) (unit-variance activations), like the
  // in-memory synthetic models of the benchmarks.
  const bool embedding = t.name.find("embed_tokens") != std::string::npos;
  const float stddev = embedding ? 1.0f : 1.0f / std::sqrt(static_cast<float>(cols));
  const RandomSource rng(seed, t.name);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r)
    for (int64_t k = 0; k < cols; ++k) out[r * cols + k] = rng.normal((r0 + r) * cols + k, 0.0f, stddev);
}

// The engine-convention values of a vector tensor.
std::vector<float> vector_values(const CheckpointTensor& t, uint64_t seed) {
  if (t.values != nullptr) return *t.values;
  const RandomSource rng(seed, t.name);
  std::vector<float> v(static_cast<size_t>(numel(t.shape)));
  for (size_t i = 0; i < v.size(); ++i) {
    const auto idx = static_cast<int64_t>(i);
    switch (t.role) {
      case TensorRole::kNorm:
      case TensorRole::kPlainNorm:
        v[i] = rng.normal(idx, 1.0f, 0.1f);
        break;
      case TensorRole::kConv1d:
        v[i] = rng.normal(idx, 0.0f, 0.3f);
        break;
      default:
        v[i] = rng.normal(idx, 0.0f, 0.5f);
        break;
    }
  }
  return v;
}

// One tensor as it is written: name, dtype, shape, bytes.
struct Encoded {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};

std::vector<std::byte> bf16_bytes(const float* v, int64_t n) {
  std::vector<std::byte> out(static_cast<size_t>(n * 2));
  auto* p = reinterpret_cast<uint16_t*>(out.data());
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) p[i] = f32_to_bf16(v[i]);
  return out;
}

// Bytes the encoded forms of `t` take (to plan shards before producing any data).
int64_t encoded_bytes(const CheckpointTensor& t, const QuantSpec& spec) {
  if (t.role != TensorRole::kMatrix) return numel(t.shape) * 2;
  const int bits = matrix_bits(t, spec);
  const int64_t rows = matrix_rows_total(t), cols = matrix_cols(t);
  if (bits == 16) return rows * cols * 2;
  return rows * cols * bits / 8 + 2 * rows * (cols / spec.group_size) * 2;
}

std::vector<Encoded> encode(const CheckpointTensor& t, const WriteOptions& o) {
  const std::string name = layout_name(t.name, o.layout);
  std::vector<Encoded> out;
  if (t.role != TensorRole::kMatrix) {
    std::vector<float> v = vector_values(t, o.seed);
    std::vector<int64_t> shape = t.shape;
    // Engine convention -> file convention (see checkpoint.h).
    if (t.role == TensorRole::kNorm && o.layout == Layout::kHuggingFace)
      for (float& x : v) x -= 1.0f;
    if (t.role == TensorRole::kConv1d && o.layout == Layout::kMlx) shape = {t.shape[0], t.shape[2], 1};
    out.push_back({name, DType::kBF16, shape, bf16_bytes(v.data(), static_cast<int64_t>(v.size()))});
    return out;
  }
  const int64_t rows = matrix_rows_total(t), cols = matrix_cols(t);
  const int bits = matrix_bits(t, o.quant);
  // A stack's codes, scales and biases keep its leading expert dimension.
  auto shaped = [&](int64_t last) {
    std::vector<int64_t> shape = t.shape;
    shape.back() = last;
    return shape;
  };
  if (bits == 16 && t.matrix != nullptr && t.matrix->type == cpu::WeightType::kBF16) {
    const auto* src = static_cast<const std::byte*>(t.matrix->data);
    out.push_back({name, DType::kBF16, t.shape, std::vector<std::byte>(src, src + rows * cols * 2)});
    return out;
  }
  // Blocks of rows through float32, so a large matrix never exists twice in float32.
  const int64_t block = std::max<int64_t>(1, (int64_t{64} << 20) / (cols * 4));
  std::vector<float> f32(static_cast<size_t>(std::min(block, rows) * cols));
  if (bits == 16) {
    Encoded e{name, DType::kBF16, t.shape, std::vector<std::byte>(static_cast<size_t>(rows * cols * 2))};
    auto* dst = reinterpret_cast<uint16_t*>(e.bytes.data());
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
      const int64_t n = std::min(block, rows - r0);
      matrix_rows(t, o.seed, r0, n, f32.data());
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n * cols; ++i) dst[r0 * cols + i] = f32_to_bf16(f32[static_cast<size_t>(i)]);
    }
    out.push_back(std::move(e));
    return out;
  }
  const int64_t words = cols * bits / 32, groups = cols / o.quant.group_size;
  // Column weights from calibration: E[x_k^2] plus 1% of their mean, so that no column's error is ignored
  // (an input the calibration text never excited still gets a sensible fit). A stack's experts each have
  // their own inputs, so a stack is fitted one expert's rows at a time.
  auto column_weights = [&](const cpu::WeightMatrix* m) {
    std::vector<float> importance;
    if (o.importance != nullptr && m != nullptr) importance = o.importance->mean_squares(*m);
    if (static_cast<int64_t>(importance.size()) != cols) return std::vector<float>{};
    double mean = 0;
    for (float v : importance) mean += v;
    mean /= static_cast<double>(cols);
    for (float& v : importance) v += static_cast<float>(0.01 * mean);
    return importance;
  };
  const bool per_part = !t.parts.empty() && o.quant.method == QuantMethod::kLeastSquares;
  const int64_t quant_block = per_part ? t.parts[0]->rows : block;
  if (quant_block > block) f32.resize(static_cast<size_t>(quant_block * cols));
  std::vector<float> importance = per_part ? std::vector<float>{} : column_weights(t.matrix);
  const std::string base = name.substr(0, name.size() - std::string(".weight").size());
  Encoded codes{name, DType::kU32, shaped(words),
                std::vector<std::byte>(static_cast<size_t>(rows * words * 4))};
  Encoded scales{base + ".scales", DType::kBF16, shaped(groups),
                 std::vector<std::byte>(static_cast<size_t>(rows * groups * 2))};
  Encoded biases{base + ".biases", DType::kBF16, shaped(groups),
                 std::vector<std::byte>(static_cast<size_t>(rows * groups * 2))};
  std::vector<float> s(static_cast<size_t>(std::min(quant_block, rows) * groups)), b(s.size());
  auto* scale_out = reinterpret_cast<uint16_t*>(scales.bytes.data());
  auto* bias_out = reinterpret_cast<uint16_t*>(biases.bytes.data());
  for (int64_t r0 = 0; r0 < rows; r0 += quant_block) {
    const int64_t n = std::min(quant_block, rows - r0);
    matrix_rows(t, o.seed, r0, n, f32.data());
    if (per_part) importance = column_weights(t.parts[static_cast<size_t>(r0 / quant_block)]);
    // Scales and biases are stored in bf16, as MLX stores them for a bf16 model.
    uint32_t* block_codes = reinterpret_cast<uint32_t*>(codes.bytes.data()) + r0 * words;
    if (o.quant.method == QuantMethod::kLeastSquares)
      cpu::quantize_affine_least_squares(f32.data(), n, cols, bits, o.quant.group_size, block_codes, s.data(),
                                         b.data(), importance.empty() ? nullptr : importance.data());
    else
      cpu::quantize_affine(f32.data(), n, cols, bits, o.quant.group_size, block_codes, s.data(), b.data());
    for (int64_t i = 0; i < n * groups; ++i) {
      scale_out[r0 * groups + i] = f32_to_bf16(s[static_cast<size_t>(i)]);
      bias_out[r0 * groups + i] = f32_to_bf16(b[static_cast<size_t>(i)]);
    }
  }
  out.push_back(std::move(codes));
  out.push_back(std::move(scales));
  out.push_back(std::move(biases));
  return out;
}

}  // namespace

std::vector<CheckpointTensor> checkpoint_manifest(const ModelConfig& config, bool with_mtp, Layout layout) {
  ManifestBuilder b{config, layout, {}};
  b.trunk(nullptr);
  if (with_mtp) b.head(nullptr);
  return b.out;
}

std::vector<CheckpointTensor> checkpoint_manifest(const ModelConfig& config, const ModelWeights& weights,
                                                  const MtpWeights* mtp, Layout layout) {
  ManifestBuilder b{config, layout, {}};
  b.trunk(&weights);
  if (mtp != nullptr) b.head(mtp);
  return b.out;
}

json config_json(const ModelConfig& c, const WriteOptions& o) {
  json layer_types = json::array();
  for (LayerType t : c.layer_types)
    layer_types.push_back(t == LayerType::kFullAttention ? "full_attention" : "linear_attention");
  json text = {
      {"model_type", c.is_moe() ? "qwen3_5_moe_text" : "qwen3_5_text"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_kv_heads},
      {"head_dim", c.head_dim},
      {"hidden_act", "silu"},
      {"rms_norm_eps", c.rms_norm_eps},
      {"attention_bias", false},
      {"attn_output_gate", true},
      {"layer_types", layer_types},
      {"linear_conv_kernel_dim", c.linear_conv_kernel_dim},
      {"linear_key_head_dim", c.linear_key_head_dim},
      {"linear_value_head_dim", c.linear_value_head_dim},
      {"linear_num_key_heads", c.linear_num_key_heads},
      {"linear_num_value_heads", c.linear_num_value_heads},
      {"max_position_embeddings", c.max_position_embeddings > 0 ? c.max_position_embeddings : 262144},
      {"mtp_num_hidden_layers", c.mtp_num_hidden_layers},
      {"rope_parameters",
       {{"rope_type", "default"},
        {"rope_theta", c.rope_theta},
        {"partial_rotary_factor", c.partial_rotary_factor}}},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"dtype", "bfloat16"},
  };
  if (c.is_moe()) {
    text["num_experts"] = c.num_experts;
    text["num_experts_per_tok"] = c.num_experts_per_tok;
    text["moe_intermediate_size"] = c.moe_intermediate_size;
    text["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
  } else {
    text["intermediate_size"] = c.intermediate_size;
  }
  if (!c.eos_token_ids.empty()) text["eos_token_id"] = c.eos_token_ids;
  json root = {{"architectures",
                {c.is_moe() ? "Qwen3_5MoeForConditionalGeneration" : "Qwen3_5ForConditionalGeneration"}},
               {"model_type", c.is_moe() ? "qwen3_5_moe" : "qwen3_5"},
               {"tie_word_embeddings", c.tie_word_embeddings},
               {"text_config", text}};
  if (o.quant.bits < 16) {
    json q = {{"group_size", o.quant.group_size}, {"bits", o.quant.bits}, {"mode", "affine"}};
    if (o.quant.mtp_fc_bits != o.quant.bits && o.quant.mtp_fc_bits < 16)
      q["mtp.fc"] = {{"group_size", o.quant.group_size}, {"bits", o.quant.mtp_fc_bits}};
    // Per-module overrides, named as MLX names the modules.
    if (o.quant.embed_bits > 0 && o.quant.embed_bits != o.quant.bits) {
      const json e = o.quant.embed_bits < 16
                         ? json{{"group_size", o.quant.group_size}, {"bits", o.quant.embed_bits}}
                         : json(false);
      q["language_model.model.embed_tokens"] = e;
      if (!c.tie_word_embeddings) q["language_model.lm_head"] = e;
    }
    root["quantization"] = q;
    root["quantization_config"] = q;
  }
  return root;
}

int64_t write_checkpoint_tensors(const std::filesystem::path& dir,
                                 const std::vector<CheckpointTensor>& tensors, const WriteOptions& o) {
  // Plan the shards from the encoded sizes, then produce and write one shard at a time.
  std::vector<std::vector<size_t>> shards(1);
  int64_t shard_bytes = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t n = encoded_bytes(tensors[i], o.quant);
    if (shard_bytes > 0 && shard_bytes + n > o.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += n;
    total += n;
  }
  const bool sharded = shards.size() > 1;
  json weight_map = json::object();
  int64_t done = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file = sharded ? fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size())
                                     : "model.safetensors";
    std::vector<Encoded> encoded;
    for (size_t i : shards[s]) {
      for (Encoded& e : encode(tensors[i], o)) encoded.push_back(std::move(e));
      done += encoded_bytes(tensors[i], o.quant);
      if (o.progress)
        o.progress(static_cast<double>(done) / static_cast<double>(std::max<int64_t>(total, 1)));
    }
    std::vector<TensorToWrite> views;
    for (const Encoded& e : encoded) {
      views.push_back({e.name, e.dtype, e.shape, std::span<const std::byte>(e.bytes)});
      weight_map[e.name] = file;
    }
    write_safetensors(dir / file, views, {{"format", "pt"}});
  }
  if (sharded)
    write_json_file(dir / "model.safetensors.index.json",
                    {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}});
  return total;
}

void write_json_file(const std::filesystem::path& path, const json& value) {
  write_text_file(path, value.dump(2) + "\n");
}

void write_text_file(const std::filesystem::path& path, const std::string& text) {
  const std::filesystem::path tmp = path.string() + ".tmp-" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) invalid_input("cannot create '{}'", tmp.string());
    out << text;
    out.flush();
    if (!out) fail(ErrorKind::kInternal, "cannot write '{}'", tmp.string());
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    fail(ErrorKind::kInternal, "cannot rename '{}' into place", path.string());
  }
}

namespace {

bool process_alive(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

// fsync of a file or directory (best effort: a failure only weakens durability after a power loss).
void sync_path(const std::filesystem::path& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0));
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// What runs that no longer exist (killed, crashed, cut off by a power loss) left next to `target`: their
// staging directories ".NAME.tmp-PID", incomplete, are removed; a ".NAME.tmp-PID.old" is a previous
// version of the target moved aside by a replacing commit: when the target is missing (the run died
// between the two renames) it is moved back, else removed. Directories of runs still alive are left.
void clean_stale_staging(const std::filesystem::path& parent, const std::string& name,
                         const std::filesystem::path& target) {
  namespace fs = std::filesystem;
  const std::string prefix = "." + name + ".tmp-";
  std::error_code ec;
  std::vector<fs::path> stale;
  for (const auto& entry : fs::directory_iterator(parent, ec)) {
    const std::string file = entry.path().filename().string();
    if (!file.starts_with(prefix)) continue;
    std::string pid_text = file.substr(prefix.size());
    if (pid_text.ends_with(".old")) pid_text.resize(pid_text.size() - 4);
    if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos ||
        pid_text.size() > 9)
      continue;
    const auto pid = static_cast<pid_t>(std::stol(pid_text));
    if (pid != ::getpid() && !process_alive(pid)) stale.push_back(entry.path());
  }
  for (const fs::path& path : stale) {
    if (path.filename().string().ends_with(".old") && !fs::exists(target, ec)) {
      fs::rename(path, target, ec);
      if (!ec) {
        std::fprintf(stderr, "note: restored '%s' from '%s', left by an interrupted run\n", target.c_str(),
                     path.c_str());
        continue;
      }
    }
    fs::remove_all(path, ec);
  }
}

}  // namespace

AtomicDirectory::AtomicDirectory(const std::filesystem::path& target, bool replace)
    : target_(target), replace_(replace) {
  namespace fs = std::filesystem;
  if (target_.empty()) invalid_input("--out: an output directory is required");
  const fs::path parent = fs::absolute(target_).parent_path();
  if (!fs::is_directory(parent))
    invalid_input("--out '{}': the parent directory does not exist", target_.string());
  clean_stale_staging(parent, fs::absolute(target_).filename().string(), target_);
  if (fs::exists(target_) && !replace_)
    invalid_input("--out '{}' already exists (choose a new directory or pass --force)", target_.string());
  staging_ = parent / fmt::format(".{}.tmp-{}", fs::absolute(target_).filename().string(), ::getpid());
  std::error_code ec;
  fs::remove_all(staging_, ec);
  if (!fs::create_directory(staging_, ec) || ec)
    invalid_input("cannot create '{}': {}", staging_.string(), ec ? ec.message() : "exists");
}

AtomicDirectory::~AtomicDirectory() {
  if (!committed_) {
    std::error_code ec;
    std::filesystem::remove_all(staging_, ec);
  }
}

void AtomicDirectory::commit() {
  namespace fs = std::filesystem;
  std::error_code ec;
  // Contents on disk before the rename makes them visible: after a power loss the target is then the old
  // directory or the complete new one (a killed process needs none of this: its writes are in the cache).
  for (const auto& entry : fs::directory_iterator(staging_, ec))
    if (entry.is_regular_file(ec)) sync_path(entry.path(), false);
  sync_path(staging_, true);
  if (replace_ && fs::exists(target_)) {
    // Move the old directory aside first so that a crash between the two renames leaves one of them.
    const fs::path old = staging_.string() + ".old";
    fs::rename(target_, old, ec);
    if (ec) fail(ErrorKind::kInternal, "cannot move '{}' aside: {}", target_.string(), ec.message());
    fs::rename(staging_, target_, ec);
    if (ec)
      fail(ErrorKind::kInternal, "cannot rename '{}' to '{}': {}", staging_.string(), target_.string(),
           ec.message());
    fs::remove_all(old, ec);
  } else {
    fs::rename(staging_, target_, ec);
    if (ec)
      fail(ErrorKind::kInternal, "cannot rename '{}' to '{}': {}", staging_.string(), target_.string(),
           ec.message());
  }
  committed_ = true;
  sync_path(fs::absolute(target_).parent_path(), true);
}

}  // namespace mtpx::tools
