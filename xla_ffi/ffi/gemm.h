// FFI handler of the GEMM-only mode: the fused kernels' GEMM with communication switched off,
// used to measure what fusion costs the GEMM itself against XLA's dot (cuBLAS).
#ifndef JAXFLUX_XLA_FFI_FFI_GEMM_H_
#define JAXFLUX_XLA_FFI_FFI_GEMM_H_

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxGemm);
// The fused GEMM+ReduceScatter's own-rows GEMM alone, with or without its source C.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxGemmOwnRows);

#endif  // JAXFLUX_XLA_FFI_FFI_GEMM_H_
