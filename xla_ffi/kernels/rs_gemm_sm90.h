// GEMM+ReduceScatter on Hopper at tp=2: the GEMM of this device's own output rows with the
// reduction in its epilogue. D[M,N] = A[M,K] · B[K,N] + C[M,N], where C is the peer's partial
// of these rows, which the peer's copy engine is still pushing here while the kernel runs.
// Before the warp that loads C for an output tile loads it, it waits (bounded) on the flag the
// peer writes once the partial's chunk has landed (rs_epilogue_sm90.cuh); the mainloop never
// waits (A and B are local), so the wait overlaps the tile's math. Plain C++ interface: the FFI
// handler never sees CUTLASS.
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

#include "xla_ffi/kernels/ag_gemm_sm90.h"

namespace jaxflux {

struct RsGemmProblem {
  GemmProblem gemm;  // a = this device's rows of x, b = w, d = the output z (batched: L mode)
  // The peer's partial of the same rows, laid out like d; nullptr: no source, D = A·B (the
  // GEMM-only probe in gemm.cc, which measures what reading C costs the same kernel).
  const void* c;
  // One source (tp = 1; source_ranks[0] = the peer), rows_per_shard = rows per batch entry,
  // the push's chunks in chunk_ends; op = kMatmulReduceScatter. The chunks also set the tile
  // order: more than one sweeps the rows along N, in landing order.
  AgGemmWait wait;
  int32_t wait_for_flags = 1;  // 0: no waits (the GEMM-only probe; wait's flags unused)
  // 0: cooperative 128x256 tiles; 1: ping-pong 128x128 (rs_gemm_sm90.cuh). The caller chooses
  // (gemm_rs.cc: OwnRowsPingpong); the kernel reads no environment.
  int32_t pingpong = 0;
  // 1: the same GEMM and source-C epilogue under CUTLASS's own scheduler instead of the fused
  // ops' (the probe only: no waits, no rotation; bf16/fp16 with an N-major weight). Against 0
  // it tells what the fused scheduler costs apart from the C-capable epilogue. Cooperative only.
  int32_t cutlass_scheduler = 0;
};

size_t RsGemmSm90WorkspaceBytes(GemmDtype dtype, const RsGemmProblem& problem);

// Launches on `stream`. Returns a static string describing the failure, or nullptr.
const char* RsGemmSm90(GemmDtype dtype, const RsGemmProblem& problem, void* workspace,
                       cudaStream_t stream);

}  // namespace jaxflux
