// The grouped GEMM of a mixture-of-experts layer on Hopper (sm_90a), bf16 or fp16 in and out,
// fp32 accumulation. The rows of A are sorted by group and `group_sizes` (int32, in device
// memory) says how many each group has, so routing never leaves the GPU: a setup kernel turns
// the sizes into CUTLASS's per-group problem shapes and pointers, and CUTLASS's ptr-array
// grouped GEMM reads them on the device (an empty group has no tiles).
//
//   kForward:    D[rows of g] = A[rows of g] · B[g]      A [m, k], B [groups, k, n] (or
//                                                        [groups, n, k] with b_kmajor), D [m, n];
//                                                        rows past sum(group_sizes) are zeroed.
//   kWeightGrad: D[g] = A[rows of g]ᵀ · B[rows of g]     A [m, k], B [m, n], D [groups, k, n];
//                                                        an empty group's D[g] is zeroed.
//   FP8 (kForward, GemmDtype::kE4M3): A and B e4m3, B K-major [groups, n, k], D bf16:
//                D[i, j] = (A[i] · B[g][j]) · row_scale[i] · col_scale[g, j] in fp32, rounded
//                once (the scales in CUTLASS's epilogue).
//
// Group sizes are clamped as the kernels read them: negative sizes count as 0, and groups past
// row m get only the rows that are left, so no size can make a kernel read or write out of
// bounds. Plain C++ interface: the FFI handler never sees CUTLASS.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "xla_ffi/kernels/gemm_sm90.h"

namespace jaxflux {

enum class GroupedGemmKind { kForward = 0, kWeightGrad = 1 };

// The tile configs built, the `tile` attribute of jaxflux_grouped_gemm.
enum class GroupedGemmTiles {
  // Cooperative 128x256 tiles, 1x2 clusters (A multicast along N; M is per group, so clusters
  // never straddle the M side where a group's rows end).
  kCooperative128x256 = 0,
  // Ping-pong 128x128 tiles, 1x2 clusters: more, smaller tiles for groups of few rows.
  kPingpong128x128 = 1,
};
inline constexpr int kGroupedGemmNumTiles = 2;

struct GroupedGemmProblem {
  const void* a;               // [m, k] row-major, rows sorted by group
  const void* b;               // kForward: [groups, k, n] (b_kmajor: [groups, n, k]); else [m, n]
  const int32_t* group_sizes;  // [groups], device memory
  void* d;                     // kForward: [m, n]; kWeightGrad: [groups, k, n]
  int m, n, k, groups;
  bool b_kmajor = false;       // kForward only
  GroupedGemmKind kind = GroupedGemmKind::kForward;
  GroupedGemmTiles tiles = GroupedGemmTiles::kCooperative128x256;
  int device = 0;              // CUDA ordinal (SM count of the persistent grid)
  const float* row_scale = nullptr;  // FP8: [m], one per row of A
  const float* col_scale = nullptr;  // FP8: [groups, n], one per column of each B[g]
};

// Bytes of scratch the call needs: the per-group arguments and CUTLASS's tensor maps.
size_t GroupedGemmSm90WorkspaceBytes(GemmDtype dtype, const GroupedGemmProblem& problem);

// Launches on `stream`. Returns a static string describing the failure, or nullptr.
const char* GroupedGemmSm90(GemmDtype dtype, const GroupedGemmProblem& problem, void* workspace,
                            cudaStream_t stream);

}  // namespace jaxflux
