// Stream memory operations: a 64-bit flag write that the GPU's front end performs in stream
// order, with no kernel (so it needs no SM). The fused kernels spin on flags while occupying
// every SM; a flag released by a kernel could then never run, so peers' "chunk landed" signals
// go through these instead. Reached through the driver entry point, so libcuda is not linked.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace jaxflux {

// Enqueues *flag = value on `stream` after all earlier work of the stream, preceded by a
// system-scope memory barrier (earlier copies are visible to whoever sees the new value).
// `flag` may live on this device or on a peer with peer access enabled. On failure returns false
// and says why in `error`.
bool WriteFlag(cudaStream_t stream, uint64_t* flag, uint64_t value, std::string* error);

}  // namespace jaxflux
