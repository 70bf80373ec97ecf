// How many times the host ran the execute stage of the tp=1 handlers. XLA would run a captured
// handler only to record it (again when its buffers move) and replay the CUDA graph after that,
// so the counts tell whether a program's calls were captured (tests/test_command_buffers_gpu.py).
#pragma once

#include <atomic>
#include <cstdint>

namespace jaxflux {

enum class CountedTarget { kGemm = 0, kGroupedGemm = 1 };
inline constexpr int kNumCountedTargets = 2;

inline std::atomic<int64_t>& HostExecutions(CountedTarget target) {
  static std::atomic<int64_t> counts[kNumCountedTargets];
  return counts[static_cast<int>(target)];
}

inline void CountHostExecution(CountedTarget target) {
  HostExecutions(target).fetch_add(1, std::memory_order_relaxed);
}

}  // namespace jaxflux
