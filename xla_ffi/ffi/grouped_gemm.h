// FFI handler of the grouped GEMM (the MoE expert matmul and its weight gradient).
#pragma once

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxGroupedGemm);
