// Errors of the FFI handlers: every message starts with "jaxflux <op>: ", CUDA failures name
// the call that failed and clear CUDA's sticky last error.
#ifndef JAXFLUX_XLA_FFI_FFI_ERRORS_H_
#define JAXFLUX_XLA_FFI_FFI_ERRORS_H_

#include <cuda_runtime_api.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxflux {

inline xla::ffi::Error OpError(const char* op, const std::string& what) {
  return xla::ffi::Error::Internal(std::string("jaxflux ") + op + ": " + what);
}

inline xla::ffi::Error CudaOpError(const char* op, const char* call, cudaError_t err) {
  (void)cudaGetLastError();
  return OpError(op, std::string(call) + " failed: " + cudaGetErrorString(err));
}

}  // namespace jaxflux

// Returns the handler's error when a CUDA runtime call fails.
#define JAXFLUX_RETURN_IF_CUDA_ERROR(op, call)                            \
  do {                                                                    \
    if (cudaError_t jaxflux_err_ = (call); jaxflux_err_ != cudaSuccess) { \
      return ::jaxflux::CudaOpError(op, #call, jaxflux_err_);             \
    }                                                                     \
  } while (0)

#endif  // JAXFLUX_XLA_FFI_FFI_ERRORS_H_
