// Builds without the CUDA backend (no nvcc found by CMake): --device cuda says so.
#include "model/device.h"
#include "util/error.h"

namespace mtpx {

bool cuda_compiled_in() { return false; }

std::unique_ptr<DeviceExecutor> make_cuda_executor(const Model&) {
  fail(ErrorKind::kUnsupported,
       "--device cuda: this mtpx was built without CUDA (no nvcc found at configure time)");
}

}  // namespace mtpx
