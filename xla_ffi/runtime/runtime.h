// Host-side runtime of jaxflux: symmetric workspace, signal channels, epochs, rank discovery and
// the device error record. Plain C++ (no CUDA types) so that module.cc can call it without nvcc.
#ifndef JAXFLUX_XLA_FFI_RUNTIME_RUNTIME_H_
#define JAXFLUX_XLA_FFI_RUNTIME_RUNTIME_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace jaxflux {

inline constexpr int kMaxDevices = 16;      // local GPUs one process drives
inline constexpr int kMaxRanks = 8;         // ranks of one group (NVLink domain of one host)
inline constexpr int kMaxChannels = 1024;   // distinct groups (device sets) ever seen
inline constexpr int kMaxGenerations = 64;  // workspace growths over a process lifetime

// Makes every device in `ordinals` hold an arena of at least `bytes` (the call's receive-slot
// needs) in the current workspace generation; grows (new generation, old arenas kept alive)
// when needed. Returns the generation to bake into the traced call, or nullopt with `error`.
std::optional<int64_t> EnsureWorkspace(const std::vector<int>& ordinals, size_t bytes,
                                       size_t minimum_bytes, std::string* error);

// Bytes of arena per device in a generation (0 when it does not exist).
size_t WorkspaceBytes(int64_t generation);

// Settings read by every handler call (so they apply to programs compiled earlier too).
void SetTimeoutNs(uint64_t timeout_ns);
uint64_t TimeoutNs();
void SetSyncErrors(bool sync);
bool SyncErrors();

// Takes (and clears) the first error a device recorded since the last take, formatted.
std::optional<std::string> TakeDeviceErrorMessage();
// Same, into a caller's buffer (plain-C shape for the nanobind module); false when none.
bool TakeDeviceError(char* buffer, size_t size);

// Test hooks: number of rank discoveries done so far (each costs one host sync).
int64_t DiscoveryCount();

// JAXFLUX_DEBUG=1: handlers trace what they do on stderr.
bool DebugEnabled();

}  // namespace jaxflux

#endif  // JAXFLUX_XLA_FFI_RUNTIME_RUNTIME_H_
