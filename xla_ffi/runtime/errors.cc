// The runtime's settings and diagnostics: the timeout and synchronous-error settings, the debug
// flag, and the host-mapped record that kernels write an error into.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"

namespace jaxflux {
namespace {

std::atomic<uint64_t> g_timeout_ns{30ull * 1000 * 1000 * 1000};
std::atomic<bool> g_sync_errors{false};

DeviceErrorRecord* g_error_host = nullptr;
DeviceErrorRecord* g_error_device = nullptr;
std::once_flag g_error_once;

const char* OpName(int32_t op) {
  switch (static_cast<OpCode>(op)) {
    case OpCode::kAllGather: return "all_gather";
    case OpCode::kAllGatherMatmul: return "all_gather_matmul";
    case OpCode::kMatmulReduceScatter: return "matmul_reduce_scatter";
    case OpCode::kMatmulAllReduce: return "matmul_all_reduce";
    case OpCode::kMoeAllGatherGroupedMatmul: return "all_gather_grouped_matmul";
    case OpCode::kMoeGroupedMatmulReduceScatter: return "grouped_matmul_reduce_scatter";
  }
  return "op";
}

}  // namespace

void SetTimeoutNs(uint64_t timeout_ns) { g_timeout_ns.store(timeout_ns); }
uint64_t TimeoutNs() { return g_timeout_ns.load(); }
void SetSyncErrors(bool sync) { g_sync_errors.store(sync); }
bool SyncErrors() { return g_sync_errors.load(); }

// The one environment variable the native code reads.
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
  // extension (two libstdc++ builds in one process, suspected).
  const char* op = OpName(copy.op);
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
                  "jaxflux %s: GPU %d found rank %d at its first call but this program says "
                  "rank %d, group %d (epoch %llu). One executable instance runs under two "
                  "device assignments; re-trace per mesh (jax.jit a fresh function per mesh). "
                  "Results of that call are invalid.",
                  op, copy.device, copy.rank, copy.peer, copy.group,
                  static_cast<unsigned long long>(copy.epoch));
  }
  return std::string(text);
}

}  // namespace jaxflux
