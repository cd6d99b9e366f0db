#include "backend/cuda/cublas_api.h"

#include <dlfcn.h>

#include <string>

#include "util/error.h"

namespace mtpx::cuda {
namespace {

#define MTPX_STRINGIFY2(x) #x
#define MTPX_STRINGIFY(x) MTPX_STRINGIFY2(x)
// The soname of the major version the headers describe (the ABI the table's types were compiled for).
constexpr const char* kSoname = "libcublas.so." MTPX_STRINGIFY(CUBLAS_VER_MAJOR);

struct LoadedCublas {
  CublasApi api;
  std::string error;  // empty when every symbol resolved
};

template <typename Fn>
bool resolve(void* library, const char* symbol, Fn* out, std::string* error) {
  *out = reinterpret_cast<Fn>(::dlsym(library, symbol));
  if (*out == nullptr && error->empty()) *error = std::string(kSoname) + " lacks the symbol " + symbol;
  return *out != nullptr;
}

LoadedCublas load() {
  LoadedCublas loaded;
  // The soname first (LD_LIBRARY_PATH, the loader cache), then the toolkit the build used.
  void* library = ::dlopen(kSoname, RTLD_NOW | RTLD_LOCAL);
#ifdef MTPX_CUDA_LIBRARY_DIR
  if (library == nullptr) {
    library = ::dlopen((std::string(MTPX_CUDA_LIBRARY_DIR) + "/" + kSoname).c_str(), RTLD_NOW | RTLD_LOCAL);
  }
#endif
  if (library == nullptr) {
    const char* why = ::dlerror();
    loaded.error = std::string("cannot load ") + kSoname +
                   " (cuBLAS, from the CUDA toolkit): " + (why != nullptr ? why : "not found");
    return loaded;
  }
  // Never closed: handles and functions from it live as long as the process.
  CublasApi& a = loaded.api;
  std::string& e = loaded.error;
  resolve(library, "cublasCreate_v2", &a.create, &e);
  resolve(library, "cublasDestroy_v2", &a.destroy, &e);
  resolve(library, "cublasSetStream_v2", &a.set_stream, &e);
  resolve(library, "cublasSetAtomicsMode", &a.set_atomics_mode, &e);
  resolve(library, "cublasSgemm_v2", &a.sgemm, &e);
  resolve(library, "cublasGemmEx", &a.gemm_ex, &e);
  return loaded;
}

// Loaded once per process (thread-safe static initialisation): the library is process-wide by nature.
const LoadedCublas& loaded_cublas() {
  static const LoadedCublas loaded = load();
  return loaded;
}

}  // namespace

const CublasApi& cublas_api() {
  const LoadedCublas& loaded = loaded_cublas();
  if (!loaded.error.empty()) fail(ErrorKind::kUnsupported, "{}", loaded.error);
  return loaded.api;
}

const char* cublas_load_error() { return loaded_cublas().error.c_str(); }

}  // namespace mtpx::cuda
