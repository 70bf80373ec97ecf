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

}  // namespace

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
