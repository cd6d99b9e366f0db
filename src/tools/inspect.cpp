#include "tools/inspect.h"

#include <fmt/core.h>

#include <fstream>
#include <map>
#include <sstream>

#include "io/model_config.h"
#include "io/safetensors.h"
#include "model/weights.h"
#include "tokenizer/tokenizer.h"
#include "tools/runtime_profile.h"
#include "util/error.h"

namespace mtpx::tools {
namespace {

using nlohmann::json;

// Which part of the model a tensor belongs to, by name.
std::string component_of(const std::string& name) {
  if (name.rfind("mtp.", 0) == 0) return "mtp_head";
  if (name.find(".mlp.experts.") != std::string::npos || name.find(".mlp.switch_mlp.") != std::string::npos)
    return "routed experts";
  if (name.find("visual") != std::string::npos || name.find("vision") != std::string::npos)
    return "vision (ignored)";
  if (name.find("embed_tokens") != std::string::npos || name.find("lm_head") != std::string::npos)
    return "embeddings";
  return "trunk";
}

struct ComponentTally {
  int64_t parameters = 0;
  int64_t bytes = 0;
  std::map<std::string, int64_t> storage;  // "bf16" / "affine 4-bit g64" -> parameters
};

// Parameters and storage of every tensor, from the headers. A quantized matrix (uint32 codes with
// scales and biases) counts rows x cols parameters, cols = scale groups x group size.
json tally_tensors(const TensorStore& store, const json& config_root) {
  std::map<std::string, ComponentTally> tally;
  const int64_t default_group =
      config_root.contains("quantization") && config_root["quantization"].is_object()
          ? config_root["quantization"].value("group_size", int64_t{64})
          : int64_t{64};
  for (const std::string& name : store.names()) {
    const TensorView* t = store.find(name);
    ComponentTally& c = tally[component_of(name)];
    c.bytes += static_cast<int64_t>(t->nbytes);
    if (name.ends_with(".scales") || name.ends_with(".biases")) {
      const std::string base = name.substr(0, name.size() - 7);
      if (store.find(base + ".weight") != nullptr && store.find(base + ".weight")->dtype == DType::kU32)
        continue;
    }
    if (t->dtype == DType::kU32 && name.ends_with(".weight")) {
      const std::string base = name.substr(0, name.size() - 7);
      const TensorView* scales = store.find(base + ".scales");
      // [rows, words] or a stack of experts [E, rows, words], with scales [.., groups].
      if (scales != nullptr && scales->shape.size() == t->shape.size() && t->shape.size() >= 2) {
        const int64_t cols = scales->shape.back() * default_group;
        const int64_t bits = cols > 0 ? t->shape.back() * 32 / cols : 0;
        const int64_t rows = t->numel() / t->shape.back();
        c.parameters += rows * cols;
        c.storage[fmt::format("affine {}-bit g{}", bits, default_group)] += rows * cols;
        continue;
      }
    }
    c.parameters += t->numel();
    std::string dtype(dtype_name(t->dtype));
    for (char& ch : dtype) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    c.storage[dtype] += t->numel();
  }
  json out = json::object();
  for (const auto& [name, c] : tally)
    out[name] = {{"parameters", c.parameters}, {"bytes", c.bytes}, {"storage", c.storage}};
  return out;
}

// State the engine keeps per sequence (fp32): attention KV for `context` positions in the full-attention
// layers (and the head's one), the DeltaNet recurrent and conv states, and a verify window's snapshot.
int64_t state_bytes(const ModelConfig& c, int64_t context, bool mtp) {
  const int64_t kv_per_layer = 2 * context * c.num_kv_heads * c.head_dim * 4;
  const int64_t attention_layers = c.num_full_attention_layers() + (mtp ? 1 : 0);
  const int64_t ssm = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4;
  const int64_t conv = (c.linear_conv_kernel_dim - 1) * c.conv_dim() * 4;
  const int64_t linear_layers = c.num_linear_attention_layers();
  return attention_layers * kv_per_layer + linear_layers * (ssm + conv) * (mtp ? 2 : 1);
}

json tokenizer_summary(const std::filesystem::path& dir) {
  json out = {{"present", false}};
  const auto path = dir / "tokenizer.json";
  if (!std::filesystem::exists(path)) return out;
  try {
    const Tokenizer tok = Tokenizer::from_file(path);
    out["present"] = true;
    out["vocab_size"] = tok.vocab_size();
    json specials = json::array();
    for (const char* s :
         {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>"})
      if (auto id = tok.token_to_id(s)) specials.push_back({{"token", s}, {"id", *id}});
    out["special_tokens"] = specials;
  } catch (const Error& e) {
    out["error"] = e.what();
  }
  bool chat_template = std::filesystem::exists(dir / "chat_template.jinja");
  if (std::filesystem::exists(dir / "tokenizer_config.json")) {
    try {
      const json tc = read_json_file(dir / "tokenizer_config.json");
      chat_template = chat_template || (tc.is_object() && tc.contains("chat_template"));
    } catch (const Error&) {
    }
  }
  out["chat_template"] = chat_template;
  return out;
}

// Parameters and bytes of the routed experts of a MoE model's layers (each expert counted once), and what
// one token reads of them (k of E experts per layer).
struct ExpertTally {
  int64_t parameters = 0, bytes = 0;
  double active_parameters = 0, active_bytes = 0;
  void add(const LayerWeights& l) {
    if (!l.moe) return;
    int64_t layer_parameters = 0, layer_bytes = 0;
    for (const MlpWeights& e : l.moe->experts)
      for (const cpu::WeightMatrix* w : {&e.gate_proj, &e.up_proj, &e.down_proj}) {
        layer_parameters += w->rows * w->cols;
        layer_bytes += cpu::weight_bytes(*w);
      }
    const double share =
        static_cast<double>(l.moe->experts_per_token) / static_cast<double>(l.moe->experts.size());
    parameters += layer_parameters, bytes += layer_bytes;
    active_parameters += share * static_cast<double>(layer_parameters);
    active_bytes += share * static_cast<double>(layer_bytes);
  }
};

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  return fmt::format("{:.1f} {}", b, units[u]);
}

std::string human_count(double n) {
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f}K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

}  // namespace

int64_t available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t value = 0;
  std::string unit;
  while (in >> key >> value >> unit)
    if (key == "MemAvailable:") return value * 1024;
  return 0;
}

json inspect_model(const std::filesystem::path& dir, const InspectOptions& o) {
  if (!std::filesystem::is_directory(dir))
    fail(ErrorKind::kNotFound, "model directory '{}' does not exist", dir.string());
  const auto config_path = dir / "config.json";
  if (!std::filesystem::exists(config_path))
    fail(ErrorKind::kNotFound, "'{}' has no config.json (not a Hugging Face model directory)", dir.string());
  json report = {{"path", dir.string()}};
  const json config_root = read_json_file(config_path);
  ModelConfig c = parse_model_config(config_root, config_path.string());
  json layer_counts = {{"linear_attention", c.num_linear_attention_layers()},
                       {"full_attention", c.num_full_attention_layers()}};
  report["architecture"] = c.architecture;
  report["shape"] = {{"hidden_size", c.hidden_size},
                     {"layers", c.num_layers},
                     {"layer_types", layer_counts},
                     {"intermediate_size", c.intermediate_size},
                     {"vocab_size", c.vocab_size},
                     {"attention_heads", c.num_attention_heads},
                     {"kv_heads", c.num_kv_heads},
                     {"head_dim", c.head_dim},
                     {"linear_key_heads", c.linear_num_key_heads},
                     {"linear_value_heads", c.linear_num_value_heads},
                     {"linear_head_dims", {c.linear_key_head_dim, c.linear_value_head_dim}},
                     {"max_position_embeddings", c.max_position_embeddings}};
  if (c.is_moe())
    report["shape"]["experts"] = {{"routed", c.num_experts},
                                  {"per_token", c.num_experts_per_tok},
                                  {"intermediate_size", c.moe_intermediate_size},
                                  {"shared_intermediate_size", c.shared_expert_intermediate_size}};
  if (config_root.contains("quantization")) report["quantization"] = config_root["quantization"];

  auto store = std::make_unique<TensorStore>(TensorStore::open_directory(dir));
  if (std::filesystem::exists(dir / "mtp.safetensors") && store->find("mtp.fc.weight") == nullptr)
    store->add_file(dir / "mtp.safetensors");
  report["components"] = tally_tensors(*store, config_root);

  // Resolving the weights checks every name, shape and dtype; it reads only the small vectors.
  const CheckpointConvention convention = detect_checkpoint_convention(*store, c);
  c.tensor_prefix = convention.tensor_prefix;
  report["layout"] = convention.tensor_prefix == "language_model.model." ? "mlx" : "huggingface";
  report["norms_stored_as"] =
      convention.norm_offset == 0.0f ? "1+w (MLX)" : "w (zero-centered, Hugging Face)";
  const ModelWeights w = load_model_weights(*store, c, convention.norm_offset);
  const int64_t matrix_bytes = w.matrix_bytes;
  report["tied_embeddings"] = w.tied;
  // What a decode token reads: every matrix but the embedding (one row of it), and of a MoE model's routed
  // experts only its k per layer.
  ExpertTally experts;
  for (const LayerWeights& l : w.layers) experts.add(l);
  int64_t matrix_parameters = w.lm_head.rows * w.lm_head.cols;
  for (const LayerWeights& l : w.layers)
    for_each_matrix(l, [&](const cpu::WeightMatrix& m) { matrix_parameters += m.rows * m.cols; });
  const int64_t embed_bytes = w.tied ? 0 : cpu::weight_bytes(w.embed_tokens);
  const double active_bytes =
      static_cast<double>(matrix_bytes - embed_bytes - experts.bytes) + experts.active_bytes;
  const double active_parameters =
      static_cast<double>(matrix_parameters - experts.parameters) + experts.active_parameters;
  report["per_token"] = {{"parameters", static_cast<int64_t>(active_parameters)},
                         {"bytes", static_cast<int64_t>(active_bytes)}};
  if (c.is_moe())
    report["per_token"]["routed_expert_parameters"] = static_cast<int64_t>(experts.active_parameters);

  MtpStatus status;
  const std::optional<MtpWeights> head = load_mtp_weights(*store, c, status, convention.norm_offset);
  const char* kinds[] = {"present", "absent", "incomplete", "incompatible"};
  report["mtp"] = {{"status", kinds[static_cast<int>(status.kind)]}, {"detail", status.detail}};
  if (head) report["mtp"]["bytes"] = head->matrix_bytes;

  report["tokenizer"] = tokenizer_summary(dir);
  try {
    const GenerationConfig g = load_generation_config(dir / "generation_config.json");
    report["generation_defaults"] = {{"do_sample", g.do_sample}, {"temperature", g.temperature},
                                     {"top_k", g.top_k},         {"top_p", g.top_p},
                                     {"min_p", g.min_p},         {"eos_token_ids", g.eos_token_ids}};
  } catch (const Error& e) {
    report["generation_defaults"] = {{"error", e.what()}};
  }
  report["runtime_profile"] = describe_runtime_profile(dir);

  // Memory: the mapped weights are read every token, so they must fit in RAM with the state.
  int64_t weight_bytes = 0;
  for (const auto& [name, comp] : report["components"].items())
    if (name != "vision (ignored)") weight_bytes += comp["bytes"].get<int64_t>();
  const bool with_mtp = head.has_value();
  const int64_t state = state_bytes(c, o.context + o.draft + 1, with_mtp);
  const int64_t scratch = (o.draft + 1) * c.vocab_size * 4 * 3 + (int64_t{64} << 20);
  const int64_t total = weight_bytes + state + scratch;
  const int64_t available = available_memory_bytes();
  report["memory"] = {{"context_tokens", o.context},
                      {"weights_bytes", weight_bytes},
                      {"matrix_bytes_per_token", matrix_bytes},
                      {"state_bytes", state},
                      {"scratch_bytes", scratch},
                      {"total_bytes", total},
                      {"available_bytes", available}};
  // NaN or Inf in a weight: generate would stop with an error naming the tensor (Model::fail_non_finite).
  std::string non_finite_reason;
  if (o.check_values) {
    json non_finite = json::array();
    for (const std::string& name : store->names()) {
      const int64_t bad = count_non_finite(*store->find(name));
      if (bad > 0) non_finite.push_back({{"tensor", name}, {"count", bad}});
    }
    if (!non_finite.empty())
      non_finite_reason =
          fmt::format("{} tensor(s) hold NaN or Inf values, first '{}' ({} values)", non_finite.size(),
                      non_finite[0]["tensor"].get<std::string>(), non_finite[0]["count"].get<int64_t>());
    report["non_finite"] = non_finite;
  }
  if (!non_finite_reason.empty()) {
    report["can_run"] = false;
    report["reason"] = non_finite_reason;
  } else if (available > 0 && total > available && c.is_moe() &&
             static_cast<int64_t>(active_bytes) + state + scratch < available) {
    // Each token reads its k experts per layer: from the mapped files, the experts a text routes to stay in
    // the page cache and the others are read from disk when first routed to.
    report["can_run"] = true;
    report["memory"]["pages_experts_from_disk"] = true;
    report["reason"] = fmt::format(
        "the weights ({}) exceed the available memory ({}): runs from the mapped files, routed experts paged "
        "in from disk as tokens reach them (a token reads {}); slower until the experts in use are cached",
        human_bytes(static_cast<double>(weight_bytes)), human_bytes(static_cast<double>(available)),
        human_bytes(active_bytes));
  } else if (available > 0 && total > available) {
    report["can_run"] = false;
    report["reason"] =
        fmt::format("needs {} for a {}-token context, {} available", human_bytes(static_cast<double>(total)),
                    o.context, human_bytes(static_cast<double>(available)));
  } else {
    report["can_run"] = true;
    report["reason"] =
        fmt::format("weights and a {}-token context fit in memory{}", o.context,
                    with_mtp ? "; MTP head usable (--mtp)" : "; no usable MTP head (plain decoding only)");
  }
  return report;
}

std::string render_inspect_report(const json& r) {
  std::ostringstream s;
  s << fmt::format("model      {}\n", r.value("path", ""));
  if (!r.contains("architecture")) {
    s << fmt::format("can run    no: {}\n", r.value("reason", ""));
    return s.str();
  }
  const json& sh = r["shape"];
  s << fmt::format("arch       {} ({} layout, norms stored as {})\n", r.value("architecture", ""),
                   r.value("layout", "?"), r.value("norms_stored_as", "?"));
  const int64_t intermediate = sh["intermediate_size"].get<int64_t>();
  s << fmt::format(
      "shape      hidden {}, {} layers ({} linear + {} full attention), {}, vocab {}\n",
      sh["hidden_size"].get<int64_t>(), sh["layers"].get<int64_t>(),
      sh["layer_types"]["linear_attention"].get<int64_t>(),
      sh["layer_types"]["full_attention"].get<int64_t>(),
      intermediate > 0 ? fmt::format("intermediate {}", intermediate) : std::string("mixture of experts"),
      sh["vocab_size"].get<int64_t>());
  if (sh.contains("experts")) {
    const json& e = sh["experts"];
    s << fmt::format("experts    {} routed of size {}, {} per token, plus a shared expert of size {}\n",
                     e["routed"].get<int64_t>(), e["intermediate_size"].get<int64_t>(),
                     e["per_token"].get<int64_t>(), e["shared_intermediate_size"].get<int64_t>());
  }
  if (r.contains("per_token"))
    s << fmt::format("per token  {} parameters active, {} of weights read per decoded token\n",
                     human_count(r["per_token"]["parameters"].get<double>()),
                     human_bytes(r["per_token"]["bytes"].get<double>()));
  s << fmt::format(
      "attention  {} q heads / {} kv heads of {}; DeltaNet {} k / {} v heads; tied embeddings: {}\n",
      sh["attention_heads"].get<int64_t>(), sh["kv_heads"].get<int64_t>(), sh["head_dim"].get<int64_t>(),
      sh["linear_key_heads"].get<int64_t>(), sh["linear_value_heads"].get<int64_t>(),
      r.value("tied_embeddings", false) ? "yes" : "no");
  if (r.contains("components")) {
    for (const auto& [name, c] : r["components"].items()) {
      std::string storage;
      for (const auto& [kind, n] : c["storage"].items())
        storage += (storage.empty() ? "" : ", ") + kind + " " + human_count(n.get<double>());
      s << fmt::format("  {:<17} {:>9} params {:>11}   {}\n", name,
                       human_count(c["parameters"].get<double>()), human_bytes(c["bytes"].get<double>()),
                       storage);
    }
  }
  if (r.contains("mtp"))
    s << fmt::format("mtp head   {}{}\n", r["mtp"].value("status", "?"),
                     r["mtp"].value("detail", "").empty() ? "" : ": " + r["mtp"].value("detail", ""));
  if (r.contains("tokenizer")) {
    const json& t = r["tokenizer"];
    if (t.value("present", false))
      s << fmt::format("tokenizer  {} ids, chat template: {}\n", t.value("vocab_size", 0),
                       t.value("chat_template", false) ? "yes" : "no");
    else
      s << fmt::format("tokenizer  none{}\n",
                       t.contains("error") ? ": " + t.value("error", "") : " (use --prompt-ids)");
  }
  if (r.contains("generation_defaults") && !r["generation_defaults"].contains("error")) {
    const json& g = r["generation_defaults"];
    s << fmt::format("sampler    {}\n", g.value("do_sample", false)
                                            ? fmt::format("temperature {}, top-k {}, top-p {}, min-p {}",
                                                          g.value("temperature", 1.0), g.value("top_k", 0),
                                                          g.value("top_p", 1.0), g.value("min_p", 0.0))
                                            : std::string("greedy"));
  }
  if (r.contains("runtime_profile"))
    s << fmt::format("profile    {}\n", r["runtime_profile"].value("summary", "none"));
  if (r.contains("memory")) {
    const json& m = r["memory"];
    s << fmt::format("memory     {} to run with a {}-token context (weights {}, state {}), {} available\n",
                     human_bytes(m["total_bytes"].get<double>()), m["context_tokens"].get<int64_t>(),
                     human_bytes(m["weights_bytes"].get<double>()),
                     human_bytes(m["state_bytes"].get<double>()),
                     human_bytes(m["available_bytes"].get<double>()));
  }
  if (r.contains("non_finite")) {
    std::string tensors;
    for (const auto& t : r["non_finite"])
      tensors +=
          fmt::format("{}{} ({})", tensors.empty() ? "" : ", ", t.value("tensor", ""), t.value("count", 0));
    s << fmt::format("values     {}\n", tensors.empty() ? "all finite" : "NaN/Inf in " + tensors);
  }
  s << fmt::format("can run    {}: {}\n", r.value("can_run", false) ? "yes" : "no", r.value("reason", ""));
  return s.str();
}

}  // namespace mtpx::tools
