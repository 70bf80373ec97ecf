// FFI handlers of the fused AllGather+GEMM. Plain header: module.cc includes it to build the
// registrations.
#ifndef JAXFLUX_XLA_FFI_FFI_AG_GEMM_H_
#define JAXFLUX_XLA_FFI_FFI_AG_GEMM_H_

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

// Stateful target (rank cache per executable, shares the instantiate stage of the all-gather).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxAgGemmExecute);
// Fallback target: rank cache keyed by (call site, device).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxAgGemmSiteCached);

#endif  // JAXFLUX_XLA_FFI_FFI_AG_GEMM_H_
