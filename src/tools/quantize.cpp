#include "tools/quantize.h"

#include <fmt/core.h>

#include <cstdio>

#include "io/model_config.h"
#include "model/qwen35.h"
#include "util/error.h"

namespace mtpx::tools {

namespace fs = std::filesystem;
using nlohmann::json;

json quantize_model(const fs::path& model_dir, const fs::path& out, const QuantizeOptions& o) {
  if (o.quant.bits != 4 && o.quant.bits != 6 && o.quant.bits != 8) invalid_input("--bits must be 4, 6 or 8");
  if (o.quant.mtp_fc_bits != 16 && o.quant.mtp_fc_bits != 8 && o.quant.mtp_fc_bits != 4)
    invalid_input("--mtp-fc-bits must be 16, 8 or 4");
  const auto model = Model::load(model_dir);
  std::error_code ec;
  if (fs::exists(out) && fs::equivalent(out, model_dir, ec)) invalid_input("--out must differ from --model");
  bool requantized = false;
  for (const auto& t : checkpoint_manifest(model->config(), model->weights(), model->mtp()))
    if (t.matrix != nullptr && t.matrix->type == cpu::WeightType::kAffine) requantized = true;
  if (requantized)
    std::fprintf(stderr,
                 "warning: '%s' is already quantized; its weights are dequantized and quantized again\n",
                 model_dir.c_str());

  WriteOptions w;
  w.layout = Layout::kMlx;
  w.quant = o.quant;
  w.progress = o.progress;
  AtomicDirectory staging(out, o.force);
  const int64_t bytes = write_checkpoint_tensors(
      staging.path(), checkpoint_manifest(model->config(), model->weights(), model->mtp()), w);
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
          {"mtp_fc_bits", o.quant.mtp_fc_bits},
          {"mtp_head", model->mtp() != nullptr},
          {"bytes", bytes}};
}

}  // namespace mtpx::tools
