// Where a device stands in its tensor-parallel group, found once per executable instance (XLA
// FFI state) and shared by every communicating FFI handler.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <mutex>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/runtime/signals.h"

namespace jaxflux {

// Ranks learned by one executable instance, per device of this process (XLA FFI state).
struct RankState {
  static xla::ffi::TypeId id;
  std::mutex mu;
  std::array<bool, kMaxDevices> known{};
  std::array<GroupInfo, kMaxDevices> groups{};
};

// The group of `ordinal` for this call, from `state`; runs DiscoverGroup (one host sync and a
// rendezvous with the peers) the first time. `op` names the caller in errors. `rank_info` is the
// op's rank operand: [rank, group], plus the group's slots in rank order with one process per
// GPU.
xla::ffi::Error ResolveGroup(const char* op, cudaStream_t stream, int ordinal, RankState* state,
                             xla::ffi::Buffer<xla::ffi::S32> rank_info, RendezvousKey key,
                             int64_t tp, int64_t num_groups, GroupInfo* group);

// What a communicating handler needs of every rank of its group: workspace arenas of one
// class and the per-device resources (streams, events, flag arrays).
struct GroupResources {
  DeviceResources* self = nullptr;                  // this device's
  std::array<DeviceResources*, kMaxRanks> ranks{};  // by rank
  std::array<char*, kMaxRanks> arenas{};            // by rank; checked when need_arenas
};

// Fills `out` for this device (g.slot) in group `g`. Call with the device current (DeviceGuard).
xla::ffi::Error GetGroupResources(const char* op, int64_t workspace_class, const GroupInfo& g,
                                  bool need_arenas, GroupResources* out);

}  // namespace jaxflux
