// Per-sequence inference state: the attention KV caches and the Gated DeltaNet conv/recurrent states.
// Rollback (for speculative verification) is part of this interface: KV is truncated by length; the
// DeltaNet states are restored from snapshots taken after each position of a verify window.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "io/model_config.h"

namespace mtpx {

class InputStatistics;

// Attention cache of one full-attention layer: post-norm, post-RoPE keys and values, grown by the
// attention forward to the positions used so far (at most the state's capacity).
struct KvCache {
  std::vector<float> keys;    // [positions, nkv, D]
  std::vector<float> values;  // [positions, nkv, D]
};

// What a recorded forward window keeps to roll back to any non-empty prefix of itself (spec §7, the
// snapshot option; a verify window's first token is the last one emitted, always kept): the recurrent
// state after each of its tokens, and the pre-conv rows. The recurrence writes each token's state to its
// own buffer (the first in place, the same arithmetic), and buffers change hands by swapping, so a window
// copies no state and a rollback replays nothing: it swaps the kept snapshot in, bit-identical to having
// run only those tokens. (The replay this replaced cost a state copy on each side and a second delta rule
// per kept token: a quarter of a two-row verify on the shipped model, BENCHMARKS.md session 8.)
struct DeltaNetWindow {
  int64_t tokens = 0;
  std::vector<std::vector<float>> ssm_after;  // [T][Hv, Dk, Dv] after token t; slot T-1 is swapped with the
                                              // state itself at the end of the window (stale from then on)
  std::vector<float> conv_before;             // [Kc-1, conv_dim]
  std::vector<float> qkv;                     // [T, conv_dim] pre-conv rows (the conv state is made of these)
};

// Gated DeltaNet state of one linear-attention layer (§4.1, §4.2).
struct DeltaNetState {
  std::vector<float> conv;  // [Kc-1, conv_dim]  the last Kc-1 pre-conv qkv rows (zeros at start)
  std::vector<float> ssm;   // [Hv, Dk, Dv]      recurrent state S, float32
  DeltaNetWindow window;    // filled by a forward pass run with record_window
};

// How many distinct routed experts a mixture-of-experts model's passes read (model/moe.h): each one's
// weights are read once per MoE block call, so a verify window of K+1 rows costs what its distinct experts
// cost, more than a decode row's k when its rows route apart.
struct ExpertTraffic {
  int64_t blocks = 0;         // MoE block calls (layers x forward passes)
  int64_t rows = 0;           // rows over those calls
  int64_t expert_reads = 0;   // distinct experts, summed over the calls
  int64_t max_per_block = 0;  // the most distinct experts one call read
  double experts_per_block() const {
    return blocks > 0 ? static_cast<double>(expert_reads) / static_cast<double>(blocks) : 0.0;
  }
};

// The traffic counted after `before` was taken (max_per_block: over the whole count).
inline ExpertTraffic traffic_since(const ExpertTraffic& now, const ExpertTraffic& before) {
  return {now.blocks - before.blocks, now.rows - before.rows, now.expert_reads - before.expert_reads,
          now.max_per_block};
}

// A sequence's state held by a device executor (model/device.h); opaque here.
class DeviceSequence {
 public:
  virtual ~DeviceSequence() = default;
  // A MoE model's experts read by this sequence's passes so far (counted on the device).
  virtual ExpertTraffic expert_traffic() const { return {}; }
};

class InferenceState {
 public:
  // `capacity`: the most positions this sequence will hold (prompt + generated + draft window).
  InferenceState(const ModelConfig& config, int64_t capacity);
  // A state whose caches live on a device (no host caches are allocated).
  InferenceState(int64_t capacity, std::unique_ptr<DeviceSequence> device);

  int64_t position() const { return position_; }  // tokens already processed
  // The last forward pass recorded for rollback: its first position and length (0 if none).
  int64_t window_start() const { return window_start_; }
  int64_t window_tokens() const { return window_tokens_; }
  int64_t capacity() const { return capacity_; }

  // Internal to the model forward.
  KvCache& kv(int64_t layer) { return kv_[static_cast<size_t>(layer)]; }
  DeltaNetState& delta(int64_t layer) { return delta_[static_cast<size_t>(layer)]; }
  void advance(int64_t n) { position_ += n; }
  void set_window(int64_t start, int64_t tokens) { window_start_ = start, window_tokens_ = tokens; }
  void set_position(int64_t position) { position_ = position; }
  DeviceSequence* device() const { return device_.get(); }
  // Calibration: forward passes on this (host) state add their products' inputs to `stats` (not owned;
  // nullptr: none).
  void set_input_statistics(InputStatistics* stats) { input_stats_ = stats; }
  InputStatistics* input_statistics() const { return input_stats_; }
  // Mixture-of-experts models: the experts this sequence's passes read (host passes count into it; a
  // device state's count is copied from the device first).
  ExpertTraffic& expert_traffic() {
    if (device_) expert_traffic_ = device_->expert_traffic();
    return expert_traffic_;
  }

 private:
  InputStatistics* input_stats_ = nullptr;
  ExpertTraffic expert_traffic_;
  int64_t capacity_;
  int64_t position_ = 0;
  int64_t window_start_ = 0;
  int64_t window_tokens_ = 0;
  std::vector<KvCache> kv_;           // indexed by layer (empty for linear-attention layers)
  std::vector<DeltaNetState> delta_;  // indexed by layer (empty for full-attention layers)
  std::unique_ptr<DeviceSequence> device_;
};

}  // namespace mtpx
