// The Qwen3.5 / Qwen3.6 text model (spec §2): embeddings, L decoder layers (Gated DeltaNet or gated
// full attention, then a SwiGLU MLP, each with a zero-centered pre-norm and a residual), final norm,
// lm_head. The model is immutable after loading and can serve many InferenceStates at once.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "io/model_config.h"
#include "model/decoder_layer.h"
#include "model/device.h"
#include "model/state.h"
#include "model/weights.h"

namespace mtpx {

class TensorStore;

struct ForwardResult {
  std::vector<float> hidden;    // [T, H]  post-final-norm hidden (the lm_head input; what MTP consumes)
  std::vector<float> logits;    // [rows, V]  rows = T (kAll), 1 (kLast) or 0; empty on a device when
                                // argmax was asked for
  std::vector<int32_t> argmax;  // [rows] with argmax_limit > 0: each row's argmax over ids < argmax_limit
  LogitCandidates candidates;   // on a device with a sampling request: the rows' candidates instead of
                                // the logits (device.h)
};

// One sequence's part of a batched pass (Model::forward_batch): forward()'s arguments for that sequence.
struct SequenceForward {
  InferenceState* state = nullptr;
  std::span<const int32_t> tokens;
  LogitRows rows = LogitRows::kLast;
  ForwardResult* result = nullptr;
  bool record_window = false;
  int64_t argmax_limit = 0;
  int64_t head_logit_ids = 0;
  CandidateRequest sample = {};
};

class Model {
 public:
  // Loads config.json and the safetensors of a model directory. Throws mtpx::Error naming what is wrong.
  static std::unique_ptr<Model> load(const std::filesystem::path& dir);
  // Random bf16 weights with the given shapes (benchmarks at real scale).
  static std::unique_ptr<Model> synthetic(const ModelConfig& config, uint64_t seed, bool with_mtp = false);
  ~Model();

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  // The native MTP head, loaded with the trunk when the checkpoint has one (nullptr otherwise; the
  // status says why). It shares embed_tokens and lm_head with the trunk: no tensor is held twice.
  const MtpWeights* mtp() const { return mtp_ ? &*mtp_ : nullptr; }
  const MtpStatus& mtp_status() const { return mtp_status_; }
  const std::filesystem::path& directory() const { return dir_; }
  // Bytes of the checkpoint files the weights are mapped from (0 for a synthetic model).
  int64_t mapped_bytes() const;

  // Moves the forward passes to `device`: "cpu" (the default; prepare_cpu_kernels() now) or "cuda" (weights
  // are uploaded now and the host's copies of the mapped files are dropped from memory). Throws mtpx::Error
  // (kUnsupported) naming why a device cannot be used.
  void use_device(const std::string& device);
  // The executor forward passes run on (nullptr: the CPU).
  const DeviceExecutor* executor() const { return executor_.get(); }

  InferenceState new_state(int64_t capacity) const {
    return executor_ ? InferenceState(capacity, executor_->new_sequence(capacity))
                     : InferenceState(config_, capacity);
  }

  // Runs `tokens` at positions state.position() .. +T-1, advancing the state. With `record_window`
  // (T < kGemmMinRows), the pass can afterwards be cut back to any prefix with rollback().
  // argmax_limit > 0 (greedy decoding): result.argmax gets each logit row's argmax over ids < the limit
  // (cpu::argmax_rows_kernel, the same index as cpu::argmax), and a device copies only those instead of the
  // [rows, V] logits.
  // head_logit_ids > 0: the MTP head's next pass computes the logits of ids < head_logit_ids only (a draft
  // vocabulary); the lm_head product then reads those rows last so that they are still cached for it
  // (norm_and_logits). The results do not depend on it.
  // sample (sampling): on a device, result.candidates instead of result.logits where the device serves it
  // (device.h: CandidateRequest); the CPU returns the logits.
  void forward(InferenceState& state, std::span<const int32_t> tokens, LogitRows rows, ForwardResult& result,
               bool record_window = false, int64_t argmax_limit = 0, int64_t head_logit_ids = 0,
               CandidateRequest sample = {}) const;

  // forward() of several sequences (each its own state, distinct) in one pass: the row-wise work (norms,
  // projections, MLP, lm_head) runs over the rows of all of them at once, so each weight is read once per
  // pass instead of once per sequence (decode is bound by reading the weights), while attention and the
  // delta rule run per sequence on its own cache and state. Each sequence's result and state are
  // bit-identical to what its own forward() gives (batch invariance: decoder_layer_forward_batch), so a
  // request's output does not depend on what shares its steps. Sequences of kGemmMinRows tokens or more
  // (prompts) and every sequence on a device run one by one through forward(). Every sequence's input is
  // checked before any pass runs, so an invalid one throws with no state changed.
  void forward_batch(std::span<const SequenceForward> batch) const;
  // Throws what forward() would throw for `f`'s input (an empty or out-of-vocabulary token, a context
  // overflow, a state of another device), before anything runs.
  void check_forward(const SequenceForward& f) const;
  // forward() of one SequenceForward.
  void forward(const SequenceForward& f) const {
    forward(*f.state, f.tokens, f.rows, *f.result, f.record_window, f.argmax_limit, f.head_logit_ids,
            f.sample);
  }

  // Logits of logit row `row` of `state`'s last forward() on a device that returned candidates for rows
  // sampled whole (CandidateRequest::rows_on_request), while no other pass has run on the device since:
  // the whole row (V) when `ids` is empty, else those ids' (DeviceExecutor::fetch_logits).
  void fetch_logits(const InferenceState& state, int64_t row, std::span<const int32_t> ids,
                    std::vector<float>& values) const;
  // A draw below that row's top ids on the device (BelowDraw, DeviceExecutor::draw_below).
  int32_t draw_below(const InferenceState& state, int64_t row, const BelowDraw& draw) const;

  // Throws kInvalidInput for NaN or Inf that a forward pass produced (`what`: "logits at position 12"),
  // naming the checkpoint tensors that hold NaN or Inf: sampling from such logits would emit garbage.
  // Scans the mapped weights, so it is only called on that error path.
  [[noreturn]] void fail_non_finite(const std::string& what) const;

  // What the CPU's kernels need of the weights, made once, by the first forward pass on the CPU (trunk or
  // head): where they are AMX tile products, every bf16 matrix packed into tiles (a copy of the weights;
  // the mapped files' pages are released after). Not at load: a model bound for a GPU never needs them.
  // Thread-safe; a no-op after the first call, and after use_device("cuda").
  void prepare_cpu_kernels() const;

  // Keeps only the first `keep` tokens (1 <= keep <= T) of the last recorded window of T tokens (a verify
  // window's first token is the last one emitted, never rolled back): attention KV is truncated by moving
  // the position back (later writes overwrite the rest); DeltaNet states and conv rows are taken from the
  // window's per-token snapshots (deltanet_rollback).
  void rollback(InferenceState& state, int64_t keep) const;

 private:
  Model() = default;
  ModelConfig config_;
  ModelWeights weights_;
  std::filesystem::path dir_;
  std::unique_ptr<TensorStore> store_;           // mapped files the weights point into
  std::unique_ptr<SyntheticStorage> synthetic_;  // or buffers owned by a synthetic model
  std::optional<MtpWeights> mtp_;
  MtpStatus mtp_status_;
  std::unique_ptr<DeviceExecutor> executor_;
  // The bf16 matrices repacked into AMX tiles (cpu::pack_amx_tiles) by prepare_cpu_kernels(); the
  // matrices' amx_tiles point into it.
  std::unique_ptr<cpu::TileArena> amx_arena_;
  mutable std::once_flag cpu_kernels_prepared_;
  void pack_amx_tiles();
};

}  // namespace mtpx
