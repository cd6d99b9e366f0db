// The engine against transformers 5.17 on tiny random Qwen3.5 checkpoints (tests/fixtures, made by
// scripts/make_reference_fixtures.py): logits and post-norm hidden states at every prompt position,
// greedy continuations, and step-by-step decode logits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <span>
#include <vector>

#include "decode/generate.h"
#include "io/safetensors.h"
#include "model/mtp_head.h"
#include "model/qwen35.h"
#include "test_paths.h"
#include "test_util.h"

namespace mtpx {
namespace {

using test_paths::kFixtures;
constexpr double kRelTolerance = 1e-3;
constexpr float kMarginForGreedy = 1e-3f;

template <typename T>
std::vector<T> read(const SafetensorsFile& f, const std::string& name) {
  const TensorView* t = f.find(name);
  if (t == nullptr) throw std::runtime_error("reference lacks " + name);
  std::vector<T> out(t->nbytes / sizeof(T));
  std::memcpy(out.data(), t->data, t->nbytes);
  return out;
}

using testing_util::relative_error;

void expect_rows_close(const std::vector<float>& got, const std::vector<float>& want, int64_t width,
                       const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t r = 0; r < want.size() / static_cast<size_t>(width); ++r) {
    const double e =
        relative_error(&got[r * static_cast<size_t>(width)], &want[r * static_cast<size_t>(width)], width);
    EXPECT_LT(e, kRelTolerance) << what << " row " << r;
  }
}

class ReferenceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = kFixtures / GetParam();
    model_ = Model::load(dir_);
    reference_ = std::make_unique<SafetensorsFile>(dir_ / "reference.safetensors");
  }
  std::filesystem::path dir_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<SafetensorsFile> reference_;
};

TEST_P(ReferenceTest, PrefillLogitsAndHiddenMatchTransformers) {
  const int64_t V = model_->config().vocab_size, H = model_->config().hidden_size;
  for (int i = 0; i < 3; ++i) {
    const std::string s = std::to_string(i);
    auto prompt = read<int32_t>(*reference_, "prompt_" + s);
    InferenceState state = model_->new_state(static_cast<int64_t>(prompt.size()));
    ForwardResult r;
    model_->forward(state, prompt, LogitRows::kAll, r);
    expect_rows_close(r.logits, read<float>(*reference_, "logits_" + s), V, "logits, prompt " + s);
    expect_rows_close(r.hidden, read<float>(*reference_, "hidden_" + s), H, "hidden, prompt " + s);
  }
}

TEST_P(ReferenceTest, GreedyContinuationAndDecodeLogitsMatchTransformers) {
  const int64_t V = model_->config().vocab_size;
  for (int i = 0; i < 3; ++i) {
    const std::string s = std::to_string(i);
    auto prompt = read<int32_t>(*reference_, "prompt_" + s);
    auto greedy = read<int32_t>(*reference_, "greedy_" + s);
    auto margin = read<float>(*reference_, "greedy_margin_" + s);
    auto decode_logits = read<float>(*reference_, "decode_logits_" + s);

    GenerateOptions options;
    options.max_tokens = static_cast<int64_t>(greedy.size());
    options.sampler.temperature = 0.0;
    GenerateResult g = generate(*model_, prompt, options);
    ASSERT_EQ(g.tokens.size(), greedy.size());
    // Identical while the reference's top-2 margin leaves no doubt; after a near-tie the paths may part.
    for (size_t t = 0; t < greedy.size() && margin[t] > kMarginForGreedy; ++t)
      ASSERT_EQ(g.tokens[t], greedy[t]) << "prompt " << s << " step " << t;

    // Teacher-forced decode along the reference's tokens: logits per step.
    InferenceState state = model_->new_state(static_cast<int64_t>(prompt.size() + greedy.size()));
    ForwardResult r;
    model_->forward(state, prompt, LogitRows::kLast, r);
    std::vector<float> steps(r.logits);
    for (size_t t = 0; t + 1 < greedy.size(); ++t) {
      model_->forward(state, std::span<const int32_t>(&greedy[t], 1), LogitRows::kLast, r);
      steps.insert(steps.end(), r.logits.begin(), r.logits.end());
    }
    expect_rows_close(steps, decode_logits, V, "decode logits, prompt " + s);
  }
}

// Step-by-step decoding reproduces the prefill logits of the same sequence (recurrent vs chunked
// DeltaNet, cached vs uncached attention).
TEST_P(ReferenceTest, DecodeStepsEqualPrefill) {
  const int64_t V = model_->config().vocab_size;
  auto prompt = read<int32_t>(*reference_, "prompt_2");
  InferenceState full = model_->new_state(static_cast<int64_t>(prompt.size()));
  ForwardResult all;
  model_->forward(full, prompt, LogitRows::kAll, all);
  InferenceState step = model_->new_state(static_cast<int64_t>(prompt.size()));
  ForwardResult r;
  for (size_t t = 0; t < prompt.size(); ++t) {
    model_->forward(step, std::span<const int32_t>(&prompt[t], 1), LogitRows::kLast, r);
    ASSERT_LT(relative_error(r.logits.data(), &all.logits[t * static_cast<size_t>(V)], V), kRelTolerance)
        << "position " << t;
  }
}

// A prompt prefilled in two parts (the second one on top of a cache and a DeltaNet state, as a second
// chat turn does: chunked delta rule from a non-zero state, blocked attention at an offset) matches the
// reference logits of the whole prompt.
TEST_P(ReferenceTest, PrefillOnTopOfAContextMatchesTransformers) {
  const int64_t V = model_->config().vocab_size;
  auto prompt = read<int32_t>(*reference_, "prompt_2");
  auto want = read<float>(*reference_, "logits_2");
  const size_t split = 20;
  ASSERT_GE(prompt.size(), split + static_cast<size_t>(cpu::kGemmMinRows)) << "second part must be a prefill";
  InferenceState state = model_->new_state(static_cast<int64_t>(prompt.size()));
  ForwardResult first, second;
  model_->forward(state, std::span<const int32_t>(prompt.data(), split), LogitRows::kAll, first);
  model_->forward(state, std::span<const int32_t>(prompt.data() + split, prompt.size() - split),
                  LogitRows::kAll, second);
  std::vector<float> got = first.logits;
  got.insert(got.end(), second.logits.begin(), second.logits.end());
  expect_rows_close(got, want, V, "two-part prefill logits");
}

// Whether a verify window of k+1 tokens after `context` computes bit-for-bit what k+1 single decode steps
// compute, for k = 1..max_k: the property that makes greedy speculative decoding lossless.
void expect_verify_windows_equal_decode_steps(const Model& model, std::span<const int32_t> context,
                                              std::span<const int32_t> window, size_t max_k) {
  const int64_t V = model.config().vocab_size, H = model.config().hidden_size;
  for (size_t k = 1; k <= max_k && k < window.size(); ++k) {
    std::span<const int32_t> tokens(window.data(), k + 1);
    InferenceState a = model.new_state(static_cast<int64_t>(context.size() + tokens.size()));
    InferenceState b = model.new_state(static_cast<int64_t>(context.size() + tokens.size()));
    ForwardResult ra, rb;
    model.forward(a, context, LogitRows::kLast, ra);
    model.forward(b, context, LogitRows::kLast, rb);
    model.forward(a, tokens, LogitRows::kAll, ra);
    for (size_t t = 0; t < tokens.size(); ++t) {
      model.forward(b, tokens.subspan(t, 1), LogitRows::kLast, rb);
      ASSERT_EQ(0, std::memcmp(rb.logits.data(), &ra.logits[t * static_cast<size_t>(V)],
                               static_cast<size_t>(V) * sizeof(float)))
          << "context " << context.size() << " K=" << k << " row " << t;
      ASSERT_EQ(0, std::memcmp(rb.hidden.data(), &ra.hidden[t * static_cast<size_t>(H)],
                               static_cast<size_t>(H) * sizeof(float)))
          << "context " << context.size() << " K=" << k << " row " << t;
    }
  }
}

TEST_P(ReferenceTest, VerifyWindowIsBitwiseEqualToDecodeSteps) {
  expect_verify_windows_equal_decode_steps(*model_, read<int32_t>(*reference_, "prompt_1"),
                                           read<int32_t>(*reference_, "greedy_1"), 8);
}

// The same over long contexts, where attention reads each key and value row once per KV head for all the
// window's queries, split among the threads by keys and by dims (attention.cpp): a window that crosses
// 512 keys (its decode steps before that take the per-query loop) and windows over 700 and 1100 keys.
TEST_P(ReferenceTest, VerifyWindowOverALongContextIsBitwiseEqualToDecodeSteps) {
  const auto prompt = read<int32_t>(*reference_, "prompt_1");
  const auto window = read<int32_t>(*reference_, "greedy_1");
  for (size_t length : {508, 700, 1100}) {
    std::vector<int32_t> context(length);
    for (size_t i = 0; i < length; ++i) context[i] = prompt[i % prompt.size()];
    expect_verify_windows_equal_decode_steps(*model_, context, window, 4);
    if (HasFatalFailure()) return;
  }
}

// Teacher-forced MTP head (spec §6.3): row t from the trunk hidden at t and the prompt token at t+1, at
// position t, against a PyTorch implementation of the spec built on transformers' decoder layer.
TEST_P(ReferenceTest, TeacherForcedMtpLogitsMatchThePyTorchHead) {
  if (reference_->find("mtp_logits_0") == nullptr) GTEST_SKIP() << "no MTP head in this fixture";
  ASSERT_NE(model_->mtp(), nullptr) << model_->mtp_status().detail;
  const int64_t V = model_->config().vocab_size, H = model_->config().hidden_size;
  for (int i = 1; i < 3; ++i) {
    const std::string s = std::to_string(i);
    auto prompt = read<int32_t>(*reference_, "prompt_" + s);
    const int64_t n = static_cast<int64_t>(prompt.size());
    InferenceState state = model_->new_state(n);
    ForwardResult r;
    model_->forward(state, prompt, LogitRows::kNone, r);
    MtpState head(model_->config(), n);
    MtpResult m;
    mtp_forward(*model_, head, std::span<const float>(r.hidden.data(), static_cast<size_t>((n - 1) * H)),
                std::span<const int32_t>(prompt.data() + 1, static_cast<size_t>(n - 1)), 0, LogitRows::kAll,
                m);
    expect_rows_close(m.logits, read<float>(*reference_, "mtp_logits_" + s), V, "mtp logits, prompt " + s);
    expect_rows_close(m.hidden, read<float>(*reference_, "mtp_hidden_" + s), H, "mtp hidden, prompt " + s);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ReferenceTest,
                         ::testing::Values("wrapper_sharded_tied_bf16", "causal_untied_single_bf16",
                                           "causal_f16_interval2", "causal_mtp_untied_f32",
                                           "moe_wrapper_fused_bf16", "moe_causal_mtp_f32"));

}  // namespace
}  // namespace mtpx
