// GEMM+ReduceScatter on Hopper at tp=2: the GEMM of this device's own output rows with the
// reduction in its epilogue. D[M,N] = A[M,K] · B[K,N] + C[M,N], where C is the peer's partial
// of these rows, which the peer's copy engine is still pushing here while the kernel runs.
// Before the warp that loads C for an output tile loads it, it waits (bounded) on the flag the
// peer writes once the partial's chunk has landed (rs_epilogue_sm90.cuh); the mainloop never
// waits (A and B are local), so the wait overlaps the tile's math. Plain C++ interface: the FFI
// handler never sees CUTLASS.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "xla_ffi/kernels/gemm_sm90.h"
#include "xla_ffi/kernels/tile_wait.h"

namespace jaxflux {

struct RsGemmProblem {
  // a = this device's rows of x, b = w, d = the output z (batched: L mode); gemm.swizzle and
  // gemm.grid_sms as given by the caller.
  GemmProblem gemm;
  // The peer's partial of the same rows, laid out like d; nullptr: no source, D = A·B.
  const void* c;
  // One source (tp = 1; source_ranks[0] = the peer), rows_per_shard = rows per batch entry,
  // the push's chunks in chunk_ends; op = kMatmulReduceScatter. The chunks also set the tile
  // order: more than one sweeps the rows along N, in landing order.
  TileWait wait;
  int32_t wait_for_flags = 1;  // 0: no waits (the GEMM-only kernel; wait's flags unused)
  // 0: cooperative 128x256 tiles, cluster 2x1; 1: ping-pong 128x128, cluster 2x1
  // (rs_gemm_sm90.cuh). Chosen by jaxflux/tuning.
  int32_t pingpong = 0;
};

size_t RsGemmSm90WorkspaceBytes(GemmDtype dtype, const RsGemmProblem& problem);

// Launches on `stream`. Returns a static string describing the failure, or nullptr.
const char* RsGemmSm90(GemmDtype dtype, const RsGemmProblem& problem, void* workspace,
                       cudaStream_t stream);

}  // namespace jaxflux
