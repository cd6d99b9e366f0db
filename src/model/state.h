// Per-sequence inference state: the attention KV caches and the Gated DeltaNet conv/recurrent states.
// Rollback (for speculative verification) is part of this interface: KV is truncated by length; the
// DeltaNet states are restored from snapshots taken after each position of a verify window.
#pragma once

#include <cstdint>
#include <vector>

#include "io/model_config.h"

namespace mtpx {

// Attention cache of one full-attention layer: post-norm, post-RoPE keys and values.
struct KvCache {
  std::vector<float> keys;    // [capacity, nkv, D]
  std::vector<float> values;  // [capacity, nkv, D]
};

// Gated DeltaNet state of one linear-attention layer (§4.1, §4.2).
struct DeltaNetState {
  std::vector<float> conv;  // [Kc-1, conv_dim]  the last Kc-1 pre-conv qkv rows (zeros at start)
  std::vector<float> ssm;   // [Hv, Dk, Dv]      recurrent state S, float32
};

class InferenceState {
 public:
  // `capacity`: the most positions this sequence will hold (prompt + generated + draft window).
  InferenceState(const ModelConfig& config, int64_t capacity);

  int64_t position() const { return position_; }  // tokens already processed
  int64_t capacity() const { return capacity_; }
  void reset();

  // Internal to the model forward.
  KvCache& kv(int64_t layer) { return kv_[static_cast<size_t>(layer)]; }
  DeltaNetState& delta(int64_t layer) { return delta_[static_cast<size_t>(layer)]; }
  void advance(int64_t n) { position_ += n; }

 private:
  int64_t capacity_;
  int64_t position_ = 0;
  std::vector<KvCache> kv_;           // indexed by layer (empty for linear-attention layers)
  std::vector<DeltaNetState> delta_;  // indexed by layer (empty for full-attention layers)
};

}  // namespace mtpx
