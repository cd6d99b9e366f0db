#include "model/moe.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string_view>
#include <utility>

#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"
#include "model/input_statistics.h"
#include "model/mlp.h"

namespace mtpx {

void topk_like_torch(const float* probs, int64_t n, int64_t k, int32_t* indices, float* values) {
  if (k <= 0) return;
  // The pair type and comparator of ATen's topk_impl_loop (largest = true): the algorithms below move the
  // pairs exactly as they move them there.
  using Entry = std::pair<float, int64_t>;
  std::vector<Entry> queue(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) queue[static_cast<size_t>(j)] = {probs[j], j};
  const auto before = [](const Entry& x, const Entry& y) {
    return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
  };
  if (k * 64 <= n) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), before);
  } else {
    std::nth_element(queue.begin(), queue.begin() + (k - 1), queue.end(), before);
    std::sort(queue.begin(), queue.begin() + (k - 1), before);
  }
  for (int64_t j = 0; j < k; ++j) {
    indices[j] = static_cast<int32_t>(queue[static_cast<size_t>(j)].second);
    values[j] = queue[static_cast<size_t>(j)].first;
  }
}

void route_tokens(const MoeWeights& w, const float* h, int64_t T, Routing& routing) {
  const int64_t E = w.router.rows, H = w.router.cols, k = w.experts_per_token;
  std::vector<float> logits(static_cast<size_t>(T * E));
  // Runs of fewer than kGemmMinRows rows take the batch-invariant kernels (matmul.h): a router logit is then
  // the same bits in a prompt, a verify window and a decode step.
  constexpr int64_t kRun = cpu::kGemmMinRows - 1;
  for (int64_t t0 = 0; t0 < T; t0 += kRun)
    cpu::matmul(w.router, h + t0 * H, std::min(kRun, T - t0), &logits[static_cast<size_t>(t0 * E)]);
  routing.experts_per_token = k;
  routing.experts.resize(static_cast<size_t>(T * k));
  routing.weights.resize(static_cast<size_t>(T * k));
  for (int64_t t = 0; t < T; ++t) {
    // softmax in float32 over all experts, then the top k of the probabilities (not of the logits: two
    // logits can round to one probability, and then torch's tie order decides).
    float* p = &logits[static_cast<size_t>(t * E)];
    const float max = *std::max_element(p, p + E);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - max));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    int32_t* chosen = &routing.experts[static_cast<size_t>(t * k)];
    float* weight = &routing.weights[static_cast<size_t>(t * k)];
    topk_like_torch(p, E, k, chosen, weight);
    float top_sum = 0.0f;  // in topk order, as router_top_value.sum()
    for (int64_t j = 0; j < k; ++j) top_sum += weight[j];
    for (int64_t j = 0; j < k; ++j) weight[j] /= top_sum;
  }
}

namespace {

// One expert's SwiGLU on n gathered rows: y = down(silu(gate x) * up x) ([n, H] -> [n, H]; gate and up are
// [n, I] scratch). Quantized experts take the small-row kernels in runs of fewer than kGemmMinRows rows
// even in a prompt (MTPX_MOE_PREFILL=gemm: the float32 GEMM path): an expert serves a few rows of a prompt
// (k / E of them: 16 of 512 on the 35B-A3B shape), too few to repay dequantizing it for sgemm, and the
// int8-activation row kernels (what decode runs) compute them at integer throughput. A prompt's expert rows
// are then the same bits as decode's.
void expert_products(const MlpWeights& e, const float* x, int64_t n, int64_t H, float* gate, float* up,
                     float* y) {
  static const bool gemm = [] {
    const char* v = std::getenv("MTPX_MOE_PREFILL");
    return v != nullptr && std::string_view(v) == "gemm";
  }();
  const int64_t I = e.gate_proj.rows;
  const bool rows = !gemm && e.gate_proj.type == cpu::WeightType::kAffine;
  const int64_t run = rows ? cpu::kGemmMinRows - 1 : n;
  for (int64_t r0 = 0; r0 < n; r0 += run) {
    const int64_t m = std::min(run, n - r0);
    const cpu::MatmulTarget gate_up[] = {{&e.gate_proj, gate + r0 * I}, {&e.up_proj, up + r0 * I}};
    cpu::matmul_shared_input(gate_up, x + r0 * H, m);
    cpu::swiglu(gate + r0 * I, up + r0 * I, m * I, gate + r0 * I);
    cpu::matmul(e.down_proj, gate + r0 * I, m, y + r0 * H);
  }
}

}  // namespace

void moe_forward(const MoeWeights& w, const float* h, int64_t T, float* out, InputStatistics* stats,
                 ExpertTraffic* traffic) {
  const int64_t H = w.router.cols, E = w.router.rows;
  Routing routing;
  route_tokens(w, h, T, routing);
  const int64_t k = routing.experts_per_token;

  // The rows (and their weights) each expert serves, and the experts that serve any, in ascending index
  // order: every row adds its experts' outputs in that order (as transformers' loop over the hit experts
  // does), whichever other rows share the pass.
  std::vector<std::vector<std::pair<int64_t, float>>> served(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j)
      served[static_cast<size_t>(routing.experts[static_cast<size_t>(t * k + j)])].push_back(
          {t, routing.weights[static_cast<size_t>(t * k + j)]});
  std::vector<int64_t> active, first_row;  // first_row: where an active expert's rows start in y
  int64_t y_rows = 0;
  for (int64_t e = 0; e < E; ++e)
    if (!served[static_cast<size_t>(e)].empty()) {
      active.push_back(e);
      first_row.push_back(y_rows);
      y_rows += static_cast<int64_t>(served[static_cast<size_t>(e)].size());
    }

  // One thread team for the block: the jobs are the active experts and the shared expert, each run whole by
  // one thread (its products' own thread teams are nested, so inactive), instead of a team per product: a
  // decode step's 2k + 4 small products each paid a start and a join (12% of a 35B-A3B-shaped decode step on
  // 2 cores in libgomp). Threads split whole products, never a reduction: each output is the same bits.
  // With fewer than two jobs per thread (a decode step on a many-core CPU) a job per thread would leave cores
  // idle, so the jobs run in order with each product split over the threads as usual. Calibration
  // statistics are not thread-safe: their passes run the jobs in order too.
  std::vector<float> y(static_cast<size_t>(y_rows * H));
  std::vector<float> shared(static_cast<size_t>(T * H)), shared_gate(static_cast<size_t>(T));
  const auto jobs = static_cast<int64_t>(active.size()) + 1;
  const bool by_job = stats == nullptr && jobs >= 2 * static_cast<int64_t>(omp_get_max_threads());
#pragma omp parallel if (by_job)
  {
    std::vector<float> xs, gate, up;
#pragma omp for schedule(dynamic, 1)
    for (int64_t job = 0; job < jobs; ++job) {
      if (job == jobs - 1) {
        mlp_forward(w.shared_expert, h, T, shared.data(), stats);
        cpu::matmul(w.shared_expert_gate, h, T, shared_gate.data());
        continue;
      }
      const auto& rows = served[static_cast<size_t>(active[static_cast<size_t>(job)])];
      const MlpWeights& expert = w.experts[static_cast<size_t>(active[static_cast<size_t>(job)])];
      const auto n = static_cast<int64_t>(rows.size());
      const int64_t I = expert.gate_proj.rows;
      xs.resize(static_cast<size_t>(n * H));
      for (int64_t r = 0; r < n; ++r)
        std::copy_n(h + rows[static_cast<size_t>(r)].first * H, H, &xs[static_cast<size_t>(r * H)]);
      gate.resize(static_cast<size_t>(n * I));
      up.resize(static_cast<size_t>(n * I));
      expert_products(expert, xs.data(), n, H, gate.data(), up.data(),
                      &y[static_cast<size_t>(first_row[static_cast<size_t>(job)] * H)]);
      if (stats != nullptr) {
        stats->add(expert.gate_proj, xs.data(), n);
        stats->add(expert.up_proj, xs.data(), n);
        stats->add(expert.down_proj, gate.data(), n);
      }
    }
  }

  std::fill(out, out + T * H, 0.0f);
  for (size_t a = 0; a < active.size(); ++a) {
    const auto& rows = served[static_cast<size_t>(active[a])];
    for (size_t r = 0; r < rows.size(); ++r) {
      const auto [t, weight] = rows[r];
      float* o = out + t * H;
      const float* yr = &y[static_cast<size_t>((first_row[a] + static_cast<int64_t>(r)) * H)];
      for (int64_t i = 0; i < H; ++i) o[i] += yr[i] * weight;
    }
  }
  // The shared expert, scaled by its sigmoid gate, added last (transformers: expert_output + shared).
  for (int64_t t = 0; t < T; ++t) {
    const float g = cpu::sigmoid(shared_gate[static_cast<size_t>(t)]);
    float* o = out + t * H;
    const float* s = &shared[static_cast<size_t>(t * H)];
    for (int64_t i = 0; i < H; ++i) o[i] += g * s[i];
  }
  if (stats != nullptr) {
    stats->add(w.router, h, T);
    stats->add(w.shared_expert_gate, h, T);
  }
  if (traffic != nullptr) {
    const auto distinct = static_cast<int64_t>(active.size());
    traffic->blocks += 1;
    traffic->rows += T;
    traffic->expert_reads += distinct;
    traffic->max_per_block = std::max(traffic->max_per_block, distinct);
  }
}

}  // namespace mtpx
