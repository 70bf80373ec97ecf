// The gather and combine passes of the tensor-parallel MoE ops (see moe_kernels.h).
#include "xla_ffi/kernels/moe_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "xla_ffi/runtime/wait.cuh"

namespace jaxflux {
namespace {

constexpr int kThreads = 512;
constexpr int kVec = 8;  // 16 bytes of bf16/fp16

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
__device__ __forceinline__ void Accumulate(float (&acc)[kVec], uint4 raw, float scale) {
  const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int j = 0; j < kVec; ++j) acc[j] += scale * ToFloat(v[j]);
}

template <class T>
__device__ __forceinline__ uint4 Pack(const float (&acc)[kVec]) {
  uint4 packed;
  T* o = reinterpret_cast<T*>(&packed);
#pragma unroll
  for (int j = 0; j < kVec; ++j) o[j] = FromFloat<T>(acc[j]);
  return packed;
}

// Block 0 checks the program's rank operand against the rank this call acts as.
__device__ void CheckRank(const MoeWaitInfo& who) {
  if (blockIdx.x != 0 || threadIdx.x != 0 || who.rank_info == nullptr) return;
  const int32_t rank = who.rank_info[0], group = who.rank_info[1];
  if (rank != who.rank || group != who.group) {
    device::RecordError(who.error, ErrorKind::kRankMismatch, who.op, who.device, who.rank, rank,
                        group, 0, 0, who.epoch, 0);
  }
}

// Thread 0 waits for one flag; the caller syncs the block before reading what it announces.
__device__ void WaitFlag(const MoeWaitInfo& who, const uint64_t* flag, uint64_t target,
                         int32_t peer) {
  uint64_t seen = 0;
  if (device::BoundedWait(flag, target, who.timeout_ns, who.error, &seen) ==
      device::WaitResult::kTimedOut) {
    device::RecordError(who.error, ErrorKind::kTimeout, who.op, who.device, who.rank, peer,
                        who.group, target, seen, who.epoch, who.timeout_ns);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) MoeGatherKernel(const __grid_constant__
                                                            MoeGatherParams p) {
  CheckRank(p.who);
  if (p.flag != nullptr) {
    if (threadIdx.x == 0) WaitFlag(p.who, p.flag, p.target, p.peer);
    __syncthreads();
  }
  const int64_t per_row = p.k / kVec;
  const int64_t vectors = p.num_rows * per_row;
  const uint4* src = reinterpret_cast<const uint4*>(p.src);
  uint4* rows = reinterpret_cast<uint4*>(p.rows);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors;
       i += stride) {
    const int64_t row = i / per_row, col = i % per_row;
    const int32_t token = p.token_index[row];
    if (token < 0 || token >= p.m) {
      rows[i] = make_uint4(0, 0, 0, 0);
      continue;
    }
    // A peer's tokens were written by a copy engine: bypass L1 (ld.global.cg).
    const uint4 raw = __ldcg(src + token * per_row + col);
    const float scale = p.row_scale[row];
    if (scale == 1.0f) {
      rows[i] = raw;
    } else {
      float acc[kVec] = {};
      Accumulate<T>(acc, raw, scale);
      rows[i] = Pack<T>(acc);
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) MoeCombineKernel(const __grid_constant__
                                                             MoeCombineParams p) {
  CheckRank(p.who);
  if (threadIdx.x == 0) {
    for (int r = 0; r < p.tp; ++r) {
      if (p.flags[r] != nullptr) WaitFlag(p.who, p.flags[r], p.target, r);
    }
  }
  __syncthreads();
  const int64_t per_row = p.n / kVec;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // The segment's rows reduced over the ranks, in rank order (every rank rounds alike).
  for (int64_t i = first; i < p.s * per_row; i += stride) {
    float acc[kVec] = {};
    for (int r = 0; r < p.tp; ++r) {
      Accumulate<T>(acc, __ldcg(reinterpret_cast<const uint4*>(p.partials[r]) + i), 1.0f);
    }
    reinterpret_cast<uint4*>(p.y_rows)[i] = Pack<T>(acc);
  }
  // Each token's top-k rows, weighted, summed in fp32 from the partials (one rounding).
  for (int64_t i = first; i < p.m * per_row; i += stride) {
    const int64_t t = i / per_row, col = i % per_row;
    float acc[kVec] = {};
    for (int64_t k = 0; k < p.topk; ++k) {
      const int32_t row = p.row_index[t * p.topk + k];
      if (row < 0 || row >= p.s) continue;
      const float weight = p.weights[t * p.topk + k];
      for (int r = 0; r < p.tp; ++r) {
        const uint4* partial = reinterpret_cast<const uint4*>(p.partials[r]);
        Accumulate<T>(acc, __ldcg(partial + row * per_row + col), weight);
      }
    }
    reinterpret_cast<uint4*>(p.z)[i] = Pack<T>(acc);
  }
}

unsigned Blocks(int64_t vectors, int max_blocks) {
  int64_t blocks = (vectors + kThreads - 1) / kThreads;
  if (max_blocks > 0 && blocks > max_blocks) blocks = max_blocks;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

}  // namespace

cudaError_t LaunchMoeGather(const MoeGatherParams& params, int max_blocks, cudaStream_t stream) {
  if (params.k % kVec != 0) return cudaErrorInvalidValue;
  const unsigned blocks = Blocks(params.num_rows * (params.k / kVec), max_blocks);
  if (params.dtype == ReduceDtype::kF16) {
    MoeGatherKernel<__half><<<blocks, kThreads, 0, stream>>>(params);
  } else {
    MoeGatherKernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(params);
  }
  return cudaGetLastError();
}

cudaError_t LaunchMoeCombine(const MoeCombineParams& params, int max_blocks,
                             cudaStream_t stream) {
  if (params.n % kVec != 0 || params.tp < 1 || params.tp > kReduceMaxRanks) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = params.s > params.m ? params.s : params.m;
  const unsigned blocks = Blocks(rows * (params.n / kVec), max_blocks);
  if (params.dtype == ReduceDtype::kF16) {
    MoeCombineKernel<__half><<<blocks, kThreads, 0, stream>>>(params);
  } else {
    MoeCombineKernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(params);
  }
  return cudaGetLastError();
}

}  // namespace jaxflux
