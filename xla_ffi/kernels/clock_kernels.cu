#include "xla_ffi/kernels/clock_kernels.h"

#include "xla_ffi/runtime/wait.cuh"

namespace jaxflux {
namespace {

__global__ void DeviceClockKernel(uint32_t* out, uint64_t spin_ns) {
  uint64_t now = device::GlobalTimerNs();
  const uint64_t until = now + spin_ns;
  while (now < until) {  // bounded by spin_ns, which the host caps
    __nanosleep(1000);
    now = device::GlobalTimerNs();
  }
  out[0] = static_cast<uint32_t>(now);
  out[1] = static_cast<uint32_t>(now >> 32);
}

}  // namespace

cudaError_t LaunchDeviceClock(uint32_t* out, uint64_t spin_ns, cudaStream_t stream) {
  DeviceClockKernel<<<1, 1, 0, stream>>>(out, spin_ns);
  return cudaGetLastError();
}

}  // namespace jaxflux
