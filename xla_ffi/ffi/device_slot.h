// FFI handler that tells a program which GPU each device is: its host slot word (runtime.h).
#ifndef JAXFLUX_XLA_FFI_FFI_DEVICE_SLOT_H_
#define JAXFLUX_XLA_FFI_FFI_DEVICE_SLOT_H_

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxDeviceSlot);

#endif  // JAXFLUX_XLA_FFI_FFI_DEVICE_SLOT_H_
