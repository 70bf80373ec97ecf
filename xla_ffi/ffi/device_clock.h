// FFI handler of the benchmarks' device clock (xla_ffi/kernels/clock_kernels.h).
#pragma once

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxDeviceClock);
