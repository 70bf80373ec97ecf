// jaxflux_device_slot: writes this device's slot word (runtime.h's SlotWord) into an int32[2]
// output ({word, 0}). With one process per GPU the ops all-gather it over the tp axis, so that every
// device learns its peers from the program instead of a host rendezvous (docs/design.md,
// "Multiple processes"). A stream memory op writes it: no kernel, nothing to wait for.
#include "xla_ffi/ffi/device_slot.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi/errors.h"
#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/stream_ops.h"

namespace ffi = xla::ffi;

namespace jaxflux {
namespace {

ffi::Error DeviceSlot(cudaStream_t stream, int32_t ordinal,
                      ffi::Result<ffi::Buffer<ffi::S32>> out) {
  if (out->element_count() != 2) {
    return ffi::Error::InvalidArgument("jaxflux device_slot: the output must hold 2 int32s");
  }
  const int slot = SlotOfOrdinal(ordinal);
  const int host = HostIndex();
  if (!SlotWordFits(host, slot)) {
    return ffi::Error::Internal("jaxflux device_slot: GPU " + std::to_string(ordinal) +
                                " has slot " + std::to_string(slot) + " on host " +
                                std::to_string(host) + ", outside the slot word's range");
  }
  const auto word = static_cast<uint32_t>(SlotWord(host, slot));
  std::string error;
  // Little-endian: the 64-bit write puts `word` in element 0 and zero in element 1.
  if (!WriteFlag(stream, reinterpret_cast<uint64_t*>(out->typed_data()), word, &error)) {
    return OpError("device_slot", error);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxflux

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfluxDeviceSlot, jaxflux::DeviceSlot,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
        .Ctx<xla::ffi::DeviceOrdinal>()                 // CUDA ordinal -> host slot
        .Ret<xla::ffi::Buffer<xla::ffi::S32>>());       // {host << 8 | slot, 0}
