// FFI handler that tells a program which GPU each device is: its host slot word (runtime.h).
#pragma once

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfluxDeviceSlot);
