// The receiving kernel of the copy-engine all-gather (see signal_kernels.h).
#include "xla_ffi/kernels/signal_kernels.h"

#include "xla_ffi/runtime/wait.cuh"

namespace jaxflux {
namespace {

constexpr int kCopyThreads = 512;
constexpr int kCopyUnroll = 4;

// This block's share of a segment: the grid is viewed as gy row groups of gx blocks each, so
// that a few tall rows and many short ones both spread over every block.
__device__ void CopySegment(const GatherParams& p, const GatherSegment& s) {
  if (s.rows == 0 || s.cols == 0) return;
  const unsigned blocks = gridDim.x;
  const unsigned gy = s.rows < blocks ? static_cast<unsigned>(s.rows) : blocks;
  const unsigned gx = blocks / gy;
  const unsigned by = blockIdx.x / gx, bx = blockIdx.x % gx;
  if (by >= gy) return;
  const size_t stride = static_cast<size_t>(gx) * blockDim.x;
  const size_t first = static_cast<size_t>(bx) * blockDim.x + threadIdx.x;
  const bool vec = ((reinterpret_cast<uintptr_t>(s.dst) | reinterpret_cast<uintptr_t>(s.src) |
                     s.cols | p.dst_pitch | p.src_pitch) & 15) == 0;
  for (size_t r = by; r < s.rows; r += gy) {
    if (vec) {
      const uint4* src = reinterpret_cast<const uint4*>(s.src + r * p.src_pitch);
      uint4* dst = reinterpret_cast<uint4*>(s.dst + r * p.dst_pitch);
      const size_t n = s.cols / 16;
      size_t i = first;
      for (; i + (kCopyUnroll - 1) * stride < n; i += kCopyUnroll * stride) {
        uint4 v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) v[u] = __ldcg(src + i + u * stride);
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) dst[i + u * stride] = v[u];
      }
      for (; i < n; i += stride) dst[i] = __ldcg(src + i);
    } else {
      const char* src = s.src + r * p.src_pitch;
      char* dst = s.dst + r * p.dst_pitch;
      for (size_t i = first; i < s.cols; i += stride) dst[i] = src[i];
    }
  }
}

__global__ void __launch_bounds__(kCopyThreads, 2) GatherKernel(const __grid_constant__
                                                                GatherParams p) {
  if (blockIdx.x == 0 && threadIdx.x == 0 && p.rank_info != nullptr) {
    const int32_t rank = p.rank_info[0];
    const int32_t group = p.rank_info[1];
    if (rank != p.rank || group != p.group) {
      device::RecordError(p.error, ErrorKind::kRankMismatch, p.op, p.device, p.rank, rank, group,
                          0, 0, p.epoch, 0);
    }
  }
  for (int i = 0; i < p.num_segments; ++i) {
    const GatherSegment& s = p.segments[i];
    if (s.flag != nullptr) {
      if (threadIdx.x == 0) {
        uint64_t seen = 0;
        if (device::BoundedWait(s.flag, s.target, p.timeout_ns, p.error, &seen) ==
            device::WaitResult::kTimedOut) {
          device::RecordError(p.error, ErrorKind::kTimeout, p.op, p.device, p.rank, s.peer,
                              p.group, s.target, seen, p.epoch, p.timeout_ns);
        }
      }
      __syncthreads();  // the block's copies come after thread 0's acquire of the flag
    }
    CopySegment(p, s);
  }
}

}  // namespace

cudaError_t LaunchGather(const GatherParams& params, int max_blocks, cudaStream_t stream) {
  if (params.num_segments < 0 || params.num_segments > kGatherMaxSegments) {
    return cudaErrorInvalidValue;
  }
  // As many blocks as the largest segment has 16-byte vectors per block-pass, within the cap.
  size_t largest = 1;
  for (int i = 0; i < params.num_segments; ++i) {
    const size_t bytes = params.segments[i].rows * params.segments[i].cols;
    if (bytes > largest) largest = bytes;
  }
  const size_t per_block = static_cast<size_t>(kCopyThreads) * kCopyUnroll * 16;
  size_t blocks = (largest + per_block - 1) / per_block;
  const size_t cap = static_cast<size_t>(max_blocks < 1 ? 1 : max_blocks);
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  GatherKernel<<<static_cast<unsigned>(blocks), kCopyThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace jaxflux
