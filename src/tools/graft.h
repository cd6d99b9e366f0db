// `mtpx graft`: gives a trunk whose MTP head was dropped (a fine-tune, an abliterated build, an mlx-lm
// conversion) the head of another build of the same base model. The donor's mtp.* tensors go, as stored,
// into a sidecar `mtp.safetensors` next to links (or copies) of the trunk's files; config.json gains
// mtp_num_hidden_layers and the head's quantization entries. Nothing is grafted blind: the shapes,
// the quantization layout and the norm convention must match, and the head's teacher-forced acceptance on
// a built-in text is measured; a head that does not fit only costs time, so below the threshold the
// graft is refused.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "model/qwen35.h"

namespace mtpx::tools {

struct GraftOptions {
  double min_acceptance = 0.30;
  bool force = false;  // keep the result below the threshold, and replace --out
};

// Writes the grafted model to `out` (atomically) and returns the report: checks, acceptance, files.
// Throws mtpx::Error (kInvalidInput) with the reason when the head does not fit.
nlohmann::json graft_mtp_head(const std::filesystem::path& trunk, const std::filesystem::path& donor,
                              const std::filesystem::path& out, const GraftOptions& options);

// Teacher-forced greedy acceptance of the head's first draft position over `tokens`: the fraction of
// positions t where argmax(head(h_t, x_{t+1})) equals the trunk's own argmax at t+1, i.e. where a greedy
// draft would be accepted.
double teacher_forced_acceptance(const Model& model, const std::vector<int32_t>& tokens);

// The built-in evaluation text of graft (and its id form for models without a tokenizer).
std::vector<int32_t> graft_sample_ids(const std::filesystem::path& model_dir, int64_t vocab_size);

}  // namespace mtpx::tools
