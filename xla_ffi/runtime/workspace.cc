// The symmetric workspace and per-device resources: the arenas of each size class, host
// slots, the side stream, events and flag arrays of each GPU, peer access, and epochs.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"
#include "xla_ffi/runtime/workspace_state.h"

namespace jaxflux {
namespace {

using runtime_internal::CudaCall;

// Arenas by size class (runtime.h), never freed: a traced call names its class, and every
// device of the call finds that class's arenas however many programs were traced since.
std::mutex g_workspace_mu;
constexpr int kNumClasses = kMaxWorkspaceClass + 1;
std::array<std::array<std::atomic<char*>, kMaxDevices>, kNumClasses> g_arenas{};

std::array<DeviceResources, kMaxDevices> g_devices;  // by host slot

// Host slots (runtime.h), stored as slot + 1: 0 = the CUDA ordinal itself (one process drives
// all local GPUs).
std::array<std::atomic<int>, kMaxDevices> g_slot_plus_one{};
std::atomic<int> g_host_index{0};

std::array<std::array<std::atomic<uint64_t>, kMaxDevices>, kMaxChannels> g_epochs{};

// JAX has usually enabled peer access already; that answer is fine but sticks as the last error
// unless cleared.
cudaError_t EnablePeer(int ordinal, int peer) {
  if (ordinal == peer) return cudaSuccess;
  int can = 0;
  cudaError_t err = cudaDeviceCanAccessPeer(&can, ordinal, peer);
  if (err != cudaSuccess) return err;
  if (!can) return cudaErrorPeerAccessUnsupported;
  DeviceGuard guard(ordinal);
  if (guard.status() != cudaSuccess) return guard.status();
  err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
    return cudaSuccess;
  }
  return err;
}

std::string FormatMiB(size_t bytes) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return text;
}

// Creates the side stream, events and flag arrays of `ordinal` (Python thread, under the
// workspace lock, before any program that needs them runs).
cudaError_t InitDeviceResources(int ordinal, std::string* failed_call) {
  DeviceResources& r = g_devices[SlotOfOrdinal(ordinal)];
  if (r.ready.load(std::memory_order_acquire)) return cudaSuccess;
  DeviceGuard guard(ordinal);
  cudaError_t err = guard.status();
  if (err != cudaSuccess) {
    *failed_call = "cudaSetDevice";
    return err;
  }
#define JAXFLUX_INIT(call)             \
  if ((err = (call)) != cudaSuccess) { \
    *failed_call = #call;              \
    return err;                        \
  }
  JAXFLUX_INIT(cudaDeviceGetAttribute(&r.sm_count, cudaDevAttrMultiProcessorCount, ordinal));
  JAXFLUX_INIT(cudaStreamCreateWithFlags(&r.side, cudaStreamNonBlocking));
  JAXFLUX_INIT(cudaEventCreateWithFlags(&r.fork, cudaEventDisableTiming));
  JAXFLUX_INIT(cudaEventCreateWithFlags(&r.join, cudaEventDisableTiming));
  const size_t flag_bytes = sizeof(uint64_t) * kMaxChannels * kMaxDevices;
  JAXFLUX_INIT(cudaMalloc(reinterpret_cast<void**>(&r.ready_flags), flag_bytes));
  JAXFLUX_INIT(cudaMalloc(reinterpret_cast<void**>(&r.landed_flags), flag_bytes));
  // The only memsets ever: flags start at 0 and epochs at 1, so every wait afterwards compares
  // against a value that only grows.
  JAXFLUX_INIT(cudaMemsetAsync(r.ready_flags, 0, flag_bytes, r.side));
  JAXFLUX_INIT(cudaMemsetAsync(r.landed_flags, 0, flag_bytes, r.side));
  JAXFLUX_INIT(cudaStreamSynchronize(r.side));
#undef JAXFLUX_INIT
  r.ready.store(true, std::memory_order_release);
  return cudaSuccess;
}

}  // namespace

namespace runtime_internal {

std::string CudaCall(const char* call, cudaError_t err) {
  return std::string(call) + " failed: " + cudaGetErrorString(err);
}

std::mutex& WorkspaceMutex() { return g_workspace_mu; }
bool ValidWorkspaceClass(int64_t workspace_class) {
  return workspace_class >= kMinWorkspaceClass && workspace_class <= kMaxWorkspaceClass;
}
std::atomic<char*>& ArenaEntry(int64_t workspace_class, int slot) {
  return g_arenas[workspace_class][slot];
}
DeviceResources& DeviceEntry(int slot) { return g_devices[slot]; }

}  // namespace runtime_internal

DeviceGuard::DeviceGuard(int ordinal) {
  status_ = cudaGetDevice(&previous_);
  if (status_ == cudaSuccess && previous_ != ordinal) status_ = cudaSetDevice(ordinal);
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) {
    cudaSetDevice(previous_);
  }
}

int DeviceSmCount(int ordinal) {
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, ordinal) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

bool EnsureWorkspace(const std::vector<int>& ordinals, int64_t workspace_class,
                     std::string* error) {
  std::lock_guard<std::mutex> lock(g_workspace_mu);
  if (!runtime_internal::ValidWorkspaceClass(workspace_class)) {
    *error = "jaxflux: workspace class " + std::to_string(workspace_class) + " out of range " +
             std::to_string(kMinWorkspaceClass) + ".." + std::to_string(kMaxWorkspaceClass);
    return false;
  }
  for (int ordinal : ordinals) {
    if (ordinal < 0 || ordinal >= kMaxDevices || SlotOfOrdinal(ordinal) < 0 ||
        SlotOfOrdinal(ordinal) >= kMaxDevices) {
      *error = "jaxflux: device ordinal " + std::to_string(ordinal) + " (host slot " +
               std::to_string(SlotOfOrdinal(ordinal)) + ") out of range 0.." +
               std::to_string(kMaxDevices - 1);
      return false;
    }
  }
  for (int ordinal : ordinals) {
    std::string failed;
    if (cudaError_t err = InitDeviceResources(ordinal, &failed); err != cudaSuccess) {
      (void)cudaGetLastError();
      *error = "jaxflux: setting up GPU " + std::to_string(ordinal) + ": " +
               CudaCall(failed.c_str(), err);
      return false;
    }
  }
  auto& arenas = g_arenas[workspace_class];
  const bool all_there = std::all_of(ordinals.begin(), ordinals.end(), [&](int ordinal) {
    return arenas[SlotOfOrdinal(ordinal)].load() != nullptr;
  });
  if (all_there) return true;
  for (int ordinal : ordinals) {  // every pair, in case a GPU joins an existing class
    for (int peer : ordinals) {
      cudaError_t err = EnablePeer(ordinal, peer);
      if (err != cudaSuccess) {
        *error = "jaxflux: peer access from GPU " + std::to_string(ordinal) + " to GPU " +
                 std::to_string(peer) + ": " + CudaCall("cudaDeviceEnablePeerAccess", err) +
                 ". The fused ops need all GPUs of a group linked (NVLink or PCIe P2P).";
        return false;
      }
    }
  }
  const size_t bytes = size_t{1} << workspace_class;
  for (int ordinal : ordinals) {
    if (arenas[SlotOfOrdinal(ordinal)].load() != nullptr) continue;
    DeviceGuard guard(ordinal);
    void* ptr = nullptr;
    cudaError_t err = guard.status() != cudaSuccess ? guard.status() : cudaMalloc(&ptr, bytes);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      (void)cudaGetLastError();
      *error = "jaxflux: could not allocate the symmetric workspace: " + FormatMiB(bytes) +
               " on GPU " + std::to_string(ordinal) + " (" + CudaCall("cudaMalloc", err) +
               "; " + FormatMiB(free_b) + " free outside XLA's pool). The workspace lives "
               "outside XLA's allocator, which by default takes 75% of GPU memory up front: "
               "lower XLA_PYTHON_CLIENT_MEM_FRACTION (e.g. 0.70) or set "
               "XLA_PYTHON_CLIENT_PREALLOCATE=false before JAX starts; to allocate one arena "
               "for every shape instead of one per size class, call "
               "jaxflux.configure(workspace_bytes=...) with the largest need.";
      return false;
    }
    // Published once allocated; handlers read it without the lock.
    arenas[SlotOfOrdinal(ordinal)].store(static_cast<char*>(ptr), std::memory_order_release);
  }
  return true;
}

size_t WorkspaceBytes(int64_t workspace_class) {
  if (!runtime_internal::ValidWorkspaceClass(workspace_class)) return 0;
  for (const auto& arena : g_arenas[workspace_class]) {
    if (arena.load(std::memory_order_acquire) != nullptr) return size_t{1} << workspace_class;
  }
  return 0;
}

char* WorkspaceArena(int64_t workspace_class, int slot) {
  if (!runtime_internal::ValidWorkspaceClass(workspace_class) || slot < 0 ||
      slot >= kMaxDevices) {
    return nullptr;
  }
  return g_arenas[workspace_class][slot].load(std::memory_order_acquire);
}

uint64_t NextEpoch(int channel, int slot) {
  return g_epochs[channel][slot].fetch_add(1) + 1;
}

void SetSlot(int ordinal, int slot) {
  if (ordinal >= 0 && ordinal < kMaxDevices) g_slot_plus_one[ordinal].store(slot + 1);
}

int SlotOfOrdinal(int ordinal) {
  if (ordinal < 0 || ordinal >= kMaxDevices) return -1;
  const int stored = g_slot_plus_one[ordinal].load();
  return stored == 0 ? ordinal : stored - 1;
}

void SetHostIndex(int host) { g_host_index.store(host); }
int HostIndex() { return g_host_index.load(); }

cudaError_t GetDeviceResources(int slot, DeviceResources** out, std::string* failed_call) {
  if (slot < 0 || slot >= kMaxDevices || !g_devices[slot].ready.load()) {
    *failed_call = "jaxflux: no runtime resources for host slot " + std::to_string(slot) +
                   " (the op must be traced through jaxflux, which sets them up)";
    return cudaErrorInvalidDevice;
  }
  *out = &g_devices[slot];
  return cudaSuccess;
}

}  // namespace jaxflux
