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

void check_mtp_forward(const Model& model, const MtpSequenceForward& f) {
  if (model.mtp() == nullptr) invalid_input("the model has no MTP head: {}", model.mtp_status().detail);
  const int64_t T = static_cast<int64_t>(f.tokens.size()), H = model.config().hidden_size;
  if (static_cast<int64_t>(f.hidden.size()) != T * H)
    invalid_input("mtp_forward: {} hidden values for {} tokens", f.hidden.size(), T);
  if (f.p0 + T > f.state->capacity())
    invalid_input("MTP context overflow: {} positions, capacity {}", f.p0 + T, f.state->capacity());
  if (model.executor() != nullptr && f.state->device() == nullptr)
    invalid_input("mtp_forward: a host MTP state with a device model");
}

namespace {

// fc([norm_e(embed(x)) ; norm_h(h)]) of T rows into x [T, H] (spec §6.1: the embedding first).
void head_input(const Model& model, std::span<const float> hidden, std::span<const int32_t> tokens,
                std::vector<float>& joined) {
  const MtpWeights& head = *model.mtp();
  const int64_t T = static_cast<int64_t>(tokens.size()), H = model.config().hidden_size;
  const float eps = static_cast<float>(model.config().rms_norm_eps);
  joined.resize(static_cast<size_t>(T * 2 * H));  // [T, 2H]
  for (int64_t t = 0; t < T; ++t) {
    float* e = &joined[static_cast<size_t>(t * 2 * H)];
    cpu::weight_row_to_f32(model.weights().embed_tokens, tokens[static_cast<size_t>(t)], e);
    cpu::rms_norm(e, head.pre_fc_norm_embedding.data(), eps, H, e);
    cpu::rms_norm(&hidden[static_cast<size_t>(t * H)], head.pre_fc_norm_hidden.data(), eps, H, e + H);
  }
}

// The lm_head a pass reads: a draft vocabulary is its first logit_ids rows (a view: rows are contiguous in
// every weight layout, codes and scales alike).
cpu::WeightMatrix head_lm_head(const Model& model, int64_t logit_ids) {
  cpu::WeightMatrix lm_head = model.weights().lm_head;
  if (logit_ids > 0) lm_head.rows = std::min(logit_ids, lm_head.rows);
  return lm_head;
}

}  // namespace

void mtp_forward_batch(const Model& model, std::span<const MtpSequenceForward> batch) {
  for (size_t i = 0; i < batch.size(); ++i) {
    check_mtp_forward(model, batch[i]);
    for (size_t j = 0; j < i; ++j)
      if (batch[j].state == batch[i].state) invalid_input("mtp_forward_batch: one state in two sequences");
  }
  std::vector<const MtpSequenceForward*> together;
  for (const MtpSequenceForward& f : batch) {
    if (model.executor() != nullptr || static_cast<int64_t>(f.tokens.size()) >= cpu::kGemmMinRows ||
        f.state->input_statistics() != nullptr)
      mtp_forward(model, f);
    else
      together.push_back(&f);
  }
  if (together.empty()) return;
  model.prepare_cpu_kernels();
  const MtpWeights& head = *model.mtp();
  const ModelConfig& c = model.config();
  const int64_t H = c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);

  std::vector<SequenceSlice> slices;
  int64_t N = 0;
  for (const MtpSequenceForward* f : together) {
    const int64_t T = static_cast<int64_t>(f->tokens.size());
    slices.push_back({.kv = &f->state->kv(),
                      .p0 = f->p0,
                      .first_row = N,
                      .t_count = T,
                      .traffic = &f->state->expert_traffic()});
    N += T;
  }
  std::vector<float> joined, joined_all(static_cast<size_t>(N * 2 * H));
  for (size_t i = 0; i < together.size(); ++i) {
    head_input(model, together[i]->hidden, together[i]->tokens, joined);
    std::copy(joined.begin(), joined.end(), joined_all.begin() + slices[i].first_row * 2 * H);
  }
  std::vector<float> x(static_cast<size_t>(N * H));
  for_invariant_row_blocks(N, [&](int64_t r0, int64_t n) {
    cpu::matmul(head.fc, &joined_all[static_cast<size_t>(r0 * 2 * H)], n, &x[static_cast<size_t>(r0 * H)]);
  });
  // Every row of the layer, also where mtp_forward computes only the last (kLast): rows are computed alone,
  // so the last row's result is the same.
  decoder_layer_forward_batch(head.layer, c, slices, x.data(), N);

  // mtp.norm of the rows each sequence returns, then the lm_head: one product per draft vocabulary size.
  std::vector<std::pair<int64_t, int64_t>> logit_row_of(together.size());  // (first input row, count)
  std::vector<int64_t> vocab_sizes;
  for (size_t i = 0; i < together.size(); ++i) {
    const MtpSequenceForward& f = *together[i];
    const int64_t T = slices[i].t_count, out_rows = f.rows == LogitRows::kLast ? 1 : T;
    f.result->candidates = {};
    f.result->hidden.resize(static_cast<size_t>(out_rows * H));
    for (int64_t t = 0; t < out_rows; ++t)
      cpu::rms_norm(&x[static_cast<size_t>((slices[i].first_row + T - out_rows + t) * H)], head.norm.data(),
                    eps, H, &f.result->hidden[static_cast<size_t>(t * H)]);
    const int64_t rows = head_lm_head(model, f.logit_ids).rows;
    if (std::find(vocab_sizes.begin(), vocab_sizes.end(), rows) == vocab_sizes.end())
      vocab_sizes.push_back(rows);
  }
  for (const int64_t vocab : vocab_sizes) {
    std::vector<float> inputs;
    std::vector<size_t> members;
    for (size_t i = 0; i < together.size(); ++i) {
      const MtpSequenceForward& f = *together[i];
      if (head_lm_head(model, f.logit_ids).rows != vocab || f.rows == LogitRows::kNone) continue;
      members.push_back(i);
      inputs.insert(inputs.end(), f.result->hidden.begin(), f.result->hidden.end());
    }
    const int64_t L = static_cast<int64_t>(inputs.size()) / H;
    std::vector<float> logits(static_cast<size_t>(L * vocab));
    cpu::WeightMatrix view = model.weights().lm_head;  // its first `vocab` rows
    view.rows = vocab;
    for_invariant_row_blocks(L, [&](int64_t r0, int64_t n) {
      cpu::matmul(view, &inputs[static_cast<size_t>(r0 * H)], n, &logits[static_cast<size_t>(r0 * vocab)]);
    });
    int64_t row = 0;
    for (size_t i : members) {
      const MtpSequenceForward& f = *together[i];
      const int64_t n = static_cast<int64_t>(f.result->hidden.size()) / H;
      f.result->logits.assign(logits.begin() + row * vocab, logits.begin() + (row + n) * vocab);
      row += n;
    }
  }
  for (size_t i = 0; i < together.size(); ++i) {
    const MtpSequenceForward& f = *together[i];
    if (f.rows == LogitRows::kNone) f.result->logits.clear();
    const std::vector<float>& out = f.rows == LogitRows::kNone ? f.result->hidden : f.result->logits;
    if (!cpu::all_finite(out.data(), static_cast<int64_t>(out.size())))
      model.fail_non_finite(fmt::format("in the MTP head's {} at positions {}..{}",
                                        f.rows == LogitRows::kNone ? "hidden states" : "logits", f.p0,
                                        f.p0 + slices[i].t_count - 1));
    logit_row_argmax(f.result->logits, head_lm_head(model, f.logit_ids).rows, f.argmax_limit,
                     f.result->argmax);
  }
}

void mtp_forward(const Model& model, MtpState& state, std::span<const float> hidden,
                 std::span<const int32_t> tokens, int64_t p0, LogitRows rows, MtpResult& result,
                 int64_t logit_ids, int64_t argmax_limit, CandidateRequest sample) {
  check_mtp_forward(model, {.state = &state, .hidden = hidden, .tokens = tokens, .p0 = p0});
  const MtpWeights* head = model.mtp();
  const ModelConfig& c = model.config();
  const int64_t T = static_cast<int64_t>(tokens.size()), H = c.hidden_size;
  if (const DeviceExecutor* e = model.executor()) {
    if (state.input_statistics() != nullptr) invalid_input("input statistics are collected on the CPU only");
    e->mtp_forward(*state.device(), hidden, tokens, p0, rows, logit_ids, argmax_limit, sample, result.hidden,
                   result.logits, result.argmax, result.candidates);
    if (rows == LogitRows::kLast) result.hidden.erase(result.hidden.begin(), result.hidden.end() - H);
    if (holds_non_finite(result.argmax, result.candidates))
      model.fail_non_finite(fmt::format("in the MTP head's logits at positions {}..{}", p0, p0 + T - 1));
    return;
  }
  model.prepare_cpu_kernels();
  result.candidates = {};  // the CPU returns the logits

  // u = fc([norm_e(embed(x)) ; norm_h(h)])   (embedding first, hidden second: spec §6.1)
  std::vector<float> joined;
  head_input(model, hidden, tokens, joined);
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
  const cpu::WeightMatrix lm_head = head_lm_head(model, logit_ids);
  norm_and_logits(c, lm_head, head->norm, &x[static_cast<size_t>((T - out_rows) * H)], out_rows, rows,
                  result.hidden, result.logits);
  const std::vector<float>& out = rows == LogitRows::kNone ? result.hidden : result.logits;
  if (!cpu::all_finite(out.data(), static_cast<int64_t>(out.size())))
    model.fail_non_finite(fmt::format("in the MTP head's {} at positions {}..{}",
                                      rows == LogitRows::kNone ? "hidden states" : "logits", p0, p0 + T - 1));
  logit_row_argmax(result.logits, lm_head.rows, argmax_limit, result.argmax);
}

}  // namespace mtpx
