// Per-device facts the kernels' host code needs often, read once per process.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <mutex>

namespace jaxflux {

// Streaming multiprocessors of CUDA device `device` (0 if it can't be read). Read once:
// cudaGetDeviceProperties-class queries cost milliseconds, and this is asked on every call.
inline int SmCount(int device) {
  static std::mutex mu;
  static int counts[64] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0 || device >= 64) return 0;
  if (counts[device] == 0) {
    cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device);
  }
  return counts[device];
}

// SMs the persistent GEMMs size their grid by: all of the device's, or fewer with
// JAXFLUX_GEMM_SMS=n (test and measurement knob). Fewer leave SMs free for kernels of other
// streams; the tests that run two ranks on one GPU need that (tests/multiprocess_gpu_worker.py):
// a copy between two buffers of one device runs as a kernel, which a GEMM holding every SM
// while it waits for that very copy would starve until its wait timed out.
inline int GridSms(int device) {
  static const int limit = [] {
    const char* env = std::getenv("JAXFLUX_GEMM_SMS");
    return env != nullptr ? std::atoi(env) : 0;
  }();
  const int sms = SmCount(device);
  return limit > 0 && limit < sms ? limit : sms;
}

}  // namespace jaxflux
