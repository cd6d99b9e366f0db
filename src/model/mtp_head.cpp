#include "model/mtp_head.h"

#include <algorithm>
#include <utility>

#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"
#include "model/input_statistics.h"
#include "util/error.h"

namespace mtpx {

// The cache starts empty and grows as positions are used (gated_attention_forward).
MtpState::MtpState(const ModelConfig&, int64_t capacity) : capacity_(capacity) {}

MtpState::MtpState(int64_t capacity, std::unique_ptr<DeviceSequence> device)
    : capacity_(capacity), device_(std::move(device)) {}

MtpState new_mtp_state(const Model& model, int64_t capacity) {
  if (const DeviceExecutor* e = model.executor()) return MtpState(capacity, e->new_mtp_sequence(capacity));
  return MtpState(model.config(), capacity);
}

void keep_head_logits(const Model& model, MtpState& state, int64_t slot) {
  const DeviceExecutor* e = model.executor();
  if (e == nullptr || state.device() == nullptr)
    fail(ErrorKind::kInternal, "keep_head_logits: the CPU's passes return their logits");
  e->keep_logits(*state.device(), slot);
}

void fetch_head_logits(const Model& model, const MtpState& state, int64_t slot, std::span<const int32_t> ids,
                       std::vector<float>& values) {
  const DeviceExecutor* e = model.executor();
  if (e == nullptr || state.device() == nullptr)
    fail(ErrorKind::kInternal, "fetch_head_logits: the CPU's passes return their logits");
  e->fetch_logits(*state.device(), DeviceLogitRow{.index = slot, .kept = true}, ids, values);
}

int32_t draw_below_head(const Model& model, const MtpState& state, int64_t slot, const BelowDraw& draw) {
  const DeviceExecutor* e = model.executor();
  if (e == nullptr || state.device() == nullptr)
    fail(ErrorKind::kInternal, "draw_below_head: the CPU's passes return their logits");
  return e->draw_below(*state.device(), DeviceLogitRow{.index = slot, .kept = true}, draw);
}

void mtp_forward(const Model& model, MtpState& state, std::span<const float> hidden,
                 std::span<const int32_t> tokens, int64_t p0, LogitRows rows, MtpResult& result,
                 int64_t logit_ids, int64_t argmax_limit, CandidateRequest sample) {
  const MtpWeights* head = model.mtp();
  if (head == nullptr) invalid_input("the model has no MTP head: {}", model.mtp_status().detail);
  const ModelConfig& c = model.config();
  const ModelWeights& w = model.weights();
  const int64_t T = static_cast<int64_t>(tokens.size()), H = c.hidden_size;
  if (static_cast<int64_t>(hidden.size()) != T * H)
    invalid_input("mtp_forward: {} hidden values for {} tokens", hidden.size(), T);
  if (p0 + T > state.capacity())
    invalid_input("MTP context overflow: {} positions, capacity {}", p0 + T, state.capacity());
  if (const DeviceExecutor* e = model.executor()) {
    if (state.input_statistics() != nullptr) invalid_input("input statistics are collected on the CPU only");
    if (state.device() == nullptr) invalid_input("mtp_forward: a host MTP state with a device model");
    e->mtp_forward(*state.device(), hidden, tokens, p0, rows, logit_ids, argmax_limit, sample, result.hidden,
                   result.logits, result.argmax, result.candidates);
    if (rows == LogitRows::kLast) result.hidden.erase(result.hidden.begin(), result.hidden.end() - H);
    if (holds_non_finite(result.argmax, result.candidates))
      model.fail_non_finite(fmt::format("in the MTP head's logits at positions {}..{}", p0, p0 + T - 1));
    return;
  }
  model.prepare_cpu_kernels();
  result.candidates = {};  // the CPU returns the logits
  const float eps = static_cast<float>(c.rms_norm_eps);

  // u = fc([norm_e(embed(x)) ; norm_h(h)])   (embedding first, hidden second: spec §6.1)
  std::vector<float> joined(static_cast<size_t>(T * 2 * H));  // [T, 2H]
  for (int64_t t = 0; t < T; ++t) {
    float* e = &joined[static_cast<size_t>(t * 2 * H)];
    cpu::weight_row_to_f32(w.embed_tokens, tokens[static_cast<size_t>(t)], e);
    cpu::rms_norm(e, head->pre_fc_norm_embedding.data(), eps, H, e);
    cpu::rms_norm(&hidden[static_cast<size_t>(t * H)], head->pre_fc_norm_hidden.data(), eps, H, e + H);
  }
  std::vector<float> x(static_cast<size_t>(T * H));  // [T, H]
  cpu::matmul(head->fc, joined.data(), T, x.data());
  InputStatistics* stats = state.input_statistics();
  if (stats != nullptr) stats->add(head->fc, joined.data(), T);
  // One full-attention decoder layer (the trunk's code) with the head's own KV cache, then mtp.norm and
  // the shared lm_head. With kLast the rows before the last only write the cache: nothing reads their
  // outputs, and the last row's result is the same either way (batch invariance).
  const int64_t out_rows = rows == LogitRows::kLast ? 1 : T;
  decoder_layer_forward(head->layer, c, &state.kv(), nullptr, p0, x.data(), T, false, out_rows, stats,
                        &state.expert_traffic());
  // A draft vocabulary reads the first logit_ids rows of the lm_head (a view: rows are contiguous in
  // every weight layout, codes and scales alike).
  cpu::WeightMatrix lm_head = w.lm_head;
  if (logit_ids > 0) lm_head.rows = std::min(logit_ids, lm_head.rows);
  norm_and_logits(c, lm_head, head->norm, &x[static_cast<size_t>((T - out_rows) * H)], out_rows, rows,
                  result.hidden, result.logits);
  const std::vector<float>& out = rows == LogitRows::kNone ? result.hidden : result.logits;
  if (!cpu::all_finite(out.data(), static_cast<int64_t>(out.size())))
    model.fail_non_finite(fmt::format("in the MTP head's {} at positions {}..{}",
                                      rows == LogitRows::kNone ? "hidden states" : "logits", p0, p0 + T - 1));
  logit_row_argmax(result.logits, lm_head.rows, argmax_limit, result.argmax);
}

}  // namespace mtpx
