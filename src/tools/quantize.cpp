#include "tools/quantize.h"

#include <fmt/core.h>

#include <cstdio>
#include <fstream>
#include <iterator>

#include "io/model_config.h"
#include "model/input_statistics.h"
#include "model/mtp_head.h"
#include "model/qwen35.h"
#include "tokenizer/tokenizer.h"
#include "tools/graft.h"
#include "util/error.h"

namespace mtpx::tools {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The calibration text's ids: graft's sample ("builtin") or a text file's first 2048 tokens.
std::vector<int32_t> calibration_ids(const Model& model, const fs::path& model_dir,
                                     const std::string& source) {
  if (source == "builtin") return graft_sample_ids(model_dir, model.config().vocab_size);
  if (!fs::is_regular_file(source))
    invalid_input("--calibration '{}': not a file (or builtin, none)", source);
  if (!fs::exists(model_dir / "tokenizer.json"))
    invalid_input("--calibration FILE needs the model's tokenizer.json");
  std::ifstream in(source, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<int32_t> ids = Tokenizer::from_file(model_dir / "tokenizer.json").encode(text);
  if (ids.size() > 2048) ids.resize(2048);
  return ids;
}

// Adds the inputs of every product over the calibration text to `stats`, trunk and head (teacher-forced);
// returns the text's length in tokens.
int64_t calibrate(const Model& model, const fs::path& model_dir, const std::string& source,
                  InputStatistics& stats) {
  const std::vector<int32_t> ids = calibration_ids(model, model_dir, source);
  if (ids.size() < 2) invalid_input("--calibration '{}': fewer than 2 tokens", source);
  const auto n = static_cast<int64_t>(ids.size());
  InferenceState state = model.new_state(n);
  state.set_input_statistics(&stats);
  ForwardResult r;
  model.forward(state, ids, LogitRows::kNone, r);
  if (model.mtp() != nullptr) {
    MtpState head(model.config(), n);
    head.set_input_statistics(&stats);
    MtpResult m;
    const auto H = static_cast<size_t>(model.config().hidden_size);
    mtp_forward(model, head, std::span<const float>(r.hidden.data(), static_cast<size_t>(n - 1) * H),
                std::span<const int32_t>(ids.data() + 1, static_cast<size_t>(n - 1)), 0, LogitRows::kNone, m);
  }
  return n;
}

}  // namespace

json quantize_model(const fs::path& model_dir, const fs::path& out, const QuantizeOptions& o) {
  if (o.quant.bits != 4 && o.quant.bits != 6 && o.quant.bits != 8) invalid_input("--bits must be 4, 6 or 8");
  if (o.quant.mtp_fc_bits != 16 && o.quant.mtp_fc_bits != 8 && o.quant.mtp_fc_bits != 4)
    invalid_input("--mtp-fc-bits must be 16, 8 or 4");
  const auto model = Model::load(model_dir);
  std::error_code ec;
  if (fs::exists(out) && fs::equivalent(out, model_dir, ec)) invalid_input("--out must differ from --model");
  bool requantized = false;
  for (const auto& t : checkpoint_manifest(model->config(), model->weights(), model->mtp(), Layout::kMlx)) {
    if (t.matrix != nullptr && t.matrix->type == cpu::WeightType::kAffine) requantized = true;
    for (const cpu::WeightMatrix* part : t.parts) requantized |= part->type == cpu::WeightType::kAffine;
  }
  if (requantized)
    std::fprintf(stderr,
                 "warning: '%s' is already quantized; its weights are dequantized and quantized again\n",
                 model_dir.c_str());

  if (o.quant.method == QuantMethod::kMlx && o.calibration != "builtin" && o.calibration != "none")
    invalid_input("--calibration needs --method least-squares (MLX's rule uses no calibration)");
  InputStatistics stats;
  const int64_t calibration_tokens = o.quant.method == QuantMethod::kLeastSquares && o.calibration != "none"
                                         ? calibrate(*model, model_dir, o.calibration, stats)
                                         : 0;

  WriteOptions w;
  w.layout = Layout::kMlx;
  w.quant = o.quant;
  w.importance = calibration_tokens > 0 ? &stats : nullptr;
  w.progress = o.progress;
  AtomicDirectory staging(out, o.force);
  const int64_t bytes = write_checkpoint_tensors(
      staging.path(), checkpoint_manifest(model->config(), model->weights(), model->mtp(), Layout::kMlx), w);
  // config.json: the original, with MLX's quantization entries (per-module override for mtp.fc).
  json config = read_json_file(model_dir / "config.json");
  const json generated = config_json(model->config(), w);
  for (const char* key : {"quantization", "quantization_config"}) config[key] = generated[key];
  write_json_file(staging.path() / "config.json", config);
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                           "chat_template.jinja", "special_tokens_map.json", "vocab.json", "merges.txt"})
    if (fs::exists(model_dir / name)) fs::copy_file(model_dir / name, staging.path() / name);
  staging.commit();
  return {{"model", model_dir.string()},
          {"out", out.string()},
          {"bits", o.quant.bits},
          {"group_size", o.quant.group_size},
          {"method", o.quant.method == QuantMethod::kMlx ? "mlx" : "least-squares"},
          {"calibration", calibration_tokens > 0 ? o.calibration : "none"},
          {"calibration_tokens", calibration_tokens},
          {"mtp_fc_bits", o.quant.mtp_fc_bits},
          {"mtp_head", model->mtp() != nullptr},
          {"bytes", bytes}};
}

}  // namespace mtpx::tools
