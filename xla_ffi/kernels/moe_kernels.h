// The row movement of the tensor-parallel MoE ops around their grouped GEMMs (ffi/moe_gemm.cc):
// the gather that builds one segment's sorted A operand from one rank's tokens, and the pass
// that sums every rank's partial of this rank's segment and combines each token's top-k rows.
// Both wait (bounded) for the flags of what peers pushed before they read it. Host-callable from
// plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "xla_ffi/kernels/reduce_kernels.h"
#include "xla_ffi/kernels/signal_kernels.h"

namespace jaxflux {

// Who waits, for the error record of a timed-out wait or a rank mismatch.
struct MoeWaitInfo {
  const int32_t* rank_info;  // this program's [axis_index, group]: checked against rank, group
  int32_t rank, group, device, op;
  uint64_t epoch, timeout_ns;
  DeviceErrorRecord* error;
};

// rows[j] = row_scale[j] · src[token_index[j]] for j < num_rows, rounded to the rows' dtype; a
// token index outside [0, m) gives a zero row. With `flag` set, every block first waits until
// *flag >= target (the rank `peer` pushed src).
struct MoeGatherParams {
  const void* src;             // [m, k] one rank's tokens
  const int32_t* token_index;  // [num_rows]
  const float* row_scale;      // [num_rows]
  void* rows;                  // [num_rows, k]
  int64_t m, k, num_rows;      // k a multiple of 8 (16-byte vectors)
  ReduceDtype dtype;
  const uint64_t* flag;        // nullptr: src is local, no wait
  uint64_t target;
  int32_t peer;
  MoeWaitInfo who;
};

// `max_blocks` caps the grid. A grid that waits spins while the push is on the link, so it
// should leave SMs free for whatever a peer needs meanwhile (on a GPU shared by two ranks, the
// peer's push itself runs as a kernel).
cudaError_t LaunchMoeGather(const MoeGatherParams& params, int max_blocks, cudaStream_t stream);

// After every peer's flag has reached `target`:
//   y_rows[j] = Σ_r partials[r][j]                                     (j < s, rank order)
//   z[t]      = Σ_k weights[t, k] · Σ_r partials[r][row_index[t, k]]   (t < m)
// with fp32 accumulation and one rounding each; a row index outside [0, s) adds nothing.
struct MoeCombineParams {
  const void* partials[kReduceMaxRanks];   // by source rank: [s, n] each
  const uint64_t* flags[kReduceMaxRanks];  // by source rank; nullptr: local, no wait
  uint64_t target;
  int32_t tp;
  const int32_t* row_index;  // [m, topk]
  const float* weights;      // [m, topk]
  void* z;                   // [m, n]
  void* y_rows;              // [s, n]
  int64_t m, topk, s, n;     // n a multiple of 8
  ReduceDtype dtype;
  MoeWaitInfo who;
};

cudaError_t LaunchMoeCombine(const MoeCombineParams& params, int max_blocks, cudaStream_t stream);

}  // namespace jaxflux
