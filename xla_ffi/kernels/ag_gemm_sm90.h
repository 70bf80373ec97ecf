// AllGather+GEMM on Hopper: the GEMM half. D[M,N] = A[M,K] · B[K,N] where A is the gathered input
// that copy engines are still filling while the kernel runs. Before a CTA loads A for an output
// tile it waits (bounded) on the flags of the shard chunks the tile's rows come from (TileWait).
// Plain C++ interface: the FFI handler never sees CUTLASS.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "xla_ffi/kernels/gemm_sm90.h"
#include "xla_ffi/kernels/tile_wait.h"

namespace jaxflux {

inline constexpr int kAgGemmMaxRanks = kTileWaitMaxRanks;

// The CUTLASS kernel shapes compiled for the fused kernel (tile MxN, K step 64; cluster MxN;
// cooperative or ping-pong warp specialization). Chosen per shape by jaxflux/tuning.
enum class AgGemmConfig : int {
  kCooperative128x256Cluster2x1 = 0,
  kPingpong128x128Cluster1x2 = 1,
};
inline constexpr int kAgGemmNumConfigs = 2;

// Rows of one output tile, the same in every config: a shard read through a_local must be a
// whole number of them.
inline constexpr int kAgGemmTileRows = 128;

struct AgGemmProblem {
  // a = the gathered buffer (workspace), m = batch*tp*rows_per_shard; gemm.swizzle and
  // gemm.grid_sms as given by the caller.
  GemmProblem gemm;
  TileWait wait;
  int wait_for_flags;      // 0: GEMM-only mode (no waits; what fusion costs the GEMM itself)
  AgGemmConfig config = AgGemmConfig::kCooperative128x256Cluster2x1;
  // This rank's own shard, [batch * rows_per_shard, K] row-major (x): when set, the tiles of
  // rank wait.rank's rows are read from it instead of from gemm.a, whose own rows then need not
  // hold the shard. Needs rows_per_shard % kAgGemmTileRows == 0; nullptr: all from a.
  const void* a_local = nullptr;
};

size_t AgGemmSm90WorkspaceBytes(GemmDtype dtype, const AgGemmProblem& problem);

// Launches on `stream`. Returns a static string describing the failure, or nullptr.
const char* AgGemmSm90(GemmDtype dtype, const AgGemmProblem& problem, void* workspace,
                       cudaStream_t stream);

}  // namespace jaxflux
