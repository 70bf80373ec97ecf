// FFI handler of the GEMM-only modes: the fused kernels' GEMMs with communication switched off
// (the tp=1 path of the dense ops, and what the benchmark times against XLA's dot), and the size
// of the workspace each call declares as its second result.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"
#include "xla_ffi/kernels/gemm_sm90.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxGemm);

namespace jaxflux {

// jaxflux_gemm's attributes, as jaxflux/ops/gemm.py passes them.
struct GemmChoice {
  int64_t kernel, transpose_w, tile, own_rows_schedule, push_chunks, swizzle, grid_sms,
      fast_accum;
};

// Bytes of the workspace result of a jaxflux_gemm call computing [m, k] x [k, n] (m all rows of
// a) with `choice` on CUDA device `device`; nullopt with *error for a choice the handler refuses.
std::optional<size_t> GemmWorkspaceBytes(GemmDtype dtype, int64_t m, int64_t n, int64_t k,
                                         const GemmChoice& choice, int32_t device,
                                         std::string* error);

}  // namespace jaxflux
