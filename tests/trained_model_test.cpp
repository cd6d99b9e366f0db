// The shipped model (models/default, trained by scripts/train_small_model.py): the engine against
// transformers on held-out code, and MTP acceptance with its trained head.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backend/cpu/matmul.h"
#include "decode/generate.h"
#include "decode/sampler.h"
#include "io/model_config.h"
#include "io/safetensors.h"
#include "model/input_statistics.h"
#include "model/mtp_head.h"
#include "model/qwen35.h"
#include "server/chat_template.h"
#include "test_paths.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace mtpx {
namespace {

using test_paths::kDefaultModel;
using test_paths::kSource;
const std::filesystem::path kData = kSource / "tests" / "fixtures" / "trained_default";

std::vector<float> floats(const SafetensorsFile& f, const std::string& name) {
  const TensorView& t = *f.find(name);
  std::vector<float> v(t.nbytes / 4);
  std::memcpy(v.data(), t.data, t.nbytes);
  return v;
}

nlohmann::json samples() {
  std::ifstream in(kData / "heldout_samples.json");
  return nlohmann::json::parse(in)["samples"];
}

TEST(TrainedModel, LogitsHiddenAndMtpLogitsMatchTransformersOnHeldOutCode) {
  auto model = Model::load(kDefaultModel);
  ASSERT_NE(model->mtp(), nullptr);
  SafetensorsFile ref(kData / "reference.safetensors");
  const int64_t V = model->config().vocab_size, H = model->config().hidden_size;
  for (int i = 0; i < 2; ++i) {
    const std::string s = std::to_string(i);
    const TensorView& p = *ref.find("prompt_" + s);
    std::vector<int32_t> prompt(p.nbytes / 4);
    std::memcpy(prompt.data(), p.data, p.nbytes);
    const int64_t n = static_cast<int64_t>(prompt.size());
    InferenceState state = model->new_state(n);
    ForwardResult r;
    model->forward(state, prompt, LogitRows::kAll, r);
    EXPECT_LT(testing_util::worst_row_relative_error(r.logits, floats(ref, "logits_" + s), V), 1e-3);
    EXPECT_LT(testing_util::worst_row_relative_error(r.hidden, floats(ref, "hidden_" + s), H), 1e-3);
    MtpState head(model->config(), n);
    MtpResult m;
    mtp_forward(*model, head, std::span<const float>(r.hidden.data(), static_cast<size_t>((n - 1) * H)),
                std::span<const int32_t>(prompt.data() + 1, static_cast<size_t>(n - 1)), 0, LogitRows::kAll,
                m);
    EXPECT_LT(testing_util::worst_row_relative_error(m.logits, floats(ref, "mtp_logits_" + s), V), 1e-3);
  }
}

// A head pass asked for its last row's logits computes only that row through the layer; the rows before it
// only write keys and values. The last row and the cache it leaves must be what a pass of every row gives:
// bitwise for windows (the row kernels are batch-invariant), to float rounding for a prompt pass (whose
// all-rows form attends in GEMM blocks).
// On a CPU whose kernels are AMX tile products, the first CPU pass packs every bf16 matrix of the trunk and
// the head into tiles: word (p, n) of the tile of block b and k-block kb holds w[16b + n, 32kb + 2p] in its
// low half and w[16b + n, 32kb + 2p + 1] in its high half, rows past the matrix are zero. Loading alone
// packs nothing (a model bound for a GPU never needs the copy); elsewhere nothing is packed.
TEST(TrainedModel, TheFirstCpuPassPacksEveryBf16MatrixIntoAmxTilesWhereTheKernelsUseThem) {
  auto model = Model::load(kDefaultModel);
  EXPECT_EQ(model->weights().lm_head.amx_tiles, nullptr);
  {
    InferenceState state = model->new_state(4);
    ForwardResult r;
    const int32_t token = 5;
    model->forward(state, std::span<const int32_t>(&token, 1), LogitRows::kLast, r);
  }
  std::vector<const cpu::WeightMatrix*> matrices{&model->weights().lm_head, &model->mtp()->fc};
  auto add_layer = [&](const LayerWeights& l) {
    if (l.attention)
      for (const cpu::WeightMatrix* w :
           {&l.attention->q_proj, &l.attention->k_proj, &l.attention->v_proj, &l.attention->o_proj})
        matrices.push_back(w);
    if (l.delta_net)
      for (const cpu::WeightMatrix* w :
           {&l.delta_net->in_proj_qkv, &l.delta_net->in_proj_z, &l.delta_net->in_proj_b,
            &l.delta_net->in_proj_a, &l.delta_net->out_proj})
        matrices.push_back(w);
    for (const cpu::WeightMatrix* w : {&l.mlp.gate_proj, &l.mlp.up_proj, &l.mlp.down_proj})
      matrices.push_back(w);
  };
  for (const LayerWeights& l : model->weights().layers) add_layer(l);
  add_layer(model->mtp()->layer);
  ASSERT_EQ(matrices.size(), 2u + 6 * 8 + 2 * 7 + 7);
  std::mt19937_64 rng(7);
  for (const cpu::WeightMatrix* w : matrices) {
    ASSERT_EQ(w->type, cpu::WeightType::kBF16);
    if (!cpu::amx_small_m_path()) {
      EXPECT_EQ(w->amx_tiles, nullptr);
      continue;
    }
    ASSERT_NE(w->amx_tiles, nullptr) << w->rows << " x " << w->cols;
    const auto* bits = static_cast<const uint16_t*>(w->data);
    const int64_t k_blocks = w->cols / 32, blocks = (w->rows + 31) / 32 * 2;
    for (int i = 0; i < 200; ++i) {
      const int64_t b = static_cast<int64_t>(rng() % static_cast<uint64_t>(blocks)),
                    kb = static_cast<int64_t>(rng() % static_cast<uint64_t>(k_blocks));
      const int64_t p = static_cast<int64_t>(rng() % 16), n = static_cast<int64_t>(rng() % 16);
      const int64_t row = 16 * b + n, k = 32 * kb + 2 * p;
      const uint32_t expected = row < w->rows ? static_cast<uint32_t>(bits[row * w->cols + k]) |
                                                    static_cast<uint32_t>(bits[row * w->cols + k + 1]) << 16
                                              : 0u;
      ASSERT_EQ(w->amx_tiles[((b * k_blocks + kb) * 16 + p) * 16 + n], expected)
          << w->rows << " x " << w->cols << " b=" << b << " kb=" << kb << " p=" << p << " n=" << n;
    }
  }
}

TEST(TrainedModel, MtpLastRowPassEqualsTheLastRowOfAFullPass) {
  auto model = Model::load(kDefaultModel);
  const auto prompt = samples()[0]["prompt_ids"].get<std::vector<int32_t>>();
  const int64_t n = static_cast<int64_t>(prompt.size()), H = model->config().hidden_size;
  ASSERT_GE(n, 24);
  InferenceState state = model->new_state(n);
  ForwardResult r;
  model->forward(state, prompt, LogitRows::kAll, r);
  auto hidden = [&](int64_t from, int64_t count) {
    return std::span<const float>(&r.hidden[static_cast<size_t>(from * H)], static_cast<size_t>(count * H));
  };
  auto tokens = [&](int64_t from, int64_t count) {  // row t pairs h_t with the token at t + 1
    return std::span<const int32_t>(&prompt[static_cast<size_t>(from + 1)], static_cast<size_t>(count));
  };
  const int64_t prefix = n - 5;  // rows [0, prefix) as a prompt pass, then windows of 3 and 1 rows
  MtpState last_only(model->config(), n), every_row(model->config(), n);
  MtpResult a, b;
  mtp_forward(*model, last_only, hidden(0, prefix), tokens(0, prefix), 0, LogitRows::kLast, a);
  mtp_forward(*model, every_row, hidden(0, prefix), tokens(0, prefix), 0, LogitRows::kAll, b);
  ASSERT_EQ(a.hidden.size(), static_cast<size_t>(H));
  const std::vector<float> b_last_logits(b.logits.end() - static_cast<int64_t>(a.logits.size()),
                                         b.logits.end());
  EXPECT_LT(
      testing_util::worst_row_relative_error(a.logits, b_last_logits, static_cast<int64_t>(a.logits.size())),
      1e-5);
  for (auto [from, count] : {std::pair<int64_t, int64_t>{prefix, 3}, {prefix + 3, 1}}) {
    mtp_forward(*model, last_only, hidden(from, count), tokens(from, count), from, LogitRows::kLast, a);
    mtp_forward(*model, every_row, hidden(from, count), tokens(from, count), from, LogitRows::kAll, b);
    ASSERT_EQ(a.hidden.size(), static_cast<size_t>(H));
    ASSERT_EQ(b.hidden.size(), static_cast<size_t>(count * H));
    EXPECT_EQ(
        0, std::memcmp(a.hidden.data(), &b.hidden[static_cast<size_t>((count - 1) * H)], H * sizeof(float)))
        << count << " rows";
    ASSERT_EQ(b.logits.size(), count * a.logits.size());
    EXPECT_EQ(0, std::memcmp(a.logits.data(), &b.logits[(count - 1) * a.logits.size()],
                             a.logits.size() * sizeof(float)))
        << count << " rows";
  }
}

// Calibration statistics: every product of the trunk and the head records its inputs (one entry per
// matrix), and a matrix's entry is the mean square of each input column (checked for the lm_head against
// the pass's own hidden states; the head's fc has one per column of its [embedding ; hidden] input).
TEST(TrainedModel, InputStatisticsAreTheMeanSquaresOfEachProductsInputs) {
  auto model = Model::load(kDefaultModel);
  const auto prompt = samples()[0]["prompt_ids"].get<std::vector<int32_t>>();
  const int64_t n = static_cast<int64_t>(prompt.size()), H = model->config().hidden_size;
  InputStatistics stats;
  InferenceState state = model->new_state(n);
  state.set_input_statistics(&stats);
  ForwardResult r;
  model->forward(state, prompt, LogitRows::kNone, r);
  std::vector<double> want(static_cast<size_t>(H));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t k = 0; k < H; ++k)
      want[static_cast<size_t>(k)] += std::pow(r.hidden[static_cast<size_t>(t * H + k)], 2);
  const std::vector<float> got = stats.mean_squares(model->weights().lm_head);
  ASSERT_EQ(got.size(), static_cast<size_t>(H));
  for (int64_t k = 0; k < H; ++k)
    EXPECT_NEAR(got[static_cast<size_t>(k)], want[static_cast<size_t>(k)] / static_cast<double>(n),
                1e-5 * (1 + want[static_cast<size_t>(k)] / static_cast<double>(n)));
  // Per layer: DeltaNet layers 4 input projections + out_proj, attention layers q/k/v/o, MLPs 3; lm_head.
  size_t products = 1;
  for (const LayerWeights& l : model->weights().layers) products += (l.delta_net ? 5 : 4) + 3;
  EXPECT_EQ(stats.matrices(), products);
  // The head: fc, its attention layer's 4 and its MLP's 3 more matrices.
  MtpState head(model->config(), n);
  head.set_input_statistics(&stats);
  MtpResult m;
  mtp_forward(*model, head, std::span<const float>(r.hidden.data(), static_cast<size_t>((n - 1) * H)),
              std::span<const int32_t>(prompt.data() + 1, static_cast<size_t>(n - 1)), 0, LogitRows::kNone,
              m);
  EXPECT_EQ(stats.matrices(), products + 8);
  EXPECT_EQ(stats.mean_squares(model->mtp()->fc).size(), static_cast<size_t>(2 * H));
  EXPECT_TRUE(stats.mean_squares(cpu::WeightMatrix{}).empty());  // never multiplied
}

TEST(TrainedModel, GreedyContinuationsMatchTransformers) {
  auto model = Model::load(kDefaultModel);
  for (const auto& sample : samples()) {
    auto prompt = sample["prompt_ids"].get<std::vector<int32_t>>();
    auto want = sample["greedy_ids"].get<std::vector<int32_t>>();
    auto margins = sample["greedy_margins"].get<std::vector<double>>();
    GenerateOptions o;
    o.max_tokens = static_cast<int64_t>(want.size());
    o.sampler.temperature = 0.0;
    // The reference ran transformers' generate with min_new_tokens = its length, which set the logit of the
    // model config's eos id (<|endoftext|>) to -inf but left <|im_end|>, which the chat-trained model emits
    // after a finished function. The engine runs over the whole vocabulary with no stop ids, and the
    // comparison ends at the reference's first special token (the specials are the last three ids): what
    // follows it is no longer code, and there the reference's masking makes the two differ.
    const int32_t first_special = model->config().vocab_size - 3;
    GenerateResult r = generate(*model, prompt, o);
    for (size_t t = 0; t < want.size() && margins[t] > 1e-3; ++t) {
      ASSERT_EQ(r.tokens[t], want[t]) << sample["file"] << " step " << t;
      if (want[t] >= first_special) break;
    }
  }
}

// First-position greedy acceptance >= 60% on held-out code (issue target); with the sampler the model
// ships (T 0.7, top-p 0.95, top-k 20) acceptance stays near greedy, not collapsed: rejection sampling on
// identically truncated p and q accepts with probability sum_x min(p(x), q(x)), where comparing two
// independent samples would accept with sum_x p(x) q(x). Measured: greedy 0.915, sampled 0.809.
TEST(TrainedModel, MtpAcceptanceIsHighAndSamplingDoesNotCollapseIt) {
  auto model = Model::load(kDefaultModel);
  int64_t drafted[2] = {0, 0}, accepted[2] = {0, 0};
  for (const auto& sample : samples()) {
    auto prompt = sample["prompt_ids"].get<std::vector<int32_t>>();
    for (int sampled = 0; sampled < 2; ++sampled) {
      GenerateOptions o;
      o.max_tokens = 48;
      o.draft = 1;
      o.sampler = sampled ? SamplerParams{.temperature = 0.7, .top_k = 20, .top_p = 0.95}
                          : SamplerParams{.temperature = 0.0};
      o.seed = 17;
      GenerateResult r = generate(*model, prompt, o);
      drafted[sampled] += r.stats.mtp.drafted;
      accepted[sampled] += r.stats.mtp.accepted;
      if (!sampled) {
        GenerateOptions plain = o;
        plain.draft = 0;
        EXPECT_EQ(r.tokens, generate(*model, prompt, plain).tokens) << sample["file"];
      }
    }
  }
  const double greedy = static_cast<double>(accepted[0]) / static_cast<double>(drafted[0]);
  const double sampled = static_cast<double>(accepted[1]) / static_cast<double>(drafted[1]);
  std::printf("acceptance: greedy %.3f, sampled %.3f over %lld / %lld drafts\n", greedy, sampled,
              static_cast<long long>(drafted[0]), static_cast<long long>(drafted[1]));
  EXPECT_GE(greedy, 0.60);
  EXPECT_GE(sampled, greedy - 0.15);
  EXPECT_GE(sampled, 0.60);
}

// ---- Behaviour: what a newcomer sees first (issue 43). Properties, not exact text.

// Share of the lines of `text` (of 12 characters or more, indentation aside) that repeat an earlier line.
double repeated_line_share(const std::string& text) {
  std::set<std::string> seen;
  int64_t lines = 0, repeats = 0;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    line.erase(0, line.find_first_not_of(" \t"));
    // Short lines (")", "else:", "return None", "```") repeat in any code; a degenerate answer repeats
    // a substantive one.
    if (line.size() >= 12) {
      ++lines;
      if (!seen.insert(line).second) ++repeats;
    }
    start = end + 1;
  }
  return lines > 0 ? static_cast<double>(repeats) / static_cast<double>(lines) : 0.0;
}

struct ChatAnswer {
  std::string text;
  bool stopped = false;  // ended by <|im_end|> within the bound
  int64_t tokens = 0;
};

// Requests written for this test (none is taken from the training files): the README's example, bare
// signatures, instructions and a docstring, as a user would type them.
const std::vector<std::string> kChatRequests = {
    "def fib(n):",
    "def is_prime(n):",
    "Write a Python function `reverse_words(sentence)` that returns the words of a sentence in reverse "
    "order.",
    "Write a Python function `clamp(x, lo, hi)` that limits x to the range [lo, hi].",
    "Return the number of vowels in a string.\nName the function `count_vowels`.",
    "def flatten(nested):\n    \"\"\"Flatten a list of lists into one list.\"\"\"",
    "Write a Python function `median(values)` that returns the median of a list of numbers.",
    "Check whether a string is a palindrome, ignoring case.\nName the function `is_palindrome`.",
};

ChatAnswer answer_chat(const Model& model, const Tokenizer& tokenizer, const server::ChatTemplate& chat,
                       const std::string& request, const SamplerParams& sampler, uint64_t seed) {
  const nlohmann::ordered_json messages =
      nlohmann::ordered_json::array({{{"role", "user"}, {"content", request}}});
  const std::string prompt = chat.apply(messages, nullptr, nlohmann::ordered_json::object(), true);
  GenerateOptions o;
  o.max_tokens = 320;
  o.sampler = sampler;
  o.seed = seed;
  o.draft = 2;
  const int32_t im_end = *tokenizer.token_to_id("<|im_end|>");
  o.stop_ids = {im_end, *tokenizer.token_to_id("<|endoftext|>")};
  o.vocab_limit = tokenizer.vocab_size();
  GenerateResult g = generate(model, tokenizer.encode(prompt), o);
  ChatAnswer a;
  a.tokens = static_cast<int64_t>(g.tokens.size());
  a.stopped = g.finish_reason == "stop" && !g.tokens.empty() && g.tokens.back() == im_end;
  if (!g.tokens.empty() && (g.tokens.back() == im_end)) g.tokens.pop_back();
  a.text = tokenizer.decode(g.tokens);
  return a;
}

// What a chat answer should be: it ended with <|im_end|> within the bound, it is a fenced block of code with
// a def, and it does not repeat itself.
bool is_good_answer(const ChatAnswer& a) {
  return a.stopped && a.text.find("```") != std::string::npos && a.text.find("def ") != std::string::npos &&
         repeated_line_share(a.text) <= 0.25;
}

// Whether the shipped model was trained on chat exchanges (scripts/train_small_model.py --chat-frac writes
// "chat" into its report). The model before that answers chat with junk: the chat tests wait for it.
bool shipped_model_has_chat_training() {
  std::ifstream in(kDefaultModel / "report.json");
  return in && nlohmann::json::parse(in).contains("chat");
}

TEST(ShippedModel, AnswersChatRequestsWithCodeThatEnds) {
  if (!shipped_model_has_chat_training())
    GTEST_SKIP() << "the shipped model has no chat training yet (issue 43; scripts/gpu_train_chat.sh)";
  auto model = Model::load(kDefaultModel);
  const Tokenizer tokenizer = Tokenizer::from_file(kDefaultModel / "tokenizer.json");
  const auto chat = server::ChatTemplate::from_model_dir(kDefaultModel);
  ASSERT_TRUE(chat.has_value());
  const SamplerParams sampled =
      sampler_defaults(load_generation_config(kDefaultModel / "generation_config.json"));
  const SamplerParams greedy{.temperature = 0.0};
  int sampled_good = 0, sampled_total = 0, greedy_stopped = 0;
  for (const std::string& request : kChatRequests) {
    SCOPED_TRACE(request);
    // The model's own sampler (T 0.7, top-p 0.95, top-k 20: what the server, the page and the README's
    // example use), four seeds: most answers are good, and every request gets a good one. The model before
    // chat training never ended an answer (it wrote code-like junk up to the bound).
    int good_here = 0;
    for (uint64_t seed : {1u, 2u, 3u, 4u}) {
      const ChatAnswer a = answer_chat(*model, tokenizer, *chat, request, sampled, seed);
      ++sampled_total;
      if (is_good_answer(a)) ++good_here;
    }
    sampled_good += good_here;
    EXPECT_GE(good_here, 1) << "no good answer in 4 seeds";
    // Greedy: an 8M-parameter model falls into loops on some requests under greedy decoding (Qwen's model
    // cards advise against greedy decoding for the same reason), but its answer is still a code block with
    // the function, and most answers end.
    const ChatAnswer g = answer_chat(*model, tokenizer, *chat, request, greedy, 0);
    EXPECT_EQ(g.text.rfind("```python\ndef ", 0), 0u) << g.text;
    if (g.stopped) ++greedy_stopped;
  }
  std::printf("chat answers: %d of %d sampled good, %d of %zu greedy ended\n", sampled_good, sampled_total,
              greedy_stopped, kChatRequests.size());
  EXPECT_GE(sampled_good, sampled_total * 3 / 4);
  EXPECT_GE(greedy_stopped * 2, static_cast<int>(kChatRequests.size()));
}

TEST(ShippedModel, CompletesABareSignatureInsteadOfEndingIt) {
  // A plain completion prompt that looks like a chat request (a signature alone, at the start of the text)
  // gets code, not an immediate end of text: a model trained to predict chat requests learned that such a
  // line ends with <|im_end|> and answered `mtpx generate --prompt "def fib(n):"` with nothing
  // (train_small_model.py: chat_request_weights).
  auto model = Model::load(kDefaultModel);
  const Tokenizer tokenizer = Tokenizer::from_file(kDefaultModel / "tokenizer.json");
  for (const std::string prompt : {"def fib(n):", "def quicksort(xs):", "def fibonacci(n):", "class Node:",
                                   "def is_prime(n):", "import os"}) {
    GenerateOptions o;
    o.max_tokens = 24;
    o.sampler.temperature = 0.0;
    o.stop_ids = {*tokenizer.token_to_id("<|im_end|>"), *tokenizer.token_to_id("<|endoftext|>")};
    const GenerateResult r = generate(*model, tokenizer.encode(prompt), o);
    EXPECT_EQ(r.finish_reason, "length") << prompt << ": " << tokenizer.decode(r.tokens);
  }
}

TEST(ShippedModel, CodeCompletionsDoNotDegenerate) {
  if (!shipped_model_has_chat_training())
    GTEST_SKIP() << "the shipped model has no chat training yet (issue 43; scripts/gpu_train_chat.sh)";
  // Plain completion of the held-out code prompts with the model's own sampler (what generate and the server
  // use by default), 128 tokens, four seeds: few repeated lines on average, and few completions that are
  // mostly repeats. Measured (scripts' share, 6 seeds): the model before chat training mean 0.234 with 11% of
  // completions above 0.6; the chat-trained one 0.178 and 5%.
  const Tokenizer tokenizer = Tokenizer::from_file(kDefaultModel / "tokenizer.json");
  auto model = Model::load(kDefaultModel);
  const SamplerParams sampled =
      sampler_defaults(load_generation_config(kDefaultModel / "generation_config.json"));
  double total = 0.0;
  int n = 0, mostly_repeats = 0;
  for (const auto& s : samples()) {
    for (uint64_t seed : {1u, 2u, 3u, 4u}) {
      GenerateOptions o;
      o.max_tokens = 128;
      o.sampler = sampled;
      o.seed = seed;
      o.vocab_limit = tokenizer.vocab_size();
      const std::vector<int32_t> prompt = s["prompt_ids"].get<std::vector<int32_t>>();
      const double share = repeated_line_share(tokenizer.decode(generate(*model, prompt, o).tokens));
      total += share;
      if (share > 0.6) ++mostly_repeats;
      ++n;
    }
  }
  ASSERT_GT(n, 0);
  std::printf("repeated-line share: mean %.3f, %d of %d completions above 0.6\n", total / n, mostly_repeats,
              n);
  EXPECT_LE(total / n, 0.22);
  EXPECT_LE(mostly_repeats * 10, n);
}

}  // namespace
}  // namespace mtpx
