// `mtpx quantize`: affine group-wise quantization in the MLX layout (what mlx_lm.convert -q writes, so
// mlx-lm loads the trunk; QuantMethod::kMlx writes its very tensors), keeping the MTP head: its linear layers
// are quantized like the trunk's, and mtp.fc stays bf16 by default (its input concatenates two differently
// normalized halves). Norms, A_log, dt_bias and conv1d stay bf16; the embedding (and with it a tied lm_head)
// is quantized, as MLX does. The output appears atomically.
#pragma once

#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "tools/checkpoint.h"

namespace mtpx::tools {

struct QuantizeOptions {
  QuantSpec quant;
  // QuantMethod::kLeastSquares weighs each column's error by the mean square of its input over a
  // calibration text run through the bf16 model (trunk and head): "builtin" (graft's sample text),
  // "none" (unweighted), or a text file (its first 2048 tokens).
  std::string calibration = "builtin";
  bool force = false;
  std::function<void(double)> progress;
};

nlohmann::json quantize_model(const std::filesystem::path& model_dir, const std::filesystem::path& out,
                              const QuantizeOptions& options);

}  // namespace mtpx::tools
