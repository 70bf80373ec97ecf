// Per-device facts the kernels' host code needs often, read once per process.
#pragma once

#include <cuda_runtime_api.h>

#include <mutex>

namespace jaxflux {

// Streaming multiprocessors of CUDA device `device` (0 if it can't be read). Read once:
// cudaGetDeviceProperties-class queries cost milliseconds, and this is asked on every call.
inline int SmCount(int device) {
  static std::mutex mu;
  static int counts[64] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0 || device >= 64) return 0;
  if (counts[device] == 0 &&
      cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device) !=
          cudaSuccess) {
    (void)cudaGetLastError();
    counts[device] = 0;
  }
  return counts[device];
}

// SMs a persistent GEMM sizes its grid by (GemmProblem::grid_sms): all of the device's, or
// min(grid_sms, SMs) when grid_sms > 0.
inline int GridSms(int device, int grid_sms) {
  const int sms = SmCount(device);
  return grid_sms > 0 && grid_sms < sms ? grid_sms : sms;
}

}  // namespace jaxflux
