#include "model/weights.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>

#include "backend/cpu/quant_matmul.h"
#include "io/safetensors.h"
#include "util/bf16.h"
#include "util/error.h"

namespace mtpx {

void set_conv_taps(DeltaNetWeights& d, int64_t conv_dim, int64_t kernel) {
  d.conv1d_by_tap.resize(static_cast<size_t>(kernel * conv_dim));
  for (int64_t ch = 0; ch < conv_dim; ++ch)
    for (int64_t j = 0; j < kernel; ++j)
      d.conv1d_by_tap[static_cast<size_t>(j * conv_dim + ch)] =
          d.conv1d[static_cast<size_t>(ch * kernel + j)];
}

namespace {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Looks tensors up by name and checks them; the one place that knows checkpoint naming.
class Resolver {
 public:
  Resolver(const TensorStore& store, float norm_offset) : store_(store), norm_offset_(norm_offset) {}

  const TensorView& tensor(const std::string& name, const std::vector<int64_t>& shape) const {
    const TensorView& t = store_.get(name);
    if (t.shape != shape)
      invalid_input("tensor '{}' has wrong shape: expected {}, found {} (in '{}')", name, shape_string(shape),
                    shape_string(t.shape), t.file.string());
    return t;
  }

  cpu::WeightMatrix matrix(const std::string& name, int64_t rows, int64_t cols) {
    const TensorView& raw = store_.get(name);
    if (raw.dtype == DType::kU32) return affine_matrix(raw, rows, cols);
    const TensorView& t = tensor(name, {rows, cols});
    cpu::WeightMatrix w{weight_type(t), t.data, rows, cols};
    bytes_ += static_cast<int64_t>(t.nbytes);
    return w;
  }

  // MLX affine quantization (see cpu::WeightMatrix): `name` holds uint32 codes [rows, cols*bits/32],
  // `<base>.scales` and `<base>.biases` [rows, cols/group]. bits and group size follow from the shapes.
  cpu::WeightMatrix affine_matrix(const TensorView& codes, int64_t rows, int64_t cols) {
    const std::string& name = codes.name;
    const std::string base =
        name.size() > 7 && name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
    const TensorView* scales = store_.find(base + ".scales");
    const TensorView* biases = store_.find(base + ".biases");
    if (scales == nullptr || biases == nullptr)
      invalid_input("tensor '{}' is uint32 (quantized) but '{}.scales' or '{}.biases' is missing (in '{}')",
                    name, base, base, codes.file.string());
    return affine_parts(codes, *scales, *biases, rows, cols);
  }

  // The codes, scales and biases of one [rows, cols] affine matrix, checked.
  cpu::WeightMatrix affine_parts(const TensorView& codes, const TensorView& scales_t,
                                 const TensorView& biases_t, int64_t rows, int64_t cols) {
    const TensorView* scales = &scales_t;
    const TensorView* biases = &biases_t;
    const std::string& name = codes.name;
    const std::string base =
        name.size() > 7 && name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
    if (codes.shape.size() != 2 || codes.shape[0] != rows || codes.shape[1] <= 0 ||
        (codes.shape[1] * 32) % cols != 0)
      invalid_input("quantized tensor '{}' has shape {}, which does not pack a [{}, {}] matrix (in '{}')",
                    name, shape_string(codes.shape), rows, cols, codes.file.string());
    const int64_t bits = codes.shape[1] * 32 / cols;
    if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8)
      invalid_input("quantized tensor '{}' packs {} bits per weight; supported: 2, 3, 4, 5, 6, 8 (in '{}')",
                    name, bits, codes.file.string());
    if (scales->shape.size() != 2 || scales->shape[0] != rows || scales->shape[1] <= 0 ||
        cols % scales->shape[1] != 0 || biases->shape != scales->shape || biases->dtype != scales->dtype)
      invalid_input("'{}.scales' {} / '{}.biases' {} do not fit the [{}, {}] matrix '{}'", base,
                    shape_string(scales->shape), base, shape_string(biases->shape), rows, cols, name);
    const int64_t group = cols / scales->shape[1];
    if (group < 8 || (group * bits) % 32 != 0)
      invalid_input("quantized tensor '{}' has group size {}, which is not supported", name, group);
    // The affine kernel family is chosen once per process (MTPX_AFFINE_ACTIVATIONS, quant_matmul.h): a bad
    // value is a load error here, not one in the middle of a forward pass.
    cpu::affine_default_kernel();
    cpu::WeightMatrix w{cpu::WeightType::kAffine, codes.data, rows, cols};
    w.bits = static_cast<int>(bits);
    w.group_size = group;
    w.scale_type = weight_type(*scales);
    w.scales = scales->data;
    w.biases = biases->data;
    bytes_ += static_cast<int64_t>(codes.nbytes + scales->nbytes + biases->nbytes);
    return w;
  }

  // The per-expert [rows, cols] matrices of a stacked tensor [E, rows_total, cols] (float) or, for MLX's
  // quantized switch_mlp, uint32 codes [E, rows_total, cols*bits/32] with `<base>.scales` / `.biases`
  // [E, rows_total, cols/group]: expert e's rows [row0, row0 + rows) of its slice, as views.
  std::vector<cpu::WeightMatrix> stacked(const std::string& name, int64_t experts, int64_t rows_total,
                                         int64_t row0, int64_t rows, int64_t cols) {
    const TensorView& t = store_.get(name);
    if (t.shape.size() != 3 || t.shape[0] != experts || t.shape[1] != rows_total)
      invalid_input("tensor '{}' has wrong shape: expected [{}, {}, {}], found {} (in '{}')", name, experts,
                    rows_total, cols, shape_string(t.shape), t.file.string());
    std::vector<cpu::WeightMatrix> out;
    if (t.dtype != DType::kU32) {
      tensor(name, {experts, rows_total, cols});
      const size_t elem = t.nbytes / static_cast<size_t>(t.numel());
      for (int64_t e = 0; e < experts; ++e)
        out.push_back({weight_type(t), t.data + static_cast<size_t>((e * rows_total + row0) * cols) * elem,
                       rows, cols});
      if (row0 == 0) bytes_ += static_cast<int64_t>(t.nbytes);  // a fused tensor's bytes counted once
      return out;
    }
    // Quantized: check the stack as one [E * rows_total, cols] matrix, then cut it per expert.
    TensorView flat = t;
    flat.shape = {experts * rows_total, t.shape[2]};
    const std::string base = name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
    const TensorView* scales = store_.find(base + ".scales");
    const TensorView* biases = store_.find(base + ".biases");
    if (scales == nullptr || biases == nullptr || scales->shape.size() != 3 ||
        biases->shape != scales->shape || scales->shape[0] != experts || scales->shape[1] != rows_total)
      invalid_input(
          "quantized tensor '{}' needs '{}.scales' and '{}.biases' of shape [{}, {}, groups] (in '{}')", name,
          base, base, experts, rows_total, t.file.string());
    TensorView flat_scales = *scales, flat_biases = *biases;
    flat_scales.shape = flat_biases.shape = {experts * rows_total, scales->shape[2]};
    const cpu::WeightMatrix whole = affine_parts(flat, flat_scales, flat_biases, experts * rows_total, cols);
    if (row0 != 0)
      bytes_ -= static_cast<int64_t>(t.nbytes + scales->nbytes + biases->nbytes);  // counted once
    const int64_t code_row = t.shape[2] * 4,
                  scale_row = static_cast<int64_t>(scales->nbytes) / (experts * rows_total);
    for (int64_t e = 0; e < experts; ++e) {
      cpu::WeightMatrix w = whole;
      const int64_t first = e * rows_total + row0;
      w.rows = rows;
      w.data = static_cast<const std::byte*>(whole.data) + first * code_row;
      w.scales = static_cast<const std::byte*>(whole.scales) + first * scale_row;
      w.biases = static_cast<const std::byte*>(whole.biases) + first * scale_row;
      out.push_back(w);
    }
    return out;
  }

  // A small vector widened to float32 (+ offset).
  std::vector<float> vector(const std::string& name, const std::vector<int64_t>& shape,
                            float offset = 0.0f) const {
    const TensorView& t = tensor(name, shape);
    std::vector<float> out(static_cast<size_t>(t.numel()));
    for (size_t i = 0; i < out.size(); ++i) out[i] = element(t, i) + offset;
    return out;
  }

  std::vector<float> norm(const std::string& name, int64_t n) const {
    return vector(name, {n}, norm_offset_);
  }

  int64_t bytes() const { return bytes_; }
  const TensorView* find(const std::string& name) const { return store_.find(name); }

 private:
  static cpu::WeightType weight_type(const TensorView& t) {
    switch (t.dtype) {
      case DType::kF32:
        return cpu::WeightType::kF32;
      case DType::kF16:
        return cpu::WeightType::kF16;
      case DType::kBF16:
        return cpu::WeightType::kBF16;
      default:
        invalid_input("tensor '{}' has dtype {}; weights must be F32, F16 or BF16 (in '{}')", t.name,
                      dtype_name(t.dtype), t.file.string());
    }
  }

  static float element(const TensorView& t, size_t i) {
    const auto* p = t.data;
    switch (t.dtype) {
      case DType::kF32: {
        float f;
        std::memcpy(&f, p + i * 4, 4);
        return f;
      }
      case DType::kF16:
      case DType::kBF16: {
        uint16_t h;
        std::memcpy(&h, p + i * 2, 2);
        return t.dtype == DType::kF16 ? f16_to_f32(h) : bf16_to_f32(h);
      }
      default:
        invalid_input("tensor '{}' has dtype {}; expected F32, F16 or BF16 (in '{}')", t.name,
                      dtype_name(t.dtype), t.file.string());
    }
  }

  const TensorStore& store_;
  float norm_offset_;
  int64_t bytes_ = 0;
};

AttentionWeights load_attention(Resolver& r, const std::string& p, const ModelConfig& c) {
  const int64_t H = c.hidden_size, D = c.head_dim, nq = c.num_attention_heads, nkv = c.num_kv_heads;
  AttentionWeights a;
  a.q_proj = r.matrix(p + "q_proj.weight", nq * 2 * D, H);
  a.k_proj = r.matrix(p + "k_proj.weight", nkv * D, H);
  a.v_proj = r.matrix(p + "v_proj.weight", nkv * D, H);
  a.o_proj = r.matrix(p + "o_proj.weight", H, nq * D);
  a.q_norm = r.norm(p + "q_norm.weight", D);
  a.k_norm = r.norm(p + "k_norm.weight", D);
  return a;
}

DeltaNetWeights load_delta_net(Resolver& r, const std::string& p, const ModelConfig& c) {
  const int64_t H = c.hidden_size, Hv = c.linear_num_value_heads, Dv = c.linear_value_head_dim;
  const int64_t conv_dim = c.conv_dim(), Kc = c.linear_conv_kernel_dim;
  DeltaNetWeights d;
  d.in_proj_qkv = r.matrix(p + "in_proj_qkv.weight", conv_dim, H);
  d.in_proj_z = r.matrix(p + "in_proj_z.weight", Hv * Dv, H);
  d.in_proj_b = r.matrix(p + "in_proj_b.weight", Hv, H);
  d.in_proj_a = r.matrix(p + "in_proj_a.weight", Hv, H);
  d.out_proj = r.matrix(p + "out_proj.weight", H, Hv * Dv);
  // [C, 1, K] (Hugging Face) or [C, K, 1] (MLX): the same bytes for a depthwise kernel.
  const TensorView* conv = r.find(p + "conv1d.weight");
  const bool mlx_conv = conv != nullptr && conv->shape == std::vector<int64_t>{conv_dim, Kc, 1};
  d.conv1d = r.vector(p + "conv1d.weight", mlx_conv ? std::vector<int64_t>{conv_dim, Kc, 1}
                                                    : std::vector<int64_t>{conv_dim, 1, Kc});
  set_conv_taps(d, conv_dim, Kc);
  d.a_log = r.vector(p + "A_log", {Hv});
  d.dt_bias = r.vector(p + "dt_bias", {Hv});
  d.norm = r.vector(p + "norm.weight", {Dv});  // plain w: RMSNormGated is not zero-centered (§2.1)
  return d;
}

MlpWeights load_mlp(Resolver& r, const std::string& p, int64_t hidden, int64_t intermediate) {
  MlpWeights m;
  m.gate_proj = r.matrix(p + "gate_proj.weight", intermediate, hidden);
  m.up_proj = r.matrix(p + "up_proj.weight", intermediate, hidden);
  m.down_proj = r.matrix(p + "down_proj.weight", hidden, intermediate);
  return m;
}

// The MoE block under prefix p ("...mlp."), its experts in whichever layout the checkpoint stores them
// (qwen35_arch.md §10): fused 3-D experts.gate_up_proj / experts.down_proj (official bf16 releases), one
// tensor per expert experts.{e}.{gate,up,down}_proj.weight (transformers' save_pretrained, FP8 releases,
// the Qwen3.5 MTP heads), or MLX's stacked switch_mlp.{gate,up,down}_proj (quantized or not). Quantization is
// read per tensor: MLX leaves a tensor in bf16 when its input size is not a multiple of the group.
MoeWeights load_moe(Resolver& r, const std::string& p, const ModelConfig& c) {
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size,
                Is = c.shared_expert_intermediate_size;
  MoeWeights m;
  m.experts_per_token = c.num_experts_per_tok;
  m.router = r.matrix(p + "gate.weight", E, H);
  m.shared_expert = load_mlp(r, p + "shared_expert.", H, Is);
  m.shared_expert_gate = r.matrix(p + "shared_expert_gate.weight", 1, H);
  m.experts.resize(static_cast<size_t>(E));
  auto assign = [&](std::vector<cpu::WeightMatrix> views, cpu::WeightMatrix MlpWeights::*field) {
    for (int64_t e = 0; e < E; ++e) m.experts[static_cast<size_t>(e)].*field = views[static_cast<size_t>(e)];
  };
  if (r.find(p + "experts.gate_up_proj") != nullptr) {
    assign(r.stacked(p + "experts.gate_up_proj", E, 2 * I, 0, I, H), &MlpWeights::gate_proj);
    assign(r.stacked(p + "experts.gate_up_proj", E, 2 * I, I, I, H), &MlpWeights::up_proj);
    assign(r.stacked(p + "experts.down_proj", E, H, 0, H, I), &MlpWeights::down_proj);
  } else if (r.find(p + "switch_mlp.gate_proj.weight") != nullptr) {
    assign(r.stacked(p + "switch_mlp.gate_proj.weight", E, I, 0, I, H), &MlpWeights::gate_proj);
    assign(r.stacked(p + "switch_mlp.up_proj.weight", E, I, 0, I, H), &MlpWeights::up_proj);
    assign(r.stacked(p + "switch_mlp.down_proj.weight", E, H, 0, H, I), &MlpWeights::down_proj);
  } else if (r.find(p + "experts.0.gate_proj.weight") != nullptr) {
    for (int64_t e = 0; e < E; ++e)
      m.experts[static_cast<size_t>(e)] = load_mlp(r, p + "experts." + std::to_string(e) + ".", H, I);
  } else {
    invalid_input(
        "no experts for '{}': expected '{}experts.gate_up_proj', '{}experts.0.gate_proj.weight' or "
        "'{}switch_mlp.gate_proj.weight'",
        p, p, p, p);
  }
  return m;
}

}  // namespace

CheckpointConvention detect_checkpoint_convention(const TensorStore& store, const ModelConfig& c) {
  CheckpointConvention conv;
  conv.tensor_prefix = c.tensor_prefix;
  if (store.find(c.tensor_prefix + "embed_tokens.weight") == nullptr) {
    for (const char* prefix : {"model.language_model.", "language_model.model.", "model."})
      if (store.find(std::string(prefix) + "embed_tokens.weight") != nullptr) {
        conv.tensor_prefix = prefix;
        break;
      }
  }
  // MLX's converter adds the 1 of the zero-centered norms into the stored weights and moves conv1d to
  // [C, K, 1]; the conv1d shape is the reliable sign (mlx-lm decides the same way), see tools/checkpoint.h.
  for (int64_t i = 0; i < c.num_layers; ++i) {
    if (c.layer_types[static_cast<size_t>(i)] != LayerType::kLinearAttention) continue;
    const TensorView* conv1d =
        store.find(conv.tensor_prefix + "layers." + std::to_string(i) + ".linear_attn.conv1d.weight");
    if (conv1d != nullptr && conv1d->shape.size() == 3 && conv1d->shape[2] == 1 && conv1d->shape[1] > 1)
      conv.norm_offset = 0.0f;
    break;
  }
  return conv;
}

ModelWeights load_model_weights(const TensorStore& store, const ModelConfig& c, float norm_offset) {
  Resolver r(store, norm_offset);
  const std::string& P = c.tensor_prefix;
  ModelWeights w;
  w.embed_tokens = r.matrix(P + "embed_tokens.weight", c.vocab_size, c.hidden_size);
  // Tied when the config says so or when the checkpoint simply has no lm_head (§1.1).
  const std::string lm_head_name =
      P == "language_model.model." ? "language_model.lm_head.weight" : std::string("lm_head.weight");
  if (store.find(lm_head_name) != nullptr && !c.tie_word_embeddings) {
    w.lm_head = r.matrix(lm_head_name, c.vocab_size, c.hidden_size);
  } else {
    w.lm_head = w.embed_tokens;
    w.tied = true;
  }
  w.final_norm = r.norm(P + "norm.weight", c.hidden_size);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = P + "layers." + std::to_string(i) + ".";
    LayerWeights layer;
    layer.type = c.layer_types[static_cast<size_t>(i)];
    layer.input_norm = r.norm(p + "input_layernorm.weight", c.hidden_size);
    layer.post_attn_norm = r.norm(p + "post_attention_layernorm.weight", c.hidden_size);
    if (layer.type == LayerType::kFullAttention) {
      layer.attention = load_attention(r, p + "self_attn.", c);
    } else {
      layer.delta_net = load_delta_net(r, p + "linear_attn.", c);
    }
    if (c.is_moe())
      layer.moe = load_moe(r, p + "mlp.", c);
    else
      layer.mlp = load_mlp(r, p + "mlp.", c.hidden_size, c.intermediate_size);
    w.layers.push_back(std::move(layer));
  }
  w.matrix_bytes = r.bytes();
  return w;
}

std::optional<MtpWeights> load_mtp_weights(const TensorStore& store, const ModelConfig& c, MtpStatus& status,
                                           float norm_offset) {
  const int64_t H = c.hidden_size;
  // Every tensor a dense one-layer head has (spec §1.2: exactly 15); a MoE head's layer has the MoE block's
  // router and shared expert instead of the MLP (its experts, in any layout, are checked by load_moe).
  std::vector<std::string> required = {"mtp.fc.weight",
                                       "mtp.pre_fc_norm_embedding.weight",
                                       "mtp.pre_fc_norm_hidden.weight",
                                       "mtp.norm.weight",
                                       "mtp.layers.0.input_layernorm.weight",
                                       "mtp.layers.0.post_attention_layernorm.weight",
                                       "mtp.layers.0.self_attn.q_proj.weight",
                                       "mtp.layers.0.self_attn.k_proj.weight",
                                       "mtp.layers.0.self_attn.v_proj.weight",
                                       "mtp.layers.0.self_attn.o_proj.weight",
                                       "mtp.layers.0.self_attn.q_norm.weight",
                                       "mtp.layers.0.self_attn.k_norm.weight",
                                       "mtp.layers.0.mlp.gate_proj.weight",
                                       "mtp.layers.0.mlp.up_proj.weight",
                                       "mtp.layers.0.mlp.down_proj.weight"};
  if (c.is_moe()) {
    required.resize(required.size() - 3);
    for (const char* name : {"gate.weight", "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                             "shared_expert.down_proj.weight", "shared_expert_gate.weight"})
      required.push_back(std::string("mtp.layers.0.mlp.") + name);
  }
  std::vector<std::string> missing;
  for (const std::string& name : required)
    if (store.find(name) == nullptr) missing.push_back(name);
  if (missing.size() == required.size()) {
    status = {
        MtpStatus::Kind::kAbsent,
        c.mtp_num_hidden_layers > 0
            ? fmt::format("config declares mtp_num_hidden_layers={} but the checkpoint has no mtp.* tensors",
                          c.mtp_num_hidden_layers)
            : "the checkpoint has no MTP head"};
    return std::nullopt;
  }
  if (!missing.empty()) {
    std::string names;
    for (const std::string& n : missing) names += (names.empty() ? "" : ", ") + n;
    status = {MtpStatus::Kind::kIncomplete, "MTP head is incomplete, missing: " + names};
    return std::nullopt;
  }
  try {
    Resolver r(store, norm_offset);
    MtpWeights m;
    m.fc = r.matrix("mtp.fc.weight", H, 2 * H);
    m.pre_fc_norm_embedding = r.norm("mtp.pre_fc_norm_embedding.weight", H);
    m.pre_fc_norm_hidden = r.norm("mtp.pre_fc_norm_hidden.weight", H);
    m.norm = r.norm("mtp.norm.weight", H);
    m.layer.type = LayerType::kFullAttention;
    m.layer.input_norm = r.norm("mtp.layers.0.input_layernorm.weight", H);
    m.layer.post_attn_norm = r.norm("mtp.layers.0.post_attention_layernorm.weight", H);
    m.layer.attention = load_attention(r, "mtp.layers.0.self_attn.", c);
    if (c.is_moe())
      m.layer.moe = load_moe(r, "mtp.layers.0.mlp.", c);
    else
      m.layer.mlp = load_mlp(r, "mtp.layers.0.mlp.", H, c.intermediate_size);
    m.matrix_bytes = r.bytes();
    status = {MtpStatus::Kind::kPresent, ""};
    return m;
  } catch (const Error& e) {
    status = {MtpStatus::Kind::kIncompatible, fmt::format("MTP head does not fit the trunk: {}", e.what())};
    return std::nullopt;
  }
}

namespace {

// Fills a bf16 matrix with approximately N(0, std^2) values (Irwin-Hall: a sum of 4 uniforms from
// splitmix64), deterministic for a seed and fast enough for the 0.8B..27B shapes.
cpu::WeightMatrix random_matrix(SyntheticStorage& s, uint64_t seed, int64_t rows, int64_t cols,
                                float stddev) {
  const int64_t n = rows * cols;
  auto buffer = std::make_unique<uint16_t[]>(static_cast<size_t>(n));
  uint16_t* data = buffer.get();
  // Sum of 4 U(0,1) has mean 2 and variance 1/3.
  const float scale = stddev * std::sqrt(3.0f) / 65536.0f;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float sum =
        static_cast<float>((z & 0xffff) + ((z >> 16) & 0xffff) + ((z >> 32) & 0xffff) + (z >> 48));
    data[i] = f32_to_bf16((sum - 2.0f * 65535.0f) * scale);
  }
  cpu::WeightMatrix w{cpu::WeightType::kBF16, data, rows, cols};
  s.buffers.push_back(std::move(buffer));
  return w;
}

std::vector<float> random_vector(std::mt19937_64& rng, int64_t n, float mean, float stddev) {
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

template <typename MakeMatrix>
AttentionWeights random_attention(const ModelConfig& c, std::mt19937_64& rng, MakeMatrix& mat) {
  const int64_t H = c.hidden_size, D = c.head_dim;
  AttentionWeights a;
  a.q_proj = mat(c.num_attention_heads * 2 * D, H);
  a.k_proj = mat(c.num_kv_heads * D, H);
  a.v_proj = mat(c.num_kv_heads * D, H);
  a.o_proj = mat(H, c.num_attention_heads * D);
  a.q_norm = random_vector(rng, D, 1.0f, 0.1f);
  a.k_norm = random_vector(rng, D, 1.0f, 0.1f);
  return a;
}

template <typename MakeMatrix>
MoeWeights random_moe(const ModelConfig& c, MakeMatrix& mat) {
  const int64_t H = c.hidden_size, I = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
  MoeWeights m;
  m.experts_per_token = c.num_experts_per_tok;
  m.router = mat(c.num_experts, H);
  m.shared_expert = {mat(Is, H), mat(Is, H), mat(H, Is)};
  m.shared_expert_gate = mat(1, H);
  for (int64_t e = 0; e < c.num_experts; ++e) m.experts.push_back({mat(I, H), mat(I, H), mat(H, I)});
  return m;
}

int64_t layer_matrix_bytes(const LayerWeights& l) {
  int64_t bytes = 0;
  for_each_matrix(l, [&](const cpu::WeightMatrix& w) { bytes += cpu::weight_bytes(w); });
  return bytes;
}

}  // namespace

ModelWeights make_synthetic_weights(const ModelConfig& c, uint64_t seed, SyntheticStorage& s) {
  std::mt19937_64 rng(seed);
  uint64_t next = seed * 1000003ull;
  auto mat = [&](int64_t rows, int64_t cols) {
    return random_matrix(s, ++next, rows, cols, 1.0f / std::sqrt(static_cast<float>(cols)));
  };
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  ModelWeights w;
  w.embed_tokens = random_matrix(s, ++next, c.vocab_size, H, 1.0f);
  w.lm_head = c.tie_word_embeddings ? w.embed_tokens : mat(c.vocab_size, H);
  w.tied = c.tie_word_embeddings;
  w.final_norm = random_vector(rng, H, 1.0f, 0.1f);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    LayerWeights layer;
    layer.type = c.layer_types[static_cast<size_t>(i)];
    layer.input_norm = random_vector(rng, H, 1.0f, 0.1f);
    layer.post_attn_norm = random_vector(rng, H, 1.0f, 0.1f);
    if (layer.type == LayerType::kFullAttention) {
      layer.attention = random_attention(c, rng, mat);
    } else {
      const int64_t Hv = c.linear_num_value_heads, Dv = c.linear_value_head_dim;
      DeltaNetWeights d;
      d.in_proj_qkv = mat(c.conv_dim(), H);
      d.in_proj_z = mat(Hv * Dv, H);
      d.in_proj_b = mat(Hv, H);
      d.in_proj_a = mat(Hv, H);
      d.out_proj = mat(H, Hv * Dv);
      d.conv1d = random_vector(rng, c.conv_dim() * c.linear_conv_kernel_dim, 0.0f, 0.3f);
      set_conv_taps(d, c.conv_dim(), c.linear_conv_kernel_dim);
      d.a_log = random_vector(rng, Hv, 0.0f, 0.5f);
      d.dt_bias = random_vector(rng, Hv, 0.0f, 0.5f);
      d.norm = random_vector(rng, Dv, 1.0f, 0.1f);
      layer.delta_net = std::move(d);
    }
    if (c.is_moe()) {
      layer.moe = random_moe(c, mat);
    } else {
      layer.mlp.gate_proj = mat(I, H);
      layer.mlp.up_proj = mat(I, H);
      layer.mlp.down_proj = mat(H, I);
    }
    w.layers.push_back(std::move(layer));
  }
  w.matrix_bytes = cpu::weight_bytes(w.embed_tokens) + (w.tied ? 0 : cpu::weight_bytes(w.lm_head));
  for (const LayerWeights& l : w.layers) w.matrix_bytes += layer_matrix_bytes(l);
  return w;
}

MtpWeights make_synthetic_mtp_weights(const ModelConfig& c, uint64_t seed, SyntheticStorage& s) {
  std::mt19937_64 rng(seed);
  uint64_t next = seed * 7919ull + 17;
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  auto mat = [&](int64_t rows, int64_t cols) {
    return random_matrix(s, ++next, rows, cols, 1.0f / std::sqrt(static_cast<float>(cols)));
  };
  MtpWeights m;
  m.fc = mat(H, 2 * H);
  m.pre_fc_norm_embedding = random_vector(rng, H, 1.0f, 0.1f);
  m.pre_fc_norm_hidden = random_vector(rng, H, 1.0f, 0.1f);
  m.norm = random_vector(rng, H, 1.0f, 0.1f);
  m.layer.type = LayerType::kFullAttention;
  m.layer.input_norm = random_vector(rng, H, 1.0f, 0.1f);
  m.layer.post_attn_norm = random_vector(rng, H, 1.0f, 0.1f);
  m.layer.attention = random_attention(c, rng, mat);
  if (c.is_moe()) {
    m.layer.moe = random_moe(c, mat);
  } else {
    m.layer.mlp.gate_proj = mat(I, H);
    m.layer.mlp.up_proj = mat(I, H);
    m.layer.mlp.down_proj = mat(H, I);
  }
  m.matrix_bytes = cpu::weight_bytes(m.fc) + layer_matrix_bytes(m.layer);
  return m;
}

}  // namespace mtpx
