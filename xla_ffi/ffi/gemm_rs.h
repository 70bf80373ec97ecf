// FFI handlers of the fused GEMM+ReduceScatter. Plain header: module.cc includes it to build the
// registrations.
#ifndef JAXFLUX_XLA_FFI_FFI_GEMM_RS_H_
#define JAXFLUX_XLA_FFI_FFI_GEMM_RS_H_

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

// Stateful target (rank cache per executable, shares the all-gather's instantiate stage).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxGemmRsExecute);
// Fallback target: rank cache keyed by (call site, device).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxGemmRsSiteCached);

#endif  // JAXFLUX_XLA_FFI_FFI_GEMM_RS_H_
