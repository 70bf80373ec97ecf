// The sm90 GEMM: D[M,N] = A[M,K] · B[K,N], row-major, bf16 or fp16 in and out, fp32
// accumulation, on Hopper (sm_90a); B may also be given transposed (b_kmajor). FP8: A e4m3 or
// e5m2, B e4m3 given transposed (wgmma reads 8-bit operands K-major only), D bf16 =
// (A·B) * row_scale[m] * col_scale[n], the scales applied in the epilogue. CUTLASS's
// persistent GEMM runs GEMM+ReduceScatter's peer rows and the GEMM-only kernel 0; GemmProblem
// also describes the fused kernels' GEMMs (ag_gemm_sm90.h, rs_gemm_sm90.h). Plain C++
// interface: the FFI handlers and nanobind never see CUTLASS.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace jaxflux {

// 16-bit kinds: A, B and D of that type. FP8 kinds: A of that type, B e4m3 (K-major), D bf16.
enum class GemmDtype { kBF16, kF16, kE4M3, kE5M2 };

constexpr bool IsFp8(GemmDtype dtype) {
  return dtype == GemmDtype::kE4M3 || dtype == GemmDtype::kE5M2;
}

// The fused FP8 kernels accumulate in wgmma's own accumulator ("fast accumulation"): its error
// stayed within 3x the bf16 output's rounding on every benchmark shape, while promoting to fp32
// registers every 4 k-blocks took 3.0-3.3x the time with 128x256 tiles (docs/design.md, "FP8").
inline constexpr bool kFp8FastAccum = true;

// GemmSm90's kernels, the `tile` attribute of GEMM+AllReduce and of the GEMM-only kernel 0.
enum class GemmTiles {
  // CUTLASS's persistent GEMM, 128x256 tiles, 2x1 clusters: many output tiles (prefill).
  kPersistent128x256 = 0,
  // CUTLASS's stream-K scheduler on 128x128 tiles: fewer output tiles than SMs, so K is split
  // across SMs and every SM reads its share of B.
  kStreamK128x128 = 1,
  // The decode GEMM (gemm_swap_ab_sm90.h): Dᵀ = Bᵀ·Aᵀ, B's N on the 128-row side of the tile
  // and A's few rows on the narrow side, stream-K across SMs.
  kSwapAB = 2,
};
inline constexpr int kGemmNumTiles = 3;

struct GemmProblem {
  const void* a;  // [m, k] row-major (rows contiguous, leading dimension k)
  const void* b;  // [k, n] row-major (or [n, k] with b_kmajor), shared by every batch entry
  void* d;        // [m, n] row-major
  int m, n, k;
  int device;     // CUDA ordinal (for the SM count the persistent scheduler sizes its grid by)
  // Batched problems (L mode): `batch` entries, a and d advancing by these element strides.
  int batch = 1;
  int64_t batch_stride_a = 0, batch_stride_d = 0;
  // b holds Bᵀ, [n, k] row-major (K-major B, wgmma's native layout): D = A · bᵀ. The backward
  // passes use the forward weight this way instead of a transposed copy XLA would materialize.
  bool b_kmajor = false;
  // The tile order's swizzle (CUTLASS max_swizzle_size: 1, 2, 4 or 8 M-tile cluster rows swept
  // together, for L2 reuse of B). Chosen by jaxflux/tuning; the kernels take it as given.
  int swizzle = 1;
  // SMs the persistent grid is sized for: 0 all of the device's, n > 0 min(n, SMs). Fewer leave
  // SMs free for other streams' kernels (tests run two ranks on one GPU this way).
  int grid_sms = 0;
  // The kernel's tiles (GemmSm90 only: GEMM+AllReduce and the GEMM-only kernel 0).
  GemmTiles tiles = GemmTiles::kPersistent128x256;
  // FP8 kinds only: D = (A·B) * row_scale[m] * col_scale[n] in fp32, then rounded to bf16.
  const float* row_scale = nullptr;  // [batch][m], entries batch_stride_row_scale apart
  int64_t batch_stride_row_scale = 0;
  const float* col_scale = nullptr;  // [n]
  // FP8 kinds only, GemmSm90 only (the fused kernels use kFp8FastAccum): accumulate in wgmma's
  // accumulator instead of promoting to fp32 registers every 4 k-blocks.
  bool fast_accum = kFp8FastAccum;
};

// Bytes of scratch the kernel needs for this problem (stream-K: its partial-tile workspace).
size_t GemmSm90WorkspaceBytes(GemmDtype dtype, const GemmProblem& problem);

// Launches on `stream`. Returns a static string describing the failure, or nullptr.
const char* GemmSm90(GemmDtype dtype, const GemmProblem& problem, void* workspace,
                     cudaStream_t stream);

}  // namespace jaxflux
