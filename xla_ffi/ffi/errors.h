// Errors of the FFI handlers: every message starts with "jaxflux <op>: ", CUDA failures name
// the call that failed and clear CUDA's sticky last error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <limits>
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

// InvalidArgument "jaxflux <op>: attribute <name>=<value> <why>".
inline xla::ffi::Error InvalidAttr(const char* op, const char* name, int64_t value,
                                   const std::string& why) {
  return xla::ffi::Error::InvalidArgument(std::string("jaxflux ") + op + ": attribute " + name +
                                          "=" + std::to_string(value) + " " + why);
}

// Success when `value` is one of `allowed`, else InvalidArgument naming them.
inline xla::ffi::Error CheckAttrIn(const char* op, const char* name, int64_t value,
                                   std::initializer_list<int64_t> allowed) {
  std::string list;
  for (int64_t a : allowed) {
    if (a == value) return xla::ffi::Error::Success();
    list += (list.empty() ? "" : ", ") + std::to_string(a);
  }
  return InvalidAttr(op, name, value, "must be one of " + list);
}

// A tile-order swizzle (CUTLASS max_swizzle_size).
inline xla::ffi::Error CheckSwizzle(const char* op, const char* name, int64_t value) {
  return CheckAttrIn(op, name, value, {1, 2, 4, 8});
}

// grid_sms: 0 (all SMs) or a positive SM count.
inline xla::ffi::Error CheckGridSms(const char* op, int64_t value) {
  if (value < 0 || value > std::numeric_limits<int>::max()) {
    return InvalidAttr(op, "grid_sms", value, "must be 0 (all SMs) or a positive SM count");
  }
  return xla::ffi::Error::Success();
}

}  // namespace jaxflux

// Returns the handler's error when `expr` (an xla::ffi::Error) is a failure.
#define JAXFLUX_RETURN_IF_ERROR(expr)                                    \
  do {                                                                   \
    if (::xla::ffi::Error jaxflux_e_ = (expr); jaxflux_e_.failure()) {   \
      return jaxflux_e_;                                                 \
    }                                                                    \
  } while (0)

// Returns the handler's error when a CUDA runtime call fails.
#define JAXFLUX_RETURN_IF_CUDA_ERROR(op, call)                            \
  do {                                                                    \
    if (cudaError_t jaxflux_err_ = (call); jaxflux_err_ != cudaSuccess) { \
      return ::jaxflux::CudaOpError(op, #call, jaxflux_err_);             \
    }                                                                     \
  } while (0)
