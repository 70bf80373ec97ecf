// The runtime's process-wide tables shared by its .cc files (workspace.cc owns them, ipc.cc maps
// other processes' GPUs into them). Internal: no handler includes this.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>
#include <string>

#include "xla_ffi/runtime/signals.h"

namespace jaxflux::runtime_internal {

// "<call> failed: <CUDA's message>".
std::string CudaCall(const char* call, cudaError_t err);

// Guards growing the workspace and importing peers.
std::mutex& WorkspaceMutex();

// Generations published so far.
int64_t NumGenerations();

// The arena of host slot `slot` in `generation` (< NumGenerations()), to read or set under
// WorkspaceMutex().
char*& ArenaEntry(int64_t generation, int slot);

// Resources of host slot `slot` (0 <= slot < kMaxDevices), whether set up or not.
DeviceResources& DeviceEntry(int slot);

}  // namespace jaxflux::runtime_internal
