// Rank discovery: where a device stands in its tensor-parallel group. One rendezvous per
// (run, signature key, round): the devices of one run of an executable share the run id, and a
// device's round counts the calls of that key it discovered in the run, so the k-th such call
// of every device meets the others' k-th (devices run a program's calls in one order). With one
// process per GPU the rank operand names the peers and no rendezvous is needed.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"
#include "xla_ffi/runtime/workspace_state.h"

namespace jaxflux {

namespace {

std::atomic<int64_t> g_discoveries{0};

struct Rendezvous {
  std::map<int, std::pair<int, int>> members;  // ordinal -> (rank, group)
};

std::mutex g_rdv_mu;
std::condition_variable g_rdv_cv;
std::map<std::tuple<int64_t, int64_t, int64_t>, Rendezvous> g_rendezvous;  // (run, site, round)
std::map<std::tuple<int64_t, int64_t, int>, int64_t> g_rounds;  // (run, site, ordinal) -> next

// The group's channel: the bitmask of its slots. A set, not the rank order, so that programs that
// rank the same devices differently (permuted meshes) share one epoch sequence and one set of
// flags (indexed by source slot), which keeps the receive-slot argument of docs/runtime.md
// valid across them; and a pure function of the set, so that every process of a group (one
// process per GPU) numbers it alike with no agreement.
bool ChannelOf(const std::array<int, kMaxRanks>& peers, int64_t tp, int* channel,
               std::string* error) {
  int mask = 0;
  for (int r = 0; r < tp; ++r) {
    if (peers[r] < 0 || peers[r] >= kMaxDevices || (mask >> peers[r] & 1)) {
      *error = "jaxflux: a group names host slot " + std::to_string(peers[r]) +
               " twice or out of range";
      return false;
    }
    mask |= 1 << peers[r];
  }
  *channel = mask;
  return true;
}

// One process per GPU: the operand [rank, group, slot word of rank 0, ..., of rank tp-1] names
// every peer (slot words, runtime.h; gathered in the program), so no rendezvous is needed.
bool GroupFromSlots(int ordinal, const int32_t* words, int rank, int group, int64_t tp,
                    GroupInfo* info, std::string* error) {
  const int my_slot = SlotOfOrdinal(ordinal);
  std::array<int, kMaxRanks> peers;
  peers.fill(-1);
  for (int r = 0; r < tp; ++r) {
    const int host = SlotWordHost(words[r]), slot = SlotWordSlot(words[r]);
    if (host != HostIndex()) {
      *error = "jaxflux: rank " + std::to_string(r) + " of the tp group of GPU " +
               std::to_string(ordinal) + " is on host " + std::to_string(host) + ", this GPU on "
               "host " + std::to_string(HostIndex()) + ": the fused ops need the tp axis inside "
               "one host (put tp on the GPUs of a host and dp across hosts).";
      return false;
    }
    peers[r] = slot;
  }
  if (peers[rank] != my_slot) {
    *error = "jaxflux: GPU " + std::to_string(ordinal) + " is host slot " +
             std::to_string(my_slot) + " but its group names slot " + std::to_string(peers[rank]) +
             " at its rank " + std::to_string(rank);
    return false;
  }
  info->rank = rank;
  info->group = group;
  info->tp = static_cast<int>(tp);
  info->slot = my_slot;
  info->peers = peers;
  return ChannelOf(peers, tp, &info->channel, error);
}

// The in-process rendezvous: waits (bounded) until the `tp` ranks of `group` in this device's
// round of `key` are known; `peers[rank]` = their host slots.
bool MeetLocalPeers(int ordinal, int rank, int group, RendezvousKey key, int64_t tp,
                    std::array<int, kMaxRanks>* peers_out, std::string* error) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(TimeoutNs());
  std::unique_lock<std::mutex> lock(g_rdv_mu);
  const int64_t round = g_rounds[{key.run_id, key.site, ordinal}]++;
  Rendezvous& rdv = g_rendezvous[{key.run_id, key.site, round}];
  rdv.members[ordinal] = {rank, group};
  g_rdv_cv.notify_all();
  std::array<int, kMaxRanks> peers;
  auto complete = [&] {
    peers.fill(-1);
    int found = 0;
    for (const auto& [o, rg] : rdv.members) {
      if (rg.second != group) continue;
      if (peers[rg.first] != -1) return false;  // duplicate rank: resolved below on timeout
      peers[rg.first] = SlotOfOrdinal(o);
      ++found;
    }
    return found == tp;
  };
  if (!g_rdv_cv.wait_until(lock, deadline, complete)) {
    std::string found;
    for (const auto& [o, rg] : rdv.members) {
      found += " GPU " + std::to_string(o) + "=rank " + std::to_string(rg.first) + "/group " +
               std::to_string(rg.second);
    }
    *error = "jaxflux: GPU " + std::to_string(ordinal) + " (rank " + std::to_string(rank) +
             ", group " + std::to_string(group) + ") found only these local devices of its "
             "call after " + std::to_string(TimeoutNs() / 1000000) + " ms:" + found +
             ". All " + std::to_string(tp) + " ranks of a group must be GPUs of this process "
             "(with one process per GPU the rank operand names the peers instead), and XLA must "
             "run them concurrently.";
    return false;
  }
  lock.unlock();
  if (DebugEnabled()) {
    std::fprintf(stderr, "[jaxflux] GPU %d run %lld site %lld round %lld: group complete\n",
                 ordinal, static_cast<long long>(key.run_id), static_cast<long long>(key.site),
                 static_cast<long long>(round));
  }
  *peers_out = peers;
  return true;
}

}  // namespace

int64_t DiscoveryCount() { return g_discoveries.load(); }

bool MeetLocalPeersForTest(int ordinal, int rank, int group, int64_t run_id, int64_t site,
                           int64_t tp, std::vector<int>* peers, std::string* error) {
  if (tp < 1 || tp > kMaxRanks || rank < 0 || rank >= tp) {
    *error = "jaxflux: bad test arguments";
    return false;
  }
  std::array<int, kMaxRanks> found;
  if (!MeetLocalPeers(ordinal, rank, group, {run_id, site}, tp, &found, error)) return false;
  peers->assign(found.begin(), found.begin() + tp);
  return true;
}

bool GroupFromSlotWordsForTest(int ordinal, const std::vector<int32_t>& words, int rank,
                               int group, std::vector<int>* out, std::string* error) {
  const auto tp = static_cast<int64_t>(words.size());
  if (tp < 1 || tp > kMaxRanks || rank < 0 || rank >= tp) {
    *error = "jaxflux: bad test arguments";
    return false;
  }
  GroupInfo info;
  if (!GroupFromSlots(ordinal, words.data(), rank, group, tp, &info, error)) return false;
  *out = {info.rank, info.group, info.channel, info.slot};
  out->insert(out->end(), info.peers.begin(), info.peers.begin() + tp);
  return true;
}

bool DiscoverGroup(cudaStream_t stream, int ordinal, const int32_t* rank_info_device,
                   int64_t info_count, RendezvousKey key, int64_t tp, int64_t num_groups,
                   GroupInfo* info, std::string* error) {
  if (tp < 1 || tp > kMaxRanks) {
    *error = "jaxflux: group size " + std::to_string(tp) + " unsupported (1.." +
             std::to_string(kMaxRanks) + " GPUs of one host)";
    return false;
  }
  if (info_count != 2 && info_count != 2 + tp) {
    *error = "jaxflux: the rank operand holds " + std::to_string(info_count) + " int32s; expected "
             "2, or 2 + tp with one process per GPU";
    return false;
  }
  int32_t host[2 + kMaxRanks];
  std::fill(std::begin(host), std::end(host), -1);
  cudaError_t err = cudaMemcpyAsync(host, rank_info_device, sizeof(int32_t) * info_count,
                                    cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) {
    *error = "jaxflux: reading the rank operand: " +
             runtime_internal::CudaCall("cudaMemcpyAsync/Synchronize", err);
    return false;
  }
  const int rank = host[0], group = host[1];
  if (DebugEnabled()) {
    std::fprintf(stderr, "[jaxflux] GPU %d run %lld site %lld: rank %d group %d, rendezvous\n",
                 ordinal, static_cast<long long>(key.run_id), static_cast<long long>(key.site),
                 rank, group);
  }
  if (rank < 0 || rank >= tp || group < 0 || group >= num_groups) {
    *error = "jaxflux: rank operand out of range on GPU " + std::to_string(ordinal) + ": rank " +
             std::to_string(rank) + " of " + std::to_string(tp) + ", group " +
             std::to_string(group) + " of " + std::to_string(num_groups);
    return false;
  }
  g_discoveries.fetch_add(1);
  if (info_count == 2 + tp) return GroupFromSlots(ordinal, host + 2, rank, group, tp, info, error);
  std::array<int, kMaxRanks> peers;
  if (!MeetLocalPeers(ordinal, rank, group, key, tp, &peers, error)) return false;
  int channel;
  if (!ChannelOf(peers, tp, &channel, error)) return false;
  info->rank = rank;
  info->group = group;
  info->tp = static_cast<int>(tp);
  info->channel = channel;
  info->slot = SlotOfOrdinal(ordinal);
  info->peers = peers;
  return true;
}

}  // namespace jaxflux
