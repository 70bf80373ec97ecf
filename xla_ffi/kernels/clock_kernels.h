// A device-side clock for benchmarks: one thread reads %globaltimer (ns) on the stream, after
// optionally idling the stream for a while so the host can queue the timed calls behind it.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace jaxflux {

// Writes the device's global timer as two 32-bit words {low, high} to `out` (uint32 so that JAX
// reads it without 64-bit mode), once `spin_ns` nanoseconds have passed since the kernel began.
cudaError_t LaunchDeviceClock(uint32_t* out, uint64_t spin_ns, cudaStream_t stream);

}  // namespace jaxflux
