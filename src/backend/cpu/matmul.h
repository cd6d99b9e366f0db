// Matrix products of float32 activations with weights in their stored dtype (f32, f16, bf16).
//
// Batch invariance (the property that makes greedy MTP lossless): for M < kGemmMinRows, y[m, o] is
// computed by the same sequence of floating-point operations whatever M is and whichever rows share a
// kernel call: the reduction over k runs in a fixed lane-blocked order into four vector accumulators per
// (m, o), followed by a fixed sum of the four and a fixed horizontal sum (on AMX CPUs, bf16 weights packed
// into tiles: tile multiplies over the k-blocks in order, each C element from its own row and column);
// threads split the output features, never the reduction. Decode (1 row) and speculative verify windows
// (K+1 <= 9 rows) are therefore bit-identical row by row.
// Prompt prefill (M >= kGemmMinRows) is compute-bound instead: bf16 weights on a CPU with AMX go through
// tile products with the activations split into two bf16 terms (16 of their 24 bits; matmul.cpp bounds
// the error), other weights are widened to float32 in blocks for OpenBLAS sgemm. Its rows agree with the
// single-row results to float rounding, not bitwise; prefill is the same computation in plain and
// speculative decoding, so this costs no losslessness. MTPX_MATMUL_KERNEL=avx512|avx2|scalar keeps
// prefill on sgemm.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace mtpx::cpu {

// kAffine: group-wise affine quantization in the MLX layout (see WeightMatrix).
enum class WeightType { kF32, kF16, kBF16, kAffine };

// Row counts from which matmul switches to the GEMM path (see above).
inline constexpr int64_t kGemmMinRows = 16;

// A row-major [rows, cols] weight matrix (PyTorch nn.Linear layout: rows = out_features).
// kAffine (MLX's affine quantization, mx.quantize): w[o, k] = scales[o, k / group_size] * q[o, k]
// + biases[o, k / group_size], with q an unsigned `bits`-bit code. `data` is the packed uint32 array
// [rows, cols * bits / 32]: each row's codes form one little-endian bit stream, code k at bits
// [k * bits, (k + 1) * bits) (for bits 4 and 8 that is code j of a word at bits j * bits). scales and
// biases are [rows, cols / group_size] in scale_type (f32, f16 or bf16). The quantizer (quantize_affine)
// and the affine kernels are in quant_matmul.h.
struct WeightMatrix {
  WeightType type = WeightType::kF32;
  const void* data = nullptr;
  int64_t rows = 0;  // out features
  int64_t cols = 0;  // in features
  // kAffine only.
  int bits = 0;
  int64_t group_size = 0;
  WeightType scale_type = WeightType::kBF16;
  const void* scales = nullptr;
  const void* biases = nullptr;
  // bf16 only, optional: the same weights repacked into AMX tiles by pack_amx_tiles (owned by whoever made
  // the matrix). The AMX kernels need them for small-M products; the other kernels read `data`.
  const uint32_t* amx_tiles = nullptr;
};

// AMX tiles of a bf16 matrix with cols % 32 == 0: per block of 16 output rows (zero rows pad the matrix to a
// whole pair of blocks), per k-block of 32 columns, a 1 KiB tile of 16 pair rows x 16 outputs, word (p, n) =
// w[n, 2p] | w[n, 2p + 1] << 16. amx_tile_words: its size in 32-bit words (0 for a matrix the tiles do not
// serve).
int64_t amx_tile_words(const WeightMatrix& w);
void pack_amx_tiles(const WeightMatrix& w, uint32_t* out);
// Memory for AMX tiles: `words` 32-bit words, 64-byte aligned, on transparent huge pages where the OS
// grants them (madvise), zeroed. Owned; freed with the arena.
class TileArena {
 public:
  explicit TileArena(int64_t words);
  ~TileArena();
  TileArena(const TileArena&) = delete;
  TileArena& operator=(const TileArena&) = delete;
  uint32_t* data() const { return data_; }

 private:
  uint32_t* data_ = nullptr;
  size_t bytes_ = 0;
};

// Whether matmul() runs small-M products on AMX tiles (the kernel family in use is AMX): then models pack
// their bf16 matrices at load.
bool amx_small_m_path();

// Bytes a full pass over the matrix reads (codes plus scales and biases for kAffine).
int64_t weight_bytes(const WeightMatrix& w);

// y[m, o] = sum_k x[m, k] * W[o, k]   for m < M, o < W.rows.
// x: [M, W.cols] float32 row-major; y: [M, W.rows] float32 row-major (must not alias x).
void matmul(const WeightMatrix& w, const float* x, int64_t m, float* y);

// matmul() whose threads each read their share of the rows [0, prefix_rows) last: the share a matmul() of
// those rows alone gives the same thread. The lm_head of a verify pass is read this way so that the MTP
// head's product over its draft vocabulary (the first prefix_rows rows), which comes next, finds each
// thread's rows still in that core's L2 instead of streaming them from L3 again. Bit-identical to matmul().
void matmul_prefix_last(const WeightMatrix& w, const float* x, int64_t m, float* y, int64_t prefix_rows);

// One product of a matmul_shared_input() call: y = x W^T.
struct MatmulTarget {
  const WeightMatrix* w;
  float* y;
};

// matmul() of several matrices with the same input x ([M, cols]; every W.cols equal): each y is
// bit-identical to what matmul() gives. For decode and verify windows one thread team splits the output
// features of all the matrices at once, instead of one team per matrix: a small matrix (the shipped
// model's 128 KiB projections) split on its own barely gained from a second thread (each thread's share
// starts a new stream from L3), and every team costs a start and a join.
void matmul_shared_input(std::span<const MatmulTarget> targets, const float* x, int64_t m);

// The SIMD families of the small-M kernels. matmul() uses the one simd_path() names; tests run every one
// this CPU supports (each is batch-invariant on its own; they differ from one another in the last bits).
// kAvx2 runs on AVX-512 CPUs too. Affine weights ignore the choice (see affine_matmul's AffineKernel).
// kAmx (Intel AMX-BF16 tile multiplies, Sapphire Rapids and later) serves bf16 weights whose rows are a
// multiple of 32 long; other weights take the AVX-512 kernels in that family. A tile multiply costs the
// same for 1 or 5 rows, so its verify windows cost little more than a decode row; but its one-row pass
// was slower than AVX-512's where measured, so it runs only when asked for.
// The family is picked once per process from the CPU (AVX-512, else AVX2, else scalar); the environment
// variable MTPX_MATMUL_KERNEL (amx, avx512, avx2 or scalar) overrides it.
enum class MatmulKernel { kAmx, kAvx512, kAvx2, kScalar };
bool matmul_kernel_supported(MatmulKernel kernel);
// With an explicit family, prefill takes the AMX tiles only for kAmx. The family must be supported.
void matmul(const WeightMatrix& w, const float* x, int64_t m, float* y, MatmulKernel kernel);

// The same product computed in the plainest way (double accumulation): the oracle for tests.
void matmul_reference(const WeightMatrix& w, const float* x, int64_t m, float* y);

// Row `row` of the matrix widened to float32 (embedding lookup).
void weight_row_to_f32(const WeightMatrix& w, int64_t row, float* out);

// Which SIMD path the kernels picked on this CPU ("amx", "avx512", "avx2", "scalar").
const char* simd_path();

}  // namespace mtpx::cpu
