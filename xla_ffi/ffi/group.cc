#include "xla_ffi/ffi/group.h"

#include <map>
#include <shared_mutex>
#include <utility>

namespace ffi = xla::ffi;

namespace jaxflux {

ffi::TypeId RankState::id = {};

namespace {

std::shared_mutex g_site_mu;
std::map<std::pair<int64_t, int>, GroupInfo> g_site_groups;

ffi::Error Discover(cudaStream_t stream, int ordinal, const int32_t* rank_info,
                    int64_t rank_info_count, int64_t site, int64_t tp, int64_t num_groups,
                    GroupInfo* group) {
  std::string error;
  if (!DiscoverGroup(stream, ordinal, rank_info, rank_info_count, site, tp, num_groups, group,
                     &error)) {
    return ffi::Error::Internal(error);
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error ResolveGroup(const char* op, cudaStream_t stream, int ordinal, RankState* state,
                        ffi::Buffer<ffi::S32> rank_info_buffer, int64_t site, int64_t tp,
                        int64_t num_groups, GroupInfo* group) {
  const int32_t* rank_info = rank_info_buffer.typed_data();
  const auto rank_info_count = static_cast<int64_t>(rank_info_buffer.element_count());
  if (ordinal < 0 || ordinal >= kMaxDevices) {
    return ffi::Error::InvalidArgument(std::string("jaxflux ") + op +
                                       ": device ordinal out of range");
  }
  if (state != nullptr) {
    std::unique_lock<std::mutex> lock(state->mu);
    if (!state->known[ordinal]) {
      // Discovery blocks on peers; don't hold the state lock that their handlers need.
      lock.unlock();
      GroupInfo found;
      if (ffi::Error e = Discover(stream, ordinal, rank_info, rank_info_count, site, tp,
                                  num_groups, &found);
          e.failure()) {
        return e;
      }
      lock.lock();
      state->groups[ordinal] = found;
      state->known[ordinal] = true;
    }
    *group = state->groups[ordinal];
    return ffi::Error::Success();
  }
  {
    std::shared_lock<std::shared_mutex> lock(g_site_mu);
    auto it = g_site_groups.find({site, ordinal});
    if (it != g_site_groups.end()) {
      *group = it->second;
      return ffi::Error::Success();
    }
  }
  if (ffi::Error e = Discover(stream, ordinal, rank_info, rank_info_count, site, tp, num_groups,
                              group);
      e.failure()) {
    return e;
  }
  std::unique_lock<std::shared_mutex> lock(g_site_mu);
  g_site_groups[{site, ordinal}] = *group;
  return ffi::Error::Success();
}

ffi::Error GetGroupResources(const char* op, int64_t generation, const GroupInfo& g,
                             bool need_arenas, GroupResources* out) {
  std::string failed;
  auto cuda_error = [&](cudaError_t err) {
    (void)cudaGetLastError();
    return ffi::Error::Internal(std::string("jaxflux ") + op + ": " + failed + " failed: " +
                                cudaGetErrorString(err));
  };
  if (cudaError_t err = GetDeviceResources(g.slot, &out->self, &failed); err != cudaSuccess) {
    return cuda_error(err);
  }
  for (int p = 0; p < g.tp; ++p) {
    out->arenas[p] = WorkspaceArena(generation, g.peers[p]);
    if (need_arenas && out->arenas[p] == nullptr) {
      return ffi::Error::Internal(std::string("jaxflux ") + op + ": no workspace for host slot " +
                                  std::to_string(g.peers[p]) + " in generation " +
                                  std::to_string(generation));
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
