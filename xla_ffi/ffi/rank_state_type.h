// Type id and info of the per-executable rank cache (RankState, defined in group.cc), for
// jax.ffi.register_ffi_type. Plain header: module.cc includes it.
#pragma once

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

XLA_FFI_DECLARE_TYPE_ID_SYMBOL(JaxfluxRankStateTypeId);
XLA_FFI_DECLARE_TYPE_INFO_SYMBOL(JaxfluxRankStateTypeInfo);
