#include "io/model_config.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "util/error.h"

namespace mtpx {
namespace {

using nlohmann::json;

// Upper bounds that reject absurd configs before anything is allocated. Generous: the largest released
// Qwen3.5 has H=5120, L=64, V=248320.
constexpr int64_t kMaxHidden = 1 << 16;
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxVocab = 1 << 22;
constexpr int64_t kMaxHeads = 1024;
constexpr int64_t kMaxHeadDim = 1024;
constexpr int64_t kMaxIntermediate = 1 << 18;
constexpr int64_t kMaxExperts = 4096;

class Reader {
 public:
  Reader(const json& object, std::string source) : object_(object), source_(std::move(source)) {}

  bool has(const char* key) const { return object_.contains(key) && !object_.at(key).is_null(); }

  int64_t integer(const char* key, std::optional<int64_t> fallback, int64_t lo, int64_t hi) const {
    if (!has(key)) {
      if (fallback) return *fallback;
      invalid_input("{}: missing key '{}'", source_, key);
    }
    const json& v = object_.at(key);
    // Some configs write integers as floats (4096.0): those with an integral value count.
    if (!v.is_number_integer() && !(v.is_number_float() && std::trunc(v.get<double>()) == v.get<double>()))
      invalid_input("{}: '{}' must be an integer, got {}", source_, key, v.dump());
    // Range first, as a double: a value beyond int64 (1e20, 2^64-1) must not reach the conversion.
    const double approx = v.get<double>();
    if (!(approx >= static_cast<double>(lo) && approx <= static_cast<double>(hi)))
      invalid_input("{}: '{}' = {} is out of range [{}, {}]", source_, key, v.dump(), lo, hi);
    const int64_t x = v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(approx);
    if (x < lo || x > hi) invalid_input("{}: '{}' = {} is out of range [{}, {}]", source_, key, x, lo, hi);
    return x;
  }

  double number(const char* key, double fallback, double lo, double hi) const {
    if (!has(key)) return fallback;
    const json& v = object_.at(key);
    if (!v.is_number()) invalid_input("{}: '{}' must be a number, got {}", source_, key, v.dump());
    double x = v.get<double>();
    if (!(x >= lo && x <= hi))
      invalid_input("{}: '{}' = {} is out of range [{}, {}]", source_, key, x, lo, hi);
    return x;
  }

  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    const json& v = object_.at(key);
    if (!v.is_boolean()) invalid_input("{}: '{}' must be true or false, got {}", source_, key, v.dump());
    return v.get<bool>();
  }

  std::string string(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    const json& v = object_.at(key);
    if (!v.is_string()) invalid_input("{}: '{}' must be a string, got {}", source_, key, v.dump());
    return v.get<std::string>();
  }

  // An id or a list of ids (eos_token_id is either in Qwen files).
  std::vector<int32_t> ids(const char* key) const {
    std::vector<int32_t> out;
    if (!has(key)) return out;
    const json& v = object_.at(key);
    auto one = [&](const json& x) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= kMaxVocab)
        invalid_input("{}: '{}' must hold token ids, got {}", source_, key, x.dump());
      out.push_back(static_cast<int32_t>(x.get<int64_t>()));
    };
    if (v.is_array()) {
      for (const json& x : v) one(x);
    } else {
      one(v);
    }
    return out;
  }

  const json& object() const { return object_; }
  const std::string& source() const { return source_; }

 private:
  const json& object_;
  std::string source_;
};

}  // namespace

int64_t ModelConfig::num_full_attention_layers() const {
  return std::count(layer_types.begin(), layer_types.end(), LayerType::kFullAttention);
}

ModelConfig parse_model_config(const json& root, const std::string& source) {
  if (!root.is_object()) invalid_input("{}: expected a JSON object", source);
  ModelConfig c;

  // Layout (§1.1): the multimodal wrapper nests the text model under text_config; a text-only config is
  // the text config itself.
  std::string architecture;
  if (root.contains("architectures")) {
    const json& a = root.at("architectures");
    if (!a.is_array() || a.empty() || !a.at(0).is_string())
      invalid_input("{}: 'architectures' must be a non-empty list of strings", source);
    architecture = a.at(0).get<std::string>();
  }
  const std::string model_type = Reader(root, source).string("model_type", "");
  const bool wrapper = root.contains("text_config");
  if (wrapper && !root.at("text_config").is_object())
    invalid_input("{}: 'text_config' must be an object", source);
  const json& text = wrapper ? root.at("text_config") : root;
  const std::string text_type = Reader(text, source).string("model_type", model_type);

  // Dense (qwen3_5) and mixture-of-experts (qwen3_5_moe) checkpoints differ only in their MLPs.
  const bool dense = architecture == "Qwen3_5ForConditionalGeneration" ||
                     architecture == "Qwen3_5ForCausalLM" ||
                     (architecture.empty() && (model_type == "qwen3_5" || model_type == "qwen3_5_text"));
  const bool moe =
      architecture == "Qwen3_5MoeForConditionalGeneration" || architecture == "Qwen3_5MoeForCausalLM" ||
      (architecture.empty() && (model_type == "qwen3_5_moe" || model_type == "qwen3_5_moe_text"));
  if (!dense && !moe)
    fail(ErrorKind::kUnsupported,
         "{}: unknown architecture '{}' (model_type '{}'); mtpx runs Qwen3_5ForConditionalGeneration, "
         "Qwen3_5ForCausalLM, Qwen3_5MoeForConditionalGeneration and Qwen3_5MoeForCausalLM",
         source, architecture, model_type);
  const std::string family = moe ? "Qwen3_5Moe" : "Qwen3_5";
  c.architecture =
      architecture.empty() ? family + (wrapper ? "ForConditionalGeneration" : "ForCausalLM") : architecture;
  c.tensor_prefix = wrapper ? "model.language_model." : "model.";

  Reader t(text, wrapper ? source + " (text_config)" : source);
  c.vocab_size = t.integer("vocab_size", std::nullopt, 1, kMaxVocab);
  c.hidden_size = t.integer("hidden_size", std::nullopt, 1, kMaxHidden);
  if (moe) {
    // MoE configs carry no intermediate_size (transformers' Qwen3_5MoeTextConfig has none); every layer is
    // routed (5.17 reads no layer-selection field, so a config asking for dense layers cannot be honoured).
    c.num_experts = t.integer("num_experts", 256, 1, kMaxExperts);
    c.num_experts_per_tok = t.integer("num_experts_per_tok", 8, 1, c.num_experts);
    c.moe_intermediate_size = t.integer("moe_intermediate_size", 512, 1, kMaxIntermediate);
    c.shared_expert_intermediate_size =
        t.integer("shared_expert_intermediate_size", 512, 1, kMaxIntermediate);
    t.boolean("norm_topk_prob", true);  // checked for its type only: 5.17 renormalizes either way
    if (t.has("mlp_only_layers") &&
        !(text.at("mlp_only_layers").is_array() && text.at("mlp_only_layers").empty()))
      fail(ErrorKind::kUnsupported,
           "{}: 'mlp_only_layers' = {} asks for dense layers, which Qwen3.5 MoE models do not have",
           t.source(), text.at("mlp_only_layers").dump());
    if (t.integer("decoder_sparse_step", 1, 1, kMaxLayers) != 1)
      fail(ErrorKind::kUnsupported,
           "{}: 'decoder_sparse_step' = {} asks for dense layers, which Qwen3.5 MoE models do not have",
           t.source(), text.at("decoder_sparse_step").dump());
  } else {
    c.intermediate_size = t.integer("intermediate_size", std::nullopt, 1, kMaxIntermediate);
  }
  c.num_layers = t.integer("num_hidden_layers", std::nullopt, 1, kMaxLayers);
  c.num_attention_heads = t.integer("num_attention_heads", std::nullopt, 1, kMaxHeads);
  c.num_kv_heads = t.integer("num_key_value_heads", c.num_attention_heads, 1, kMaxHeads);
  c.head_dim = t.integer("head_dim", std::nullopt, 2, kMaxHeadDim);
  c.linear_num_key_heads = t.integer("linear_num_key_heads", std::nullopt, 1, kMaxHeads);
  c.linear_num_value_heads = t.integer("linear_num_value_heads", std::nullopt, 1, kMaxHeads);
  c.linear_key_head_dim = t.integer("linear_key_head_dim", std::nullopt, 1, kMaxHeadDim);
  c.linear_value_head_dim = t.integer("linear_value_head_dim", std::nullopt, 1, kMaxHeadDim);
  c.linear_conv_kernel_dim = t.integer("linear_conv_kernel_dim", 4, 1, 64);
  c.rms_norm_eps = t.number("rms_norm_eps", 1e-6, 0.0, 1.0);
  c.attn_output_gate = t.boolean("attn_output_gate", true);
  c.max_position_embeddings = t.integer("max_position_embeddings", 262144, 1, int64_t{1} << 40);
  c.mtp_num_hidden_layers = t.integer("mtp_num_hidden_layers", 0, 0, 16);
  if (!c.attn_output_gate)
    fail(ErrorKind::kUnsupported, "{}: attn_output_gate=false is not a Qwen3.5 configuration", t.source());
  if (t.string("hidden_act", "silu") != "silu")
    fail(ErrorKind::kUnsupported, "{}: hidden_act '{}' is not supported (Qwen3.5 uses silu)", t.source(),
         t.string("hidden_act", ""));
  if (t.boolean("attention_bias", false))
    fail(ErrorKind::kUnsupported, "{}: attention_bias=true is not supported", t.source());

  if (c.num_attention_heads % c.num_kv_heads != 0)
    invalid_input("{}: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})", t.source(),
                  c.num_attention_heads, c.num_kv_heads);
  if (c.linear_num_value_heads % c.linear_num_key_heads != 0)
    invalid_input("{}: linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({})",
                  t.source(), c.linear_num_value_heads, c.linear_num_key_heads);

  // RoPE (§3.1): rope_parameters (new) or rope_theta/partial_rotary_factor/rope_scaling at top level (old).
  // Default as transformers' Qwen3_5TextConfig (10000); released checkpoints all state 1e7 explicitly.
  double theta = t.number("rope_theta", 10000.0, 1.0, 1e12);
  double partial = t.number("partial_rotary_factor", 0.25, 0.0, 1.0);
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!t.has(key)) continue;
    const json& rp = text.at(key);
    if (!rp.is_object()) invalid_input("{}: '{}' must be an object", t.source(), key);
    Reader r(rp, t.source() + " (" + key + ")");
    theta = r.number("rope_theta", theta, 1.0, 1e12);
    partial = r.number("partial_rotary_factor", partial, 0.0, 1.0);
    std::string type = r.string("rope_type", r.string("type", "default"));
    if (type != "default" && type != "mrope")
      fail(ErrorKind::kUnsupported, "{}: rope type '{}' is not supported (only default)", r.source(), type);
  }
  c.rope_theta = theta;
  c.partial_rotary_factor = partial;
  c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * partial);
  if (c.rotary_dim % 2 != 0 || c.rotary_dim > c.head_dim)
    invalid_input("{}: rotary dim {} (head_dim {} x partial_rotary_factor {}) must be even", t.source(),
                  c.rotary_dim, c.head_dim, partial);

  // Layer types (§1.1): explicit list, or full attention every full_attention_interval-th layer.
  if (t.has("layer_types")) {
    const json& lt = text.at("layer_types");
    if (!lt.is_array() || static_cast<int64_t>(lt.size()) != c.num_layers)
      invalid_input("{}: 'layer_types' must be a list of num_hidden_layers ({}) entries", t.source(),
                    c.num_layers);
    for (const json& x : lt) {
      std::string s = x.is_string() ? x.get<std::string>() : x.dump();
      if (s == "full_attention")
        c.layer_types.push_back(LayerType::kFullAttention);
      else if (s == "linear_attention")
        c.layer_types.push_back(LayerType::kLinearAttention);
      else
        invalid_input("{}: unknown layer type '{}' (expected linear_attention or full_attention)", t.source(),
                      s);
    }
  } else {
    int64_t interval = t.integer("full_attention_interval", 4, 1, kMaxLayers);
    for (int64_t i = 0; i < c.num_layers; ++i)
      c.layer_types.push_back((i + 1) % interval == 0 ? LayerType::kFullAttention
                                                      : LayerType::kLinearAttention);
  }

  // Tied embeddings: text_config wins over the top level (the loader also looks for lm_head.weight).
  c.tie_word_embeddings =
      t.boolean("tie_word_embeddings", Reader(root, source).boolean("tie_word_embeddings", false));
  c.eos_token_ids = t.ids("eos_token_id");
  if (c.eos_token_ids.empty()) c.eos_token_ids = Reader(root, source).ids("eos_token_id");
  return c;
}

ModelConfig load_model_config(const std::filesystem::path& config_json) {
  return parse_model_config(read_json_file(config_json), config_json.string());
}

GenerationConfig parse_generation_config(const json& root, const std::string& source) {
  if (!root.is_object()) invalid_input("{}: expected a JSON object", source);
  Reader r(root, source);
  GenerationConfig g;
  g.do_sample = r.boolean("do_sample", false);
  g.temperature = r.number("temperature", 1.0, 0.0, 100.0);
  g.top_k = r.integer("top_k", 0, 0, kMaxVocab);
  g.top_p = r.number("top_p", 1.0, 0.0, 1.0);
  g.min_p = r.number("min_p", 0.0, 0.0, 1.0);
  g.eos_token_ids = r.ids("eos_token_id");
  return g;
}

GenerationConfig load_generation_config(const std::filesystem::path& generation_config_json) {
  if (!std::filesystem::exists(generation_config_json)) return GenerationConfig{};
  return parse_generation_config(read_json_file(generation_config_json), generation_config_json.string());
}

}  // namespace mtpx
