#include "xla_ffi/ffi/group.h"

#include <string>

#include "xla_ffi/ffi/errors.h"

namespace ffi = xla::ffi;

namespace jaxflux {

ffi::TypeId RankState::id = {};

ffi::Error ResolveGroup(const char* op, cudaStream_t stream, int ordinal, RankState* state,
                        ffi::Buffer<ffi::S32> rank_info, RendezvousKey key, int64_t tp,
                        int64_t num_groups, GroupInfo* group) {
  if (ordinal < 0 || ordinal >= kMaxDevices) {
    return ffi::Error::InvalidArgument(std::string("jaxflux ") + op +
                                       ": device ordinal out of range");
  }
  if (state == nullptr) {
    return OpError(op, "no rank state (the target's instantiate stage did not run)");
  }
  std::unique_lock<std::mutex> lock(state->mu);
  if (!state->known[ordinal]) {
    // Discovery blocks on peers; don't hold the state lock that their handlers need.
    lock.unlock();
    GroupInfo found;
    std::string error;
    if (!DiscoverGroup(stream, ordinal, rank_info.typed_data(),
                       static_cast<int64_t>(rank_info.element_count()), key, tp, num_groups,
                       &found, &error)) {
      return ffi::Error::Internal(error);
    }
    lock.lock();
    state->groups[ordinal] = found;
    state->known[ordinal] = true;
  }
  *group = state->groups[ordinal];
  return ffi::Error::Success();
}

ffi::Error GetGroupResources(const char* op, int64_t workspace_class, const GroupInfo& g,
                             bool need_arenas, GroupResources* out) {
  std::string failed;
  auto cuda_error = [&](cudaError_t err) {
    (void)cudaGetLastError();
    return OpError(op, failed + " failed: " + cudaGetErrorString(err));
  };
  if (cudaError_t err = GetDeviceResources(g.slot, &out->self, &failed); err != cudaSuccess) {
    return cuda_error(err);
  }
  for (int p = 0; p < g.tp; ++p) {
    out->arenas[p] = WorkspaceArena(workspace_class, g.peers[p]);
    if (need_arenas && out->arenas[p] == nullptr) {
      return OpError(op, "no workspace for host slot " + std::to_string(g.peers[p]) +
                             " in workspace class " + std::to_string(workspace_class));
    }
    if (cudaError_t err = GetDeviceResources(g.peers[p], &out->ranks[p], &failed);
        err != cudaSuccess) {
      return cuda_error(err);
    }
  }
  return ffi::Error::Success();
}

}  // namespace jaxflux

extern "C" XLA_FFI_TypeId* JaxfluxRankStateTypeId() { return &jaxflux::RankState::id; }

extern "C" const XLA_FFI_TypeInfo* JaxfluxRankStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = xla::ffi::MakeTypeInfo<jaxflux::RankState>();
  return &info;
}
