// Tiny single-thread kernels that order copy-engine work through flags. Stream order already
// guarantees a preceding copy completed when the kernel starts; the system-scope fence makes the
// copied bytes visible to the peer before the flag that announces them.
#include "xla_ffi/kernels/signal_kernels.h"

#include "xla_ffi/runtime/wait.cuh"

namespace jaxflux {
namespace {

__global__ void ReleaseKernel(ReleaseParams p) {
  const int32_t rank = p.rank_info[0];
  const int32_t group = p.rank_info[1];
  if (rank != p.expected_rank || group != p.expected_group) {
    // The rank cached at discovery no longer matches this program's operand: the data would land
    // in the wrong place. Report it; still release so that peers do not wait out the timeout.
    device::RecordError(p.error, ErrorKind::kRankMismatch, p.op, p.device, p.expected_rank, rank,
                        group, 0, 0, p.epoch, 0);
  }
  __threadfence_system();
  for (int i = 0; i < p.num_flags; ++i) device::StoreReleaseSys(p.flags[i], p.value);
}

__global__ void WaitKernel(WaitParams p) {
  uint64_t seen = 0;
  if (!device::BoundedWait(p.flag, p.target, p.timeout_ns, &seen)) {
    device::RecordError(p.error, ErrorKind::kTimeout, p.op, p.device, p.rank, p.peer, -1,
                        p.target, seen, p.epoch, p.timeout_ns);
  }
}

__global__ void MarkKernel(MarkParams p) {
  __threadfence_system();
  device::StoreReleaseSys(p.flag, p.value);
}

constexpr int kCopyThreads = 512;
constexpr int kCopyUnroll = 4;

// Copy half of LaunchWaitCopy (the wait is a separate one-thread kernel before it).
__global__ void __launch_bounds__(kCopyThreads, 2) CopyKernel(WaitCopyParams p) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool vec = ((reinterpret_cast<uintptr_t>(p.dst) | reinterpret_cast<uintptr_t>(p.src) |
                     p.cols | p.dst_pitch | p.src_pitch) & 15) == 0;
  for (size_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    if (vec) {
      const uint4* s = reinterpret_cast<const uint4*>(p.src + r * p.src_pitch);
      uint4* d = reinterpret_cast<uint4*>(p.dst + r * p.dst_pitch);
      const size_t n = p.cols / 16;
      size_t i = first;
      for (; i + (kCopyUnroll - 1) * stride < n; i += kCopyUnroll * stride) {
        uint4 v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) v[u] = __ldcg(s + i + u * stride);
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) d[i + u * stride] = v[u];
      }
      for (; i < n; i += stride) d[i] = __ldcg(s + i);
    } else {
      const char* s = p.src + r * p.src_pitch;
      char* d = p.dst + r * p.dst_pitch;
      for (size_t i = first; i < p.cols; i += stride) d[i] = s[i];
    }
  }
}

}  // namespace

cudaError_t LaunchWaitCopy(const WaitCopyParams& wait_copy, int max_blocks,
                           cudaStream_t stream) {
  // The wait runs as its own one-thread kernel and the copy grid never spins: a grid of spinning
  // blocks that fills every SM hung on the GPU machine (2×H200, a grid of one block per SM),
  // presumably because the peer-side release kernel of the same device found no room.
  if (wait_copy.wait.flag != nullptr) {
    WaitKernel<<<1, 1, 0, stream>>>(wait_copy.wait);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  WaitCopyParams params = wait_copy;
  params.wait.flag = nullptr;
  if (params.rows == 0 || params.cols == 0) return cudaSuccess;
  const size_t per_block = static_cast<size_t>(kCopyThreads) * kCopyUnroll * 16;
  const size_t cap = static_cast<size_t>(max_blocks < 1 ? 1 : max_blocks);
  const size_t gy = params.rows < cap ? params.rows : cap;
  size_t gx = (params.cols + per_block - 1) / per_block;
  const size_t gx_cap = cap / gy < 1 ? 1 : cap / gy;
  if (gx > gx_cap) gx = gx_cap;
  if (gx < 1) gx = 1;
  dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy > 65535 ? 65535 : gy));
  CopyKernel<<<grid, kCopyThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t LaunchRelease(const ReleaseParams& params, cudaStream_t stream) {
  ReleaseKernel<<<1, 1, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t LaunchWait(const WaitParams& params, cudaStream_t stream) {
  WaitKernel<<<1, 1, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t LaunchMark(const MarkParams& params, cudaStream_t stream) {
  MarkKernel<<<1, 1, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace jaxflux
