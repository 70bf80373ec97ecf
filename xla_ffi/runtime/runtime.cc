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

std::array<DeviceResources, kMaxDevices> g_devices;
std::array<std::array<std::atomic<uint64_t>, kMaxDevices>, kMaxChannels> g_epochs{};

std::mutex g_channel_mu;
std::map<std::vector<int>, int> g_channels;  // sorted ordinals of a group -> channel

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
    if (ordinal < 0 || ordinal >= kMaxDevices) {
      *error = "jaxflux: device ordinal " + std::to_string(ordinal) + " out of range";
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
    for (int ordinal : ordinals) all = all && g_arenas[n - 1][ordinal] != nullptr;
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
        if (arenas[o] != nullptr) {
          DeviceGuard g(o);
          cudaFree(arenas[o]);  // never published, so nothing can be using it
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
    arenas[ordinal] = static_cast<char*>(ptr);
  }
  // Devices not in `ordinals` inherit the previous generation's arena (still alive) so that a
  // generation's table is never sparser than the one before it.
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

char* WorkspaceArena(int64_t generation, int ordinal) {
  if (generation < 0 || generation >= g_num_generations.load(std::memory_order_acquire) ||
      ordinal < 0 || ordinal >= kMaxDevices) {
    return nullptr;
  }
  return g_arenas[generation][ordinal];
}

uint64_t NextEpoch(int channel, int ordinal) {
  return g_epochs[channel][ordinal].fetch_add(1) + 1;
}

namespace {

// Creates the side stream, events and flag arrays of `ordinal` (Python thread, under the
// workspace lock, before any program that needs them runs).
cudaError_t InitDeviceResources(int ordinal, std::string* failed_call) {
  DeviceResources& r = g_devices[ordinal];
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

cudaError_t GetDeviceResources(int ordinal, DeviceResources** out, std::string* failed_call) {
  if (ordinal < 0 || ordinal >= kMaxDevices || !g_devices[ordinal].ready.load()) {
    *failed_call = "jaxflux: no runtime resources on GPU " + std::to_string(ordinal) +
                   " (the op must be traced through jaxflux, which sets them up)";
    return cudaErrorInvalidDevice;
  }
  *out = &g_devices[ordinal];
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

bool DiscoverGroup(cudaStream_t stream, int ordinal, const int32_t* rank_info_device,
                   int64_t site, int64_t tp, int64_t num_groups, GroupInfo* info,
                   std::string* error) {
  if (tp < 1 || tp > kMaxRanks) {
    *error = "jaxflux: group size " + std::to_string(tp) + " unsupported (1.." +
             std::to_string(kMaxRanks) + " GPUs of one host)";
    return false;
  }
  int32_t host[2] = {-1, -1};
  cudaError_t err = cudaMemcpyAsync(host, rank_info_device, sizeof(host), cudaMemcpyDeviceToHost,
                                    stream);
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
      peers[rg.first] = o;
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
             "(one process per GPU is not supported yet), and XLA must run them concurrently.";
    return false;
  }
  lock.unlock();
  if (DebugEnabled()) {
    std::fprintf(stderr, "[jaxflux] GPU %d site %lld round %lld: group complete\n", ordinal,
                 static_cast<long long>(site), static_cast<long long>(round));
  }
  // Keyed by the *set* of devices, not their rank order: programs that rank the same devices
  // differently (permuted meshes) then share one epoch sequence and one set of flags (indexed by
  // source device), which keeps the receive-slot argument of docs/runtime.md valid across them.
  std::vector<int> key(peers.begin(), peers.begin() + tp);
  std::sort(key.begin(), key.end());
  int channel;
  {
    std::lock_guard<std::mutex> channel_lock(g_channel_mu);
    auto it = g_channels.find(key);
    if (it == g_channels.end()) {
      if (static_cast<int>(g_channels.size()) >= kMaxChannels) {
        *error = "jaxflux: too many distinct device groups";
        return false;
      }
      it = g_channels.emplace(key, static_cast<int>(g_channels.size())).first;
    }
    channel = it->second;
  }
  info->rank = rank;
  info->group = group;
  info->tp = static_cast<int>(tp);
  info->channel = channel;
  info->peers = peers;
  return true;
}

}  // namespace jaxflux
