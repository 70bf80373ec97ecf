// jaxflux_device_clock: reads the GPU's global timer in stream order. The benchmark brackets a
// run of queued calls with two of these, so the time it reports is the GPU's, free of host
// dispatch and of the final host synchronization (jaxflux/bench/device_clock.py).
#include "xla_ffi/ffi/device_clock.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi/errors.h"
#include "xla_ffi/kernels/clock_kernels.h"

namespace ffi = xla::ffi;

namespace jaxflux {
namespace {

// A spin only lets the host queue the timed calls; ten seconds is far more than any run needs.
constexpr int64_t kMaxSpinNs = int64_t{10} * 1000 * 1000 * 1000;

ffi::Error DeviceClock(cudaStream_t stream, ffi::AnyBuffer /*after*/,
                       ffi::Result<ffi::Buffer<ffi::U32>> out, int64_t spin_ns) {
  if (out->element_count() != 2) {
    return ffi::Error::InvalidArgument("jaxflux device_clock: the output must hold 2 uint32s");
  }
  if (spin_ns < 0 || spin_ns > kMaxSpinNs) {
    return ffi::Error::InvalidArgument("jaxflux device_clock: spin_ns must be in [0, 1e10], got " +
                                       std::to_string(spin_ns));
  }
  JAXFLUX_RETURN_IF_CUDA_ERROR(
      "device_clock", LaunchDeviceClock(out->typed_data(), static_cast<uint64_t>(spin_ns), stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxflux

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfluxDeviceClock, jaxflux::DeviceClock,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: the calls' order
        .Arg<xla::ffi::AnyBuffer>()                     // after: orders the read after its producer
        .Ret<xla::ffi::Buffer<xla::ffi::U32>>()         // {low, high} words of %globaltimer, ns
        .Attr<int64_t>("spin_ns"));                     // idle this long first
