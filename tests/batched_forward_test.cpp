// Model::forward_batch: several sequences' rows in one pass, each bit-identical to its own forward() (the
// batch invariance that lets a server share its steps between requests without changing any of them).
#include <gtest/gtest.h>

#include <array>
#include <memory>
#include <vector>

#include "model/mtp_head.h"
#include "model/qwen35.h"
#include "model/shapes.h"
#include "test_paths.h"
#include "util/error.h"

namespace mtpx {
namespace {

struct Sequence {
  InferenceState state;
  ForwardResult result;
};

std::vector<int32_t> tokens_of(int64_t seed, int64_t n, int64_t vocab) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(static_cast<int32_t>((seed * 7919 + i * 104729) % (vocab - 3)));
  return t;
}

// Runs the same steps on two copies of each sequence, one by one (forward) and together (forward_batch), and
// checks that every result is bit-identical, rollbacks included.
void expect_batch_equals_solo(const Model& model, const std::vector<int64_t>& prompt_lengths,
                              const std::vector<std::vector<int64_t>>& steps_rows) {
  const int64_t V = model.config().vocab_size;
  const size_t n = prompt_lengths.size();
  std::vector<std::unique_ptr<Sequence>> solo, together;
  for (size_t i = 0; i < n; ++i) {
    solo.push_back(std::make_unique<Sequence>(Sequence{model.new_state(256), {}}));
    together.push_back(std::make_unique<Sequence>(Sequence{model.new_state(256), {}}));
    const auto prompt = tokens_of(static_cast<int64_t>(i) + 1, prompt_lengths[i], V);
    model.forward(solo[i]->state, prompt, LogitRows::kLast, solo[i]->result);
    model.forward(together[i]->state, prompt, LogitRows::kLast, together[i]->result);
  }
  for (size_t step = 0; step < steps_rows.size(); ++step) {
    std::vector<std::vector<int32_t>> tokens(n);
    std::vector<SequenceForward> batch;
    for (size_t i = 0; i < n; ++i) {
      const int64_t T = steps_rows[step][i];
      tokens[i] = tokens_of(static_cast<int64_t>(100 * step + i), T, V);
      const bool window = T > 1 && T < 16;  // a verify window, rolled back below
      const LogitRows rows = T > 1 ? LogitRows::kAll : LogitRows::kLast;
      model.forward(solo[i]->state, tokens[i], rows, solo[i]->result, window, V);
      batch.push_back({.state = &together[i]->state,
                       .tokens = tokens[i],
                       .rows = rows,
                       .result = &together[i]->result,
                       .record_window = window,
                       .argmax_limit = V});
    }
    model.forward_batch(batch);
    for (size_t i = 0; i < n; ++i) {
      SCOPED_TRACE(::testing::Message() << "step " << step << ", sequence " << i);
      EXPECT_EQ(together[i]->result.hidden, solo[i]->result.hidden);
      EXPECT_EQ(together[i]->result.logits, solo[i]->result.logits);
      EXPECT_EQ(together[i]->result.argmax, solo[i]->result.argmax);
      EXPECT_EQ(together[i]->state.position(), solo[i]->state.position());
      // A rejected draft: keep part of the window, on both copies.
      const int64_t T = steps_rows[step][i];
      if (T > 1 && T < 16) {
        model.rollback(solo[i]->state, 1 + (T - 1) / 2);
        model.rollback(together[i]->state, 1 + (T - 1) / 2);
      }
    }
  }
  // What the states hold now: one more decode row each, solo, compared.
  for (size_t i = 0; i < n; ++i) {
    const std::vector<int32_t> next = {static_cast<int32_t>(i + 5)};
    model.forward(solo[i]->state, next, LogitRows::kLast, solo[i]->result);
    model.forward(together[i]->state, next, LogitRows::kLast, together[i]->result);
    EXPECT_EQ(together[i]->result.logits, solo[i]->result.logits) << "sequence " << i;
  }
}

TEST(ForwardBatch, ShippedModelRowsAreBitIdenticalToEachSequenceAlone) {
  const auto model = Model::load(test_paths::kDefaultModel);
  // Decode rows, verify windows of 3 and 5 rows, 24 rows in all at the last step (two invariant blocks),
  // and a prompt-length pass (20 rows) that runs alone.
  expect_batch_equals_solo(*model, {7, 30, 1, 12}, {{1, 1, 1, 1}, {3, 1, 5, 2}, {5, 5, 9, 5}, {1, 20, 3, 1}});
}

TEST(ForwardBatch, MixtureOfExpertsRowsAreBitIdenticalToEachSequenceAlone) {
  const auto model = Model::synthetic(shape_config("tiny-moe"), 3);
  expect_batch_equals_solo(*model, {4, 9, 2}, {{1, 1, 1}, {4, 2, 6}, {1, 7, 1}});
}

// The head's passes: mtp_forward_batch against each sequence's own mtp_forward, on heads prefilled alike.
// rows_and_vocab[step][i] = {T, logit_ids, rows (0 kLast, 1 kAll, 2 kNone)}.
void expect_head_batch_equals_solo(const Model& model, int64_t sequences,
                                   const std::vector<std::vector<std::array<int64_t, 3>>>& steps) {
  const int64_t H = model.config().hidden_size, V = model.config().vocab_size;
  std::vector<MtpState> solo, together;
  std::vector<int64_t> position(static_cast<size_t>(sequences), 0);
  for (int64_t i = 0; i < sequences; ++i) {
    solo.push_back(new_mtp_state(model, 256));
    together.push_back(new_mtp_state(model, 256));
  }
  std::vector<MtpResult> solo_results(static_cast<size_t>(sequences)), together_results(solo_results.size());
  for (size_t step = 0; step < steps.size(); ++step) {
    std::vector<std::vector<int32_t>> tokens(static_cast<size_t>(sequences));
    std::vector<std::vector<float>> hidden(tokens.size());
    std::vector<MtpSequenceForward> batch;
    for (size_t i = 0; i < tokens.size(); ++i) {
      const auto [T, logit_ids, rows_kind] = steps[step][i];
      tokens[i] = tokens_of(static_cast<int64_t>(10 * step + i), T, V);
      for (int64_t k = 0; k < T * H; ++k)
        hidden[i].push_back(static_cast<float>(((k * 37 + static_cast<int64_t>(i)) % 101) - 50) / 25.0f);
      const LogitRows rows = rows_kind == 0   ? LogitRows::kLast
                             : rows_kind == 1 ? LogitRows::kAll
                                              : LogitRows::kNone;
      const MtpSequenceForward f{.state = &solo[i],
                                 .hidden = hidden[i],
                                 .tokens = tokens[i],
                                 .p0 = position[i],
                                 .rows = rows,
                                 .result = &solo_results[i],
                                 .logit_ids = logit_ids,
                                 .argmax_limit = logit_ids > 0 ? logit_ids : V};
      mtp_forward(model, f);
      MtpSequenceForward g = f;
      g.state = &together[i];
      g.result = &together_results[i];
      batch.push_back(g);
      position[i] += T;
    }
    mtp_forward_batch(model, batch);
    for (size_t i = 0; i < tokens.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "step " << step << ", sequence " << i);
      EXPECT_EQ(together_results[i].hidden, solo_results[i].hidden);
      EXPECT_EQ(together_results[i].logits, solo_results[i].logits);
      EXPECT_EQ(together_results[i].argmax, solo_results[i].argmax);
    }
  }
}

TEST(ForwardBatch, MtpHeadRowsAreBitIdenticalToEachSequenceAlone) {
  const auto model = Model::load(test_paths::kDefaultModel);
  // A prompt pass (20 rows, alone), draft rows with a draft vocabulary, commit windows, all logits, none.
  expect_head_batch_equals_solo(*model, 4,
                                {{{{20, 0, 0}}, {{6, 4096, 0}}, {{3, 0, 1}}, {{1, 4096, 0}}},
                                 {{{1, 4096, 0}}, {{1, 4096, 0}}, {{3, 0, 0}}, {{2, 0, 2}}},
                                 {{{3, 4096, 0}}, {{4, 0, 1}}, {{1, 2048, 0}}, {{1, 4096, 0}}}});
  const auto moe = Model::synthetic(shape_config("tiny-moe"), 3, /*with_mtp=*/true);
  expect_head_batch_equals_solo(
      *moe, 3, {{{{5, 0, 0}}, {{1, 0, 0}}, {{3, 0, 1}}}, {{{1, 0, 0}}, {{2, 0, 0}}, {{1, 0, 0}}}});
}

TEST(ForwardBatch, OneStateTwiceIsAnError) {
  const auto model = Model::load(test_paths::kDefaultModel);
  InferenceState state = model->new_state(32);
  ForwardResult a, b;
  const std::vector<int32_t> t = {1};
  const SequenceForward batch[] = {{.state = &state, .tokens = t, .result = &a},
                                   {.state = &state, .tokens = t, .result = &b}};
  EXPECT_THROW(model->forward_batch(batch), Error);
}

}  // namespace
}  // namespace mtpx
