// Device-side signalling primitives: system-scope acquire/release on flags, the global timer,
// and the error record. Shared by the copy-engine all-gather and the fused kernels.
#pragma once

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

enum class WaitResult { kLanded, kTimedOut, kGaveUp };

// The one spin-wait of every jaxflux kernel: until *flag >= target, bounded. Returns kTimedOut
// once timeout_ns has passed (the caller records the error: it knows the op, rank and peer), and
// kGaveUp as soon as `error` shows that some wait has already failed (the call's results are
// void then, and a dead peer should cost one timeout, not one per block, tile or chunk). Never
// traps: a trap would kill the CUDA context that XLA shares. *seen is the last value read.
__device__ __forceinline__ WaitResult BoundedWait(const uint64_t* flag, uint64_t target,
                                                  uint64_t timeout_ns,
                                                  const DeviceErrorRecord* error,
                                                  uint64_t* seen) {
  uint64_t v = LoadAcquireSys(flag);
  if (v >= target) {  // the common case reads no timer
    *seen = v;
    return WaitResult::kLanded;
  }
  const uint64_t start = GlobalTimerNs();
  for (uint32_t spins = 1; v < target; ++spins) {
    if ((spins & 63u) == 0) {
      // The record is host memory: polled over PCIe by every spinning thread it slows the copy
      // engines' pushes into this GPU many times over, so only every 4096th spin.
      if ((spins & 4095u) == 0 && error != nullptr &&
          *reinterpret_cast<const volatile int32_t*>(&error->ready)) {
        *seen = v;
        return WaitResult::kGaveUp;
      }
      if (GlobalTimerNs() - start > timeout_ns) {
        *seen = v;
        return WaitResult::kTimedOut;
      }
    }
    __nanosleep(128);
    v = LoadAcquireSys(flag);
  }
  *seen = v;
  return WaitResult::kLanded;
}

}  // namespace jaxflux::device
