// The sm90 GEMM: D[M,N] = A[M,K] · B[K,N], row-major, bf16 or fp16 in and out, fp32
// accumulation, on Hopper (sm_90a); B may also be given transposed (b_kmajor). CUTLASS's
// persistent GEMM runs GEMM+ReduceScatter's peer rows and the GEMM-only kernel 0; GemmProblem
// also describes the fused kernels' GEMMs (ag_gemm_sm90.h, rs_gemm_sm90.h). Plain C++
// interface: the FFI handlers and nanobind never see CUTLASS.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace jaxflux {

enum class GemmDtype { kBF16, kF16 };

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
  // Stream-K 128x128 tiles instead of the stock 128x256 ones: CUTLASS's stream-K scheduler splits
  // K across SMs when there are fewer output tiles than SMs (few rows: decode), so every SM reads
  // its share of B. Only GemmSm90 takes it (GEMM+AllReduce and the GEMM-only kernel 0).
  bool streamk = false;
};

// Bytes of scratch the kernel needs for this problem (stream-K: its partial-tile workspace).
size_t GemmSm90WorkspaceBytes(GemmDtype dtype, const GemmProblem& problem);

// Launches on `stream`. Returns a static string describing the failure, or nullptr.
const char* GemmSm90(GemmDtype dtype, const GemmProblem& problem, void* workspace,
                     cudaStream_t stream);

}  // namespace jaxflux
