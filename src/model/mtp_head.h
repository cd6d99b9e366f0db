// The native MTP head's forward pass (spec §6). Row t combines the trunk's post-final-norm hidden h_t
// with the embedding of the token at t+1, runs one full-attention decoder layer at RoPE position t with
// the head's own KV cache, and predicts the token at t+2 through the shared lm_head.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "model/qwen35.h"
#include "model/state.h"

namespace mtpx {

// The head's own attention cache, separate from every trunk cache.
class MtpState {
 public:
  MtpState(const ModelConfig& config, int64_t capacity);
  MtpState(int64_t capacity, std::unique_ptr<DeviceSequence> device);  // caches on a device
  KvCache& kv() { return kv_; }
  int64_t capacity() const { return capacity_; }
  DeviceSequence* device() const { return device_.get(); }
  // As InferenceState::set_input_statistics, for the head's products.
  void set_input_statistics(InputStatistics* stats) { input_stats_ = stats; }
  InputStatistics* input_statistics() const { return input_stats_; }
  // A MoE head: the experts its passes read (as InferenceState::expert_traffic).
  ExpertTraffic& expert_traffic() {
    if (device_) expert_traffic_ = device_->expert_traffic();
    return expert_traffic_;
  }

 private:
  InputStatistics* input_stats_ = nullptr;
  ExpertTraffic expert_traffic_;
  int64_t capacity_;
  KvCache kv_;
  std::unique_ptr<DeviceSequence> device_;
};

// The head's state for `model`, on the device its forward passes run on.
MtpState new_mtp_state(const Model& model, int64_t capacity);

struct MtpResult {
  std::vector<float> hidden;    // [T, H] post-mtp.norm, the last row only ([1, H]) with LogitRows::kLast
                                // (fed back as the hidden of a chained draft step)
  std::vector<float> logits;    // [rows, V] (empty on a device when argmax was asked for)
  std::vector<int32_t> argmax;  // [rows] with argmax_limit > 0, as ForwardResult::argmax
  LogitCandidates candidates;   // as ForwardResult::candidates
};

// hidden: [T, H] trunk (or chained head) hiddens; tokens: [T] the tokens at positions p0+1 .. p0+T;
// rows p0 .. p0+T-1 of the head's KV cache are (over)written. Requires model.mtp().
// logit_ids > 0 (a draft vocabulary): the logits of ids < logit_ids only, [rows, logit_ids], from that
// many rows of the lm_head. argmax_limit > 0 and sample: as Model::forward's (over ids < min(logit_ids,
// limit)).
// On a device, for the head's rows sampled whole (CandidateRequest::rows_on_request): keep_head_logits keeps
// the last logit row of its last pass in slot `slot` (< kKeptLogitRows: one per draft of a step), and
// fetch_head_logits copies a kept row's logits of `ids`, or the whole row (logit ids long) when `ids` is
// empty (DeviceExecutor::keep_logits, fetch_logits).
void keep_head_logits(const Model& model, MtpState& state, int64_t slot);
void fetch_head_logits(const Model& model, const MtpState& state, int64_t slot, std::span<const int32_t> ids,
                       std::vector<float>& values);
// A draw below a kept row's top ids on the device (BelowDraw, DeviceExecutor::draw_below).
int32_t draw_below_head(const Model& model, const MtpState& state, int64_t slot, const BelowDraw& draw);

void mtp_forward(const Model& model, MtpState& state, std::span<const float> hidden,
                 std::span<const int32_t> tokens, int64_t p0, LogitRows rows, MtpResult& result,
                 int64_t logit_ids = 0, int64_t argmax_limit = 0, CandidateRequest sample = {});

// One sequence's part of a batched head pass (mtp_forward_batch): mtp_forward()'s arguments.
struct MtpSequenceForward {
  MtpState* state = nullptr;
  std::span<const float> hidden;
  std::span<const int32_t> tokens;
  int64_t p0 = 0;
  LogitRows rows = LogitRows::kLast;
  MtpResult* result = nullptr;
  int64_t logit_ids = 0;
  int64_t argmax_limit = 0;
  CandidateRequest sample = {};
};
inline void mtp_forward(const Model& model, const MtpSequenceForward& f) {
  mtp_forward(model, *f.state, f.hidden, f.tokens, f.p0, f.rows, *f.result, f.logit_ids, f.argmax_limit,
              f.sample);
}
// Throws what mtp_forward() would throw for `f`'s input (no head, a hidden of the wrong size, a context
// overflow, a state of another device), before anything runs.
void check_mtp_forward(const Model& model, const MtpSequenceForward& f);
// mtp_forward() of several sequences in one pass, as Model::forward_batch does for the trunk: fc, the head's
// layer and the lm_head over all rows in invariant blocks, attention per sequence on its own cache. Each
// result is bit-identical to the sequence's own mtp_forward(). Passes of kGemmMinRows rows or more (a
// prompt's) and device passes run one by one.
void mtp_forward_batch(const Model& model, std::span<const MtpSequenceForward> batch);

}  // namespace mtpx
