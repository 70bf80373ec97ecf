// The reduction half of GEMM+ReduceScatter: wait (bounded) until every peer's partial product
// of this rank's rows has landed, then sum all tp partials in a fixed rank order (fp32
// accumulation, one rounding) into the output. Host-callable from plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "xla_ffi/kernels/signal_kernels.h"

namespace jaxflux {

inline constexpr int kReduceMaxRanks = 8;

enum class ReduceDtype : int32_t { kBF16 = 0, kF16 = 1 };

struct WaitReduceParams {
  const void* partials[kReduceMaxRanks];     // by source rank, `count` elements each
  const uint64_t* flags[kReduceMaxRanks];    // by source rank; nullptr: nothing to wait for
  uint64_t target;                           // wait until *flags[r] >= target
  int32_t tp;
  void* out;                                 // `count` elements
  size_t count;                              // a multiple of 8 (16-byte vectors)
  ReduceDtype dtype;
  // For the error record on timeout.
  uint64_t timeout_ns, epoch;
  int32_t device, rank, op;
  DeviceErrorRecord* error;
};

// `max_blocks` caps the grid (every block waits on the flags first, then reduces its share).
cudaError_t LaunchWaitReduce(const WaitReduceParams& params, int max_blocks, cudaStream_t stream);

}  // namespace jaxflux
