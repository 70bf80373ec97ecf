#include "xla_ffi/runtime/stream_ops.h"

#include <cuda.h>

namespace jaxflux {
namespace {

using WriteValue64Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

struct Entry {
  WriteValue64Fn fn = nullptr;
  std::string error;
};

const Entry& WriteValue64() {
  static const Entry entry = [] {
    Entry e;
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    // Version 12000: the cuStreamWriteValue64 of CUDA 12 (the _v2 ABI), present in every driver
    // that runs CUDA 12 or 13 code.
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &fn, 12000, cudaEnableDefault,
                                         &status);
    if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || fn == nullptr) {
      (void)cudaGetLastError();
      e.error = std::string("the CUDA driver does not provide cuStreamWriteValue64 (") +
                cudaGetErrorString(err) + "); update the NVIDIA driver";
      return e;
    }
    e.fn = reinterpret_cast<WriteValue64Fn>(fn);
    return e;
  }();
  return entry;
}

}  // namespace

bool WriteFlag(cudaStream_t stream, uint64_t* flag, uint64_t value, std::string* error) {
  const Entry& entry = WriteValue64();
  if (entry.fn == nullptr) {
    *error = entry.error;
    return false;
  }
  const CUresult res = entry.fn(reinterpret_cast<CUstream>(stream),
                                reinterpret_cast<CUdeviceptr>(flag), value, 0);
  if (res != CUDA_SUCCESS) {
    *error = "cuStreamWriteValue64 failed with CUresult " + std::to_string(static_cast<int>(res)) +
             " (64-bit stream memory operations need CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_"
             "MEM_OPS)";
    return false;
  }
  return true;
}

}  // namespace jaxflux
