// MTP benchmark: plain (AR) vs speculative decode speed for K = 1..4 on one model and prompt, the
// acceptance by draft position, and peak resident memory with MTP off vs on.
//
// On a random-weight model the head's drafts are never right, so besides the real head ("head") the
// benchmark runs a synthetic-acceptance mode ("synthetic A"): each draft is replaced by the token plain
// greedy decoding produces there with probability A (otherwise left as the head's guess), as vLLM's
// synthetic rejection mode does. That measures what a head with acceptance A would buy on this machine.
//
//   bench_mtp [--shape 0.8B] [--tokens 48] [--prompt-tokens 32] [--synthetic-acceptance 0.8] [--threads N]
//   [--json]
#include <fmt/core.h>
#include <omp.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "decode/generate.h"
#include "model/qwen35.h"
#include "model/shapes.h"

namespace {

int64_t peak_rss() {
  struct rusage u {};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

// Runs `work` in a child process and returns its peak RSS (a process's peak cannot be reset).
int64_t child_peak_rss(const std::function<void()>& work) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    work();
    int64_t rss = peak_rss();
    if (write(fds[1], &rss, sizeof rss) != sizeof rss) _exit(1);
    _exit(0);
  }
  close(fds[1]);
  int64_t rss = -1;
  if (read(fds[0], &rss, sizeof rss) != sizeof rss) rss = -1;
  close(fds[0]);
  waitpid(pid, nullptr, 0);
  return rss;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape = "0.8B";
  int64_t tokens = 48, prompt_tokens = 32;
  double synthetic = 0.8;
  int threads = 0;
  bool json = false;
  CLI::App app{"mtpx MTP benchmark"};
  app.add_option("--shape", shape);
  app.add_option("--tokens", tokens)->check(CLI::PositiveNumber);
  app.add_option("--prompt-tokens", prompt_tokens)->check(CLI::Range(int64_t{8}, int64_t{1} << 16));
  app.add_option("--synthetic-acceptance", synthetic)->check(CLI::Range(0.0, 1.0));
  app.add_option("--threads", threads)->check(CLI::Range(1, 1024));
  app.add_flag("--json", json);
  if (const int code = mtpx::bench::parse_arguments(app, argc, argv); code >= 0) return code;
  if (threads > 0) omp_set_num_threads(threads);
  const mtpx::ModelConfig config = mtpx::shape_config(shape);
  std::vector<int32_t> prompt(static_cast<size_t>(prompt_tokens));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 13) % 1000);
  mtpx::GenerateOptions plain;
  plain.max_tokens = tokens;
  plain.sampler.temperature = 0.0;

  // Peak memory, each in a fresh process: MTP off (trunk only) vs on (trunk + head, K = 3).
  const int64_t rss_off = child_peak_rss([&] {
    auto m = mtpx::Model::synthetic(config, 1, false);
    mtpx::generate(*m, prompt, plain);
  });
  int64_t head_bytes = 0;
  const int64_t rss_on = child_peak_rss([&] {
    auto m = mtpx::Model::synthetic(config, 1, true);
    mtpx::GenerateOptions o = plain;
    o.draft = 3;
    mtpx::generate(*m, prompt, o);
  });
  auto model = mtpx::Model::synthetic(config, 1, true);
  head_bytes = model->mtp()->matrix_bytes;
  // Rollback state: one DeltaNet state copy per linear layer (+ the window's inputs, small) and the
  // head's KV cache; both sized by the run.
  const int64_t rollback_bytes = model->config().num_linear_attention_layers() *
                                 config.linear_num_value_heads * config.linear_key_head_dim *
                                 config.linear_value_head_dim * 4;
  const int64_t head_kv_bytes = (prompt_tokens + tokens + 8) * config.num_kv_heads * config.head_dim * 2 * 4;

  mtpx::generate(*model, std::vector<int32_t>(prompt.begin(), prompt.begin() + 8), [&] {
    auto o = plain;
    o.max_tokens = 2;
    return o;
  }());  // warm-up
  const mtpx::GenerateResult ar = mtpx::generate(*model, prompt, plain);
  const double ar_tok_s = ar.stats.decode_tok_s();

  nlohmann::json rows = nlohmann::json::array();
  auto run = [&](int64_t k, double acceptance) {
    mtpx::GenerateOptions o = plain;
    o.draft = k;
    if (acceptance > 0) {
      auto rng = std::make_shared<std::mt19937_64>(42);
      const std::vector<int32_t> truth = ar.tokens;
      const size_t n = prompt.size();
      o.draft_hook = [rng, truth, n, acceptance](std::span<const int32_t> context,
                                                 std::vector<int32_t>& drafts) {
        std::uniform_real_distribution<double> u(0.0, 1.0);
        for (size_t i = 0; i < drafts.size(); ++i) {
          const size_t index = context.size() - n + i;
          if (index < truth.size() && u(*rng) < acceptance) drafts[i] = truth[index];
        }
      };
    }
    const mtpx::GenerateResult r = mtpx::generate(*model, prompt, o);
    if (r.tokens != ar.tokens) {
      std::fprintf(stderr, "error: MTP output differs from plain greedy output (K=%lld)\n",
                   static_cast<long long>(k));
      std::exit(1);
    }
    std::vector<double> by_position;
    for (size_t i = 0; i < r.stats.mtp.drafted_by_position.size(); ++i)
      by_position.push_back(r.stats.mtp.drafted_by_position[i]
                                ? double(r.stats.mtp.accepted_by_position[i]) /
                                      double(r.stats.mtp.drafted_by_position[i])
                                : 0.0);
    rows.push_back({{"mode", acceptance > 0 ? fmt::format("synthetic {:.2f}", acceptance) : "head"},
                    {"draft", k},
                    {"tok_s", r.stats.decode_tok_s()},
                    {"speedup", r.stats.decode_tok_s() / ar_tok_s},
                    {"acceptance", r.stats.mtp.acceptance()},
                    {"acceptance_by_position", by_position},
                    {"tokens_per_step",
                     r.stats.mtp.steps ? double(r.tokens.size() - 1) / double(r.stats.mtp.steps) : 0.0}});
  };
  run(1, 0.0);
  for (int64_t k = 1; k <= 4; ++k) run(k, synthetic);

  nlohmann::json out = {
      {"shape", shape},
      {"threads", omp_get_max_threads()},
      {"tokens", tokens},
      {"prompt_tokens", prompt_tokens},
      {"ar_tok_s", ar_tok_s},
      {"runs", rows},
      {"peak_rss_mtp_off", rss_off},
      {"peak_rss_mtp_on", rss_on},
      {"head_bytes", head_bytes},
      {"rollback_bytes", rollback_bytes + head_kv_bytes},
      {"memory_budget_met",
       rss_on <= static_cast<int64_t>(
                     1.05 * static_cast<double>(rss_off + head_bytes + rollback_bytes + head_kv_bytes))}};
  if (json) {
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  fmt::print(
      "shape {} | threads {} | {} tokens after a {}-token prompt, greedy; outputs checked identical to AR\n",
      shape, omp_get_max_threads(), tokens, prompt_tokens);
  fmt::print("AR: {:.2f} tok/s\n", ar_tok_s);
  for (const auto& r : rows) {
    std::string pos;
    for (double a : r["acceptance_by_position"]) pos += fmt::format(" {:.2f}", a);
    fmt::print(
        "{:>15} K={}: {:6.2f} tok/s  x{:.2f}  acceptance {:.2f} (by position:{})  {:.2f} tokens/step\n",
        r["mode"].get<std::string>(), r["draft"].get<int>(), r["tok_s"].get<double>(),
        r["speedup"].get<double>(), r["acceptance"].get<double>(), pos, r["tokens_per_step"].get<double>());
  }
  fmt::print(
      "peak RSS: MTP off {:.0f} MiB, MTP on {:.0f} MiB; head {:.0f} MiB + rollback/head-KV {:.1f} MiB -> "
      "budget {:.0f} MiB (+5%): {}\n",
      rss_off / 1048576.0, rss_on / 1048576.0, head_bytes / 1048576.0,
      (rollback_bytes + head_kv_bytes) / 1048576.0,
      1.05 * (rss_off + head_bytes + rollback_bytes + head_kv_bytes) / 1048576.0,
      out["memory_budget_met"].get<bool>() ? "met" : "NOT met");
  return 0;
}
