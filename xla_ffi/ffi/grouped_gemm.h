// FFI handler of the grouped GEMM (the MoE expert matmul and its weight gradient), and the size
// of the workspace each call declares as its second result.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"
#include "xla_ffi/kernels/gemm_sm90.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxGroupedGemm);

namespace jaxflux {

// Bytes of the workspace result of a jaxflux_grouped_gemm call: a [m, k], `groups` groups, the
// output's n, with the call's kind, transpose_w and tile attributes, on CUDA device `device`;
// nullopt with *error for attributes the handler refuses.
std::optional<size_t> GroupedGemmWorkspaceBytes(GemmDtype dtype, int64_t m, int64_t n, int64_t k,
                                                int64_t groups, int64_t kind,
                                                int64_t transpose_w, int64_t tile,
                                                int32_t device, std::string* error);

}  // namespace jaxflux
