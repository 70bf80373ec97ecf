// FFI handler of the GEMM-only modes: the fused kernels' GEMMs with communication switched off,
// used to measure what fusion costs the GEMM itself against XLA's dot (cuBLAS).
#pragma once

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxGemm);
