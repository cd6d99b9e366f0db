// cuBLAS, loaded with dlopen on first use instead of linked. libcublasLt alone is 540 MB: linked, the
// dynamic loader mapped and relocated it at every start, so each CPU-only run of a CUDA build (even
// `mtpx --version`) paid 0.2 s and 220 MB of resident memory for a library it never called. Loaded
// lazily, a CUDA build also starts on machines without the CUDA libraries and says why `--device cuda`
// cannot run there. Only backend/cuda sources include this header.
#pragma once

#include <cublas_v2.h>

namespace mtpx::cuda {

// The cuBLAS entry points mtpx calls (cublas_v2.h maps cublasCreate to cublasCreate_v2 and so on; the
// table names the exported symbols).
struct CublasApi {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetAtomicsMode) set_atomics_mode = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  // Spelled out: C++ also sees an inline overload taking a cudaDataType compute type.
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*,
                            void*, cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
};

// The loaded library; throws mtpx::Error (kUnsupported) naming the library or symbol that is missing.
const CublasApi& cublas_api();

// Empty when cuBLAS loads; else why not.
const char* cublas_load_error();

}  // namespace mtpx::cuda
