// FFI handlers of the copy-engine all-gather (tiled along axis -2), and the instantiate stage
// that every group target shares. Plain header: module.cc includes it to build the registrations.
#pragma once

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

// Instantiate stage of jaxflux_all_gather, jaxflux_all_gather_matmul and
// jaxflux_matmul_reduce_scatter: creates the per-executable rank state (jaxflux_rank_state).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxRankStateInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxAllGatherExecute);
