#include "tools/tune.h"

#include <fmt/core.h>

#include <algorithm>

#include "util/error.h"

namespace mtpx::tools {

using nlohmann::json;

std::vector<int64_t> default_draft_vocabularies(int64_t vocab_size) {
  constexpr int64_t kDraftVocab = 32768, kMinHalved = 2048;
  if (vocab_size >= 4 * kDraftVocab) return {kDraftVocab};
  if (vocab_size >= kMinHalved) return {vocab_size / 2};
  return {};
}

json tune_draft_depth(const Model& model, const std::vector<std::vector<int32_t>>& prompts,
                      const TuneOptions& o, const std::function<void(double)>& progress) {
  if (model.mtp() == nullptr)
    invalid_input("tune: the model has no usable MTP head: {}", model.mtp_status().detail);
  if (o.max_draft < 1 || o.max_draft > kMaxDraft) invalid_input("--max-draft must be in [1, {}]", kMaxDraft);
  const int64_t V = model.config().vocab_size;
  std::vector<int64_t> vocabs;  // candidates smaller than the vocabulary, each once
  for (int64_t n : o.draft_vocabs.value_or(default_draft_vocabularies(V))) {
    if (n < 0) invalid_input("--draft-vocab must be positive, got {}", n);
    if (n > 0 && n < V && std::find(vocabs.begin(), vocabs.end(), n) == vocabs.end()) vocabs.push_back(n);
  }
  std::vector<BenchCase> cases;
  for (int64_t k = 0; k <= o.max_draft; ++k) {
    cases.push_back({o.sampler_name, o.sampler, k});
    if (k > 0)
      for (int64_t n : vocabs) cases.push_back({o.sampler_name, o.sampler, k, n});
  }
  BenchProtocol protocol;
  protocol.prompts = prompts;
  protocol.max_tokens = o.max_tokens;
  protocol.runs = o.runs;
  protocol.synthetic_acceptance = o.synthetic_acceptance;
  const std::vector<BenchResult> results = run_bench(model, protocol, cases, progress);

  const double plain = results[0].median_tok_s;
  json evidence = json::array();
  int64_t best = 0, best_vocab = 0;
  double best_rate = 0.0;
  for (const BenchResult& r : results) {
    json e = {{"draft", r.spec.draft},    {"draft_vocab", r.spec.draft_vocab},
              {"tok_s", r.median_tok_s},  {"tok_s_min", r.min_tok_s},
              {"tok_s_max", r.max_tok_s}, {"speedup", r.median_tok_s / plain}};
    if (r.spec.draft > 0) {
      e["acceptance"] = r.mtp.acceptance();
      e["acceptance_by_position"] = r.acceptance_by_position;
      e["tokens_per_step"] = r.tokens_per_step;
      if (r.median_tok_s > best_rate)
        best = r.spec.draft, best_vocab = r.spec.draft_vocab, best_rate = r.median_tok_s;
    }
    // MoE: what a pass of K+1 rows reads (c(K) grows with the distinct experts, not only with the rows).
    if (r.decode_experts.blocks > 0) e["experts_per_layer_pass"] = r.decode_experts.experts_per_block();
    evidence.push_back(e);
  }
  const bool worth_it = best_rate >= plain * (1.0 + o.margin);
  const std::string best_name =
      best_vocab > 0 ? fmt::format("K={}, draft vocabulary {}", best, best_vocab) : fmt::format("K={}", best);
  return {{"draft", worth_it ? best : 0},
          {"draft_vocab", worth_it ? best_vocab : 0},
          {"draft_vocab_candidates", vocabs},
          {"recommendation",
           worth_it ? fmt::format("MTP with {} ({:.2f}x plain decoding)", best_name, best_rate / plain)
                    : fmt::format("plain decoding (best MTP, {}, is {:.2f}x: below the {:.0f}% margin)",
                                  best_name, best_rate / plain, 100 * o.margin)},
          {"sampler", o.sampler_name},
          {"margin", o.margin},
          {"max_tokens", o.max_tokens},
          {"runs", o.runs},
          {"prompts", prompts.size()},
          {"synthetic_acceptance", o.synthetic_acceptance >= 0 ? json(o.synthetic_acceptance) : json()},
          {"plain_tok_s", plain},
          {"evidence", evidence}};
}

std::string tune_chart_svg(const json& profile) {
  const json& ev = profile.at("evidence");
  const int W = 520, H = 300, left = 60, right = 60, top = 40, bottom = 50;
  const double plot_w = W - left - right, plot_h = H - top - bottom;
  double max_rate = 1.0;
  for (const json& e : ev) max_rate = std::max(max_rate, e["tok_s_max"].get<double>());
  max_rate *= 1.1;
  const size_t n = ev.size();
  const double slot = plot_w / static_cast<double>(n);
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"20\" font-size=\"14\">mtpx tune: decode tok/s (bars) and first-position acceptance "
      "(line) by draft depth K, sampler {}</text>\n",
      W, H, left, profile.value("sampler", "?"));
  s += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n", left, top + plot_h,
                   left + plot_w, top + plot_h);
  s += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n", left, top, left,
                   top + plot_h);
  for (int i = 0; i <= 4; ++i) {
    const double v = max_rate * i / 4, y = top + plot_h - plot_h * i / 4;
    s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.0f}</text>\n", left - 6, y + 4, v);
    s += fmt::format("<text x=\"{}\" y=\"{:.1f}\">{:.0f}%</text>\n", left + plot_w + 6, y + 4, 25.0 * i);
  }
  s += fmt::format("<text x=\"14\" y=\"{}\" transform=\"rotate(-90 14 {})\">tok/s</text>\n", top + plot_h / 2,
                   top + plot_h / 2);
  std::string line;
  const int64_t chosen = profile.value("draft", int64_t{0}),
                chosen_vocab = profile.value("draft_vocab", int64_t{0});
  for (size_t i = 0; i < n; ++i) {
    const json& e = ev[i];
    const int64_t k = e["draft"].get<int64_t>(), vocab = e.value("draft_vocab", int64_t{0});
    const double rate = e["tok_s"].get<double>();
    const double x = left + slot * static_cast<double>(i) + slot * 0.2, bw = slot * 0.6;
    const double bh = plot_h * rate / max_rate;
    s += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\"/>\n", x,
                     top + plot_h - bh, bw, bh, k == chosen && vocab == chosen_vocab ? "#2b7bba" : "#9cc3e4");
    s += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{:.0f}</text>\n", x + bw / 2,
                     top + plot_h - bh - 4, rate);
    s += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", x + bw / 2,
                     top + plot_h + 16,
                     k == 0       ? std::string("plain")
                     : vocab == 0 ? fmt::format("K={}", k)
                                  : fmt::format("K={}/{}k", k, vocab / 1024));
    if (e.contains("acceptance_by_position") && !e["acceptance_by_position"].empty()) {
      const double a = e["acceptance_by_position"][0].get<double>();
      line += fmt::format("{}{:.1f},{:.1f}", line.empty() ? "" : " ", x + bw / 2, top + plot_h - plot_h * a);
    }
  }
  if (!line.empty())
    s += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"#d9534f\" stroke-width=\"2\"/>\n", line);
  s += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", left, H - 10, profile.value("recommendation", ""));
  s += "</svg>\n";
  return s;
}

}  // namespace mtpx::tools
