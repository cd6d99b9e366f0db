// The Qwen3.5 forward pass on a CUDA GPU: the same blocks as the CPU code (decoder_layer.cpp,
// attention.cpp, gated_deltanet.cpp, mlp.cpp, mtp_head.cpp) composed from backend/cuda kernels.
// Weights are uploaded once; activations live in scratch buffers sized for the longest pass so far;
// each sequence holds its KV caches and DeltaNet states in device memory.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "backend/cuda/kernels.h"
#include "backend/cuda/runtime.h"
#include "model/device.h"
#include "model/mtp_head.h"
#include "model/qwen35.h"
#include "util/bf16.h"
#include "util/error.h"

namespace mtpx {
namespace {

using cuda::Buffer;
using cuda::Matrix;

struct DeviceAttention {
  Matrix q_proj, k_proj, v_proj, o_proj;
  const float *q_norm = nullptr, *k_norm = nullptr;
};
struct DeviceDeltaNet {
  Matrix in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj;
  const float *conv1d = nullptr, *a_log = nullptr, *dt_bias = nullptr, *norm = nullptr;
};
// A mixture-of-experts MLP (model/moe.h): the router, the routed experts as tables of device pointers, the
// shared expert and its gate.
struct DeviceMoe {
  Matrix router, shared_expert_gate;  // [E, H], [1, H]
  Matrix shared_gate_proj, shared_up_proj, shared_down_proj;
  cuda::ExpertMatrices gate, up, down;
  int64_t experts = 0, per_token = 0;
};
struct DeviceLayer {
  LayerType type = LayerType::kLinearAttention;
  const float *input_norm = nullptr, *post_attn_norm = nullptr;
  DeviceAttention attention;
  DeviceDeltaNet delta_net;
  Matrix gate_proj, up_proj, down_proj;  // dense models
  std::optional<DeviceMoe> moe;          // MoE models
};
struct DeviceHead {
  Matrix fc;
  const float *pre_fc_norm_embedding = nullptr, *pre_fc_norm_hidden = nullptr, *norm = nullptr;
  DeviceLayer layer;
};

// A verify window longer than this is not recorded (the CPU has the same bound: kGemmMinRows).
constexpr int64_t kMaxWindow = cuda::kGemmMinRows - 1;
// A prompt's MoE blocks run over chunks of this many rows (their per-entry scratch, [rows * k, H], stays
// a few tens of MB).
constexpr int64_t kMoeChunk = 512;

struct DeviceKv {
  Buffer keys, values;  // [capacity, nkv, D]
};
struct DeviceDelta {
  Buffer conv, ssm;  // [Kc-1, conv_dim], [Hv, Dk, Dv]
  // The recorded window (as DeltaNetWindow on the CPU): state before it and its per-token inputs.
  Buffer conv_before, ssm_before, qkv, x, g, beta;
};

// A captured pass: replaying it launches the same kernels on the same buffers (positions and tokens
// are read from device memory, written before each launch).
struct CapturedPass {
  void* exec = nullptr;     // cudaGraphExec_t
  int64_t generation = -1;  // the scratch buffers it was captured with
};

class CudaExecutor;

class CudaSequence : public DeviceSequence {
 public:
  ~CudaSequence() override {
    for (auto& [key, pass] : graphs) cuda::Stream::destroy_graph(pass.exec);
  }
  ExpertTraffic expert_traffic() const override;
  const CudaExecutor* owner = nullptr;
  int64_t id = 0;  // unique among the executor's sequences
  // MoE models: the experts this sequence's passes read, counted by the routing kernel (4 x uint64:
  // ExpertTraffic's fields).
  Buffer traffic;
  Buffer pos{sizeof(int32_t)};
  std::vector<DeviceKv> kv;        // per layer (empty buffers for DeltaNet layers)
  std::vector<DeviceDelta> delta;  // per layer (empty for attention layers)
  // Key: rows T, logit rows, record_window, logit ids, argmax limit, the served sampling request's limit, k
  // and inverse temperature. One set per sequence: the graphs hold its buffers.
  std::map<std::tuple<int64_t, LogitRows, bool, int64_t, int64_t, int64_t, int64_t, double>, CapturedPass>
      graphs;
  // Logit rows kept for sampling (DeviceExecutor::keep_logits): kKeptLogitRows slots of the vocabulary's
  // length, made on the first keep; each slot's length as kept (0: empty).
  Buffer kept;
  std::vector<int64_t> kept_lengths;
};

class CudaExecutor final : public DeviceExecutor {
 public:
  explicit CudaExecutor(const Model& model);
  std::string description() const override { return description_; }
  int64_t weight_bytes() const override { return weight_bytes_; }
  int64_t peak_device_bytes() const override { return peak_device_bytes_.load(); }
  std::unique_ptr<DeviceSequence> new_sequence(int64_t capacity) const override;
  std::unique_ptr<DeviceSequence> new_mtp_sequence(int64_t capacity) const override;
  void forward(DeviceSequence& sequence, int64_t p0, std::span<const int32_t> tokens, LogitRows rows,
               bool record_window, int64_t argmax_limit, CandidateRequest sample, std::vector<float>& hidden,
               std::vector<float>& logits, std::vector<int32_t>& argmax,
               LogitCandidates& candidates) const override;
  void rollback(DeviceSequence& sequence, int64_t window_tokens, int64_t keep) const override;
  void fetch_logits(const DeviceSequence& sequence, DeviceLogitRow row, std::span<const int32_t> ids,
                    std::vector<float>& values) const override;
  void keep_logits(DeviceSequence& sequence, int64_t slot) const override;
  int32_t draw_below(const DeviceSequence& sequence, DeviceLogitRow row,
                     const BelowDraw& draw) const override;
  void mtp_forward(DeviceSequence& sequence, std::span<const float> hidden, std::span<const int32_t> tokens,
                   int64_t p0, LogitRows rows, int64_t logit_ids, int64_t argmax_limit,
                   CandidateRequest sample, std::vector<float>& hidden_out, std::vector<float>& logits,
                   std::vector<int32_t>& argmax, LogitCandidates& candidates) const override;

 private:
  // Scratch activations for passes of up to `capacity` rows.
  struct Scratch {
    int64_t rows = 0;
    Buffer tokens, x, normed, hidden, joined, qg, k, v, attn_o, qkv, xconv, z, b, a, g, beta, dn_o, gate, up,
        rounded, delta_chunks;
    // MoE blocks, for min(rows, kMoeChunk) rows: router logits [n, E], the chosen experts and their weights
    // [n, k], the plan, the experts' SwiGLU [n k, I] and outputs [n k, H], the shared expert's output [n, H]
    // and its gate logit [n].
    Buffer router_logits, chosen, route_weights, plan, expert_act, expert_y, shared_out, shared_gate;
  };

 public:
  // The experts `seq`'s passes read so far (copied from the device).
  ExpertTraffic traffic_of(const CudaSequence& seq) const;

 private:
  const void* upload_bytes(const void* host, size_t bytes);
  Matrix upload(const cpu::WeightMatrix& w, const char* what);
  const float* upload(const std::vector<float>& v);
  DeviceLayer upload(const LayerWeights& layer);
  DeviceMoe upload(const MoeWeights& moe);
  // Every expert's `which` matrix in one allocation, and the table of their device pointers.
  cuda::ExpertMatrices upload_experts(const MoeWeights& moe, cpu::WeightMatrix MlpWeights::*which,
                                      const char* what);
  // The MoE block's update of scratch x [T, H] (x += moe(post_norm(x))).
  void moe_forward(const DeviceMoe& moe, const float* post_attn_norm, CudaSequence& seq,
                   int64_t t_count) const;
  void ensure_scratch(int64_t rows) const;
  void layer_forward(const DeviceLayer& layer, CudaSequence& seq, int64_t layer_index, DeviceKv* kv,
                     int64_t t_count, bool record_window) const;
  cuda::Workspace workspace() const {
    return {stream_.handle(), stream_.cublas(), scratch_.rounded.data(), dequant_.data()};
  }
  void mm(const Matrix& w, const float* x, int64_t m, float* y, bool accumulate = false) const {
    cuda::matmul(w, x, m, y, accumulate, workspace());
  }
  // `vocab`: logits of the first `vocab` ids (all of them but for an MTP draft vocabulary); argmax_limit
  // > 0: each row's argmax over ids < min(vocab, argmax_limit) too, and copy_out copies only those;
  // sample (served: see served()): each row's candidates, and copy_out copies those.
  void final_norm_and_logits(int64_t t_count, LogitRows rows, const float* norm, int64_t vocab,
                             int64_t argmax_limit, const CandidateRequest& sample) const;
  void copy_out(int64_t t_count, LogitRows rows, int64_t vocab, int64_t argmax_limit,
                const CandidateRequest& sample, std::vector<float>& hidden, std::vector<float>& logits,
                std::vector<int32_t>& argmax, LogitCandidates& candidates) const;
  // The staging buffer, at least `bytes` long (only kAll passes need more than a row).
  void* staging(size_t bytes) const {
    if (staging_.bytes() < bytes) staging_ = cuda::PinnedBuffer(bytes);
    return staging_.data();
  }
  // Where a logit row of `seq` is on the device and its length (fetch_logits' rules); the mutex held.
  std::pair<const float*, int64_t> logit_row(const CudaSequence& seq, DeviceLogitRow row) const;
  // `count` floats from `from` (device) into `logits`, through the staging buffer.
  void logits_to_host(const float* from, int64_t count, std::vector<float>& logits) const;
  // Logit rows of a pass of t_count tokens.
  static int64_t logit_rows(LogitRows rows, int64_t t_count) {
    return rows == LogitRows::kAll ? t_count : rows == LogitRows::kLast ? 1 : 0;
  }
  // After a pass of `seq`: logits_ holds its logits (fetch_logits).
  void note_logits_owner(const CudaSequence& seq, LogitRows rows, int64_t t_count, int64_t vocab) const {
    logits_owner_ = seq.id;
    logits_rows_ = logit_rows(rows, t_count);
    logits_vocab_ = vocab;
  }
  // What the kernels compute for a sampling request (cuda::topk_candidates): the ids at or above the k-th
  // largest logit below `limit`, and with inv_temperature > 0 the masses.
  struct ServedRequest {
    int64_t limit = 0, k = 0;
    double inv_temperature = 0.0;
    bool active() const { return k > 0; }
  };
  // The request this pass serves over its `vocab` logits ({} for none: the logits are copied), never with
  // an argmax: top-k's survivors for a k up to kMaxTopK; without top-k, top-p or min-p from the
  // kThresholdCandidates largest and the rest's mass (CandidateRequest).
  static ServedRequest served(CandidateRequest sample, int64_t vocab, int64_t argmax_limit) {
    sample.limit = std::min(sample.limit, vocab);
    if (argmax_limit != 0 || !sample.active()) return {};
    if (sample.top_k_active())
      return sample.top_k <= kMaxTopK ? ServedRequest{sample.limit, sample.top_k} : ServedRequest{};
    if (kThresholdCandidates >= sample.limit) return {};
    return {sample.limit, kThresholdCandidates, 1.0 / sample.temperature};
  }
  static constexpr int64_t kMaxTopK = 256;
  // Why 768: top-p's prefix at Qwen's recommended settings is rarely longer, and a row whose prefix is
  // longer comes back whole; 8 KiB per row stays the copy.
  static constexpr int64_t kThresholdCandidates = 768;
  static constexpr int64_t kCandidateCap = 1024;  // candidates held per row (ties past the k-th included)
  // Runs `body` (kernels only) on the stream; passes short enough for the row kernels are captured into a
  // CUDA graph the first time and replayed after (one launch instead of hundreds).
  template <typename Body>
  void run_pass(CudaSequence& seq, int64_t t_count, LogitRows rows, bool record, int64_t vocab,
                int64_t argmax_limit, const CandidateRequest& sample, Body&& body) const;
  void set_inputs(CudaSequence& seq, int64_t p0, std::span<const int32_t> tokens) const;
  // The per-row results of `rows` logit rows: argmax_ and the candidate_ buffers.
  void allocate_row_results(int64_t rows) const {
    const auto n = static_cast<size_t>(rows), slots = static_cast<size_t>(rows * kCandidateCap);
    argmax_ = Buffer(n * sizeof(int32_t));
    candidate_ids_ = Buffer(slots * sizeof(int32_t));
    candidate_values_ = Buffer(slots * sizeof(float));
    candidate_counts_ = Buffer(n * sizeof(int32_t));
    candidate_masses_ = Buffer(2 * n * sizeof(double));
    candidate_bands_ = Buffer(n * sizeof(cuda::TopPBand));
    candidate_scratch_ = Buffer(static_cast<size_t>(cuda::topk_scratch_bytes(rows)));
  }

  ModelConfig config_;
  std::string description_;
  int64_t weight_bytes_ = 0;
  mutable std::atomic<int64_t> peak_device_bytes_{0};
  // Samples the device's memory in use into peak_device_bytes_.
  void note_device_usage() const {
    const cuda::DeviceInfo info = cuda::device_info();
    const int64_t used = info.total_bytes - info.free_bytes;
    int64_t seen = peak_device_bytes_.load();
    while (used > seen && !peak_device_bytes_.compare_exchange_weak(seen, used)) {
    }
  }
  mutable std::mutex mutex_;  // one pass at a time: the scratch buffers are shared
  cuda::Stream stream_;
  std::vector<Buffer> arena_;               // every uploaded tensor
  Buffer dequant_;                          // affine weights on the prompt path (when there are any)
  std::map<const void*, Matrix> uploaded_;  // host data -> device matrix (tied weights upload once)
  Matrix embed_tokens_, lm_head_;
  const float* final_norm_ = nullptr;
  std::vector<DeviceLayer> layers_;
  std::optional<DeviceHead> head_;
  mutable Scratch scratch_;
  // The split-key attention's partial results and counters: decode and verify rows only, so one size.
  Buffer attention_scratch_;
  mutable int64_t scratch_generation_ = 0;
  bool use_graphs_ = true;
  mutable Buffer logits_;
  // The sequence (CudaSequence::id, trunk or head) whose pass computed logits_, its logit rows and their
  // length: what fetch_logits may copy.
  mutable int64_t logits_owner_ = 0;
  mutable int64_t logits_rows_ = 0, logits_vocab_ = 0;
  mutable std::atomic<int64_t> sequences_made_{0};
  mutable Buffer argmax_;                                               // int32 per logit row (greedy passes)
  mutable Buffer candidate_ids_, candidate_values_, candidate_counts_;  // [rows, kCandidateCap], [rows]
  mutable Buffer candidate_masses_;     // [rows, 2]: the candidates' and the rest's
  mutable Buffer candidate_bands_;      // [rows]: where top-p ends below the candidates (cuda::topp_band)
  mutable Buffer candidate_scratch_;    // the select's state per row
  mutable Buffer draw_scratch_;         // draw_below's sums, then its result (made on first use)
  mutable cuda::PinnedBuffer staging_;  // host side of the result copies (grown on demand: staging())
};

cuda::Dtype device_dtype(cpu::WeightType t) {
  switch (t) {
    case cpu::WeightType::kF32:
      return cuda::Dtype::kF32;
    case cpu::WeightType::kF16:
      return cuda::Dtype::kF16;
    case cpu::WeightType::kBF16:
      return cuda::Dtype::kBF16;
    case cpu::WeightType::kAffine:
      break;
  }
  return cuda::Dtype::kAffine;
}

size_t dtype_bytes(cuda::Dtype t) { return t == cuda::Dtype::kF32 ? 4 : 2; }

CudaExecutor::CudaExecutor(const Model& model) : config_(model.config()) {
  const ModelConfig& c = config_;
  const cuda::DeviceInfo info = cuda::device_info();
  description_ = fmt::format("cuda: {}, sm_{}{}, {:.1f} GiB", info.name, info.compute_major,
                             info.compute_minor, static_cast<double>(info.total_bytes) / (1 << 30));
  if (c.head_dim % 32 != 0 || c.head_dim > 256)
    fail(ErrorKind::kUnsupported, "--device cuda: head_dim {} is not supported (32, 64, 128, 256)",
         c.head_dim);
  if (c.num_kv_heads < 1 || c.num_attention_heads % c.num_kv_heads != 0 ||
      c.num_attention_heads / c.num_kv_heads > 16)
    fail(ErrorKind::kUnsupported,
         "--device cuda: {} attention heads over {} key-value heads is not supported (at most 16 per group)",
         c.num_attention_heads, c.num_kv_heads);
  const ModelWeights& w = model.weights();
  // A model whose matrices alone exceed the GPU's free memory cannot be uploaded: say so before copying
  // tens of GB only to fail at the last allocation (a MoE model's experts all live on the device).
  const int64_t matrices = w.matrix_bytes + (model.mtp() != nullptr ? model.mtp()->matrix_bytes : 0);
  if (matrices > info.free_bytes)
    fail(ErrorKind::kUnsupported,
         "--device cuda: the weights take {:.1f} GiB, more than the {:.1f} GiB free on the GPU ({}); a "
         "quantized checkpoint (mtpx quantize) may fit, or --device cpu runs it from the mapped files",
         static_cast<double>(matrices) / (1 << 30), static_cast<double>(info.free_bytes) / (1 << 30),
         info.name);
  embed_tokens_ = upload(w.embed_tokens, "embed_tokens");
  lm_head_ = upload(w.lm_head, "lm_head");
  final_norm_ = upload(w.final_norm);
  for (const LayerWeights& layer : w.layers) layers_.push_back(upload(layer));
  if (const MtpWeights* m = model.mtp()) {
    DeviceHead h;
    h.fc = upload(m->fc, "mtp.fc");
    h.pre_fc_norm_embedding = upload(m->pre_fc_norm_embedding);
    h.pre_fc_norm_hidden = upload(m->pre_fc_norm_hidden);
    h.norm = upload(m->norm);
    h.layer = upload(m->layer);
    head_ = h;
  }
  const auto attention_bytes =
      static_cast<size_t>(cuda::attention_scratch_bytes(kMaxWindow, c.num_attention_heads, c.head_dim));
  attention_scratch_ = Buffer(attention_bytes);
  stream_.zero(attention_scratch_.data(), attention_bytes);
  stream_.synchronize();
  ensure_scratch(cuda::kGemmMinRows);
  logits_ = Buffer(static_cast<size_t>(cuda::kGemmMinRows * c.vocab_size) * sizeof(float));
  allocate_row_results(cuda::kGemmMinRows);
  note_device_usage();
  // MTPX_CUDA_GRAPHS=0 runs every pass launch by launch (for debugging and for measuring what graphs save).
  if (const char* g = std::getenv("MTPX_CUDA_GRAPHS")) use_graphs_ = std::string(g) != "0";
}

const void* CudaExecutor::upload_bytes(const void* host, size_t bytes) {
  Buffer b(bytes);
  stream_.to_device(b.data(), host, bytes);
  const void* p = b.data();
  weight_bytes_ += static_cast<int64_t>(bytes);
  arena_.push_back(std::move(b));
  return p;
}

Matrix CudaExecutor::upload(const cpu::WeightMatrix& w, const char* what) {
  if (auto it = uploaded_.find(w.data); it != uploaded_.end()) return it->second;
  Matrix m;
  m.type = device_dtype(w.type);
  m.rows = w.rows, m.cols = w.cols;
  if (m.type != cuda::Dtype::kAffine) {
    m.data = upload_bytes(w.data, static_cast<size_t>(w.rows * w.cols) * dtype_bytes(m.type));
  } else {
    if (const char* why = cuda::affine_unsupported(w.bits, w.group_size, w.cols); *why != '\0')
      fail(ErrorKind::kUnsupported, "--device cuda: quantized {} ({} bits, group {}): {}", what, w.bits,
           w.group_size, why);
    m.bits = w.bits, m.group_size = w.group_size;
    m.data = upload_bytes(w.data, static_cast<size_t>(w.rows * w.cols / 32 * w.bits) * 4);
    const size_t n = static_cast<size_t>(w.rows * (w.cols / w.group_size));
    // Scales and biases keep their bf16 or float32 type; float16 ones are widened to float32 (exact).
    auto widened = [&](const void* p) {
      std::vector<float> f(n);
      const auto* h = static_cast<const uint16_t*>(p);
      for (size_t i = 0; i < n; ++i) f[i] = f16_to_f32(h[i]);
      const void* d = upload_bytes(f.data(), n * sizeof(float));
      stream_.synchronize();  // f is about to go away
      return d;
    };
    switch (w.scale_type) {
      case cpu::WeightType::kBF16:
        m.scale_type = cuda::Dtype::kBF16;
        m.scales = upload_bytes(w.scales, n * 2), m.biases = upload_bytes(w.biases, n * 2);
        break;
      case cpu::WeightType::kF32:
        m.scale_type = cuda::Dtype::kF32;
        m.scales = upload_bytes(w.scales, n * 4), m.biases = upload_bytes(w.biases, n * 4);
        break;
      default:
        m.scale_type = cuda::Dtype::kF32;
        m.scales = widened(w.scales), m.biases = widened(w.biases);
        break;
    }
    if (dequant_.bytes() == 0) dequant_ = Buffer(static_cast<size_t>(cuda::kDequantBytes));
  }
  uploaded_[w.data] = m;
  return m;
}

const float* CudaExecutor::upload(const std::vector<float>& v) {
  if (v.empty()) return nullptr;
  const void* p = upload_bytes(v.data(), v.size() * sizeof(float));
  stream_.synchronize();  // v is pageable host memory that may go away
  return static_cast<const float*>(p);
}

DeviceLayer CudaExecutor::upload(const LayerWeights& l) {
  DeviceLayer d;
  d.type = l.type;
  d.input_norm = upload(l.input_norm);
  d.post_attn_norm = upload(l.post_attn_norm);
  if (l.attention) {
    const AttentionWeights& a = *l.attention;
    d.attention = {upload(a.q_proj, "q_proj"), upload(a.k_proj, "k_proj"), upload(a.v_proj, "v_proj"),
                   upload(a.o_proj, "o_proj"), upload(a.q_norm),           upload(a.k_norm)};
  }
  if (l.delta_net) {
    const DeltaNetWeights& n = *l.delta_net;
    d.delta_net = {upload(n.in_proj_qkv, "in_proj_qkv"),
                   upload(n.in_proj_z, "in_proj_z"),
                   upload(n.in_proj_b, "in_proj_b"),
                   upload(n.in_proj_a, "in_proj_a"),
                   upload(n.out_proj, "out_proj"),
                   upload(n.conv1d),
                   upload(n.a_log),
                   upload(n.dt_bias),
                   upload(n.norm)};
  }
  if (l.moe) {
    d.moe = upload(*l.moe);
  } else {
    d.gate_proj = upload(l.mlp.gate_proj, "gate_proj");
    d.up_proj = upload(l.mlp.up_proj, "up_proj");
    d.down_proj = upload(l.mlp.down_proj, "down_proj");
  }
  return d;
}

DeviceMoe CudaExecutor::upload(const MoeWeights& m) {
  DeviceMoe d;
  d.router = upload(m.router, "mlp.gate");
  d.shared_expert_gate = upload(m.shared_expert_gate, "shared_expert_gate");
  d.shared_gate_proj = upload(m.shared_expert.gate_proj, "shared_expert.gate_proj");
  d.shared_up_proj = upload(m.shared_expert.up_proj, "shared_expert.up_proj");
  d.shared_down_proj = upload(m.shared_expert.down_proj, "shared_expert.down_proj");
  d.experts = static_cast<int64_t>(m.experts.size());
  d.per_token = m.experts_per_token;
  d.gate = upload_experts(m, &MlpWeights::gate_proj, "experts' gate_proj");
  d.up = upload_experts(m, &MlpWeights::up_proj, "experts' up_proj");
  d.down = upload_experts(m, &MlpWeights::down_proj, "experts' down_proj");
  const cuda::ExpertMatrices &g = d.gate, &u = d.up;
  if (g.type != u.type || g.rows != u.rows || g.cols != u.cols || g.bits != u.bits ||
      g.group_size != u.group_size || g.scale_type != u.scale_type)
    fail(ErrorKind::kUnsupported,
         "--device cuda: the experts' gate_proj and up_proj are stored differently (type, shape or "
         "quantization); the GPU runs them in one product");
  return d;
}

cuda::ExpertMatrices CudaExecutor::upload_experts(const MoeWeights& moe, cpu::WeightMatrix MlpWeights::*which,
                                                  const char* what) {
  const cpu::WeightMatrix& first = moe.experts.at(0).*which;
  cuda::ExpertMatrices m;
  m.type = device_dtype(first.type);
  m.rows = first.rows, m.cols = first.cols;
  const bool affine = m.type == cuda::Dtype::kAffine;
  if (affine) {
    m.bits = first.bits, m.group_size = first.group_size;
    m.scale_type = first.scale_type == cpu::WeightType::kBF16 ? cuda::Dtype::kBF16 : cuda::Dtype::kF32;
  }
  const auto E = static_cast<int64_t>(moe.experts.size());
  if (const char* why = cuda::moe_unsupported(m, E, moe.experts_per_token); *why != '\0')
    fail(ErrorKind::kUnsupported, "--device cuda: {} ({} experts, {} per token): {}", what, E,
         moe.experts_per_token, why);
  for (int64_t e = 0; e < E; ++e) {
    const cpu::WeightMatrix& w = moe.experts[static_cast<size_t>(e)].*which;
    if (w.type != first.type || w.rows != first.rows || w.cols != first.cols || w.bits != first.bits ||
        w.group_size != first.group_size || w.scale_type != first.scale_type)
      fail(ErrorKind::kUnsupported, "--device cuda: the {} of expert {} are stored unlike expert 0's", what,
           e);
  }
  // Each expert's pieces at 256-byte boundaries (the kernels' 16-byte loads need 16).
  auto round_up = [](size_t n) { return (n + 255) / 256 * 256; };
  const size_t data_bytes = affine ? static_cast<size_t>(m.rows * m.cols / 32 * m.bits) * 4
                                   : static_cast<size_t>(m.rows * m.cols) * dtype_bytes(m.type);
  const size_t scale_count = affine ? static_cast<size_t>(m.rows * (m.cols / m.group_size)) : 0;
  const size_t scale_bytes = scale_count * (m.scale_type == cuda::Dtype::kF32 ? 4 : 2);
  const size_t piece = round_up(data_bytes) + 2 * round_up(scale_bytes);
  Buffer arena(piece * static_cast<size_t>(E));
  auto* base = static_cast<char*>(arena.data());
  std::vector<cuda::ExpertPointers> table(static_cast<size_t>(E));
  std::vector<float> widened;  // float16 scales and biases as float32 (exact)
  auto copy_scales = [&](void* to, const void* from) {
    if (first.scale_type == cpu::WeightType::kBF16 || first.scale_type == cpu::WeightType::kF32) {
      stream_.to_device(to, from, scale_bytes);
      return;
    }
    widened.resize(scale_count);
    for (size_t i = 0; i < scale_count; ++i) widened[i] = f16_to_f32(load_u16(from, static_cast<int64_t>(i)));
    stream_.to_device(to, widened.data(), scale_bytes);
    stream_.synchronize();  // `widened` is refilled next
  };
  for (int64_t e = 0; e < E; ++e) {
    const cpu::WeightMatrix& w = moe.experts[static_cast<size_t>(e)].*which;
    char* at = base + piece * static_cast<size_t>(e);
    stream_.to_device(at, w.data, data_bytes);
    cuda::ExpertPointers& p = table[static_cast<size_t>(e)];
    p.data = at;
    if (affine) {
      p.scales = at + round_up(data_bytes);
      p.biases = at + round_up(data_bytes) + round_up(scale_bytes);
      copy_scales(const_cast<void*>(p.scales), w.scales);
      copy_scales(const_cast<void*>(p.biases), w.biases);
    }
  }
  weight_bytes_ += static_cast<int64_t>(piece) * E;
  arena_.push_back(std::move(arena));
  m.table = static_cast<const cuda::ExpertPointers*>(
      upload_bytes(table.data(), table.size() * sizeof(cuda::ExpertPointers)));
  stream_.synchronize();  // `table` goes away
  return m;
}

void CudaExecutor::ensure_scratch(int64_t rows) const {
  if (rows <= scratch_.rows) return;
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, qg = c.num_attention_heads * 2 * c.head_dim,
                kv = c.num_kv_heads * c.head_dim;
  const int64_t hv = c.linear_num_value_heads, vdim = hv * c.linear_value_head_dim, conv = c.conv_dim();
  // The MLP's width: the dense one's, or a MoE model's shared expert (its routed experts have scratch of
  // their own).
  const int64_t mlp = std::max(c.intermediate_size, c.shared_expert_intermediate_size);
  const int64_t widest = std::max({2 * H, mlp, conv, vdim, c.num_attention_heads * c.head_dim});
  auto f32 = [&](int64_t per_row) { return Buffer(static_cast<size_t>(rows * per_row) * sizeof(float)); };
  Scratch s;
  s.rows = rows;
  s.tokens = Buffer(static_cast<size_t>(rows) * sizeof(int32_t));
  s.x = f32(H), s.normed = f32(H), s.hidden = f32(H), s.joined = f32(2 * H);
  s.qg = f32(qg), s.k = f32(kv), s.v = f32(kv), s.attn_o = f32(c.num_attention_heads * c.head_dim);
  s.qkv = f32(conv), s.xconv = f32(conv), s.z = f32(vdim), s.b = f32(hv), s.a = f32(hv), s.g = f32(hv);
  s.beta = f32(hv), s.dn_o = f32(vdim), s.gate = f32(mlp), s.up = f32(mlp);
  if (c.is_moe()) {
    const int64_t n = std::min(rows, kMoeChunk), E = c.num_experts, k = c.num_experts_per_tok;
    auto bytes = [](int64_t count) { return static_cast<size_t>(count) * 4; };
    s.router_logits = Buffer(bytes(n * E));
    s.chosen = Buffer(bytes(n * k)), s.route_weights = Buffer(bytes(n * k));
    s.plan = Buffer(static_cast<size_t>(cuda::moe_plan_bytes(n, k, E)));
    s.expert_act = Buffer(bytes(n * k * c.moe_intermediate_size));
    s.expert_y = Buffer(bytes(n * k * H));
    s.shared_out = Buffer(bytes(n * H)), s.shared_gate = Buffer(bytes(n));
  }
  s.rounded = Buffer(static_cast<size_t>(rows * widest) * 4);  // hi + lo 16-bit halves
  s.delta_chunks = Buffer(static_cast<size_t>(cuda::delta_rule_chunked_scratch_bytes(rows, hv)));
  stream_.synchronize();  // the old buffers may still be in use by queued work
  scratch_ = std::move(s);
  ++scratch_generation_;  // graphs captured on the old buffers are stale
  note_device_usage();
}

std::unique_ptr<DeviceSequence> CudaExecutor::new_sequence(int64_t capacity) const {
  const ModelConfig& c = config_;
  auto seq = std::make_unique<CudaSequence>();
  seq->id = ++sequences_made_;
  seq->owner = this;
  if (c.is_moe()) {
    seq->traffic = Buffer(4 * sizeof(unsigned long long));
    stream_.zero(seq->traffic.data(), seq->traffic.bytes());
  }
  seq->kv.resize(static_cast<size_t>(c.num_layers));
  seq->delta.resize(static_cast<size_t>(c.num_layers));
  const int64_t conv = c.conv_dim(), kc1 = c.linear_conv_kernel_dim - 1, hv = c.linear_num_value_heads;
  const size_t ssm =
      static_cast<size_t>(hv * c.linear_key_head_dim * c.linear_value_head_dim) * sizeof(float);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    if (c.layer_types[static_cast<size_t>(i)] == LayerType::kFullAttention) {
      const size_t n = static_cast<size_t>(capacity * c.num_kv_heads * c.head_dim) * sizeof(float);
      seq->kv[static_cast<size_t>(i)] = {Buffer(n), Buffer(n)};
    } else {
      DeviceDelta& d = seq->delta[static_cast<size_t>(i)];
      const size_t conv_bytes = static_cast<size_t>(kc1 * conv) * sizeof(float);
      d.conv = Buffer(conv_bytes), d.ssm = Buffer(ssm);
      d.conv_before = Buffer(conv_bytes), d.ssm_before = Buffer(ssm);
      d.qkv = Buffer(static_cast<size_t>(kMaxWindow * conv) * sizeof(float));
      d.x = Buffer(static_cast<size_t>(kMaxWindow * conv) * sizeof(float));
      d.g = Buffer(static_cast<size_t>(kMaxWindow * hv) * sizeof(float));
      d.beta = Buffer(static_cast<size_t>(kMaxWindow * hv) * sizeof(float));
      stream_.zero(d.conv.data(), conv_bytes);
      stream_.zero(d.ssm.data(), ssm);
    }
  }
  stream_.synchronize();
  note_device_usage();
  return seq;
}

std::unique_ptr<DeviceSequence> CudaExecutor::new_mtp_sequence(int64_t capacity) const {
  auto seq = std::make_unique<CudaSequence>();
  seq->id = ++sequences_made_;
  seq->owner = this;
  if (config_.is_moe()) {
    seq->traffic = Buffer(4 * sizeof(unsigned long long));
    stream_.zero(seq->traffic.data(), seq->traffic.bytes());
    stream_.synchronize();
  }
  const size_t n = static_cast<size_t>(capacity * config_.num_kv_heads * config_.head_dim) * sizeof(float);
  seq->kv.push_back({Buffer(n), Buffer(n)});
  note_device_usage();
  return seq;
}

void CudaExecutor::set_inputs(CudaSequence& seq, int64_t p0, std::span<const int32_t> tokens) const {
  ensure_scratch(static_cast<int64_t>(tokens.size()));
  const int32_t pos = static_cast<int32_t>(p0);
  stream_.to_device(seq.pos.data(), &pos, sizeof(pos));
  stream_.to_device(scratch_.tokens.data(), tokens.data(), tokens.size_bytes());
}

// One decoder layer (decoder_layer.cpp) in place on scratch x [T, H].
void CudaExecutor::layer_forward(const DeviceLayer& l, CudaSequence& seq, int64_t li, DeviceKv* kv, int64_t T,
                                 bool record) const {
  const ModelConfig& c = config_;
  const Scratch& s = scratch_;
  void* st = stream_.handle();
  const float eps = static_cast<float>(c.rms_norm_eps);
  float* x = s.x.as<float>();
  float* normed = s.normed.as<float>();
  // The pre-norms go into the products that read them where those can take them (cuda::RowNorm), else
  // into `normed` first.
  const cuda::RowNorm input_norm{l.input_norm, eps}, post_attn_norm{l.post_attn_norm, eps};
  if (l.type == LayerType::kFullAttention) {
    const DeviceAttention& a = l.attention;
    const Matrix qkv[3] = {a.q_proj, a.k_proj, a.v_proj};
    float* const qkv_out[3] = {s.qg.as<float>(), s.k.as<float>(), s.v.as<float>()};
    cuda::matmul_group(qkv, qkv_out, 3, x, T, workspace(), input_norm, normed);
    cuda::qk_norm_rope_store(s.qg.as<float>(), s.k.as<float>(), s.v.as<float>(), a.q_norm, a.k_norm, eps, T,
                             c.num_attention_heads, c.num_kv_heads, c.head_dim, c.rotary_dim, c.rope_theta,
                             seq.pos.as<int32_t>(), kv->keys.as<float>(), kv->values.as<float>(), st);
    cuda::attention(s.qg.as<float>(), kv->keys.as<float>(), kv->values.as<float>(), T, c.num_attention_heads,
                    c.num_kv_heads, c.head_dim, seq.pos.as<int32_t>(), s.attn_o.as<float>(),
                    attention_scratch_.data(), st);
    mm(a.o_proj, s.attn_o.as<float>(), T, x, /*accumulate=*/true);  // x += o_proj(o)
  } else {
    const DeviceDeltaNet& n = l.delta_net;
    DeviceDelta& d = seq.delta[static_cast<size_t>(li)];
    const int64_t conv = c.conv_dim(), hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
    const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
    // A recorded window's projections, conv output, g and beta go straight into the sequence's window
    // buffers, which rollback replays from (copying them there cost 4 copies per layer in each window).
    float* const qkv = record ? d.qkv.as<float>() : s.qkv.as<float>();
    float* const xconv = record ? d.x.as<float>() : s.xconv.as<float>();
    float* const g = record ? d.g.as<float>() : s.g.as<float>();
    float* const beta = record ? d.beta.as<float>() : s.beta.as<float>();
    const Matrix in[4] = {n.in_proj_qkv, n.in_proj_z, n.in_proj_b, n.in_proj_a};
    float* const in_out[4] = {qkv, s.z.as<float>(), s.b.as<float>(), s.a.as<float>()};
    cuda::matmul_group(in, in_out, 4, x, T, workspace(), input_norm, normed);
    cuda::deltanet_conv_prepare(qkv, d.conv.as<float>(), n.conv1d, s.b.as<float>(), s.a.as<float>(), n.a_log,
                                n.dt_bias, T, hk, hv, dk, conv, c.linear_conv_kernel_dim, xconv,
                                record ? d.conv_before.as<float>() : nullptr, beta, g, st);
    if (T >= cuda::kGemmMinRows)  // a prompt (never recorded: windows are shorter)
      cuda::delta_rule_chunked(xconv, g, beta, d.ssm.as<float>(), s.dn_o.as<float>(), T, hk, hv, dk, dv, conv,
                               s.delta_chunks.data(), st);
    else
      cuda::delta_rule(xconv, g, beta, d.ssm.as<float>(), d.ssm.as<float>(),
                       record ? d.ssm_before.as<float>() : nullptr, s.dn_o.as<float>(), T, hk, hv, dk, dv,
                       conv, st);
    cuda::gated_rms_norm(s.dn_o.as<float>(), s.z.as<float>(), n.norm, eps, T * hv, dv, st);
    mm(n.out_proj, s.dn_o.as<float>(), T, x, /*accumulate=*/true);  // x += out_proj(o)
  }
  if (l.moe) return moe_forward(*l.moe, l.post_attn_norm, seq, T);
  cuda::matmul_swiglu(l.gate_proj, l.up_proj, x, T, s.gate.as<float>(), s.up.as<float>(), workspace(),
                      post_attn_norm, normed);
  mm(l.down_proj, s.gate.as<float>(), T, x, /*accumulate=*/true);  // x += down(silu(gate) * up)
}

// model/moe.cpp's block on the device: x += sum of the chosen experts' SwiGLU outputs, weighted, in
// ascending expert order, + sigmoid(shared_expert_gate) * shared_expert, all of post_attn_norm(x).
void CudaExecutor::moe_forward(const DeviceMoe& m, const float* post_attn_norm, CudaSequence& seq,
                               int64_t T) const {
  const ModelConfig& c = config_;
  const Scratch& s = scratch_;
  void* st = stream_.handle();
  const int64_t H = c.hidden_size, E = m.experts, k = m.per_token;
  float* const x = s.x.as<float>();
  float* const normed = s.normed.as<float>();
  cuda::rms_norm_rows(x, H, post_attn_norm, static_cast<float>(c.rms_norm_eps), T, H, normed, H, st);
  auto* const traffic = static_cast<unsigned long long*>(seq.traffic.data());
  const int64_t chunk = T < cuda::kGemmMinRows ? T : kMoeChunk;
  for (int64_t c0 = 0; c0 < T; c0 += chunk) {
    const int64_t n = std::min(chunk, T - c0);
    const float* const h = normed + c0 * H;
    // The router and the shared expert's gate in runs of fewer than kGemmMinRows rows: the batch-invariant
    // row kernels, so that a prompt's token routes exactly as the same row would in a decode step.
    for (int64_t r0 = 0; r0 < n; r0 += kMaxWindow) {
      const Matrix both[2] = {m.router, m.shared_expert_gate};
      float* const out[2] = {s.router_logits.as<float>() + r0 * E, s.shared_gate.as<float>() + r0};
      cuda::matmul_group(both, out, 2, h + r0 * H, std::min(kMaxWindow, n - r0), workspace());
    }
    cuda::moe_route(s.router_logits.as<float>(), n, E, k, s.chosen.as<int32_t>(), s.route_weights.as<float>(),
                    s.plan.data(), traffic, st);
    cuda::moe_expert_swiglu(m.gate, m.up, s.plan.data(), n, k, E, h, s.expert_act.as<float>(), st);
    cuda::moe_expert_down(m.down, s.plan.data(), n, k, E, s.expert_act.as<float>(), s.expert_y.as<float>(),
                          st);
    cuda::matmul_swiglu(m.shared_gate_proj, m.shared_up_proj, h, n, s.gate.as<float>(), s.up.as<float>(),
                        workspace());
    mm(m.shared_down_proj, s.gate.as<float>(), n, s.shared_out.as<float>());
    cuda::moe_combine(x + c0 * H, s.expert_y.as<float>(), s.chosen.as<int32_t>(), s.route_weights.as<float>(),
                      s.shared_out.as<float>(), s.shared_gate.as<float>(), n, k, H, st);
  }
}

ExpertTraffic CudaExecutor::traffic_of(const CudaSequence& seq) const {
  if (seq.traffic.bytes() == 0) return {};
  std::lock_guard lock(mutex_);
  unsigned long long counts[4] = {};
  void* host = staging(sizeof(counts));
  stream_.to_host(host, seq.traffic.data(), sizeof(counts));
  stream_.synchronize();
  std::memcpy(counts, host, sizeof(counts));
  return {static_cast<int64_t>(counts[0]), static_cast<int64_t>(counts[1]), static_cast<int64_t>(counts[2]),
          static_cast<int64_t>(counts[3])};
}

ExpertTraffic CudaSequence::expert_traffic() const { return owner->traffic_of(*this); }

// hidden = final norm of x; logits for the rows asked for (kernels only: may be captured).
void CudaExecutor::final_norm_and_logits(int64_t T, LogitRows rows, const float* norm, int64_t V,
                                         int64_t argmax_limit, const CandidateRequest& sample) const {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size;
  const Scratch& s = scratch_;
  cuda::rms_norm_rows(s.x.as<float>(), H, norm, static_cast<float>(c.rms_norm_eps), T, H,
                      s.hidden.as<float>(), H, stream_.handle());
  const int64_t n_rows = logit_rows(rows, T);
  if (n_rows > 0) {
    if (static_cast<size_t>(n_rows * V) * sizeof(float) > logits_.bytes()) {  // never while capturing: T < 16
      stream_.synchronize();
      logits_ = Buffer(static_cast<size_t>(n_rows * V) * sizeof(float));
    }
    if (static_cast<size_t>(n_rows) * sizeof(int32_t) > argmax_.bytes()) {  // likewise
      stream_.synchronize();
      allocate_row_results(n_rows);
    }
    cuda::Matrix lm_head = lm_head_;  // the first V rows (a draft vocabulary's prefix, or all of them)
    lm_head.rows = V;
    mm(lm_head, s.hidden.as<float>() + (T - n_rows) * H, n_rows, logits_.as<float>());
    if (argmax_limit > 0)
      cuda::argmax_rows(logits_.as<float>(), n_rows, V, std::min(argmax_limit, V), argmax_.as<int32_t>(),
                        stream_.handle());
    if (const ServedRequest k = served(sample, V, argmax_limit); k.active())
      cuda::topk_candidates(logits_.as<float>(), n_rows, V, k.limit, k.k, kCandidateCap, k.inv_temperature,
                            candidate_ids_.as<int32_t>(), candidate_values_.as<float>(),
                            candidate_counts_.as<int32_t>(), candidate_masses_.as<double>(),
                            candidate_scratch_.data(), stream_.handle());
  }
}

void CudaExecutor::copy_out(int64_t T, LogitRows rows, int64_t V, int64_t argmax_limit,
                            const CandidateRequest& sample, std::vector<float>& hidden,
                            std::vector<float>& logits, std::vector<int32_t>& argmax,
                            LogitCandidates& candidates) const {
  const int64_t H = config_.hidden_size;
  const int64_t n_rows = logit_rows(rows, T);
  hidden.resize(static_cast<size_t>(T * H));
  candidates = {};
  // Greedy passes bring back one id per row instead of V floats (1 MB per row at Qwen's vocabulary), and
  // sampling each row's candidates (kCandidateCap of each per row, 8 KiB, and two masses).
  const bool ids_only = argmax_limit > 0;
  const ServedRequest served_request = n_rows > 0 ? served(sample, V, argmax_limit) : ServedRequest{};
  const bool survivors = served_request.active();
  const bool with_masses = served_request.inv_temperature > 0.0;
  logits.resize(ids_only || survivors ? 0 : static_cast<size_t>(n_rows * V));
  argmax.resize(ids_only ? static_cast<size_t>(n_rows) : 0);
  // Through page-locked staging: a pageable copy is staged by the driver in small pieces, far slower.
  const size_t hidden_bytes = hidden.size() * sizeof(float);
  const size_t slots = static_cast<size_t>(n_rows * kCandidateCap);
  const size_t counts_bytes = static_cast<size_t>(n_rows) * sizeof(int32_t);
  const size_t masses_bytes = with_masses ? static_cast<size_t>(2 * n_rows) * sizeof(double) : 0;
  // With the masses, room for where top-p ends below the candidates, copied only when asked (topp_band).
  const size_t bands_bytes = with_masses ? static_cast<size_t>(n_rows) * sizeof(cuda::TopPBand) : 0;
  const size_t out_bytes =
      ids_only    ? argmax.size() * sizeof(int32_t)
      : survivors ? masses_bytes + counts_bytes + slots * (sizeof(int32_t) + sizeof(float)) + bands_bytes
                  : logits.size() * sizeof(float);
  auto* host = static_cast<char*>(staging(hidden_bytes + out_bytes));
  stream_.to_host(host, scratch_.hidden.data(), hidden_bytes);
  char* out = host + hidden_bytes;  // survivors: the masses (8-byte aligned), counts, ids, values
  char* counts_at = out + masses_bytes;
  char* ids_at = counts_at + counts_bytes;
  char* values_at = ids_at + slots * sizeof(int32_t);
  char* bands_at = values_at + slots * sizeof(float);
  if (n_rows > 0) {
    if (survivors) {
      if (with_masses) stream_.to_host(out, candidate_masses_.data(), masses_bytes);
      stream_.to_host(counts_at, candidate_counts_.data(), counts_bytes);
      stream_.to_host(ids_at, candidate_ids_.data(), slots * sizeof(int32_t));
      stream_.to_host(values_at, candidate_values_.data(), slots * sizeof(float));
    } else {
      stream_.to_host(out, ids_only ? argmax_.data() : logits_.data(), out_bytes);
    }
  }
  stream_.synchronize();
  std::memcpy(hidden.data(), host, hidden_bytes);
  if (n_rows == 0) return;
  if (!survivors) {
    std::memcpy(ids_only ? static_cast<void*>(argmax.data()) : logits.data(), out, out_bytes);
    return;
  }
  std::vector<int32_t> counts(static_cast<size_t>(n_rows));
  std::memcpy(counts.data(), counts_at, counts_bytes);
  if (std::any_of(counts.begin(), counts.end(), [](int32_t c) { return c < 0; })) {
    candidates.offsets = {0, -1};  // NaN or Inf in a row: the caller reports it
    return;
  }
  std::vector<double> masses(static_cast<size_t>(2 * n_rows));
  if (with_masses) std::memcpy(masses.data(), out, masses_bytes);
  const auto* ids = reinterpret_cast<const int32_t*>(ids_at);
  const auto* values = reinterpret_cast<const float*>(values_at);
  bool whole_rows = false;  // more tied candidates than a row holds, or candidates that do not decide a row
  // Per row whose top-p prefix ends below its candidates: its lowest candidate logit; nullopt where the
  // candidates decide the row.
  std::vector<std::optional<float>> undecided(static_cast<size_t>(n_rows));
  for (int64_t r = 0; r < n_rows && !whole_rows; ++r) {
    const int32_t c = counts[static_cast<size_t>(r)];
    whole_rows = c > kCandidateCap;
    if (whole_rows || !with_masses) continue;
    const float* v = values + r * kCandidateCap;
    const auto [lowest, highest] = std::minmax_element(v, v + c);
    const double inv_t = served_request.inv_temperature;
    // As the sampler weighs them (decode/sampler.cpp), the highest weighing 1.
    const double lowest_weight =
        std::exp(static_cast<double>(*lowest) * inv_t - static_cast<double>(*highest) * inv_t);
    if (!sample.decided_by(masses[static_cast<size_t>(2 * r)], masses[static_cast<size_t>(2 * r + 1)],
                           lowest_weight))
      undecided[static_cast<size_t>(r)] = *lowest;
  }
  const bool any_undecided = std::any_of(undecided.begin(), undecided.end(),
                                         [](const std::optional<float>& u) { return u.has_value(); });
  // Top-p alone whose prefix ends below the candidates: where it ends, found on the device (a few passes
  // over the rows still there) instead of copying the rows (1 MB each at Qwen's vocabulary) and sorting on
  // the host (6 ms per flat row).
  std::vector<cuda::TopPBand> bands;
  if (!whole_rows && any_undecided) {
    // Only where the caller can draw below the candidates on the device (rows_on_request).
    whole_rows = !sample.rows_on_request || !sample.top_p_alone();
    if (!whole_rows) {
      bands.resize(static_cast<size_t>(n_rows));
      cuda::topp_band(logits_.as<float>(), n_rows, V, served_request.limit, served_request.inv_temperature,
                      sample.top_p, candidate_bands_.as<cuda::TopPBand>(), candidate_scratch_.data(),
                      stream_.handle());
      stream_.to_host(bands_at, candidate_bands_.data(), bands_bytes);
      stream_.synchronize();
      std::memcpy(bands.data(), bands_at, bands_bytes);
      for (int64_t r = 0; r < n_rows && !whole_rows; ++r) {
        const std::optional<float>& lowest_candidate = undecided[static_cast<size_t>(r)];
        if (!lowest_candidate) continue;
        const cuda::TopPBand& b = bands[static_cast<size_t>(r)];
        const double candidate_mass = masses[static_cast<size_t>(2 * r)];
        whole_rows =
            !(b.boundary < *lowest_candidate) ||
            !sample.decides_kept_below(candidate_mass, b.above_mass, b.boundary_mass, b.boundary_count,
                                       candidate_mass + masses[static_cast<size_t>(2 * r + 1)]);
      }
    }
  }
  if (whole_rows)
    return logits_to_host(logits_.as<float>(), n_rows * V,
                          logits);  // after all (they are still on the device)
  candidates.offsets.assign(1, 0);
  for (int64_t r = 0; r < n_rows; ++r) {
    const int32_t c = counts[static_cast<size_t>(r)];
    candidates.ids.insert(candidates.ids.end(), ids + r * kCandidateCap, ids + r * kCandidateCap + c);
    candidates.logits.insert(candidates.logits.end(), values + r * kCandidateCap,
                             values + r * kCandidateCap + c);
    candidates.offsets.push_back(static_cast<int64_t>(candidates.ids.size()));
    if (with_masses) candidates.rest_mass.push_back(masses[static_cast<size_t>(2 * r + 1)]);
    if (!bands.empty()) {
      const cuda::TopPBand& b = bands[static_cast<size_t>(r)];
      candidates.kept_below.push_back(
          undecided[static_cast<size_t>(r)].has_value()
              ? KeptBelow{.at_least = b.boundary, .mass = b.above_mass + b.boundary_mass}
              : KeptBelow{});
    }
  }
}

template <typename Body>
void CudaExecutor::run_pass(CudaSequence& seq, int64_t T, LogitRows rows, bool record, int64_t vocab,
                            int64_t argmax_limit, const CandidateRequest& sample, Body&& body) const {
  if (!use_graphs_ || T >= cuda::kGemmMinRows) {
    body();
    return;
  }
  const ServedRequest k = served(sample, vocab, argmax_limit);
  CapturedPass& pass = seq.graphs[{T, rows, record, vocab, argmax_limit, k.limit, k.k, k.inv_temperature}];
  if (pass.exec == nullptr || pass.generation != scratch_generation_) {
    cuda::Stream::destroy_graph(pass.exec);
    pass.exec = nullptr;
    stream_.begin_capture();
    try {
      body();
    } catch (...) {
      stream_.end_capture();  // leave the stream usable
      throw;
    }
    pass.exec = stream_.end_capture();
    pass.generation = scratch_generation_;
  }
  stream_.launch_graph(pass.exec);
}

void CudaExecutor::forward(DeviceSequence& sequence, int64_t p0, std::span<const int32_t> tokens,
                           LogitRows rows, bool record_window, int64_t argmax_limit, CandidateRequest sample,
                           std::vector<float>& hidden, std::vector<float>& logits,
                           std::vector<int32_t>& argmax, LogitCandidates& candidates) const {
  std::lock_guard lock(mutex_);
  auto& seq = static_cast<CudaSequence&>(sequence);
  const int64_t T = static_cast<int64_t>(tokens.size());
  if (record_window && T > kMaxWindow)
    invalid_input("a recorded (rollback) window holds at most {} tokens, got {}", kMaxWindow, T);
  set_inputs(seq, p0, tokens);
  const int64_t V = config_.vocab_size;
  run_pass(seq, T, rows, record_window, V, argmax_limit, sample, [&] {
    cuda::embed_rows(embed_tokens_, scratch_.tokens.as<int32_t>(), T, scratch_.x.as<float>(),
                     stream_.handle());
    for (size_t li = 0; li < layers_.size(); ++li)
      layer_forward(layers_[li], seq, static_cast<int64_t>(li), &seq.kv[li], T, record_window);
    final_norm_and_logits(T, rows, final_norm_, V, argmax_limit, sample);
  });
  note_logits_owner(seq, rows, T, V);
  copy_out(T, rows, V, argmax_limit, sample, hidden, logits, argmax, candidates);
}

std::pair<const float*, int64_t> CudaExecutor::logit_row(const CudaSequence& seq, DeviceLogitRow row) const {
  if (row.kept) {
    if (row.index < 0 || row.index >= static_cast<int64_t>(seq.kept_lengths.size()) ||
        seq.kept_lengths[static_cast<size_t>(row.index)] == 0)
      fail(ErrorKind::kInternal, "logits: none kept in slot {}", row.index);
    return {seq.kept.as<float>() + row.index * config_.vocab_size,
            seq.kept_lengths[static_cast<size_t>(row.index)]};
  }
  if (logits_owner_ != seq.id || row.index < 0 || row.index >= logits_rows_)
    fail(ErrorKind::kInternal, "logits: row {} is not of this sequence's last pass (another pass ran since?)",
         row.index);
  return {logits_.as<float>() + row.index * logits_vocab_, logits_vocab_};
}

void CudaExecutor::fetch_logits(const DeviceSequence& sequence, DeviceLogitRow row,
                                std::span<const int32_t> ids, std::vector<float>& values) const {
  std::lock_guard lock(mutex_);
  const auto [from, length] = logit_row(static_cast<const CudaSequence&>(sequence), row);
  if (ids.empty()) return logits_to_host(from, length, values);
  // One copy per id into the staging buffer, one wait (a draw needs a few ids at most).
  const size_t bytes = ids.size() * sizeof(float);
  auto* host = static_cast<float*>(staging(bytes));
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= length)
      fail(ErrorKind::kInternal, "fetch_logits: id {} of a row of {} logits", ids[i], length);
    stream_.to_host(host + i, from + ids[i], sizeof(float));
  }
  stream_.synchronize();
  values.assign(host, host + ids.size());
}

int32_t CudaExecutor::draw_below(const DeviceSequence& sequence, DeviceLogitRow row,
                                 const BelowDraw& draw) const {
  std::lock_guard lock(mutex_);
  const auto [from, length] = logit_row(static_cast<const CudaSequence&>(sequence), row);
  if (draw.limit < 1 || draw.limit > length)
    fail(ErrorKind::kInternal, "draw_below: a limit of {} in a row of {} logits", draw.limit, length);
  const auto scratch_bytes = static_cast<size_t>(cuda::draw_below_scratch_bytes());
  if (draw_scratch_.bytes() == 0) draw_scratch_ = Buffer(scratch_bytes + sizeof(int32_t));
  auto* out = reinterpret_cast<int32_t*>(static_cast<char*>(draw_scratch_.data()) + scratch_bytes);
  cuda::draw_below(from, draw.limit, draw.below, draw.at_least, draw.inv_temperature, draw.max_scaled,
                   draw.weight, draw_scratch_.data(), out, stream_.handle());
  void* host = staging(sizeof(int32_t));
  stream_.to_host(host, out, sizeof(int32_t));
  stream_.synchronize();
  int32_t id = -1;
  std::memcpy(&id, host, sizeof(id));
  if (id < 0) fail(ErrorKind::kInternal, "draw_below: no id of the row is below {}", draw.below);
  return id;
}

void CudaExecutor::keep_logits(DeviceSequence& sequence, int64_t slot) const {
  std::lock_guard lock(mutex_);
  auto& seq = static_cast<CudaSequence&>(sequence);
  if (logits_owner_ != seq.id || logits_rows_ == 0)
    fail(ErrorKind::kInternal, "keep_logits: another pass ran since this sequence's (or it had no logits)");
  if (slot < 0 || slot >= kKeptLogitRows) fail(ErrorKind::kInternal, "keep_logits: slot {}", slot);
  const int64_t V = config_.vocab_size;
  if (seq.kept_lengths.empty()) {
    seq.kept = Buffer(static_cast<size_t>(kKeptLogitRows * V) * sizeof(float));
    seq.kept_lengths.assign(static_cast<size_t>(kKeptLogitRows), 0);
    note_device_usage();
  }
  stream_.device_copy(seq.kept.as<float>() + slot * V,
                      logits_.as<float>() + (logits_rows_ - 1) * logits_vocab_,
                      static_cast<size_t>(logits_vocab_) * sizeof(float));
  seq.kept_lengths[static_cast<size_t>(slot)] = logits_vocab_;
}

void CudaExecutor::logits_to_host(const float* from, int64_t count, std::vector<float>& logits) const {
  logits.resize(static_cast<size_t>(count));
  const size_t bytes = logits.size() * sizeof(float);
  void* host = staging(bytes);
  stream_.to_host(host, from, bytes);
  stream_.synchronize();
  std::memcpy(logits.data(), host, bytes);
}

void CudaExecutor::rollback(DeviceSequence& sequence, int64_t window_tokens, int64_t keep) const {
  if (keep == window_tokens) return;  // the state is already the one after the whole window
  std::lock_guard lock(mutex_);
  auto& seq = static_cast<CudaSequence&>(sequence);
  const ModelConfig& c = config_;
  const int64_t conv = c.conv_dim();
  // Replay the kept tokens' recurrence from the pre-window state (bit-identical to having run only them),
  // all layers in one launch, then their conv states in another.
  std::vector<cuda::DeltaNetRollbackLayer> layers;
  for (int64_t li = 0; li < c.num_layers; ++li) {
    if (c.layer_types[static_cast<size_t>(li)] != LayerType::kLinearAttention) continue;
    DeviceDelta& d = seq.delta[static_cast<size_t>(li)];
    layers.push_back({.x = d.x.as<float>(),
                      .g = d.g.as<float>(),
                      .beta = d.beta.as<float>(),
                      .ssm_before = d.ssm_before.as<float>(),
                      .conv_before = d.conv_before.as<float>(),
                      .qkv = d.qkv.as<float>(),
                      .ssm = d.ssm.as<float>(),
                      .conv = d.conv.as<float>()});
  }
  cuda::deltanet_rollback(layers.data(), static_cast<int64_t>(layers.size()), keep, c.linear_num_key_heads,
                          c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim, conv,
                          c.linear_conv_kernel_dim, stream_.handle());
  stream_.synchronize();
}

void CudaExecutor::mtp_forward(DeviceSequence& sequence, std::span<const float> hidden,
                               std::span<const int32_t> tokens, int64_t p0, LogitRows rows, int64_t logit_ids,
                               int64_t argmax_limit, CandidateRequest sample, std::vector<float>& hidden_out,
                               std::vector<float>& logits, std::vector<int32_t>& argmax,
                               LogitCandidates& candidates) const {
  if (!head_) invalid_input("the model has no MTP head");
  std::lock_guard lock(mutex_);
  auto& seq = static_cast<CudaSequence&>(sequence);
  const ModelConfig& c = config_;
  const int64_t T = static_cast<int64_t>(tokens.size()), H = c.hidden_size;
  const int64_t V = logit_ids > 0 ? std::min(logit_ids, c.vocab_size) : c.vocab_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  void* st = stream_.handle();
  set_inputs(seq, p0, tokens);
  const Scratch& s = scratch_;
  // u = fc([norm_e(embed(x)) ; norm_h(h)])   (embedding first, hidden second: spec §6.1)
  stream_.to_device(s.hidden.data(), hidden.data(), hidden.size_bytes());
  run_pass(seq, T, rows, false, V, argmax_limit, sample, [&] {
    cuda::embed_rows(embed_tokens_, s.tokens.as<int32_t>(), T, s.normed.as<float>(), st);
    cuda::rms_norm_rows(s.normed.as<float>(), H, head_->pre_fc_norm_embedding, eps, T, H,
                        s.joined.as<float>(), 2 * H, st);
    cuda::rms_norm_rows(s.hidden.as<float>(), H, head_->pre_fc_norm_hidden, eps, T, H,
                        s.joined.as<float>() + H, 2 * H, st);
    mm(head_->fc, s.joined.as<float>(), T, s.x.as<float>());
    layer_forward(head_->layer, seq, -1, &seq.kv[0], T, false);
    final_norm_and_logits(T, rows, head_->norm, V, argmax_limit, sample);
  });
  note_logits_owner(seq, rows, T, V);
  copy_out(T, rows, V, argmax_limit, sample, hidden_out, logits, argmax, candidates);
}

}  // namespace

bool cuda_compiled_in() { return true; }

std::unique_ptr<DeviceExecutor> make_cuda_executor(const Model& model) {
  const std::string why = cuda::unavailable_reason();
  if (!why.empty()) fail(ErrorKind::kUnsupported, "--device cuda: {}", why);
  return std::make_unique<CudaExecutor>(model);
}

}  // namespace mtpx
