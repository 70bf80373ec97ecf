#include "xla_ffi/kernels/reduce_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "xla_ffi/runtime/wait.cuh"

namespace jaxflux {
namespace {

constexpr int kThreads = 256;

template <class T>
__device__ __forceinline__ float ToFloat(T v);
template <>
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

template <class T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat(float v) { return __float2bfloat16(v); }
template <>
__device__ __forceinline__ __half FromFloat(float v) { return __float2half(v); }

template <class T>
__global__ void __launch_bounds__(kThreads) WaitReduceKernel(WaitReduceParams p) {
  if (threadIdx.x == 0) {
    for (int r = 0; r < p.tp; ++r) {
      if (p.flags[r] == nullptr) continue;
      uint64_t seen = 0;
      const device::WaitResult result =
          device::BoundedWait(p.flags[r], p.target, p.timeout_ns, p.error, &seen);
      if (result == device::WaitResult::kTimedOut) {
        device::RecordError(p.error, ErrorKind::kTimeout, p.op, p.device, p.rank, r, -1,
                            p.target, seen, p.epoch, p.timeout_ns);
      }
      if (result != device::WaitResult::kLanded) break;  // the results are void
    }
  }
  __syncthreads();
  constexpr int kVec = 8;  // 16 bytes of bf16/fp16
  const size_t vectors = p.count / kVec;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors;
       i += stride) {
    float acc[kVec] = {};
    for (int r = 0; r < p.tp; ++r) {  // fixed order: every rank rounds the same sums
      // Peers wrote these bytes through copy engines; bypass L1 (ld.global.cg).
      const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(p.partials[r]) + i);
      const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] += ToFloat(v[j]);
    }
    uint4 packed;
    T* o = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int j = 0; j < kVec; ++j) o[j] = FromFloat<T>(acc[j]);
    reinterpret_cast<uint4*>(p.out)[i] = packed;
  }
}

}  // namespace

cudaError_t LaunchWaitReduce(const WaitReduceParams& params, int max_blocks,
                             cudaStream_t stream) {
  const size_t vectors = params.count / 8;
  size_t blocks = (vectors + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (max_blocks > 0 && blocks > static_cast<size_t>(max_blocks)) blocks = max_blocks;
  if (params.dtype == ReduceDtype::kF16) {
    WaitReduceKernel<__half><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
  } else {
    WaitReduceKernel<__nv_bfloat16><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        params);
  }
  return cudaGetLastError();
}

}  // namespace jaxflux
