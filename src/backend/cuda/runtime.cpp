#include "backend/cuda/runtime.h"

#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "backend/cuda/cublas_api.h"
#include "util/error.h"

namespace mtpx::cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(ErrorKind::kInternal, "CUDA: {} failed: {}", what, cudaGetErrorString(e));
}
void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    fail(ErrorKind::kInternal, "cuBLAS: {} failed (status {})", what, static_cast<int>(s));
}
cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

std::string unavailable_reason() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error for later callers
    // Without an NVIDIA kernel driver the runtime reports an "insufficient" driver; say what it means.
    if (e == cudaErrorNoDevice ||
        (e == cudaErrorInsufficientDriver && !std::filesystem::exists("/proc/driver/nvidia/version")))
      return "no CUDA GPU found (no NVIDIA GPU driver on this machine)";
    return fmt::format("no usable GPU ({})", cudaGetErrorString(e));
  }
  if (count == 0) return "no CUDA GPU found";
  if (const std::string cublas = cublas_load_error(); !cublas.empty())
    return fmt::format("no usable GPU ({})", cublas);
  return "";
}

DeviceInfo device_info() {
  DeviceInfo info;
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, 0), "cudaGetDeviceProperties");
  info.name = p.name;
  info.compute_major = p.major;
  info.compute_minor = p.minor;
  size_t free_b = 0, total_b = 0;
  check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  info.free_bytes = static_cast<int64_t>(free_b);
  info.total_bytes = static_cast<int64_t>(total_b);
  return info;
}

Buffer::Buffer(size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t e = cudaMalloc(&data_, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    fail(ErrorKind::kInvalidInput, "CUDA: cannot allocate {:.1f} MiB of GPU memory: {}",
         static_cast<double>(bytes) / (1 << 20), cudaGetErrorString(e));
  }
}
Buffer::~Buffer() {
  if (data_ != nullptr) cudaFree(data_);
}
Buffer::Buffer(Buffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_) { o.data_ = nullptr, o.bytes_ = 0; }
Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) cudaFree(data_);
    data_ = o.data_, bytes_ = o.bytes_;
    o.data_ = nullptr, o.bytes_ = 0;
  }
  return *this;
}

PinnedBuffer::PinnedBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes > 0) check(cudaMallocHost(&data_, bytes), "cudaMallocHost");
}
PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);
}
PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_) {
  o.data_ = nullptr, o.bytes_ = 0;
}
PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = o.data_, bytes_ = o.bytes_;
    o.data_ = nullptr, o.bytes_ = 0;
  }
  return *this;
}

Stream::Stream() {
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  stream_ = s;
  const CublasApi& blas = cublas_api();
  cublasHandle_t h = nullptr;
  check(blas.create(&h), "cublasCreate");
  cublas_ = h;
  check(blas.set_stream(h, s), "cublasSetStream");
  // Deterministic results run to run (no split-K atomics).
  check(blas.set_atomics_mode(h, CUBLAS_ATOMICS_NOT_ALLOWED), "cublasSetAtomicsMode");
}
Stream::~Stream() {
  if (cublas_ != nullptr) cublas_api().destroy(static_cast<cublasHandle_t>(cublas_));
  if (stream_ != nullptr) cudaStreamDestroy(as_stream(stream_));
}
void Stream::synchronize() const {
  check(cudaStreamSynchronize(as_stream(stream_)), "cudaStreamSynchronize");
}
void Stream::to_device(void* dst, const void* src, size_t bytes) const {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, as_stream(stream_)), "cudaMemcpy H2D");
}
void Stream::to_host(void* dst, const void* src, size_t bytes) const {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, as_stream(stream_)), "cudaMemcpy D2H");
}
void Stream::device_copy(void* dst, const void* src, size_t bytes) const {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, as_stream(stream_)), "cudaMemcpy D2D");
}
void Stream::zero(void* dst, size_t bytes) const {
  check(cudaMemsetAsync(dst, 0, bytes, as_stream(stream_)), "cudaMemset");
}
void Stream::begin_capture() const {
  check(cudaStreamBeginCapture(as_stream(stream_), cudaStreamCaptureModeThreadLocal),
        "cudaStreamBeginCapture");
}
void* Stream::end_capture() const {
  cudaGraph_t graph = nullptr;
  check(cudaStreamEndCapture(as_stream(stream_), &graph), "cudaStreamEndCapture");
  // MTPX_CUDA_GRAPH_NODES=1 prints each captured pass's kernel count (the latency floor of a pass is that
  // count times dependent_launch_seconds).
  if (const char* v = std::getenv("MTPX_CUDA_GRAPH_NODES"); v != nullptr && std::string(v) == "1") {
    size_t nodes = 0;
    if (cudaGraphGetNodes(graph, nullptr, &nodes) == cudaSuccess)
      std::fprintf(stderr, "mtpx: captured a CUDA graph of %zu nodes\n", nodes);
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check(e, "cudaGraphInstantiate");
  return exec;
}
void Stream::launch_graph(void* graph) const {
  check(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), as_stream(stream_)), "cudaGraphLaunch");
}
void Stream::destroy_graph(void* graph) {
  if (graph != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph));
}

namespace {
template <typename F>
double seconds_per_rep(const Stream& s, int reps, F&& body) {
  body();  // warm-up
  s.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) body();
  s.synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}
}  // namespace

double copy_bandwidth(size_t bytes, int reps) {
  Stream s;
  Buffer a(bytes), b(bytes);
  s.zero(a.data(), bytes);
  const double t = seconds_per_rep(s, reps, [&] { s.device_copy(b.data(), a.data(), bytes); });
  return 2.0 * static_cast<double>(bytes) / t;
}

double bf16_gemm_rate(int n, int reps) {
  Stream s;
  const size_t elems = static_cast<size_t>(n) * static_cast<size_t>(n);
  Buffer a(elems * 2), b(elems * 2), c(elems * 4);
  // Constant non-zero operands (bf16 0x3c3c ~ 0.0115); all-zero data would run cooler than real weights.
  check(cudaMemsetAsync(a.data(), 0x3c, elems * 2, as_stream(s.handle())), "cudaMemset");
  check(cudaMemsetAsync(b.data(), 0x3c, elems * 2, as_stream(s.handle())), "cudaMemset");
  const float alpha = 1.0f, beta = 0.0f;
  const auto h = static_cast<cublasHandle_t>(s.cublas());
  const double t = seconds_per_rep(s, reps, [&] {
    check(cublas_api().gemm_ex(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a.data(), CUDA_R_16BF, n,
                               b.data(), CUDA_R_16BF, n, &beta, c.data(), CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                               CUBLAS_GEMM_DEFAULT),
          "cublasGemmEx");
  });
  return 2.0 * n * static_cast<double>(n) * n / t;
}

void check_launch(const char* what) { check(cudaGetLastError(), what); }

namespace {
// True unless the environment sets `name` to `off` (the switches below are read once).
bool unless_env(const char* name, const char* off) {
  const char* v = std::getenv(name);
  return v == nullptr || std::string(v) != off;
}
}  // namespace

bool pdl_enabled() {
  static const bool enabled = unless_env("MTPX_CUDA_PDL", "0");
  return enabled;
}

bool affine_int8_activations() {
  // The CPU validates the value (quant_matmul.cpp); here anything but f32 keeps the default.
  static const bool enabled = unless_env("MTPX_AFFINE_ACTIVATIONS", "f32");
  return enabled;
}

bool bf16_tensor_rows() {
  static const bool enabled = unless_env("MTPX_BF16_ROWS", "fma");
  return enabled;
}

bool fused_row_norms() {
  static const bool enabled = unless_env("MTPX_FUSED_NORMS", "0");
  return enabled;
}

bool early_loads() {
  static const bool enabled = unless_env("MTPX_EARLY_LOADS", "0");
  return enabled;
}

bool int8_row_slices() {
  static const bool enabled = unless_env("MTPX_INT8_SLICES", "1");
  return enabled;
}

bool bf16_streaming() {
  static const bool enabled = unless_env("MTPX_BF16_STREAM", "0");
  return enabled;
}

int multiprocessor_count() {
  static const int count = [] {
    int device = 0, n = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n < 1)
      fail(ErrorKind::kInternal, "CUDA: cannot read the number of multiprocessors");
    return n;
  }();
  return count;
}

}  // namespace mtpx::cuda
