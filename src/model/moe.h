// Mixture-of-experts MLP (spec §5; transformers 5.17 Qwen3_5MoeSparseMoeBlock):
//   p = softmax_f32(h Wr^T);  (w, e) = topk(p, k);  w /= sum(w)
//   y = sum over the chosen e in ascending index order of w_e * down_e(silu(gate_e h) * up_e h)
//     + sigmoid(h Wsg^T) * shared(h)
// Each token reads only its k experts' weights; the rows of a pass that route to one expert are gathered and
// multiplied together (a verify window reads each expert it touches once; a prompt runs grouped products).
#pragma once

#include <cstdint>
#include <vector>

#include "model/state.h"
#include "model/weights.h"

namespace mtpx {

class InputStatistics;

// The experts each of T rows routes to, in torch.topk's order, and their renormalized weights.
struct Routing {
  int64_t experts_per_token = 0;  // k
  std::vector<int32_t> experts;   // [T, k]
  std::vector<float> weights;     // [T, k]  sum 1 per row
};

// torch.topk(probs, k) on the CPU, ties included: ATen's topk_impl_loop orders (value, index) pairs with
// "a before b iff a.value > b.value (NaN first)" by std::partial_sort when k * 64 <= n, else by
// std::nth_element at k - 1 and then std::sort of the first k - 1. Equal values therefore come out in the
// order those libstdc++ algorithms leave them (not lowest index first: topk([.1, .3, .3, .3], 2) is [1, 3]),
// and reproducing the algorithm reproduces the choice. indices/values: [k].
void topk_like_torch(const float* probs, int64_t n, int64_t k, int32_t* indices, float* values);

// Router logits of T rows in float32, routed as transformers routes them. The logits are computed in runs
// of fewer than cpu::kGemmMinRows rows, so a token's routing never depends on the rows around it (a prompt's
// tokens route exactly as they would one at a time).
void route_tokens(const MoeWeights& w, const float* h, int64_t t_count, Routing& routing);

// h: [T, H] -> out: [T, H]. traffic (optional): this call's experts are counted in it.
void moe_forward(const MoeWeights& w, const float* h, int64_t t_count, float* out,
                 InputStatistics* stats = nullptr, ExpertTraffic* traffic = nullptr);

}  // namespace mtpx
