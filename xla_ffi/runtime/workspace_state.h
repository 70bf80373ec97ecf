// The runtime's process-wide tables shared by its .cc files (workspace.cc owns them, ipc.cc maps
// other processes' GPUs into them). Internal: no handler includes this.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "xla_ffi/runtime/signals.h"

namespace jaxflux::runtime_internal {

// "<call> failed: <CUDA's message>".
std::string CudaCall(const char* call, cudaError_t err);

// Guards allocating arenas and importing peers.
std::mutex& WorkspaceMutex();

// Whether `workspace_class` is a class the runtime has (runtime.h).
bool ValidWorkspaceClass(int64_t workspace_class);

// The arena of host slot `slot` of a valid `workspace_class`, to read or set under
// WorkspaceMutex().
std::atomic<char*>& ArenaEntry(int64_t workspace_class, int slot);

// Resources of host slot `slot` (0 <= slot < kMaxDevices), whether set up or not.
DeviceResources& DeviceEntry(int slot);

}  // namespace jaxflux::runtime_internal
