// FFI handler of the benchmarks' device clock (xla_ffi/kernels/clock_kernels.h).
#ifndef JAXFLUX_XLA_FFI_FFI_DEVICE_CLOCK_H_
#define JAXFLUX_XLA_FFI_FFI_DEVICE_CLOCK_H_

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxDeviceClock);

#endif  // JAXFLUX_XLA_FFI_FFI_DEVICE_CLOCK_H_
