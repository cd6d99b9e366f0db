// Where a model's forward passes run. The CPU path is the model's own code (qwen35.cpp and the block
// files); a device executor runs the same computation on an accelerator (the CUDA one is in
// cuda_executor.cpp). The executor holds its own copy of the weights in device memory and the per-sequence
// states (KV caches, DeltaNet states) live there too; the host side keeps positions and windows.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/decoder_layer.h"
#include "model/state.h"

namespace mtpx {

class Model;
struct ForwardResult;

// Sampling on a device: instead of [rows, V] logits (1 MB per row at Qwen's vocabulary), each row's
// candidates, the ids at the top of the row with their logits, which decide the sampler's truncation
// (decode/sampler.h: truncate(); the fields are its settings, so the device truncates the same way):
// - with top-k (0 < top_k < limit), its survivors: every id < limit whose logit is >= the k-th largest of
//   those (ties included). truncate_candidates() turns them into exactly what truncate() makes of the row.
// - without it, with top-p or min-p: every id whose logit is >= a threshold the device picks, plus the
//   row's rest mass: the sum of exp((logit - max) / temperature) over the ids < limit below it. The
//   candidates decide the result when top-p's prefix ends inside them (their mass >= top_p * total) or
//   min-p drops the weakest of them (every id below weighs no more). Where top-p's prefix ends below them
//   (min-p off, rows_on_request), the device also finds where (LogitCandidates::kept_below: the ids kept
//   below the candidates are those down to a logit, with their mass; the sampler lists them in part and draws
//   among them on the device). Any other row they do not decide comes back as logits (decided_by(),
//   decides_kept_below()).
// - with none of them (temperature alone, the row sampled whole) and rows_on_request: the same threshold
//   candidates and rest mass, and the logits stay on the device until its next pass
//   (DeviceExecutor::fetch_logits, keep_logits), for what reaches below the candidates. Without
//   rows_on_request such rows come back as logits.
struct CandidateRequest {
  int64_t limit = 0;  // ids < limit are eligible; 0: no request
  int64_t top_k = 0;
  double temperature = 1.0, top_p = 1.0, min_p = 0.0;
  bool rows_on_request = false;

  bool top_k_active() const { return top_k > 0 && top_k < limit; }
  bool whole_row() const { return !top_k_active() && top_p >= 1.0 && min_p <= 0.0; }
  bool active() const { return limit > 0 && (!whole_row() || rows_on_request); }
  // Top-p with neither top-k nor min-p: the only truncation whose ids kept below the candidates a device
  // can describe by one boundary logit (decides_kept_below()).
  bool top_p_alone() const { return !top_k_active() && top_p < 1.0 && min_p <= 0.0; }
  // Whether candidates with this mass (and the lowest of them weighing lowest_weight, the highest 1: the
  // weights exp((logit - max) / temperature)) decide top-p or min-p without the ids below them. A margin
  // of 1e-9 covers the different order of the sums here and in the sampler's truncation.
  bool decided_by(double candidate_mass, double rest_mass, double lowest_weight) const {
    constexpr double kMargin = 1e-9;
    if (rest_mass <= 0.0) return true;  // nothing below the candidates
    if (whole_row()) return rows_on_request;
    const bool top_p_inside =
        top_p < 1.0 && candidate_mass >= top_p * (candidate_mass + rest_mass) * (1.0 + kMargin);
    const bool min_p_drops = min_p > 0.0 && lowest_weight < min_p * (1.0 - kMargin);
    return top_p_inside || min_p_drops;
  }
  // Whether top-p keeps exactly the candidates and the ids below them whose logit is >= a boundary, when the
  // candidates weigh candidate_mass, the ids below and above the boundary above_mass, the `count` ids at
  // the boundary boundary_mass, and the row total: the prefix (ranked, ties by id; an id kept while the mass
  // before it is < top_p x total) keeps every id at the boundary and none below. The same margin as
  // decided_by() (a row within it comes back whole). min-p must be off (it would cut inside the kept ids
  // below).
  bool decides_kept_below(double candidate_mass, double above_mass, double boundary_mass, int64_t count,
                          double total) const {
    constexpr double kMargin = 1e-9;
    if (!top_p_alone() || count < 1) return false;
    const double end = top_p * total,
                 before_last = candidate_mass + above_mass +
                               boundary_mass * static_cast<double>(count - 1) / static_cast<double>(count);
    return before_last < end * (1.0 - kMargin) &&
           candidate_mass + above_mass + boundary_mass >= end * (1.0 + kMargin);
  }
};

// The ids a row keeps below its candidates where top-p's prefix ends there (CandidateRequest): those whose
// logit is >= at_least, weighing `mass` in all (each exp((logit - max) / T)); mass 0: none.
struct KeptBelow {
  float at_least = 0.0f;
  double mass = 0.0;
};

// Per row r, ids / logits [offsets[r], offsets[r + 1]) (any order), and for candidates below a threshold
// the row's rest mass (CandidateRequest; 0 for top-k survivors, where the rest plays no part). Empty when
// not asked for, or when a device sent the full logits instead (a request it does not serve, more tied
// candidates than it holds, or a row they do not decide).
struct LogitCandidates {
  std::vector<int64_t> offsets;
  std::vector<int32_t> ids;
  std::vector<float> logits;
  std::vector<double> rest_mass;      // per row
  std::vector<KeptBelow> kept_below;  // per row; empty where no row has any
  bool present() const { return !offsets.empty(); }
  int64_t rows() const { return present() ? static_cast<int64_t>(offsets.size()) - 1 : 0; }
  std::span<const int32_t> row_ids(int64_t r) const {
    return {ids.data() + offsets[static_cast<size_t>(r)],
            static_cast<size_t>(offsets[static_cast<size_t>(r) + 1] - offsets[static_cast<size_t>(r)])};
  }
  std::span<const float> row_logits(int64_t r) const {
    return {logits.data() + offsets[static_cast<size_t>(r)],
            static_cast<size_t>(offsets[static_cast<size_t>(r) + 1] - offsets[static_cast<size_t>(r)])};
  }
  double row_rest_mass(int64_t r) const {
    return rest_mass.empty() ? 0.0 : rest_mass[static_cast<size_t>(r)];
  }
  KeptBelow row_kept_below(int64_t r) const {
    return kept_below.empty() ? KeptBelow{} : kept_below[static_cast<size_t>(r)];
  }
};

// Whether a device pass reported NaN or Inf logits: an argmax of -1, or a candidates row ending at -1.
inline bool holds_non_finite(std::span<const int32_t> argmax, const LogitCandidates& candidates) {
  for (int32_t id : argmax)
    if (id < 0) return true;
  for (int64_t end : candidates.offsets)
    if (end < 0) return true;
  return false;
}

// A logit row on a device (DeviceExecutor::fetch_logits): row `index` of a sequence's last pass, or with
// `kept` its slot `index` (DeviceExecutor::keep_logits).
struct DeviceLogitRow {
  int64_t index = 0;
  bool kept = false;
};
inline constexpr int64_t kKeptLogitRows = 8;  // kMaxDraft (decode/generate.h)

// A draw among the ids of a row below its listed top ids (DeviceExecutor::draw_below): the ids < limit whose
// logit is < below and >= at_least, each weighing exp(logit * inv_temperature - max_scaled), in id order;
// the draw is the first id at which the running sum of the weights exceeds `weight` (decode/sampler.h:
// below_draw()).
struct BelowDraw {
  int64_t limit = 0;
  float below = 0.0f, at_least = -std::numeric_limits<float>::infinity();
  double inv_temperature = 0.0, max_scaled = 0.0, weight = 0.0;
};

class DeviceExecutor {
 public:
  virtual ~DeviceExecutor() = default;
  virtual std::string description() const = 0;  // "cuda: NVIDIA H200, sm_90, 139.8 GiB"
  virtual int64_t weight_bytes() const = 0;     // device memory holding weights
  // The most device memory seen in use, as the driver counts it (cudaMemGetInfo: this process's context,
  // weights, scratch and sequences, and any other process's), sampled after the upload and after each
  // sequence or scratch allocation (the moments it grows).
  virtual int64_t peak_device_bytes() const = 0;

  // A trunk sequence (KV caches + DeltaNet states) and an MTP-head sequence (its KV cache).
  virtual std::unique_ptr<DeviceSequence> new_sequence(int64_t capacity) const = 0;
  virtual std::unique_ptr<DeviceSequence> new_mtp_sequence(int64_t capacity) const = 0;

  // As Model::forward, at positions p0.. (validated by the caller). `record_window` keeps what
  // rollback needs.
  // argmax_limit > 0: only each logit row's argmax over ids < argmax_limit is copied back (-1 for a row
  // holding NaN or Inf), `logits` is left empty. sample.active(): each row's candidates instead of the
  // logits where the device serves the request and they decide every row (candidates.present(); a row
  // holding NaN or Inf gets offsets[r + 1] = -1), else the logits.
  virtual void forward(DeviceSequence& sequence, int64_t p0, std::span<const int32_t> tokens, LogitRows rows,
                       bool record_window, int64_t argmax_limit, CandidateRequest sample,
                       std::vector<float>& hidden, std::vector<float>& logits, std::vector<int32_t>& argmax,
                       LogitCandidates& candidates) const = 0;
  // Cuts the last recorded window (of window_tokens) back to its first `keep` tokens.
  virtual void rollback(DeviceSequence& sequence, int64_t window_tokens, int64_t keep) const = 0;
  // Logits of a row a device still holds, for sampling rows listed in part (CandidateRequest's
  // rows_on_request): row `index` of `sequence`'s last pass (forward() or, for a head sequence,
  // mtp_forward(); an mtpx::Error, kInternal, once another pass has run since), or with `kept` the row kept
  // in slot `index` (keep_logits). `ids` empty: the whole row, as long as that pass computed it; else the
  // logits of those ids (each < its length) in order. Into `values`.
  virtual void fetch_logits(const DeviceSequence& sequence, DeviceLogitRow row, std::span<const int32_t> ids,
                            std::vector<float>& values) const = 0;
  // A draw below a row's top ids (BelowDraw) from the row as fetch_logits finds it, on the device
  // (cuda::draw_below): a draw that lands below a row's listed ids without copying the row.
  virtual int32_t draw_below(const DeviceSequence& sequence, DeviceLogitRow row,
                             const BelowDraw& draw) const = 0;
  // Keeps the last logit row of `sequence`'s last pass in the sequence's slot `slot` (< kKeptLogitRows) for
  // fetch_logits, until the slot is kept over: the head's drafts of one step are sampled from rows of
  // successive passes, which the verify pass must still reach. A copy on the device; no host copy.
  virtual void keep_logits(DeviceSequence& sequence, int64_t slot) const = 0;
  // As mtp_forward (model/mtp_head.h): logits of ids < logit_ids only (0: all), from that many lm_head rows.
  virtual void mtp_forward(DeviceSequence& sequence, std::span<const float> hidden,
                           std::span<const int32_t> tokens, int64_t p0, LogitRows rows, int64_t logit_ids,
                           int64_t argmax_limit, CandidateRequest sample, std::vector<float>& hidden_out,
                           std::vector<float>& logits, std::vector<int32_t>& argmax,
                           LogitCandidates& candidates) const = 0;
};

// The CUDA executor for `model` (weights uploaded now). Throws mtpx::Error (kUnsupported) when mtpx was
// built without CUDA, no GPU is usable, or the model has something the CUDA kernels do not handle.
std::unique_ptr<DeviceExecutor> make_cuda_executor(const Model& model);

// True when this build has the CUDA backend compiled in.
bool cuda_compiled_in();

}  // namespace mtpx
