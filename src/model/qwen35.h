// The Qwen3.5 / Qwen3.6 text model (spec §2): embeddings, L decoder layers (Gated DeltaNet or gated
// full attention, then a SwiGLU MLP, each with a zero-centered pre-norm and a residual), final norm,
// lm_head. The model is immutable after loading and can serve many InferenceStates at once.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "io/model_config.h"
#include "model/state.h"
#include "model/weights.h"

namespace mtpx {

class TensorStore;

enum class LogitRows { kNone, kLast, kAll };

struct ForwardResult {
  std::vector<float> hidden;  // [T, H]  post-final-norm hidden (the lm_head input; what MTP consumes)
  std::vector<float> logits;  // [rows, V]  rows = T (kAll), 1 (kLast) or 0
};

class Model {
 public:
  // Loads config.json and the safetensors of a model directory. Throws mtpx::Error naming what is wrong.
  static std::unique_ptr<Model> load(const std::filesystem::path& dir);
  // Random bf16 weights with the given shapes (benchmarks at real scale).
  static std::unique_ptr<Model> synthetic(const ModelConfig& config, uint64_t seed);
  ~Model();

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  const std::filesystem::path& directory() const { return dir_; }

  InferenceState new_state(int64_t capacity) const { return InferenceState(config_, capacity); }

  // Runs `tokens` at positions state.position() .. +T-1, advancing the state.
  void forward(InferenceState& state, std::span<const int32_t> tokens, LogitRows rows, ForwardResult& result) const;

 private:
  Model() = default;
  ModelConfig config_;
  ModelWeights weights_;
  std::filesystem::path dir_;
  std::unique_ptr<TensorStore> store_;          // mapped files the weights point into
  std::unique_ptr<SyntheticStorage> synthetic_;  // or buffers owned by a synthetic model
};

}  // namespace mtpx
