// FFI handlers of the tensor-parallel MoE ops (stateful targets: their instantiate stage is
// JaxfluxRankStateInstantiate, all_gather.h). Plain header: module.cc includes it to build the
// registrations.
#pragma once

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxMoeAgGroupedGemmExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxMoeGroupedGemmRsExecute);
