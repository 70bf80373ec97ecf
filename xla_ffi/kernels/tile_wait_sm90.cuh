// The fused GEMMs' bounded waits on a peer's rows (TileWait), shared by the AllGather+GEMM's
// tile scheduler (it waits for A's rows before loading a tile) and GEMM+ReduceScatter's
// epilogue (it waits for the peer's partial, its source C, before loading a tile's C). A warp
// calls them together: one lane polls the flag, the warp then syncs.
#pragma once

#include "cutlass/cutlass.h"
#include "xla_ffi/kernels/tile_wait.h"
#include "xla_ffi/runtime/wait.cuh"

namespace jaxflux::tile_wait {

CUTLASS_DEVICE void Poll(TileWait const& w, int source, int chunk) {
  const uint64_t target = w.flag_base + static_cast<uint64_t>(chunk) + 1;
  uint64_t seen = 0;
  if (device::BoundedWait(w.flags[source], target, w.timeout_ns, w.error, &seen) ==
      device::WaitResult::kTimedOut) {
    device::RecordError(w.error, ErrorKind::kTimeout, w.op, w.device, w.rank,
                        w.source_ranks[source], w.group, target, seen, w.epoch, w.timeout_ns);
  }
}

// The calling warp waits until chunk `chunk` of source `source` has landed.
CUTLASS_DEVICE void Wait(TileWait const& w, int source, int chunk) {
  const unsigned lanes = __activemask();
  if ((threadIdx.x & 31) == __ffs(lanes) - 1) Poll(w, source, chunk);
  __syncwarp(lanes);  // orders the other lanes after the leader's acquire
}

// The calling warp waits for the chunks behind rows [row0, row0 + tile_rows) of the waited-for
// operand (rows past total_rows are not waited for), then fences the async proxy so that the
// TMA loads that follow are ordered after the flag acquire.
CUTLASS_DEVICE void WaitForRows(TileWait const& w, int total_rows, int row0, int tile_rows) {
  const int end = min(row0 + tile_rows, total_rows);
  const int m = w.rows_per_shard;
  for (int row = row0; row < end;) {
    const int in_batch = row % (w.tp * m);
    const int source = in_batch / m;
    const int local = in_batch % m;
    int chunk = 0;
    while (chunk < kTileWaitMaxChunks - 1 && local >= w.chunk_ends[chunk]) ++chunk;
    Wait(w, source, chunk);
    row += min(m, w.chunk_ends[chunk]) - local;  // next chunk or shard boundary
  }
  if (row0 < end) asm volatile("fence.proxy.async.global;" ::: "memory");
}

// The rank found at discovery must match this program's operand, or data lands in the wrong
// rows (docs/runtime.md). One thread of the grid calls it.
CUTLASS_DEVICE void CheckRank(TileWait const& w) {
  if (w.rank_info == nullptr) return;
  const int32_t rank = w.rank_info[0];
  const int32_t group = w.rank_info[1];
  if (rank != w.rank || group != w.group) {
    device::RecordError(w.error, ErrorKind::kRankMismatch, w.op, w.device, w.rank, rank, group,
                        0, 0, w.epoch, 0);
  }
}

}  // namespace jaxflux::tile_wait
