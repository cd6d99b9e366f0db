#include "tools/graft.h"

#include <fmt/core.h>

#include <algorithm>

#include "io/model_config.h"
#include "io/safetensors.h"
#include "model/mtp_head.h"
#include "tokenizer/tokenizer.h"
#include "tools/checkpoint.h"
#include "tools/prompts.h"
#include "util/error.h"

namespace mtpx::tools {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::string describe_storage(const cpu::WeightMatrix& w) {
  switch (w.type) {
    case cpu::WeightType::kF32:
      return "f32";
    case cpu::WeightType::kF16:
      return "f16";
    case cpu::WeightType::kBF16:
      return "bf16";
    case cpu::WeightType::kAffine:
      return fmt::format("affine {}-bit group {}", w.bits, w.group_size);
  }
  return "?";
}

// The trunk and the donor's head must be the same model family member stored the same way.
void check_compatible(const Model& trunk, const Model& donor) {
  const ModelConfig& a = trunk.config();
  const ModelConfig& b = donor.config();
  auto same = [](const char* what, int64_t x, int64_t y) {
    if (x != y) invalid_input("graft refused: {} differs (trunk {}, donor {})", what, x, y);
  };
  same("hidden_size", a.hidden_size, b.hidden_size);
  same("vocab_size", a.vocab_size, b.vocab_size);
  same("num_attention_heads", a.num_attention_heads, b.num_attention_heads);
  same("num_key_value_heads", a.num_kv_heads, b.num_kv_heads);
  same("head_dim", a.head_dim, b.head_dim);
  same("intermediate_size", a.intermediate_size, b.intermediate_size);
  // A MoE head's layer is a MoE block of the trunk's geometry: a dense head cannot serve a MoE trunk.
  same("num_experts", a.num_experts, b.num_experts);
  same("num_experts_per_tok", a.num_experts_per_tok, b.num_experts_per_tok);
  same("moe_intermediate_size", a.moe_intermediate_size, b.moe_intermediate_size);
  same("shared_expert_intermediate_size", a.shared_expert_intermediate_size,
       b.shared_expert_intermediate_size);
  // Quantization layout: the head's layers against the trunk's full-attention layers.
  const LayerWeights* trunk_attention = nullptr;
  for (const LayerWeights& l : trunk.weights().layers)
    if (l.attention) trunk_attention = &l;
  const MtpWeights& head = *donor.mtp();
  if (trunk_attention != nullptr) {
    const std::string t = describe_storage(trunk_attention->attention->q_proj);
    const std::string h = describe_storage(head.layer.attention->q_proj);
    if (t != h)
      invalid_input(
          "graft refused: quantization differs (trunk attention is {}, donor head is {}); quantize both the "
          "same way",
          t, h);
  }
}

// Files of the trunk go to the output as hard links (no copy, no modification), or copies across
// file systems.
void link_or_copy(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::create_hard_link(from, to, ec);
  if (ec) {
    fs::copy_file(from, to, ec);
    if (ec)
      fail(ErrorKind::kInternal, "cannot copy '{}' to '{}': {}", from.string(), to.string(), ec.message());
  }
}

}  // namespace

std::vector<int32_t> graft_sample_ids(const fs::path& model_dir, int64_t vocab_size) {
  if (fs::exists(model_dir / "tokenizer.json")) {
    const Tokenizer tok = Tokenizer::from_file(model_dir / "tokenizer.json");
    std::string text;
    for (const std::string& p : builtin_prompts()) text += p + "    pass\n\n";
    text +=
        "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n            result.append(a[i])\n            i += 1\n        else:\n"
        "            result.append(b[j])\n            j += 1\n    result.extend(a[i:])\n    "
        "result.extend(b[j:])\n"
        "    return result\n";
    std::vector<int32_t> ids = tok.encode(text);
    for (int32_t& id : ids) id = std::min<int32_t>(id, static_cast<int32_t>(vocab_size - 1));
    return ids;
  }
  std::vector<int32_t> ids;
  for (const auto& p : builtin_prompt_ids(std::nullopt, vocab_size, 4))
    ids.insert(ids.end(), p.begin(), p.end());
  return ids;
}

double teacher_forced_acceptance(const Model& model, const std::vector<int32_t>& tokens) {
  if (model.mtp() == nullptr)
    invalid_input("the model has no usable MTP head: {}", model.mtp_status().detail);
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n < 3) invalid_input("teacher-forced acceptance needs at least 3 tokens");
  const int64_t V = model.config().vocab_size, H = model.config().hidden_size;
  InferenceState state = model.new_state(n);
  ForwardResult trunk;
  model.forward(state, tokens, LogitRows::kAll, trunk);
  MtpState head_state = new_mtp_state(model, n);
  MtpResult head;
  mtp_forward(
      model, head_state, std::span<const float>(trunk.hidden.data(), static_cast<size_t>((n - 1) * H)),
      std::span<const int32_t>(tokens.data() + 1, static_cast<size_t>(n - 1)), 0, LogitRows::kAll, head);
  auto argmax = [&](const float* row) { return std::max_element(row, row + V) - row; };
  int64_t agree = 0;
  // Head row t drafts token t+2; the trunk's greedy choice for it is its argmax at row t+1.
  for (int64_t t = 0; t + 1 < n; ++t)
    agree += argmax(&head.logits[static_cast<size_t>(t * V)]) ==
             argmax(&trunk.logits[static_cast<size_t>((t + 1) * V)]);
  return static_cast<double>(agree) / static_cast<double>(n - 1);
}

json graft_mtp_head(const fs::path& trunk_dir, const fs::path& donor_dir, const fs::path& out,
                    const GraftOptions& o) {
  const auto trunk = Model::load(trunk_dir);
  if (trunk->mtp() != nullptr && !o.force)
    invalid_input("graft refused: '{}' already has an MTP head (pass --force to replace it)",
                  trunk_dir.string());
  const auto donor = Model::load(donor_dir);
  if (donor->mtp() == nullptr)
    invalid_input("graft refused: the donor '{}' has no usable MTP head: {}", donor_dir.string(),
                  donor->mtp_status().detail);
  check_compatible(*trunk, *donor);

  std::error_code ec;
  if (fs::exists(out) && (fs::equivalent(out, trunk_dir, ec) || fs::equivalent(out, donor_dir, ec)))
    invalid_input("--out must be a new directory, not the trunk or the donor");
  AtomicDirectory staging(out, o.force);
  // The trunk's files, except an existing head sidecar and its runtime profile (measured without this head).
  for (const auto& entry : fs::directory_iterator(trunk_dir)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || name == "mtp.safetensors" || name == "config.json" ||
        name.rfind("mtpx_runtime", 0) == 0)
      continue;
    link_or_copy(entry.path(), staging.path() / name);
  }
  // The sidecar: the donor's mtp.* tensors byte for byte.
  TensorStore donor_all = TensorStore::open_directory(donor_dir);
  if (fs::exists(donor_dir / "mtp.safetensors") && donor_all.find("mtp.fc.weight") == nullptr)
    donor_all.add_file(donor_dir / "mtp.safetensors");
  std::vector<TensorToWrite> head_tensors;
  for (const std::string& name : donor_all.names()) {
    if (name.rfind("mtp.", 0) != 0) continue;
    const TensorView* t = donor_all.find(name);
    head_tensors.push_back({name, t->dtype, t->shape, std::span<const std::byte>(t->data, t->nbytes)});
  }
  write_safetensors(staging.path() / "mtp.safetensors", head_tensors,
                    {{"format", "pt"}, {"mtpx_graft_donor", donor_dir.string()}});
  // config.json: the trunk's, with the head declared and its quantization entries.
  json config = read_json_file(trunk_dir / "config.json");
  const json donor_config = read_json_file(donor_dir / "config.json");
  json& text = config.contains("text_config") ? config["text_config"] : config;
  text["mtp_num_hidden_layers"] = 1;
  for (const char* key : {"quantization", "quantization_config"})
    if (config.contains(key) && config[key].is_object() && donor_config.contains(key) &&
        donor_config[key].is_object())
      for (const auto& [k, v] : donor_config[key].items())
        if (k.rfind("mtp.", 0) == 0) config[key][k] = v;
  write_json_file(staging.path() / "config.json", config);

  // Measure the head on the grafted model before committing it.
  const auto grafted = Model::load(staging.path());
  if (grafted->mtp() == nullptr)
    invalid_input("graft refused: the head does not load on the trunk: {}", grafted->mtp_status().detail);
  const std::vector<int32_t> sample = graft_sample_ids(trunk_dir, grafted->config().vocab_size);
  const double acceptance = teacher_forced_acceptance(*grafted, sample);
  json report = {{"trunk", trunk_dir.string()},
                 {"donor", donor_dir.string()},
                 {"out", out.string()},
                 {"head_tensors", head_tensors.size()},
                 {"sample_tokens", sample.size()},
                 {"teacher_forced_acceptance", acceptance},
                 {"min_acceptance", o.min_acceptance}};
  if (acceptance < o.min_acceptance && !o.force)
    invalid_input(
        "graft refused: the head's teacher-forced acceptance on this trunk is {:.1f}%, below {:.0f}% "
        "(it would only cost time; --force keeps it anyway)",
        100 * acceptance, 100 * o.min_acceptance);
  staging.commit();
  report["accepted"] = acceptance >= o.min_acceptance;
  return report;
}

}  // namespace mtpx::tools
