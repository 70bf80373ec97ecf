// The decode GEMM (GemmTiles::kSwapAB): D[M, N] = A[M, K] · B[K, N] for few rows M (the tokens
// of a decode step) against a large B (the weight), computed as Dᵀ = Bᵀ·Aᵀ. sm90's wgmma tile is
// 64 or 128 rows on its M side but 8-256 on its N side, so B's N goes on the 128-row side and
// the few rows of A on the narrow side, padded only to the next token width (16, 32 or 64;
// more rows take several token tiles). A column-major Dᵀ is D row-major: no transpose pass.
// CUTLASS's stream-K scheduler spreads the K loops over every SM (N/128 tiles are fewer than
// the SMs), with its deterministic fixup: the same bits run to run.
//
// Takes what GemmSm90 takes (gemm_sm90.h): 16-bit A, B, D with B N-major or K-major; FP8 A
// e4m3/e5m2 with B e4m3 K-major, D bf16 with the row and column scales. Batched problems must
// be contiguous (they fold into the rows).
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

#include "xla_ffi/kernels/gemm_sm90.h"

namespace jaxflux {

// The token widths built: a problem of `rows` rows runs the narrowest that holds them (the
// widest for more rows).
inline constexpr int kSwapAbTokenWidths[] = {16, 32, 64};
inline constexpr int kSwapAbNumWidths = 3;

constexpr int SwapAbWidthIndex(long long rows) {
  return rows <= 16 ? 0 : rows <= 32 ? 1 : 2;
}

size_t GemmSwapAbSm90WorkspaceBytes(GemmDtype dtype, const GemmProblem& problem);

// Launches on `stream`. Returns a static string describing the failure, or nullptr.
const char* GemmSwapAbSm90(GemmDtype dtype, const GemmProblem& problem, void* workspace,
                           cudaStream_t stream);

}  // namespace jaxflux
