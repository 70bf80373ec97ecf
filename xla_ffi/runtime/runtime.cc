// Host side of the runtime: workspace generations, per-device resources, epochs, rank discovery
// and the host-mapped device error record.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>
#include <vector>

#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"

namespace jaxflux {
namespace {

constexpr size_t kArenaAlignment = size_t{2} << 20;  // grow in 2 MiB steps

std::atomic<uint64_t> g_timeout_ns{30ull * 1000 * 1000 * 1000};
std::atomic<bool> g_sync_errors{false};
std::atomic<int64_t> g_discoveries{0};

// Workspace generations. Only appended: a traced call names its generation and every device
// uses that generation's arenas, so programs queued before a growth keep consistent pointers.
std::mutex g_workspace_mu;
std::atomic<int64_t> g_num_generations{0};
std::array<size_t, kMaxGenerations> g_generation_bytes{};
std::array<std::array<char*, kMaxDevices>, kMaxGenerations> g_arenas{};

std::array<DeviceResources, kMaxDevices> g_devices;  // by host slot

// Host slots (runtime.h), stored as slot + 1: 0 = the CUDA ordinal itself (one process drives
// all local GPUs).
std::array<std::atomic<int>, kMaxDevices> g_slot_plus_one{};
std::atomic<int> g_host_index{0};

// Mappings opened with cudaIpcOpenMemHandle, closed by CloseImportedPeers.
std::mutex g_import_mu;
std::vector<void*> g_imported;
std::array<std::array<std::atomic<uint64_t>, kMaxDevices>, kMaxChannels> g_epochs{};


DeviceErrorRecord* g_error_host = nullptr;
DeviceErrorRecord* g_error_device = nullptr;
std::once_flag g_error_once;

cudaError_t InitDeviceResources(int ordinal, std::string* failed_call);

std::string CudaCall(const char* call, cudaError_t err) {
  return std::string(call) + " failed: " + cudaGetErrorString(err);
}

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

}  // namespace

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

void SetTimeoutNs(uint64_t timeout_ns) { g_timeout_ns.store(timeout_ns); }
uint64_t TimeoutNs() { return g_timeout_ns.load(); }
void SetSyncErrors(bool sync) { g_sync_errors.store(sync); }
bool SyncErrors() { return g_sync_errors.load(); }
int64_t DiscoveryCount() { return g_discoveries.load(); }

bool DebugEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("JAXFLUX_DEBUG");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  return enabled;
}

DeviceErrorRecord* DeviceErrorRecordPtr() {
  std::call_once(g_error_once, [] {
    void* host = nullptr;
    // Portable + mapped: one record every device can write through UVA.
    if (cudaHostAlloc(&host, sizeof(DeviceErrorRecord),
                      cudaHostAllocPortable | cudaHostAllocMapped) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    std::memset(host, 0, sizeof(DeviceErrorRecord));
    void* device = nullptr;
    if (cudaHostGetDevicePointer(&device, host, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    g_error_host = static_cast<DeviceErrorRecord*>(host);
    g_error_device = static_cast<DeviceErrorRecord*>(device);
  });
  return g_error_device;
}

bool TakeDeviceError(char* buffer, size_t size) {
  std::optional<std::string> message = TakeDeviceErrorMessage();
  if (!message) return false;
  std::snprintf(buffer, size, "%s", message->c_str());
  return true;
}

std::optional<std::string> TakeDeviceErrorMessage() {
  DeviceErrorRecord* r = g_error_host;
  if (r == nullptr) return std::nullopt;
  volatile DeviceErrorRecord* v = r;
  if (v->ready == 0) return std::nullopt;
  std::atomic_thread_fence(std::memory_order_acquire);
  DeviceErrorRecord copy{};
  copy.kind = v->kind;
  copy.op = v->op;
  copy.device = v->device;
  copy.rank = v->rank;
  copy.peer = v->peer;
  copy.group = v->group;
  copy.target = v->target;
  copy.seen = v->seen;
  copy.epoch = v->epoch;
  copy.timeout_ns = v->timeout_ns;
  v->ready = 0;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  v->claim = 0;
  // snprintf, not iostreams: formatting doubles through ostringstream crashed inside the
  // extension on the GPU machine (two libstdc++ builds in one process, suspected).
  const char* op = "op";
  switch (static_cast<OpCode>(copy.op)) {
    case OpCode::kAllGather: op = "all_gather"; break;
    case OpCode::kAllGatherMatmul: op = "all_gather_matmul"; break;
    case OpCode::kMatmulReduceScatter: op = "matmul_reduce_scatter"; break;
  }
  char text[1024];
  if (copy.kind == static_cast<int32_t>(ErrorKind::kTimeout)) {
    std::snprintf(text, sizeof(text),
                  "jaxflux %s: rank %d (GPU %d) timed out after %.3g s waiting for rank %d at "
                  "epoch %llu (flag %llu, needed %llu). A peer never reached this op: the devices "
                  "of a group ran different programs or different numbers of jaxflux calls, or a "
                  "peer is stuck. Raise the limit with jaxflux.configure(timeout_s=...) if the "
                  "peer is merely slow. Results of that call are invalid.",
                  op, copy.rank, copy.device, static_cast<double>(copy.timeout_ns) * 1e-9,
                  copy.peer, static_cast<unsigned long long>(copy.epoch),
                  static_cast<unsigned long long>(copy.seen),
                  static_cast<unsigned long long>(copy.target));
  } else {
    std::snprintf(text, sizeof(text),
                  "jaxflux %s: GPU %d cached rank %d at its first call but this program says "
                  "rank %d, group %d (epoch %llu). The same traced call site runs under two "
                  "device assignments; re-trace per mesh (jax.jit a fresh function per mesh) or "
                  "use the stateful targets. Results of that call are invalid.",
                  op, copy.device, copy.rank, copy.peer, copy.group,
                  static_cast<unsigned long long>(copy.epoch));
  }
  return std::string(text);
}

std::optional<int64_t> EnsureWorkspace(const std::vector<int>& ordinals, size_t bytes,
                                       size_t minimum_bytes, std::string* error) {
  std::lock_guard<std::mutex> lock(g_workspace_mu);
  const int64_t n = g_num_generations.load();
  for (int ordinal : ordinals) {
    if (ordinal < 0 || ordinal >= kMaxDevices || SlotOfOrdinal(ordinal) < 0 ||
        SlotOfOrdinal(ordinal) >= kMaxDevices) {
      *error = "jaxflux: device ordinal " + std::to_string(ordinal) + " (host slot " +
               std::to_string(SlotOfOrdinal(ordinal)) + ") out of range 0.." +
               std::to_string(kMaxDevices - 1);
      return std::nullopt;
    }
  }
  for (int ordinal : ordinals) {
    std::string failed;
    if (cudaError_t err = InitDeviceResources(ordinal, &failed); err != cudaSuccess) {
      (void)cudaGetLastError();
      *error = "jaxflux: setting up GPU " + std::to_string(ordinal) + ": " +
               CudaCall(failed.c_str(), err);
      return std::nullopt;
    }
  }
  if (n > 0 && g_generation_bytes[n - 1] >= bytes) {
    bool all = true;
    for (int ordinal : ordinals) all = all && g_arenas[n - 1][SlotOfOrdinal(ordinal)] != nullptr;
    if (all) return n - 1;
  }
  if (n >= kMaxGenerations) {
    *error = "jaxflux: the workspace grew " + std::to_string(kMaxGenerations) +
             " times; reserve it up front with jaxflux.configure(workspace_bytes=...)";
    return std::nullopt;
  }
  size_t want = std::max({bytes, minimum_bytes, n > 0 ? g_generation_bytes[n - 1] : size_t{0}});
  want = (want + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment;
  std::array<char*, kMaxDevices> arenas{};
  for (int ordinal : ordinals) {
    for (int peer : ordinals) {
      cudaError_t err = EnablePeer(ordinal, peer);
      if (err != cudaSuccess) {
        *error = "jaxflux: peer access from GPU " + std::to_string(ordinal) + " to GPU " +
                 std::to_string(peer) + ": " + CudaCall("cudaDeviceEnablePeerAccess", err) +
                 ". The fused ops need all GPUs of a group linked (NVLink or PCIe P2P).";
        return std::nullopt;
      }
    }
    DeviceGuard guard(ordinal);
    void* ptr = nullptr;
    cudaError_t err = guard.status() != cudaSuccess ? guard.status() : cudaMalloc(&ptr, want);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      for (int o : ordinals) {
        if (arenas[SlotOfOrdinal(o)] != nullptr) {
          DeviceGuard g(o);
          cudaFree(arenas[SlotOfOrdinal(o)]);  // never published, so nothing can be using it
        }
      }
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      (void)cudaGetLastError();
      *error = "jaxflux: could not allocate the symmetric workspace: " + FormatMiB(want) +
               " on GPU " + std::to_string(ordinal) + " (" + CudaCall("cudaMalloc", err) +
               "; " + FormatMiB(free_b) + " free outside XLA's pool). The workspace lives "
               "outside XLA's allocator, which by default takes 75% of GPU memory up front: "
               "lower XLA_PYTHON_CLIENT_MEM_FRACTION (e.g. 0.70) or set "
               "XLA_PYTHON_CLIENT_PREALLOCATE=false before JAX starts; to grow it once instead "
               "of per shape, call jaxflux.configure(workspace_bytes=...) with the largest need.";
      return std::nullopt;
    }
    arenas[SlotOfOrdinal(ordinal)] = static_cast<char*>(ptr);
  }
  // Slots not in `ordinals` inherit the previous generation's arena (still alive) so that a
  // generation's table is never sparser than the one before it. (Another process's GPUs get
  // theirs from ImportPeer.)
  for (int d = 0; d < kMaxDevices; ++d) {
    if (arenas[d] == nullptr && n > 0 && g_generation_bytes[n - 1] >= want) {
      arenas[d] = g_arenas[n - 1][d];
    }
  }
  g_arenas[n] = arenas;
  g_generation_bytes[n] = want;
  g_num_generations.store(n + 1, std::memory_order_release);
  return n;
}

size_t WorkspaceBytes(int64_t generation) {
  if (generation < 0 || generation >= g_num_generations.load(std::memory_order_acquire)) return 0;
  return g_generation_bytes[generation];
}

char* WorkspaceArena(int64_t generation, int slot) {
  if (generation < 0 || generation >= g_num_generations.load(std::memory_order_acquire) ||
      slot < 0 || slot >= kMaxDevices) {
    return nullptr;
  }
  return g_arenas[generation][slot];
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

bool ExportDevice(int64_t generation, int ordinal, IpcHandles* out, std::string* error) {
  const int slot = SlotOfOrdinal(ordinal);
  char* arena = WorkspaceArena(generation, slot);
  if (arena == nullptr || slot < 0 || !g_devices[slot].ready.load()) {
    *error = "jaxflux: GPU " + std::to_string(ordinal) + " has no workspace in generation " +
             std::to_string(generation) + " to export";
    return false;
  }
  DeviceGuard guard(ordinal);
  const std::pair<void*, char*> parts[] = {{arena, out->arena},
                                           {g_devices[slot].ready_flags, out->ready_flags},
                                           {g_devices[slot].landed_flags, out->landed_flags}};
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

namespace {

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

bool ImportPeer(int64_t generation, int slot, const IpcHandles& handles, int local_ordinal,
                std::string* error) {
  std::lock_guard<std::mutex> lock(g_workspace_mu);
  if (slot < 0 || slot >= kMaxDevices || generation < 0 ||
      generation >= g_num_generations.load()) {
    *error = "jaxflux: ImportPeer: slot " + std::to_string(slot) + " or generation " +
             std::to_string(generation) + " out of range";
    return false;
  }
  DeviceGuard guard(local_ordinal);
  if (guard.status() != cudaSuccess) {
    *error = "jaxflux: ImportPeer: " + CudaCall("cudaSetDevice", guard.status());
    return false;
  }
  DeviceResources& r = g_devices[slot];
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
  if (g_arenas[generation][slot] == nullptr) {
    void* arena = nullptr;
    if (!OpenHandle(handles.arena, slot, &arena, error)) return false;
    g_arenas[generation][slot] = static_cast<char*>(arena);
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

namespace {

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

cudaError_t GetDeviceResources(int slot, DeviceResources** out, std::string* failed_call) {
  if (slot < 0 || slot >= kMaxDevices || !g_devices[slot].ready.load()) {
    *failed_call = "jaxflux: no runtime resources for host slot " + std::to_string(slot) +
                   " (the op must be traced through jaxflux, which sets them up)";
    return cudaErrorInvalidDevice;
  }
  *out = &g_devices[slot];
  return cudaSuccess;
}

// ---------------------------------------------------------------------------------------------
// Rank discovery: one rendezvous per (call site, round). A device's round counts how many times
// it discovered this site (once per executable instance with stateful handlers), so all devices
// of one executable meet in the same round.

namespace {

struct Rendezvous {
  std::map<int, std::pair<int, int>> members;  // ordinal -> (rank, group)
};

std::mutex g_rdv_mu;
std::condition_variable g_rdv_cv;
std::map<std::pair<int64_t, int64_t>, Rendezvous> g_rendezvous;
std::map<std::pair<int64_t, int>, int64_t> g_rounds;  // (site, ordinal) -> next round

}  // namespace

namespace {

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
// every peer (slot word = host << 8 | slot, gathered in the program), so no rendezvous is needed.
bool GroupFromSlots(int ordinal, const int32_t* words, int rank, int group, int64_t tp,
                    GroupInfo* info, std::string* error) {
  const int my_slot = SlotOfOrdinal(ordinal);
  std::array<int, kMaxRanks> peers;
  peers.fill(-1);
  for (int r = 0; r < tp; ++r) {
    const int host = words[r] >> 8, slot = words[r] & 0xff;
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

}  // namespace

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
                   int64_t info_count, int64_t site, int64_t tp, int64_t num_groups,
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
    *error = "jaxflux: reading the rank operand: " + CudaCall("cudaMemcpyAsync/Synchronize", err);
    return false;
  }
  const int rank = host[0], group = host[1];
  if (DebugEnabled()) {
    std::fprintf(stderr, "[jaxflux] GPU %d site %lld: rank %d group %d, rendezvous\n", ordinal,
                 static_cast<long long>(site), rank, group);
  }
  if (rank < 0 || rank >= tp || group < 0 || group >= num_groups) {
    *error = "jaxflux: rank operand out of range on GPU " + std::to_string(ordinal) + ": rank " +
             std::to_string(rank) + " of " + std::to_string(tp) + ", group " +
             std::to_string(group) + " of " + std::to_string(num_groups);
    return false;
  }
  g_discoveries.fetch_add(1);
  if (info_count == 2 + tp) return GroupFromSlots(ordinal, host + 2, rank, group, tp, info, error);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(TimeoutNs());
  std::unique_lock<std::mutex> lock(g_rdv_mu);
  const int64_t round = g_rounds[{site, ordinal}]++;
  Rendezvous& rdv = g_rendezvous[{site, round}];
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
             "call site after " + std::to_string(TimeoutNs() / 1000000) + " ms:" + found +
             ". All " + std::to_string(tp) + " ranks of a group must be GPUs of this process "
             "(with one process per GPU the rank operand names the peers instead), and XLA must "
             "run them concurrently.";
    return false;
  }
  lock.unlock();
  if (DebugEnabled()) {
    std::fprintf(stderr, "[jaxflux] GPU %d site %lld round %lld: group complete\n", ordinal,
                 static_cast<long long>(site), static_cast<long long>(round));
  }
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
