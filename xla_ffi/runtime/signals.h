// Internal runtime pieces the FFI handlers use (CUDA types allowed here; not seen by module.cc).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/kernels/signal_kernels.h"

namespace jaxflux {

// Flag numbering shared by every op on a channel: chunk c of a shard at epoch e is announced by
// the value e * kMaxChunks + c + 1, so values grow monotonically across epochs and ops.
inline constexpr int kMaxChunks = 4;
// Pipelining granularity: shards are cut into chunks of about this many bytes (<= kMaxChunks).
inline constexpr size_t kChunkTargetBytes = size_t{8} << 20;

// Where one device stands in its tensor-parallel group, found once per executable instance.
struct GroupInfo {
  int rank = -1;                         // position along the gathered mesh axis
  int group = -1;                        // linear index over the other mesh axes
  int tp = 0;                            // group size
  int channel = -1;                      // index of this group's flags and epoch counters
  int slot = -1;                         // this device's host slot (see runtime.h)
  std::array<int, kMaxRanks> peers{};    // host slot of each rank of the group
};

// Per-device resources that live for the process: side stream, fork/join events, flag arrays.
struct DeviceResources {
  std::mutex mu;            // one handler at a time per device
  std::atomic<bool> ready{false};
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
  uint64_t* ready_flags = nullptr;   // [kMaxChannels][kMaxDevices]: device d pushed chunk c here
  uint64_t* landed_flags = nullptr;  // [kMaxChannels][kMaxDevices]: chunk of device d is in out
  int sm_count = 1;                  // caps the receiver's spinning copy grids
  bool remote = false;               // a GPU of another process: only the flag arrays are set
};

// Resources of host slot `slot` (created by EnsureWorkspace at trace time for this process's
// GPUs, imported by ImportPeer for other processes').
cudaError_t GetDeviceResources(int slot, DeviceResources** out, std::string* failed_call);

// Arena base of host slot `slot` of `workspace_class` (nullptr when absent).
char* WorkspaceArena(int64_t workspace_class, int slot);

// Bumps and returns the epoch of (channel, slot). Epochs start at 1.
uint64_t NextEpoch(int channel, int slot);

// Host-mapped record the kernels write on timeout / rank mismatch (device pointer).
DeviceErrorRecord* DeviceErrorRecordPtr();

// Where the local devices of one call meet: XLA's logical execution (every device of one run of
// an executable shares its run id, as XLA's own collectives rely on) and the call's signature
// key. Calls of one run with equal keys meet in successive rounds, in program order.
struct RendezvousKey {
  int64_t run_id = 0;
  int64_t site = 0;
};

// Reads this device's rank info (one synchronous D2H copy on `stream`), then rendezvous with the
// other local devices of the same call until all `tp` ranks of its group are known. Bounded by
// the configured timeout.
// With one process per GPU the operand also holds the group's slots in rank order
// (`info_count` == 2 + tp; see docs/design.md) and no rendezvous is needed.
bool DiscoverGroup(cudaStream_t stream, int ordinal, const int32_t* rank_info_device,
                   int64_t info_count, RendezvousKey key, int64_t tp, int64_t num_groups,
                   GroupInfo* info, std::string* error);

// Scoped cudaSetDevice that restores the previous device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal);
  ~DeviceGuard();
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace jaxflux
