// Type id and info of the per-executable rank cache (RankState, defined in group.cc), for
// jax.ffi.register_ffi_type. Plain header: module.cc includes it.
#ifndef JAXFLUX_XLA_FFI_FFI_RANK_STATE_TYPE_H_
#define JAXFLUX_XLA_FFI_FFI_RANK_STATE_TYPE_H_

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

XLA_FFI_DECLARE_TYPE_ID_SYMBOL(JaxfluxRankStateTypeId);
XLA_FFI_DECLARE_TYPE_INFO_SYMBOL(JaxfluxRankStateTypeInfo);

#endif  // JAXFLUX_XLA_FFI_FFI_RANK_STATE_TYPE_H_
