// Device-side signalling primitives: system-scope acquire/release on flags, the global timer,
// and the error record. Shared by the copy-engine all-gather and the fused kernels.
#ifndef JAXFLUX_XLA_FFI_RUNTIME_WAIT_CUH_
#define JAXFLUX_XLA_FFI_RUNTIME_WAIT_CUH_

#include <cstdint>

#include "xla_ffi/kernels/signal_kernels.h"

namespace jaxflux::device {

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Flags are written by peers over NVLink, so acquire/release are at system scope.
__device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// First writer wins; the host reads fields only after `ready`.
__device__ __forceinline__ void RecordError(DeviceErrorRecord* r, ErrorKind kind, int32_t op,
                                            int32_t device, int32_t rank, int32_t peer,
                                            int32_t group, uint64_t target, uint64_t seen,
                                            uint64_t epoch, uint64_t timeout_ns) {
  if (r == nullptr || atomicCAS_system(&r->claim, 0, 1) != 0) return;
  r->kind = static_cast<int32_t>(kind);
  r->op = op;
  r->device = device;
  r->rank = rank;
  r->peer = peer;
  r->group = group;
  r->target = target;
  r->seen = seen;
  r->epoch = epoch;
  r->timeout_ns = timeout_ns;
  __threadfence_system();
  atomicExch_system(&r->ready, 1);
}

// Spins until *flag >= target or the timeout passes. Never traps: a trap would kill the CUDA
// context that XLA shares; a timeout records the error and lets the stream move on.
__device__ __forceinline__ bool BoundedWait(const uint64_t* flag, uint64_t target,
                                            uint64_t timeout_ns, uint64_t* seen) {
  const uint64_t start = GlobalTimerNs();
  uint64_t v = LoadAcquireSys(flag);
  uint32_t spins = 0;
  while (v < target) {
    if ((++spins & 255u) == 0 && GlobalTimerNs() - start > timeout_ns) {
      *seen = v;
      return false;
    }
    v = LoadAcquireSys(flag);
  }
  *seen = v;
  return true;
}

}  // namespace jaxflux::device

#endif  // JAXFLUX_XLA_FFI_RUNTIME_WAIT_CUH_
