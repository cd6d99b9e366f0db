#include "model/qwen35.h"

#include <algorithm>

#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"
#include "io/safetensors.h"
#include "model/gated_deltanet.h"
#include "model/input_statistics.h"
#include "util/error.h"

namespace mtpx {

Model::~Model() = default;

std::unique_ptr<Model> Model::load(const std::filesystem::path& dir) {
  if (!std::filesystem::is_directory(dir))
    fail(ErrorKind::kNotFound, "model directory '{}' does not exist", dir.string());
  const auto config_path = dir / "config.json";
  if (!std::filesystem::exists(config_path))
    fail(ErrorKind::kNotFound, "'{}' has no config.json (not a Hugging Face model directory)", dir.string());
  std::unique_ptr<Model> m(new Model());
  m->dir_ = dir;
  m->config_ = load_model_config(config_path);
  m->store_ = std::make_unique<TensorStore>(TensorStore::open_directory(dir));
  // An MTP sidecar (written by `mtpx graft`) joins the store: its tensors are the head's.
  const auto sidecar = dir / "mtp.safetensors";
  if (std::filesystem::exists(sidecar) && m->store_->find("mtp.fc.weight") == nullptr) {
    const auto real_dir = std::filesystem::canonical(dir), real_file = std::filesystem::canonical(sidecar);
    if (real_file.parent_path() != real_dir)
      invalid_input("'{}' resolves to '{}', outside the model directory", sidecar.string(),
                    real_file.string());
    m->store_->add_file(sidecar);
  }
  const CheckpointConvention convention = detect_checkpoint_convention(*m->store_, m->config_);
  m->config_.tensor_prefix = convention.tensor_prefix;
  m->weights_ = load_model_weights(*m->store_, m->config_, convention.norm_offset);
  m->mtp_ = load_mtp_weights(*m->store_, m->config_, m->mtp_status_, convention.norm_offset);
  return m;
}

std::unique_ptr<Model> Model::synthetic(const ModelConfig& config, uint64_t seed, bool with_mtp) {
  std::unique_ptr<Model> m(new Model());
  m->config_ = config;
  m->synthetic_ = std::make_unique<SyntheticStorage>();
  m->weights_ = make_synthetic_weights(config, seed, *m->synthetic_);
  if (with_mtp) {
    m->mtp_ = make_synthetic_mtp_weights(config, seed + 1, *m->synthetic_);
    m->mtp_status_ = {MtpStatus::Kind::kPresent, ""};
  }
  return m;
}

int64_t Model::mapped_bytes() const { return store_ ? store_->mapped_bytes() : 0; }

namespace {

// Every matrix a forward pass multiplies by (not embed_tokens, whose rows are looked up).
template <typename F>
void for_each_layer_matrix(LayerWeights& l, F f) {
  if (l.attention) {
    for (cpu::WeightMatrix* w :
         {&l.attention->q_proj, &l.attention->k_proj, &l.attention->v_proj, &l.attention->o_proj})
      f(*w);
  }
  if (l.delta_net) {
    for (cpu::WeightMatrix* w : {&l.delta_net->in_proj_qkv, &l.delta_net->in_proj_z, &l.delta_net->in_proj_b,
                                 &l.delta_net->in_proj_a, &l.delta_net->out_proj})
      f(*w);
  }
  for (cpu::WeightMatrix* w : {&l.mlp.gate_proj, &l.mlp.up_proj, &l.mlp.down_proj}) f(*w);
  // A MoE block's shared parts; not its routed experts, which are most of the model (AMX tiles are a copy,
  // and the experts' small products read their rows in the AVX-512 kernels instead).
  if (l.moe)
    for (cpu::WeightMatrix* w : {&l.moe->router, &l.moe->shared_expert_gate, &l.moe->shared_expert.gate_proj,
                                 &l.moe->shared_expert.up_proj, &l.moe->shared_expert.down_proj})
      f(*w);
}

}  // namespace

void Model::prepare_cpu_kernels() const {
  // Writes each matrix's amx_tiles once, before any CPU pass reads them (call_once blocks the others).
  // Models are made by load() and synthetic(), never defined const, so writing through this is sound.
  std::call_once(cpu_kernels_prepared_, [this] { const_cast<Model*>(this)->pack_amx_tiles(); });
}

void Model::pack_amx_tiles() {
  if (!cpu::amx_small_m_path()) return;
  // One arena for all the tiles, in the order the forward pass reads them, on huge pages where the kernel
  // gives them (a decode step streams every tile once: 4 KiB pages cost a TLB miss per page).
  int64_t total = 0;
  auto count = [&](cpu::WeightMatrix& w) { total += (cpu::amx_tile_words(w) + 15) / 16 * 16; };
  for (LayerWeights& l : weights_.layers) for_each_layer_matrix(l, count);
  count(weights_.lm_head);
  if (mtp_) {
    count(mtp_->fc);
    for_each_layer_matrix(mtp_->layer, count);
  }
  if (total == 0) return;
  amx_arena_ = std::make_unique<cpu::TileArena>(total);
  int64_t offset = 0;
  auto pack = [&](cpu::WeightMatrix& w) {
    const int64_t words = cpu::amx_tile_words(w);
    if (words == 0) return;
    uint32_t* tiles = amx_arena_->data() + offset;
    offset += (words + 15) / 16 * 16;
    cpu::pack_amx_tiles(w, tiles);
    w.amx_tiles = tiles;
  };
  for (LayerWeights& l : weights_.layers) for_each_layer_matrix(l, pack);
  pack(weights_.lm_head);
  if (mtp_) {
    pack(mtp_->fc);
    for_each_layer_matrix(mtp_->layer, pack);
  }
  // The forward passes read the tiles now: let the kernel drop the mapped files' pages (embedding rows and
  // anything else are read back from the files when touched).
  if (store_) store_->release_pages();
}

void Model::use_device(const std::string& device) {
  if (device == "cpu") {
    executor_.reset();
    prepare_cpu_kernels();  // now rather than in the first request's pass
    return;
  }
  if (device != "cuda") invalid_input("--device must be cpu or cuda, got '{}'", device);
  executor_ = make_cuda_executor(*this);
  // The CPU's tile copies (if a CPU pass made them) are not used on the GPU, and are not made after.
  std::call_once(cpu_kernels_prepared_, [] {});
  for (LayerWeights& l : weights_.layers)
    for_each_layer_matrix(l, [](cpu::WeightMatrix& w) { w.amx_tiles = nullptr; });
  weights_.lm_head.amx_tiles = nullptr;
  if (mtp_) {
    mtp_->fc.amx_tiles = nullptr;
    for_each_layer_matrix(mtp_->layer, [](cpu::WeightMatrix& w) { w.amx_tiles = nullptr; });
  }
  amx_arena_.reset();
  // The weights now live on the GPU: let the kernel drop the mapped files' pages from this process's
  // memory (they are read back from the files if the CPU path ever touches them again).
  if (store_) store_->release_pages();
}

void Model::forward(InferenceState& state, std::span<const int32_t> tokens, LogitRows rows,
                    ForwardResult& result, bool record_window, int64_t argmax_limit, int64_t head_logit_ids,
                    CandidateRequest sample) const {
  const ModelConfig& c = config_;
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int64_t H = c.hidden_size;
  const int64_t p0 = state.position();
  if (T == 0) invalid_input("forward: no tokens");
  if (p0 + T > state.capacity())
    invalid_input("context overflow: {} positions needed, the state holds {}", p0 + T, state.capacity());
  for (int32_t id : tokens)
    if (id < 0 || id >= c.vocab_size)
      invalid_input("token id {} is outside the model's vocabulary [0, {})", id, c.vocab_size);

  if ((executor_ != nullptr) != (state.device() != nullptr))
    invalid_input("forward: the state was made for another device than the model's");
  if (executor_) {
    if (state.input_statistics() != nullptr) invalid_input("input statistics are collected on the CPU only");
    executor_->forward(*state.device(), p0, tokens, rows, record_window, argmax_limit, sample, result.hidden,
                       result.logits, result.argmax, result.candidates);
    if (holds_non_finite(result.argmax, result.candidates))
      fail_non_finite(fmt::format("logits at positions {}..{}", p0, p0 + T - 1));
    if (record_window) state.set_window(p0, T);
    state.advance(T);
    return;
  }
  prepare_cpu_kernels();
  result.candidates = {};  // the CPU returns the logits
  // x: the residual stream [T, H].
  std::vector<float> x(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t)
    cpu::weight_row_to_f32(weights_.embed_tokens, tokens[static_cast<size_t>(t)],
                           &x[static_cast<size_t>(t * H)]);
  InputStatistics* stats = state.input_statistics();
  for (int64_t li = 0; li < c.num_layers; ++li)
    decoder_layer_forward(weights_.layers[static_cast<size_t>(li)], c, &state.kv(li), &state.delta(li), p0,
                          x.data(), T, record_window, 0, stats, &state.expert_traffic());
  norm_and_logits(c, weights_.lm_head, weights_.final_norm, x.data(), T, rows, result.hidden, result.logits,
                  head_logit_ids);
  if (stats != nullptr) stats->add(weights_.lm_head, result.hidden.data(), T);  // every row's hidden
  const std::vector<float>& out = rows == LogitRows::kNone ? result.hidden : result.logits;
  if (!cpu::all_finite(out.data(), static_cast<int64_t>(out.size())))
    fail_non_finite(fmt::format("{} at positions {}..{}",
                                rows == LogitRows::kNone ? "hidden states" : "logits", p0, p0 + T - 1));
  logit_row_argmax(result.logits, c.vocab_size, argmax_limit, result.argmax);  // (no logits: none)
  if (record_window) state.set_window(p0, T);
  state.advance(T);
}

void Model::check_forward(const SequenceForward& s) const {
  const int64_t T = static_cast<int64_t>(s.tokens.size());
  const int64_t p0 = s.state->position();
  if (T == 0) invalid_input("forward: no tokens");
  if (p0 + T > s.state->capacity())
    invalid_input("context overflow: {} positions needed, the state holds {}", p0 + T, s.state->capacity());
  for (int32_t id : s.tokens)
    if (id < 0 || id >= config_.vocab_size)
      invalid_input("token id {} is outside the model's vocabulary [0, {})", id, config_.vocab_size);
  if ((executor_ != nullptr) != (s.state->device() != nullptr))
    invalid_input("forward: the state was made for another device than the model's");
}

void Model::forward_batch(std::span<const SequenceForward> batch) const {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  for (size_t i = 0; i < batch.size(); ++i) {
    check_forward(batch[i]);
    for (size_t j = 0; j < i; ++j)
      if (batch[j].state == batch[i].state) invalid_input("forward_batch: one state in two sequences");
  }
  std::vector<const SequenceForward*> together;  // the ones that share the pass
  for (const SequenceForward& s : batch) {
    const int64_t T = static_cast<int64_t>(s.tokens.size());
    if (executor_ || T >= cpu::kGemmMinRows || s.state->input_statistics() != nullptr)
      forward(s);
    else
      together.push_back(&s);
  }
  if (together.empty()) return;
  prepare_cpu_kernels();

  std::vector<SequenceSlice> slices;
  int64_t N = 0;
  for (const SequenceForward* s : together) {
    const int64_t T = static_cast<int64_t>(s->tokens.size());
    const int64_t p0 = s->state->position();
    slices.push_back({.p0 = p0,
                      .first_row = N,
                      .t_count = T,
                      .record_window = s->record_window,
                      .traffic = &s->state->expert_traffic()});
    N += T;
  }
  std::vector<float> x(static_cast<size_t>(N * H));
  for (size_t i = 0; i < together.size(); ++i)
    for (int64_t t = 0; t < slices[i].t_count; ++t)
      cpu::weight_row_to_f32(weights_.embed_tokens, together[i]->tokens[static_cast<size_t>(t)],
                             &x[static_cast<size_t>((slices[i].first_row + t) * H)]);
  for (int64_t li = 0; li < c.num_layers; ++li) {
    for (size_t i = 0; i < together.size(); ++i) {
      slices[i].kv = &together[i]->state->kv(li);
      slices[i].delta = &together[i]->state->delta(li);
    }
    decoder_layer_forward_batch(weights_.layers[static_cast<size_t>(li)], c, slices, x.data(), N);
  }

  // Final norm for every row; the lm_head for the rows asked for, all sequences' in one product.
  const float eps = static_cast<float>(c.rms_norm_eps);
  std::vector<float> logit_inputs;
  std::vector<std::pair<size_t, int64_t>> logit_rows;  // (sequence, its first logit row) per block of rows
  int64_t L = 0;
  for (size_t i = 0; i < together.size(); ++i) {
    const SequenceForward& s = *together[i];
    const int64_t T = slices[i].t_count;
    s.result->candidates = {};
    s.result->hidden.resize(static_cast<size_t>(T * H));
    for (int64_t t = 0; t < T; ++t)
      cpu::rms_norm(&x[static_cast<size_t>((slices[i].first_row + t) * H)], weights_.final_norm.data(), eps,
                    H, &s.result->hidden[static_cast<size_t>(t * H)]);
    const int64_t first = s.rows == LogitRows::kAll ? 0 : T - 1;
    const int64_t count = s.rows == LogitRows::kNone ? 0 : T - first;
    logit_inputs.insert(logit_inputs.end(), s.result->hidden.begin() + first * H,
                        s.result->hidden.begin() + (first + count) * H);
    logit_rows.emplace_back(i, L);
    L += count;
  }
  const int64_t Vh = weights_.lm_head.rows;
  std::vector<float> logits(static_cast<size_t>(L * Vh));
  for_invariant_row_blocks(L, [&](int64_t r0, int64_t n) {
    cpu::matmul(weights_.lm_head, &logit_inputs[static_cast<size_t>(r0 * H)], n,
                &logits[static_cast<size_t>(r0 * Vh)]);
  });
  for (size_t k = 0; k < logit_rows.size(); ++k) {
    const auto [i, first] = logit_rows[k];
    const SequenceForward& s = *together[i];
    const int64_t end = k + 1 < logit_rows.size() ? logit_rows[k + 1].second : L;
    s.result->logits.assign(logits.begin() + first * Vh, logits.begin() + end * Vh);
    const int64_t p0 = slices[i].p0, T = slices[i].t_count;
    const std::vector<float>& out = s.rows == LogitRows::kNone ? s.result->hidden : s.result->logits;
    if (!cpu::all_finite(out.data(), static_cast<int64_t>(out.size())))
      fail_non_finite(fmt::format("{} at positions {}..{}",
                                  s.rows == LogitRows::kNone ? "hidden states" : "logits", p0, p0 + T - 1));
    logit_row_argmax(s.result->logits, V, s.argmax_limit, s.result->argmax);
    if (s.record_window) s.state->set_window(p0, T);
    s.state->advance(T);
  }
}

void Model::fetch_logits(const InferenceState& state, int64_t row, std::span<const int32_t> ids,
                         std::vector<float>& values) const {
  if (!executor_ || state.device() == nullptr)
    fail(ErrorKind::kInternal, "fetch_logits: the CPU's passes return their logits");
  executor_->fetch_logits(*state.device(), DeviceLogitRow{.index = row}, ids, values);
}

int32_t Model::draw_below(const InferenceState& state, int64_t row, const BelowDraw& draw) const {
  if (!executor_ || state.device() == nullptr)
    fail(ErrorKind::kInternal, "draw_below: the CPU's passes return their logits");
  return executor_->draw_below(*state.device(), DeviceLogitRow{.index = row}, draw);
}

void Model::fail_non_finite(const std::string& what) const {
  std::string culprits;
  int found = 0;
  if (store_) {
    for (const std::string& name : store_->names()) {
      const int64_t bad = count_non_finite(*store_->find(name));
      if (bad == 0) continue;
      if (++found <= 3) culprits += fmt::format("{}'{}' ({} values)", found > 1 ? ", " : "", name, bad);
    }
  }
  if (found > 3) culprits += fmt::format(" and {} more", found - 3);
  invalid_input("the model computed NaN or Inf {}: {}", what,
                found > 0 ? fmt::format("the checkpoint has NaN/Inf weights in tensor {}", culprits)
                          : std::string("the weights are finite, so the values overflowed"));
}

void Model::rollback(InferenceState& state, int64_t keep) const {
  if (keep < 1 || keep > state.window_tokens())
    invalid_input("rollback to {} tokens of a {}-token window (at least 1)", keep, state.window_tokens());
  if (executor_)
    executor_->rollback(*state.device(), state.window_tokens(), keep);
  else
    for (int64_t li = 0; li < config_.num_layers; ++li)
      if (config_.layer_types[static_cast<size_t>(li)] == LayerType::kLinearAttention)
        deltanet_rollback(config_, state.delta(li), keep);
  state.set_position(state.window_start() + keep);
  state.set_window(state.window_start(), keep);
}

}  // namespace mtpx
