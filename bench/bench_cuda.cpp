// GPU benchmark (issue 7's targets): on a randomly initialized model of a real Qwen3.5 shape, next to
// the card's measured device-to-device copy bandwidth and bf16 GEMM rate:
//   decode tok/s and its fraction of the bandwidth roofline (weight bytes read per token / bandwidth),
//   the verify-cost curve c(K) = time(verify K+1 rows) / time(decode 1 row),
//   prefill of a long prompt against the GEMM rate,
//   decode tok/s after long prompts (--context-tokens: attention then reads a long KV cache),
//   MTP at a synthetic acceptance (drafts replaced by the greedy continuation with probability A),
//   plain decoding with several samplers side by side (--sampling-tokens).
//
//   bench_cuda [--shape 0.8B|9B|...] [--decode-tokens N] [--prefill-tokens N] [--context-tokens N ...]
//              [--acceptance A] [--sampling-tokens N] [--json]
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/cpu/matmul.h"
#include "bench_util.h"
#include "model/device.h"
#include "model/qwen35.h"
#include "model/shapes.h"
#include "tools/bench.h"
#include "util/error.h"
#ifdef MTPX_HAVE_CUDA
#include "backend/cuda/runtime.h"

// Helpers of the GPU measurements (a build without CUDA only reports that it has none).
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Bytes of weights one decode step reads: every trunk matrix once, the embedding table only by one row
// (unless tied, when it is the lm_head), and of a MoE layer's routed experts only its k of E.
int64_t bytes_per_token(const mtpx::Model& m) {
  const auto& w = m.weights();
  const int64_t embed = mtpx::cpu::weight_bytes(w.embed_tokens);
  double routed = 0.0;
  for (const mtpx::LayerWeights& l : w.layers) {
    if (!l.moe) continue;
    int64_t bytes = 0;
    for (const mtpx::MlpWeights& e : l.moe->experts)
      bytes += mtpx::cpu::weight_bytes(e.gate_proj) + mtpx::cpu::weight_bytes(e.up_proj) +
               mtpx::cpu::weight_bytes(e.down_proj);
    const double share =
        static_cast<double>(l.moe->experts_per_token) / static_cast<double>(l.moe->experts.size());
    routed += static_cast<double>(bytes) * (1.0 - share);
  }
  return (w.tied ? w.matrix_bytes : w.matrix_bytes - embed) - static_cast<int64_t>(routed);
}

}  // namespace
#endif

int main(int argc, char** argv) {
  CLI::App app("mtpx GPU benchmark");
  std::string shape = "0.8B";
  int64_t decode_tokens = 128, prefill_tokens = 2048, mtp_tokens = 256, sampling_tokens = 0;
  double acceptance = 0.8;
  bool json = false;
  int64_t profile_steps = 0, profile_rows = 1, profile_prefill = 0, draft_vocab = 32768;
  auto* shape_option = app.add_option("--shape", shape, "model shape (spec §9)");
  int64_t layers = 0;
  app.add_option("--layers", layers, "the shape's first N layers only (0: all; a reduced-depth shape)")
      ->check(CLI::Range(0, 1000));
  std::string model_dir;
  app.add_option("--model", model_dir,
                 "a checkpoint instead of a synthetic shape (e.g. mtpx synth --shape 9B --bits 4 --mtp)")
      ->excludes(shape_option);
  app.add_option(
      "--profile-steps", profile_steps,
      "only run this many passes (decode steps, or windows of --profile-rows) for a profiler, then exit");
  app.add_option("--profile-rows", profile_rows,
                 "rows per profiled pass: 1 is a decode step, more a recorded verify window")
      ->check(CLI::Range(1, 15));
  app.add_option("--profile-prefill", profile_prefill,
                 "only run one prefill of this many tokens (for a profiler), then exit");
  app.add_option("--decode-tokens", decode_tokens, "decode steps timed (0: no decode or verify measurements)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--prefill-tokens", prefill_tokens, "prompt tokens of the timed prefill (0: skip)")
      ->check(CLI::Range(0, 1 << 20));
  std::vector<int64_t> context_tokens;
  app.add_option("--context-tokens", context_tokens,
                 "also time decode steps after a prompt of each of these lengths (decode_at_context)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--mtp-tokens", mtp_tokens, "tokens per MTP run (0: skip)")->check(CLI::Range(0, 1 << 20));
  app.add_option("--acceptance", acceptance, "synthetic acceptance of the MTP runs");
  app.add_option("--sampling-tokens", sampling_tokens,
                 "tokens per run of plain decoding with each sampler, side by side (0: skip)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--draft-vocab", draft_vocab,
                 "the MTP runs also with a draft vocabulary of the first N ids (0 or >= vocab: not)");
  app.add_flag("--json", json);
  if (const int code = mtpx::bench::parse_arguments(app, argc, argv); code >= 0) return code;
#ifndef MTPX_HAVE_CUDA
  fmt::print("bench_cuda: built without CUDA\n");
  return 77;
#else
  try {
    using namespace mtpx;
    if (profile_prefill > 0) {
      auto m = model_dir.empty() ? Model::synthetic(shape_config(shape, layers), 1, /*with_mtp=*/false)
                                 : Model::load(model_dir);
      m->use_device("cuda");
      InferenceState st = m->new_state(profile_prefill + 8);
      ForwardResult out;
      std::vector<int32_t> prompt(static_cast<size_t>(profile_prefill));
      for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 11) % 1000);
      m->forward(st, prompt, LogitRows::kLast, out);
      return 0;
    }
    if (profile_steps > 0) {
      auto m = model_dir.empty() ? Model::synthetic(shape_config(shape, layers), 1, /*with_mtp=*/false)
                                 : Model::load(model_dir);
      m->use_device("cuda");
      InferenceState st = m->new_state(64 + profile_steps);
      ForwardResult out;
      std::vector<int32_t> prompt(32, 1);
      const bool window = profile_rows > 1;  // a verify window, rolled back to its first row after each pass
      for (int64_t i = 0; i < profile_steps; ++i) {
        m->forward(st, std::span(prompt.data(), static_cast<size_t>(profile_rows)),
                   window ? LogitRows::kAll : LogitRows::kLast, out, /*record_window=*/window);
        if (window) m->rollback(st, 1);
      }
      return 0;
    }
    nlohmann::json report;
    if (model_dir.empty()) report["shape"] = shape;
    if (model_dir.empty() && layers > 0)
      report["layers"] = layers;  // a checkpoint is reported as "model" below
    const double copy_bw = cuda::copy_bandwidth(size_t{1} << 30, 20);
    const double gemm = cuda::bf16_gemm_rate(8192, 20);
    report["copy_bandwidth_GBs"] = copy_bw / 1e9;
    report["bf16_gemm_TFLOPs"] = gemm / 1e12;
    // The third ceiling: the latency of one dependent kernel in a captured graph (a pass of N kernels costs
    // at least N times it), for a one-block kernel and for a grid of one block per multiprocessor.
    report["dependent_launch_us"] = {
        {"1_block", cuda::dependent_launch_seconds(512, 1, 20) * 1e6},
        {"sm_blocks", cuda::dependent_launch_seconds(512, cuda::multiprocessor_count(), 20) * 1e6}};

    auto t_build = Clock::now();
    auto model = model_dir.empty() ? Model::synthetic(shape_config(shape, layers), 1, /*with_mtp=*/true)
                                   : Model::load(model_dir);
    if (!model_dir.empty()) report["model"] = model_dir;
    const double build_s = seconds_since(t_build);
    t_build = Clock::now();
    model->use_device("cuda");
    report["upload_s"] = seconds_since(t_build);
    report["synthesize_s"] = build_s;
    report["device"] = model->executor()->description();
    report["device_weight_bytes"] = model->executor()->weight_bytes();
    const int64_t V = model->config().vocab_size;
    auto ids = [&](int64_t n, int64_t salt) {
      std::vector<int32_t> v;
      for (int64_t i = 0; i < n; ++i) v.push_back(static_cast<int32_t>((i * 7919 + salt * 104729 + 11) % V));
      return v;
    };

    // Decode: T = 1 steps after a 32-token prompt (--decode-tokens 0: no decode or verify measurements).
    const int64_t capacity = 64 + decode_tokens + prefill_tokens + 9 * 50;  // (c(K) keeps a token per pass)
    InferenceState state = model->new_state(capacity);
    ForwardResult r;
    if (decode_tokens > 0) {
      model->forward(state, ids(32, 1), LogitRows::kLast, r);
      const auto step_tokens = ids(decode_tokens, 2);
      for (int i = 0; i < 4; ++i)
        model->forward(state, std::span(&step_tokens[static_cast<size_t>(i)], 1), LogitRows::kLast, r);
      auto t0 = Clock::now();
      for (int64_t i = 0; i < decode_tokens; ++i)
        model->forward(state, std::span(&step_tokens[static_cast<size_t>(i)], 1), LogitRows::kLast, r);
      const double decode_s = seconds_since(t0) / static_cast<double>(decode_tokens);
      const double roofline = copy_bw / static_cast<double>(bytes_per_token(*model));
      report["decode_tok_s"] = 1.0 / decode_s;
      report["roofline_tok_s"] = roofline;
      report["decode_fraction_of_roofline"] = (1.0 / decode_s) / roofline;

      // c(K): a recorded verify window of K+1 rows (all logits) against a recorded one-row pass. The rollback
      // after each (to the window's first token, which keeps the position from running away) is timed apart:
      // a fully accepted window needs none.
      // Measured twice: returning every row's logits to the host, and as greedy MTP runs it (each row's
      // argmax on the device, the logits left there).
      std::vector<double> c_of_k, rollback_s, c_argmax, experts_per_pass;
      const int64_t vocab = model->config().vocab_size;
      for (int64_t k = 0; k <= 8; ++k) {
        const auto window = ids(k + 1, 3 + k);
        std::vector<double> times, rollback_times, argmax_times;
        for (int rep = 0; rep < 25; ++rep) {
          auto t = Clock::now();
          model->forward(state, window, LogitRows::kAll, r, /*record_window=*/true, /*argmax_limit=*/vocab);
          argmax_times.push_back(seconds_since(t));
          model->rollback(state, 1);
          t = Clock::now();
          model->forward(state, window, k == 0 ? LogitRows::kLast : LogitRows::kAll, r,
                         /*record_window=*/true);
          times.push_back(seconds_since(t));
          t = Clock::now();
          model->rollback(state, 1);
          rollback_times.push_back(seconds_since(t));
        }
        if (model->config().is_moe()) {  // distinct experts a window's MoE block reads (the last rep's)
          const ExpertTraffic before = state.expert_traffic();
          model->forward(state, window, LogitRows::kLast, r, /*record_window=*/true);
          model->rollback(state, 1);
          experts_per_pass.push_back(traffic_since(state.expert_traffic(), before).experts_per_block());
        }
        c_of_k.push_back(median(times));
        rollback_s.push_back(median(rollback_times));
        c_argmax.push_back(median(argmax_times));
      }
      nlohmann::json ck = nlohmann::json::object(), ck_argmax = nlohmann::json::object();
      for (int64_t k = 1; k <= 8; ++k) {
        ck[std::to_string(k)] = c_of_k[static_cast<size_t>(k)] / c_of_k[0];
        ck_argmax[std::to_string(k)] = c_argmax[static_cast<size_t>(k)] / c_argmax[0];
      }
      report["verify_cost_c"] = ck;
      if (!experts_per_pass.empty()) {  // K + 1 rows: K = 0 is a decode step
        nlohmann::json ex = nlohmann::json::object();
        for (size_t k = 0; k < experts_per_pass.size(); ++k) ex[std::to_string(k)] = experts_per_pass[k];
        report["experts_per_layer_pass"] = ex;
      }
      report["verify_cost_c_argmax"] = ck_argmax;
      report["decode_step_with_record_ms"] = c_of_k[0] * 1e3;
      report["rollback_k3_to_one_token_ms"] = rollback_s[3] * 1e3;
    }

    // Decode after long prompts: the same steps, each reading the whole KV cache of the attention layers.
    if (!context_tokens.empty()) {
      constexpr int64_t kSteps = 32;
      nlohmann::json rows = nlohmann::json::array();
      for (const int64_t n : context_tokens) {
        InferenceState s = model->new_state(n + kSteps + 8);
        model->forward(s, ids(n, 6), LogitRows::kLast, r);
        const auto step_tokens = ids(kSteps + 2, 7);
        for (int i = 0; i < 2; ++i)
          model->forward(s, std::span(&step_tokens[static_cast<size_t>(i)], 1), LogitRows::kLast, r);
        const auto t0 = Clock::now();
        for (int64_t i = 2; i < kSteps + 2; ++i)
          model->forward(s, std::span(&step_tokens[static_cast<size_t>(i)], 1), LogitRows::kLast, r);
        rows.push_back({{"context", n}, {"tok_s", static_cast<double>(kSteps) / seconds_since(t0)}});
      }
      report["decode_at_context"] = rows;
    }

    // Prefill.
    if (prefill_tokens > 0) {
      const auto prompt = ids(prefill_tokens, 4);
      std::vector<double> times;
      for (int rep = 0; rep < 3; ++rep) {
        InferenceState s = model->new_state(prefill_tokens + 8);
        auto t = Clock::now();
        model->forward(s, prompt, LogitRows::kLast, r);
        times.push_back(seconds_since(t));
      }
      const double secs = median(times);
      // Every position through every trunk matrix; lm_head for the one row asked for (LogitRows::kLast).
      const double flops = bench::matmul_flops(model->weights(), prefill_tokens, 1);
      report["prefill_tokens"] = prefill_tokens;
      report["prefill_tok_s"] = static_cast<double>(prefill_tokens) / secs;
      report["prefill_matmul_TFLOPs"] = flops / secs / 1e12;
      report["prefill_fraction_of_gemm"] = flops / secs / gemm;
    }

    // MTP at a synthetic acceptance, greedy, side by side with plain decoding in the same run.
    if (mtp_tokens > 0 && model->mtp() != nullptr) {
      tools::BenchProtocol p;
      p.prompts = {ids(32, 5)};
      p.max_tokens = mtp_tokens;
      p.runs = 3;
      p.synthetic_acceptance = acceptance;
      // Each K with the whole vocabulary and (interleaved in the same runs) with the draft vocabulary.
      const bool with_vocab = draft_vocab > 0 && draft_vocab < model->config().vocab_size;
      std::vector<tools::BenchCase> cases = {{"greedy", SamplerParams{.temperature = 0.0}, 0}};
      for (int64_t k = 1; k <= 6; ++k) {
        cases.push_back({"greedy", SamplerParams{.temperature = 0.0}, k});
        if (with_vocab) cases.push_back({"greedy", SamplerParams{.temperature = 0.0}, k, draft_vocab});
      }
      const auto results = tools::run_bench(*model, p, cases);
      nlohmann::json rows = nlohmann::json::array(), vocab_rows = nlohmann::json::array();
      for (const auto& res : results)
        (res.spec.draft_vocab > 0 ? vocab_rows : rows)
            .push_back({{"draft", res.spec.draft},
                        {"tok_s", res.median_tok_s},
                        {"speedup", res.median_tok_s / results[0].median_tok_s},
                        {"acceptance", res.mtp.acceptance()},
                        {"tokens_per_step", res.tokens_per_step}});
      report["mtp_synthetic"] = {{"acceptance", acceptance}, {"rows", rows}};
      if (with_vocab)
        report["mtp_synthetic_draft_vocab"] = {
            {"acceptance", acceptance}, {"draft_vocab", draft_vocab}, {"rows", vocab_rows}};
    }

    // Decoding with each sampler, side by side in the same runs: what sampling costs over greedy (candidates
    // on the device; a row sampled whole drawn below its top ids there), and MTP at temperature alone.
    if (sampling_tokens > 0) {
      tools::BenchProtocol p;
      p.prompts = {ids(32, 5)};
      p.max_tokens = sampling_tokens;
      p.runs = 3;
      const std::vector<tools::BenchCase> cases = {
          {"greedy", SamplerParams{.temperature = 0.0}},
          {"T 0.8, top-k 20", SamplerParams{.temperature = 0.8, .top_k = 20}},
          {"T 0.8, top-p 0.95", SamplerParams{.temperature = 0.8, .top_p = 0.95}},
          {"T 1", SamplerParams{.temperature = 1.0}},
          {"T 1, MTP K 2", SamplerParams{.temperature = 1.0}, 2}};
      nlohmann::json rows = nlohmann::json::array();
      for (const auto& res : tools::run_bench(*model, p, cases))
        rows.push_back({{"sampler", res.spec.sampler_name},
                        {"tok_s", res.median_tok_s},
                        {"draws_below", res.draws_below},
                        {"logit_rows_fetched", res.logit_rows_fetched},
                        {"logit_values_fetched", res.logit_values_fetched},
                        {"acceptance", res.mtp.acceptance()}});
      report["sampling"] = {{"tokens", sampling_tokens}, {"rows", rows}};
    }

    if (json) {
      fmt::print("{}\n", report.dump(2));
      return 0;
    }
    fmt::print("{}\n", report.dump(2));
    return 0;
  } catch (const mtpx::Error& e) {
    fmt::print(stderr, "bench_cuda: {}\n", e.what());
    return e.kind() == mtpx::ErrorKind::kUnsupported ? 77 : 1;
  }
#endif
}
