// Helpers of the GPU tests (cuda_test.cpp, cuda_moe_test.cpp): a model on the GPU or the reason there is
// none, and a deterministic prompt.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "model/qwen35.h"
#include "util/error.h"

namespace mtpx::testing_util {

// The model on the GPU, or nullptr with the reason in `why` (no CUDA build, no device).
inline std::unique_ptr<Model> on_gpu(const std::filesystem::path& dir, std::string& why) {
  auto model = Model::load(dir);
  try {
    model->use_device("cuda");
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kUnsupported) throw;
    why = e.what();
    return nullptr;
  }
  return model;
}

// `n` token ids spread over the model's vocabulary.
inline std::vector<int32_t> prompt_for(const Model& m, int64_t n) {
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i)
    ids.push_back(static_cast<int32_t>((i * 7919 + 13) % m.config().vocab_size));
  return ids;
}

}  // namespace mtpx::testing_util

// `var` = the model at `dir` on the GPU, or the test is skipped with the reason.
#define MTPX_GPU_MODEL(var, dir)                           \
  std::string why_##var;                                   \
  auto var = ::mtpx::testing_util::on_gpu(dir, why_##var); \
  if (!var) GTEST_SKIP() << why_##var;
