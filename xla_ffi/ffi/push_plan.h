// Where GEMM+ReduceScatter's split push cuts the peer's partial into flagged row chunks
// (gemm_rs.cc). Plain C++ with no CUDA or XLA, so that the plans can be
// checked on any machine (tests/test_push_plan.py compiles this header into a small program).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>

namespace jaxflux {

inline constexpr int kPushMaxChunks = 4;  // = the runtime's kMaxChunks (gemm_rs.cc checks)

// The chunks' end rows within the owner's m rows (ascending, the last = m), as many as count.
struct PushChunks {
  std::array<size_t, kPushMaxChunks> ends{};
  int count = 1;
};

// kPushMaxChunks chunks of equal rows, cut at 128-row tiles (fewer when m is small).
inline PushChunks PlanEvenChunks(size_t m) {
  PushChunks plan;
  const size_t rows =
      std::min(((m + kPushMaxChunks - 1) / kPushMaxChunks + 127) / 128 * 128, m);
  plan.count = static_cast<int>((m + rows - 1) / rows);
  for (int c = 0; c < plan.count; ++c) plan.ends[c] = std::min((c + 1) * rows, m);
  return plan;
}

}  // namespace jaxflux
