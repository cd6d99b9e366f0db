// The mixture-of-experts block (model/moe.h) on its own: configs, torch.topk's tie order, routing, and the
// batch invariance that keeps greedy MTP lossless on MoE models (a row's output is the same bits whichever
// rows share its pass and whichever experts they route to). Against transformers: reference_test.cpp's MoE
// fixtures.
#include "model/moe.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "cli_util.h"
#include "io/model_config.h"
#include "io/safetensors.h"
#include "model/qwen35.h"
#include "model/shapes.h"
#include "test_paths.h"
#include "util/bf16.h"
#include "util/error.h"
#include "util/libstdcxx_select.h"

namespace mtpx {
namespace {

using nlohmann::json;
using test_paths::kFixtures;

json moe_text_config() {
  return {{"model_type", "qwen3_5_moe_text"},
          {"vocab_size", 128},
          {"hidden_size", 32},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 2},
          {"num_key_value_heads", 1},
          {"head_dim", 16},
          {"linear_num_key_heads", 1},
          {"linear_num_value_heads", 2},
          {"linear_key_head_dim", 8},
          {"linear_value_head_dim", 8},
          {"num_experts", 6},
          {"num_experts_per_tok", 3},
          {"moe_intermediate_size", 16},
          {"shared_expert_intermediate_size", 24}};
}

TEST(MoeConfig, BothLayoutsParseWithoutIntermediateSize) {
  json causal = moe_text_config();
  causal["architectures"] = {"Qwen3_5MoeForCausalLM"};
  const ModelConfig c = parse_model_config(causal, "config.json");
  EXPECT_TRUE(c.is_moe());
  EXPECT_EQ(c.num_experts, 6);
  EXPECT_EQ(c.num_experts_per_tok, 3);
  EXPECT_EQ(c.moe_intermediate_size, 16);
  EXPECT_EQ(c.shared_expert_intermediate_size, 24);
  EXPECT_EQ(c.intermediate_size, 0);
  EXPECT_EQ(c.tensor_prefix, "model.");

  const json wrapper = {{"architectures", {"Qwen3_5MoeForConditionalGeneration"}},
                        {"model_type", "qwen3_5_moe"},
                        {"text_config", moe_text_config()}};
  const ModelConfig w = parse_model_config(wrapper, "config.json");
  EXPECT_TRUE(w.is_moe());
  EXPECT_EQ(w.architecture, "Qwen3_5MoeForConditionalGeneration");
  EXPECT_EQ(w.tensor_prefix, "model.language_model.");

  // No architectures: the model_type decides (mlx-lm writes qwen3_5_moe).
  json typed = moe_text_config();
  typed["model_type"] = "qwen3_5_moe";
  EXPECT_EQ(parse_model_config(typed, "config.json").architecture, "Qwen3_5MoeForCausalLM");
}

TEST(MoeConfig, BadExpertFieldsAreOneLineErrors) {
  auto error_of = [](const json& j) {
    try {
      parse_model_config(j, "config.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  json more_than_all = moe_text_config();
  more_than_all["num_experts_per_tok"] = 7;  // of 6
  EXPECT_NE(error_of(more_than_all).find("num_experts_per_tok"), std::string::npos);
  json zero = moe_text_config();
  zero["num_experts"] = 0;
  EXPECT_NE(error_of(zero).find("num_experts"), std::string::npos);
  json dense_layers = moe_text_config();
  dense_layers["mlp_only_layers"] = {0};
  EXPECT_NE(error_of(dense_layers).find("mlp_only_layers"), std::string::npos);
  json sparse_step = moe_text_config();
  sparse_step["decoder_sparse_step"] = 2;
  EXPECT_NE(error_of(sparse_step).find("decoder_sparse_step"), std::string::npos);
  json bad_type = moe_text_config();
  bad_type["moe_intermediate_size"] = "big";
  EXPECT_NE(error_of(bad_type).find("moe_intermediate_size"), std::string::npos);
  // An empty mlp_only_layers (Qwen3-MoE configs write one) asks for nothing.
  json empty = moe_text_config();
  empty["mlp_only_layers"] = json::array();
  EXPECT_EQ(error_of(empty), "(accepted)");
}

// torch.topk's choice among equal probabilities, recorded from torch on rows full of ties
// (scripts/make_reference_fixtures.py, moe_topk_ties), for both of its algorithms.
TEST(MoeRouting, TopkReproducesTorchTieOrder) {
  const SafetensorsFile f(kFixtures / "moe_topk_ties" / "ties.safetensors");
  int cases = 0;
  for (const auto& [name, probs] : f.tensors()) {
    if (!name.starts_with("probs_")) continue;
    const TensorView* indices = f.find("indices_" + name.substr(6));
    ASSERT_NE(indices, nullptr) << name;
    const int64_t rows = probs.shape[0], n = probs.shape[1], k = indices->shape[1];
    std::vector<float> p(static_cast<size_t>(rows * n));
    std::memcpy(p.data(), probs.data, p.size() * sizeof(float));
    std::vector<int32_t> want(static_cast<size_t>(rows * k));
    std::memcpy(want.data(), indices->data, want.size() * sizeof(int32_t));
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<int32_t> got(static_cast<size_t>(k));
      std::vector<float> values(static_cast<size_t>(k));
      topk_like_torch(&p[static_cast<size_t>(r * n)], n, k, got.data(), values.data());
      ASSERT_EQ(got, std::vector<int32_t>(want.begin() + r * k, want.begin() + (r + 1) * k))
          << name << " row " << r;
      ++cases;
    }
  }
  EXPECT_GT(cases, 100);
}

// The replica of libstdc++'s partial_sort / nth_element / sort that the CUDA router runs on tied rows
// (util/libstdcxx_select.h) leaves (value, index) pairs in exactly the order the real algorithms do, on
// inputs full of ties (values drawn from a handful), at the sizes torch.topk uses them for and past the
// sort's insertion threshold and the introselect's depth limit.
TEST(MoeRouting, LibstdcxxReplicaMovesElementsAsTheRealAlgorithms) {
  using Pair = std::pair<float, int64_t>;
  const auto before = [](const Pair& a, const Pair& b) {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  };
  // Each pair's index names it (NaN values compare unequal to themselves).
  const auto order = [](const std::vector<Pair>& v) {
    std::vector<int64_t> ids;
    for (const Pair& p : v) ids.push_back(p.second);
    return ids;
  };
  std::mt19937 rng(99);
  int compared = 0;
  for (int64_t n : {2, 3, 4, 5, 8, 17, 33, 64, 128, 256, 512, 1000}) {
    for (int distinct : {1, 2, 3, 7, 50, 100000}) {
      for (int trial = 0; trial < 6; ++trial) {
        std::uniform_int_distribution<int> pick(0, distinct - 1);
        std::vector<Pair> data(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i)
          data[static_cast<size_t>(i)] = {static_cast<float>(pick(rng)) / 8.0f, i};
        if (trial == 5 && n > 4) data[static_cast<size_t>(n / 3)].first = std::nanf("");
        for (int64_t k : {int64_t{1}, int64_t{2}, int64_t{8}, n / 2, n}) {
          if (k < 1 || k > n) continue;
          auto real = data, replica = data;
          std::partial_sort(real.begin(), real.begin() + k, real.end(), before);
          libstdcxx::partial_sort(replica.data(), k, n, before);
          ASSERT_EQ(order(real), order(replica)) << "partial_sort n " << n << " k " << k;
          real = data, replica = data;
          std::nth_element(real.begin(), real.begin() + (k - 1), real.end(), before);
          libstdcxx::nth_element(replica.data(), k - 1, n, before);
          ASSERT_EQ(order(real), order(replica)) << "nth_element n " << n << " k " << k;
          std::sort(real.begin(), real.begin() + k, before);
          libstdcxx::sort(replica.data(), k, before);
          ASSERT_EQ(order(real), order(replica)) << "sort n " << n << " k " << k;
          ++compared;
        }
      }
    }
  }
  // Sorted and reverse-sorted inputs of many equal keys (the partitions' worst cases: heap sort takes over).
  for (int64_t n : {40, 300, 2000}) {
    std::vector<Pair> data(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) data[static_cast<size_t>(i)] = {static_cast<float>(i % 3), i};
    for (bool reversed : {false, true}) {
      if (reversed) std::reverse(data.begin(), data.end());
      auto real = data, replica = data;
      std::sort(real.begin(), real.end(), before);
      libstdcxx::sort(replica.data(), n, before);
      ASSERT_EQ(order(real), order(replica)) << "sort n " << n;
      real = data, replica = data;
      std::nth_element(real.begin(), real.begin() + n / 2, real.end(), before);
      libstdcxx::nth_element(replica.data(), n / 2, n, before);
      ASSERT_EQ(order(real), order(replica)) << "nth_element n " << n;
    }
  }
  EXPECT_GT(compared, 1000);
}

// A MoE block with random bf16 weights that the test owns.
struct RandomMoe {
  std::vector<std::unique_ptr<uint16_t[]>> buffers;
  MoeWeights w;
  std::mt19937 rng{1234};

  cpu::WeightMatrix matrix(int64_t rows, int64_t cols, float scale) {
    auto b = std::make_unique<uint16_t[]>(static_cast<size_t>(rows * cols));
    std::normal_distribution<float> d(0.0f, scale);
    for (int64_t i = 0; i < rows * cols; ++i) b[static_cast<size_t>(i)] = f32_to_bf16(d(rng));
    cpu::WeightMatrix m{cpu::WeightType::kBF16, b.get(), rows, cols};
    buffers.push_back(std::move(b));
    return m;
  }

  RandomMoe(int64_t H, int64_t E, int64_t k, int64_t I, float router_scale) {
    const float s = 1.0f / std::sqrt(static_cast<float>(H));
    w.experts_per_token = k;
    w.router = matrix(E, H, router_scale);
    w.shared_expert = {matrix(I, H, s), matrix(I, H, s), matrix(H, I, s)};
    w.shared_expert_gate = matrix(1, H, s);
    for (int64_t e = 0; e < E; ++e) w.experts.push_back({matrix(I, H, s), matrix(I, H, s), matrix(H, I, s)});
  }
};

std::vector<float> random_rows(int64_t rows, int64_t H, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows * H));
  for (float& v : x) v = d(rng);
  return x;
}

// Every row of a pass equals the same row run alone, bit for bit.
void expect_rows_equal_alone(const MoeWeights& w, const std::vector<float>& x, int64_t T, int64_t H) {
  std::vector<float> together(static_cast<size_t>(T * H));
  moe_forward(w, x.data(), T, together.data());
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> alone(static_cast<size_t>(H));
    moe_forward(w, &x[static_cast<size_t>(t * H)], 1, alone.data());
    ASSERT_EQ(0, std::memcmp(alone.data(), &together[static_cast<size_t>(t * H)],
                             static_cast<size_t>(H) * sizeof(float)))
        << "row " << t << " of " << T;
  }
}

TEST(MoeBlock, EveryRowOfAWindowIsBitwiseItsRowAlone) {
  const int64_t H = 128, E = 16, k = 4, I = 64;
  RandomMoe moe(H, E, k, I, 0.3f);
  for (int64_t T : {2, 3, 5, 9}) {
    const auto x = random_rows(T, H, static_cast<uint32_t>(T));
    // The windows tried include a row with an expert no other row of the window uses.
    Routing r;
    route_tokens(moe.w, x.data(), T, r);
    std::vector<int> users(static_cast<size_t>(E));
    for (int32_t e : r.experts) ++users[static_cast<size_t>(e)];
    EXPECT_GT(std::count(users.begin(), users.end(), 1), 0) << "T=" << T;
    expect_rows_equal_alone(moe.w, x, T, H);
  }
}

// Whether a block runs its experts one per thread (several jobs per thread) or splits each product over
// the threads (many threads), every output is the same bits.
TEST(MoeBlock, ThreadCountsAndJobSplitsGiveTheSameBits) {
  const int64_t H = 128, E = 16, k = 4, I = 64;
  RandomMoe moe(H, E, k, I, 0.3f);
  const int saved = omp_get_max_threads();
  for (int64_t T : {1, 3, 20}) {
    const auto x = random_rows(T, H, 7 + static_cast<uint32_t>(T));
    std::vector<std::vector<float>> outs;
    for (int threads : {1, 2, 3, 8}) {
      omp_set_num_threads(threads);
      outs.emplace_back(static_cast<size_t>(T * H));
      moe_forward(moe.w, x.data(), T, outs.back().data());
    }
    omp_set_num_threads(saved);
    for (size_t i = 1; i < outs.size(); ++i) EXPECT_EQ(outs[0], outs[i]) << "T=" << T << " setting " << i;
  }
}

// A zero router gives every expert the same probability: every row then takes torch's tie order's k
// experts, so all rows of a window share them (the one-read-per-expert case), and each row still equals
// itself alone.
TEST(MoeBlock, AWindowWhoseRowsAllShareTheirExperts) {
  const int64_t H = 128, E = 16, k = 4, I = 64;
  RandomMoe moe(H, E, k, I, 0.0f);
  const int64_t T = 5;
  const auto x = random_rows(T, H, 99);
  Routing r;
  route_tokens(moe.w, x.data(), T, r);
  std::vector<int32_t> tie_order(static_cast<size_t>(k));
  std::vector<float> uniform(static_cast<size_t>(E), 1.0f / static_cast<float>(E)),
      values(static_cast<size_t>(k));
  topk_like_torch(uniform.data(), E, k, tie_order.data(), values.data());
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_EQ(std::vector<int32_t>(r.experts.begin() + t * k, r.experts.begin() + (t + 1) * k), tie_order);
    for (int64_t j = 0; j < k; ++j) EXPECT_FLOAT_EQ(r.weights[static_cast<size_t>(t * k + j)], 0.25f);
  }
  ExpertTraffic traffic;
  std::vector<float> out(static_cast<size_t>(T * H));
  moe_forward(moe.w, x.data(), T, out.data(), nullptr, &traffic);
  EXPECT_EQ(traffic.blocks, 1);
  EXPECT_EQ(traffic.rows, T);
  EXPECT_EQ(traffic.expert_reads, k);
  expect_rows_equal_alone(moe.w, x, T, H);
}

// The routing of a prompt's token does not depend on the prompt's length (router logits in runs of
// batch-invariant rows), and the weights are the renormalized top-k probabilities.
TEST(MoeBlock, RoutingOfALongPassEqualsRowByRow) {
  const int64_t H = 128, E = 16, k = 4, I = 64, T = 40;
  RandomMoe moe(H, E, k, I, 0.3f);
  const auto x = random_rows(T, H, 5);
  Routing all;
  route_tokens(moe.w, x.data(), T, all);
  for (int64_t t = 0; t < T; ++t) {
    Routing one;
    route_tokens(moe.w, &x[static_cast<size_t>(t * H)], 1, one);
    EXPECT_EQ(one.experts,
              std::vector<int32_t>(all.experts.begin() + t * k, all.experts.begin() + (t + 1) * k));
    EXPECT_EQ(0, std::memcmp(one.weights.data(), &all.weights[static_cast<size_t>(t * k)],
                             static_cast<size_t>(k) * sizeof(float)));
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) sum += one.weights[static_cast<size_t>(j)];
    EXPECT_NEAR(sum, 1.0, 1e-6);
    // The chosen experts are the k largest router logits (the probabilities' order), largest first.
    std::vector<float> logit(static_cast<size_t>(E));
    cpu::matmul(moe.w.router, &x[static_cast<size_t>(t * H)], 1, logit.data());
    std::vector<int32_t> by_logit(static_cast<size_t>(E));
    std::iota(by_logit.begin(), by_logit.end(), 0);
    std::stable_sort(by_logit.begin(), by_logit.end(), [&](int32_t a, int32_t b) {
      return logit[static_cast<size_t>(a)] > logit[static_cast<size_t>(b)];
    });
    EXPECT_EQ(one.experts, std::vector<int32_t>(by_logit.begin(), by_logit.begin() + k)) << "row " << t;
  }
}

// A synthetic MoE model end to end: its verify windows equal its decode steps bit for bit, and its passes
// count the experts they read.
TEST(MoeModel, VerifyWindowsEqualDecodeStepsAndTrafficIsCounted) {
  auto model = Model::synthetic(shape_config("tiny-moe"), 3, /*with_mtp=*/true);
  const int64_t V = model->config().vocab_size;
  const std::vector<int32_t> context = {5, 17, 300, 4000, 12, 9};
  const std::vector<int32_t> window = {77, 1024, 3, 3, 999};
  InferenceState a = model->new_state(16), b = model->new_state(16);
  ForwardResult ra, rb;
  model->forward(a, context, LogitRows::kLast, ra);
  model->forward(b, context, LogitRows::kLast, rb);
  const ExpertTraffic before = a.expert_traffic();
  EXPECT_EQ(before.blocks, model->config().num_layers);
  EXPECT_EQ(before.rows, model->config().num_layers * static_cast<int64_t>(context.size()));
  model->forward(a, window, LogitRows::kAll, ra, /*record_window=*/true);
  const ExpertTraffic& after = a.expert_traffic();
  const int64_t window_reads = after.expert_reads - before.expert_reads;
  const int64_t k = model->config().num_experts_per_tok;
  // At least k distinct experts per layer, at most every expert or every row's k.
  EXPECT_GE(window_reads, k * model->config().num_layers);
  EXPECT_LE(window_reads, std::min<int64_t>(model->config().num_experts, k * 5) * model->config().num_layers);
  for (size_t t = 0; t < window.size(); ++t) {
    model->forward(b, std::span<const int32_t>(&window[t], 1), LogitRows::kLast, rb);
    ASSERT_EQ(0, std::memcmp(rb.logits.data(), &ra.logits[t * static_cast<size_t>(V)],
                             static_cast<size_t>(V) * sizeof(float)))
        << "row " << t;
  }
}

// A copy of a MoE fixture whose tensors pass through `edit` (which may rename, reshape or drop them).
std::filesystem::path edited_moe_fixture(
    const std::filesystem::path& dir,
    const std::function<bool(std::string& name, std::vector<int64_t>& shape)>& edit) {
  const std::filesystem::path src = kFixtures / "moe_causal_mtp_f32";
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(src / "config.json", dir / "config.json");
  const SafetensorsFile file(src / "model.safetensors");
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<TensorToWrite> tensors;
  for (const auto& [name, t] : file.tensors()) {
    std::string n = name;
    std::vector<int64_t> shape = t.shape;
    if (!edit(n, shape)) continue;  // edits keep the element count: the bytes are the tensor's own
    tensors.push_back({n, t.dtype, shape, {t.data, t.nbytes}});
  }
  write_safetensors(dir / "model.safetensors", tensors);
  return dir;
}

std::string load_error(const std::filesystem::path& dir) {
  try {
    Model::load(dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "(loaded)";
}

// Missing or misshapen experts, in each layout, are one-line errors naming the tensor; a head whose MoE
// block is broken is reported (the trunk still runs).
TEST(MoeModel, MissingOrMisshapenExpertsAreNamed) {
  testing_util::TempDir tmp;
  // An expert of the trunk missing (per-expert layout).
  const std::string missing = load_error(edited_moe_fixture(tmp.path() / "a", [](std::string& n, auto&) {
    return n != "model.layers.2.mlp.experts.5.up_proj.weight";
  }));
  EXPECT_NE(missing.find("model.layers.2.mlp.experts.5.up_proj.weight"), std::string::npos) << missing;
  // No experts at all under a layer.
  const std::string none = load_error(edited_moe_fixture(tmp.path() / "b", [](std::string& n, auto&) {
    return n.find("model.layers.1.mlp.experts.") == std::string::npos;
  }));
  EXPECT_NE(none.find("model.layers.1.mlp."), std::string::npos) << none;
  EXPECT_NE(none.find("no experts"), std::string::npos) << none;
  // A router of the wrong width.
  const std::string router = load_error(edited_moe_fixture(tmp.path() / "c", [](std::string& n, auto& shape) {
    if (n == "model.layers.0.mlp.gate.weight") shape = {shape[1], shape[0]};
    return true;
  }));
  EXPECT_NE(router.find("model.layers.0.mlp.gate.weight"), std::string::npos) << router;
  for (const std::string& e : {missing, none, router}) EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  // The head's fused experts stacked for another expert count: the head is incompatible, the trunk loads.
  auto model = Model::load(edited_moe_fixture(tmp.path() / "d", [](std::string& n, auto& shape) {
    if (n == "mtp.layers.0.mlp.experts.gate_up_proj") shape = {shape[0] * 2, shape[1] / 2, shape[2]};
    return true;
  }));
  EXPECT_EQ(model->mtp(), nullptr);
  EXPECT_EQ(model->mtp_status().kind, MtpStatus::Kind::kIncompatible);
  EXPECT_NE(model->mtp_status().detail.find("mtp.layers.0.mlp.experts.gate_up_proj"), std::string::npos)
      << model->mtp_status().detail;
}

}  // namespace
}  // namespace mtpx
