// One process per GPU: exporting this process's GPUs' arenas and flag arrays as CUDA IPC
// handles, and mapping other processes' GPUs into the runtime's tables.
#include <cuda_runtime_api.h>

#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"
#include "xla_ffi/runtime/workspace_state.h"

namespace jaxflux {
namespace {

using runtime_internal::CudaCall;

// Mappings opened with cudaIpcOpenMemHandle, closed by CloseImportedPeers.
std::mutex g_import_mu;
std::vector<void*> g_imported;

bool OpenHandle(const char* bytes, int slot, void** ptr, std::string* error) {
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, bytes, kIpcHandleBytes);
  cudaError_t err = cudaIpcOpenMemHandle(ptr, handle, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    *error = "jaxflux: opening the workspace of host slot " + std::to_string(slot) +
             " (another process's GPU): " + CudaCall("cudaIpcOpenMemHandle", err) +
             ". The GPUs of a tp group must be peers on one host (NVLink or PCIe P2P), and "
             "visible to every process: keep CUDA_VISIBLE_DEVICES the same for all of them and "
             "give each its GPU with jax.distributed.initialize(local_device_ids=[...]).";
    return false;
  }
  std::lock_guard<std::mutex> lock(g_import_mu);
  g_imported.push_back(*ptr);
  return true;
}

}  // namespace

bool ExportDevice(int64_t workspace_class, int ordinal, IpcHandles* out, std::string* error) {
  const int slot = SlotOfOrdinal(ordinal);
  char* arena = WorkspaceArena(workspace_class, slot);
  if (arena == nullptr || slot < 0 || !runtime_internal::DeviceEntry(slot).ready.load()) {
    *error = "jaxflux: GPU " + std::to_string(ordinal) + " has no workspace of class " +
             std::to_string(workspace_class) + " to export";
    return false;
  }
  DeviceResources& device = runtime_internal::DeviceEntry(slot);
  DeviceGuard guard(ordinal);
  const std::pair<void*, char*> parts[] = {{arena, out->arena},
                                           {device.ready_flags, out->ready_flags},
                                           {device.landed_flags, out->landed_flags}};
  for (const auto& [ptr, bytes] : parts) {
    cudaIpcMemHandle_t handle;
    cudaError_t err = guard.status() != cudaSuccess ? guard.status()
                                                   : cudaIpcGetMemHandle(&handle, ptr);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      *error = "jaxflux: exporting GPU " + std::to_string(ordinal) + "'s workspace: " +
               CudaCall("cudaIpcGetMemHandle", err);
      return false;
    }
    static_assert(sizeof(handle) == kIpcHandleBytes, "cudaIpcMemHandle_t size");
    std::memcpy(bytes, &handle, kIpcHandleBytes);
  }
  return true;
}

bool ImportPeer(int64_t workspace_class, int slot, const IpcHandles& handles,
                int local_ordinal, std::string* error) {
  std::lock_guard<std::mutex> lock(runtime_internal::WorkspaceMutex());
  if (slot < 0 || slot >= kMaxDevices ||
      !runtime_internal::ValidWorkspaceClass(workspace_class)) {
    *error = "jaxflux: ImportPeer: slot " + std::to_string(slot) + " or workspace class " +
             std::to_string(workspace_class) + " out of range";
    return false;
  }
  DeviceGuard guard(local_ordinal);
  if (guard.status() != cudaSuccess) {
    *error = "jaxflux: ImportPeer: " + CudaCall("cudaSetDevice", guard.status());
    return false;
  }
  DeviceResources& r = runtime_internal::DeviceEntry(slot);
  if (!r.ready.load()) {  // the flag arrays live for the process: opened once
    void* ready = nullptr;
    void* landed = nullptr;
    if (!OpenHandle(handles.ready_flags, slot, &ready, error) ||
        !OpenHandle(handles.landed_flags, slot, &landed, error)) {
      return false;
    }
    r.ready_flags = static_cast<uint64_t*>(ready);
    r.landed_flags = static_cast<uint64_t*>(landed);
    r.remote = true;
    r.ready.store(true, std::memory_order_release);
  }
  std::atomic<char*>& arena_entry = runtime_internal::ArenaEntry(workspace_class, slot);
  if (arena_entry.load() == nullptr) {
    void* arena = nullptr;
    if (!OpenHandle(handles.arena, slot, &arena, error)) return false;
    arena_entry.store(static_cast<char*>(arena), std::memory_order_release);
  }
  return true;
}

void CloseImportedPeers() {
  std::lock_guard<std::mutex> lock(g_import_mu);
  for (void* ptr : g_imported) {
    if (cudaIpcCloseMemHandle(ptr) != cudaSuccess) (void)cudaGetLastError();
  }
  g_imported.clear();
}

}  // namespace jaxflux
