// The CUDA runtime behind small RAII wrappers, so that code above the backend never includes CUDA
// headers: device discovery, device memory, a stream, a cuBLAS handle, captured CUDA graphs.
// Every failure throws mtpx::Error naming the call (kUnsupported when there is no usable GPU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mtpx::cuda {

// Empty when a CUDA device is usable; else why not, as one phrase: "no CUDA GPU found (...)" or
// "no usable GPU (the runtime's or cuBLAS's reason)".
std::string unavailable_reason();

struct DeviceInfo {
  std::string name;
  int compute_major = 0, compute_minor = 0;
  int64_t total_bytes = 0, free_bytes = 0;
};
DeviceInfo device_info();

// Device memory (cudaMalloc), freed on destruction.
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t bytes);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Page-locked host memory (cudaMallocHost): device copies to and from it run at full speed.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// A CUDA stream and the cuBLAS handle bound to it.
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  void* handle() const { return stream_; }  // cudaStream_t
  void* cublas() const { return cublas_; }  // cublasHandle_t
  void synchronize() const;
  void to_device(void* dst, const void* src, size_t bytes) const;  // ordered on the stream
  void to_host(void* dst, const void* src, size_t bytes) const;    // ordered on the stream
  void device_copy(void* dst, const void* src, size_t bytes) const;
  void zero(void* dst, size_t bytes) const;

  // CUDA graphs: everything launched on the stream between begin_capture and end_capture is recorded
  // instead of run; the returned graph (cudaGraphExec_t) replays it with one launch.
  void begin_capture() const;
  void* end_capture() const;
  void launch_graph(void* graph) const;
  static void destroy_graph(void* graph);

 private:
  void* stream_ = nullptr;
  void* cublas_ = nullptr;
};

// Roofline probes (measure the card before judging a kernel): device-to-device copy bandwidth in bytes
// moved per second (read + written), and the bf16 GEMM rate (n x n x n, f32 accumulate) in FLOP/s.
double copy_bandwidth(size_t bytes, int reps);
double bf16_gemm_rate(int n, int reps);
// The latency floor of a pass: seconds per kernel of a captured graph of `launches` kernels of `blocks`
// blocks of 128 threads, each reading what the one before wrote and moving no other bytes, launched as the
// row kernels are (launch_pdl). A pass of N dependent kernels costs at least N times this, whatever its
// bytes (BENCHMARKS.md, "Mixture-of-experts models, GPU"). Implemented in row_ops.cu.
double dependent_launch_seconds(int launches, int blocks, int reps);

// Throws if the last kernel launch failed (launch configuration errors surface here).
void check_launch(const char* what);

// Whether the row kernels launch with programmatic stream serialization (device_math.cuh, launch_pdl);
// MTPX_CUDA_PDL=0 turns it off, to measure what it gives. Read once.
bool pdl_enabled();

// Whether the 4-bit row kernels quantize the activations to int8 (affine.cu), as the CPU's do
// (quant_matmul.h): unless the environment sets MTPX_AFFINE_ACTIVATIONS=f32. Read once.
bool affine_int8_activations();

// Whether bf16 decode and verify rows run on tensor cores (matmul.cu, bf16_tile_rows): unless the
// environment sets MTPX_BF16_ROWS=fma (the FMA kernel). Read once.
bool bf16_tensor_rows();

// Whether the bf16 row kernels take their input's RMSNorm (kernels.h, RowNorm): unless the environment sets
// MTPX_FUSED_NORMS=0 (a norm kernel before each product). Read once.
bool fused_row_norms();

// Whether the DeltaNet kernels launched under programmatic dependent launch load the state no earlier
// kernel of the pass writes (the delta rule's state, the conv state) before griddep_wait (device_math.cuh):
// unless the environment sets MTPX_EARLY_LOADS=0. Read once.
bool early_loads();

// Whether the 4-bit row kernels split each row of a product of few rows over 2 warps (affine.cu,
// int8_slices): unless the environment sets MTPX_INT8_SLICES=1 (one warp per row everywhere). Read once.
bool int8_row_slices();

// Whether bf16 decode and verify rows of up to 4 activation rows stream their weights through shared
// memory (matmul.cu, bf16_stream_rows; the same arithmetic as bf16_tile_rows): unless the environment sets
// MTPX_BF16_STREAM=0. Read once.
bool bf16_streaming();

// The current device's streaming multiprocessors. Read once.
int multiprocessor_count();

}  // namespace mtpx::cuda
