// FFI handlers of the copy-engine all-gather (tiled along axis -2). Plain header: module.cc
// includes it to build the registrations.
#ifndef JAXFLUX_XLA_FFI_FFI_ALL_GATHER_H_
#define JAXFLUX_XLA_FFI_FFI_ALL_GATHER_H_

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

// Stateful target: the instantiate stage creates the per-executable rank cache.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxAllGatherInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxAllGatherExecute);
// Fallback target: rank cache keyed by (call site, device), verified on device every call.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxAllGatherSiteCached);

#endif  // JAXFLUX_XLA_FFI_FFI_ALL_GATHER_H_
