// Where GEMM+ReduceScatter's split push cuts the peer's partial into flagged row chunks
// (gemm_rs.cc, JAXFLUX_GEMM_RS_CHUNKS). Plain C++ with no CUDA or XLA, so that the plans can be
// checked on any machine (tests/test_push_plan.py compiles this header into a small program).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
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

// A model of the own-rows GEMM and the push, with constants measured on 2xH200 in session 7
// (the GEMM+RS timeline, benchmarks/README.md): the GEMM (128x256 tiles in 2x1 clusters, rows
// swept along N) retires one wave of sm_count tiles every 2*128*256*K / kSmFlopsPerS seconds,
// waves 0..w having then consumed the rows of the first ceil((w+1)*sm_count / (2*n_tiles))
// cluster rows (256 rows each); the push lands rows at kPushBytesPerS, starting kPushStartS
// after the GEMM starts and kChunkGapS later per chunk (the flag write and the next copy's
// start). A chunk is on time when it lands before the wave that first needs its first row
// ends. The cuts are placed from the last chunk back: each chunk starts as late as keeps the
// next one on time, so the first chunk is as short as the later ones allow (about one wave's
// rows). m, n, k: the owner's rows, the output's columns, the GEMM's (local) K.
inline PushChunks PlanWaveChunks(size_t m, size_t n, size_t k, size_t elem, int sm_count) {
  constexpr double kSmFlopsPerS = 5.7e12, kPushBytesPerS = 3.65e11;
  constexpr double kPushStartS = 8e-6, kChunkGapS = 6e-6;
  const double wave_s = 2.0 * 128 * 256 * static_cast<double>(k) / kSmFlopsPerS;
  const double rows_per_s = kPushBytesPerS / static_cast<double>(n * elem);
  const size_t tiles_per_wave = static_cast<size_t>(std::max(sm_count, 1));
  const size_t tiles_per_cluster_row = 2 * ((n + 255) / 256);
  auto rows_done_by_wave = [&](size_t wave) {  // rows that waves 0..wave consume
    const size_t tiles = (wave + 1) * tiles_per_wave;
    return (tiles + tiles_per_cluster_row - 1) / tiles_per_cluster_row * 256;
  };
  std::array<size_t, kPushMaxChunks> ends{};
  ends[kPushMaxChunks - 1] = m;
  int first = kPushMaxChunks - 1;  // index of the first non-empty chunk
  for (int c = kPushMaxChunks - 1; c > 0; --c) {
    const double lands_s = kPushStartS + ends[c] / rows_per_s + c * kChunkGapS;
    // The chunk is on time if its first row is first needed by wave >= `wave`.
    const long wave = static_cast<long>(std::ceil(lands_s / wave_s)) - 1;
    const size_t start = wave >= 1 ? rows_done_by_wave(static_cast<size_t>(wave - 1)) : 0;
    const size_t cut = (start + 127) / 128 * 128;
    // start 0: the chunk may begin at row 0 (the earlier ones merge into it); cut >= its end:
    // it is late wherever it begins (the GEMM is short next to the push), so cutting earlier
    // gains nothing.
    if (start == 0 || cut >= ends[c]) break;
    ends[c - 1] = cut;
    first = c - 1;
  }
  PushChunks plan;
  plan.count = kPushMaxChunks - first;
  for (int c = 0; c < plan.count; ++c) plan.ends[c] = ends[first + c];
  return plan;
}

}  // namespace jaxflux
