// Writing model directories: the tensor manifest of a Qwen3.5 checkpoint, the two on-disk layouts
// (Hugging Face's and MLX's) and atomic output directories. Used by `synth`, `quantize` and `graft`.
//
// The layouts differ in three ways (spec §1, and what mlx_lm.convert writes):
//   tensor names   HF: model.language_model.X, lm_head.weight     MLX: language_model.model.X,
//                                                                      language_model.lm_head.weight
//   norms (1+w)    HF: w stored (zero-centered)                   MLX: 1+w stored
//   conv1d         HF: [C, 1, K]                                   MLX: [C, K, 1]
// The conv1d shape is how a reader tells the two conventions apart (as mlx-lm itself does), since the
// bytes of [C, 1, K] and [C, K, 1] are the same and only the norm values differ. mtp.* keeps its name
// in both layouts.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/cpu/matmul.h"
#include "io/model_config.h"
#include "model/input_statistics.h"
#include "model/weights.h"

namespace mtpx::tools {

enum class Layout { kHuggingFace, kMlx };

// What a tensor is, which decides how it is stored and whether it may be quantized.
enum class TensorRole {
  kMatrix,     // a linear layer or the embedding: [rows, cols]
  kNorm,       // zero-centered RMSNorm weight (engine value 1 + w)
  kPlainNorm,  // the gated DeltaNet norm (plain w)
  kVector,     // A_log, dt_bias
  kConv1d,     // depthwise conv weight, engine layout [C * K]
};

// One tensor of a checkpoint, named canonically (the Hugging Face name) with its source.
struct CheckpointTensor {
  std::string name;  // e.g. "model.language_model.layers.0.mlp.up_proj.weight", "mtp.fc.weight"
  TensorRole role = TensorRole::kMatrix;
  std::vector<int64_t> shape;  // Hugging Face shape ([E, rows, cols] for a stack of experts)
  bool mtp = false;            // part of the MTP head
  // Where the values come from: a matrix of a loaded model, an engine-convention float vector, or
  // (all null) random values for a synthetic checkpoint.
  const cpu::WeightMatrix* matrix = nullptr;
  const std::vector<float>* values = nullptr;
  // A stack of experts' matrices (shape [E, rows, cols]): the matrices whose rows it holds, in order (a
  // fused gate_up_proj holds gate_0, up_0, gate_1, up_1, ...); empty for a random stack.
  std::vector<const cpu::WeightMatrix*> parts;
};

// Every tensor of `config`'s model (trunk, then head when `with_mtp`), random sources. A mixture-of-experts
// model's experts are stacked as `layout` stores them: fused experts.gate_up_proj [E, 2I, H] and
// experts.down_proj [E, H, I] (the official releases' layout) for Hugging Face,
// switch_mlp.{gate,up,down}_proj [E, out, in] for MLX.
std::vector<CheckpointTensor> checkpoint_manifest(const ModelConfig& config, bool with_mtp,
                                                  Layout layout = Layout::kHuggingFace);
// The same manifest with each entry pointing at the loaded weights (mtp may be null: no head).
std::vector<CheckpointTensor> checkpoint_manifest(const ModelConfig& config, const ModelWeights& weights,
                                                  const MtpWeights* mtp,
                                                  Layout layout = Layout::kHuggingFace);

// How affine scales and biases are chosen (the stored layout is MLX's either way).
enum class QuantMethod {
  kMlx,           // MLX's min/max rule: bit for bit what mlx_lm.convert -q writes (cpu::quantize_affine)
  kLeastSquares,  // a small search for each group's least squared error (cpu::quantize_affine_least_squares)
};

// How matrices are stored.
struct QuantSpec {
  int bits = 16;  // 16: bf16; 2..8: affine group-wise (MLX) codes
  int64_t group_size = 64;
  QuantMethod method = QuantMethod::kMlx;
  int mtp_fc_bits = 16;  // mtp.fc separately (16: bf16, the default: its input mixes two norms' scales)
  int embed_bits = 0;    // embed_tokens / lm_head separately (0: as `bits`)
};

struct WriteOptions {
  Layout layout = Layout::kHuggingFace;
  QuantSpec quant;
  // Calibration for QuantMethod::kLeastSquares: each matrix's input mean squares weigh its columns' errors
  // (matrices it has no entry for are fitted unweighted). Not owned; nullptr: none.
  const InputStatistics* importance = nullptr;
  uint64_t seed = 0;                           // for random sources
  int64_t max_shard_bytes = int64_t{4} << 30;  // larger checkpoints are sharded with an index
  std::function<void(double fraction)> progress;
};

// The config.json object of `config` in the official wrapper layout (text_config), plus the
// "quantization" entries MLX readers expect when matrices are quantized.
nlohmann::json config_json(const ModelConfig& config, const WriteOptions& options);

// Writes the tensors (sharded when large) into `dir`, which must exist (an AtomicDirectory's staging
// path). Returns the bytes written.
int64_t write_checkpoint_tensors(const std::filesystem::path& dir,
                                 const std::vector<CheckpointTensor>& tensors, const WriteOptions& options);

// Writes a JSON file atomically (temporary file + rename).
void write_json_file(const std::filesystem::path& path, const nlohmann::json& value);
// Writes a text file atomically (temporary file + rename).
void write_text_file(const std::filesystem::path& path, const std::string& text);

// An output directory that appears all at once: files go into a staging directory next to the target
// (".NAME.tmp-PID"), commit() syncs them and renames it into place; destroyed without commit() (an error),
// the staging directory is removed and the target is untouched. A run that is killed leaves its staging
// directory: the next run for the same target removes it (or, when the kill came between the two renames
// of a replacing commit, puts the previous target back). The target must not exist unless `replace` is
// set.
class AtomicDirectory {
 public:
  AtomicDirectory(const std::filesystem::path& target, bool replace);
  ~AtomicDirectory();
  AtomicDirectory(const AtomicDirectory&) = delete;
  AtomicDirectory& operator=(const AtomicDirectory&) = delete;

  const std::filesystem::path& path() const { return staging_; }
  void commit();

 private:
  std::filesystem::path target_;
  std::filesystem::path staging_;
  bool replace_ = false;
  bool committed_ = false;
};

}  // namespace mtpx::tools
