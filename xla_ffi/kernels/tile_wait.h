// What a fused GEMM waits for before it touches a peer's rows: per source rank a flag, and the
// row chunks whose landing it announces. The AllGather+GEMM's tile scheduler waits for A's rows
// (a gathered shard), GEMM+ReduceScatter's epilogue for C's rows (the peer's partial); the device
// side is tile_wait_sm90.cuh. Plain C++: the FFI handlers fill it in (ffi/tile_wait_setup.h).
#pragma once

#include <cstdint>

#include "xla_ffi/kernels/signal_kernels.h"

namespace jaxflux {

inline constexpr int kTileWaitMaxRanks = 8;
inline constexpr int kTileWaitMaxChunks = 4;  // = runtime kMaxChunks (checked where both are seen)

// The waited-for operand = [batch][tp][rows_per_shard][...]: source p's rows of batch entry b
// start at row (b*tp + p)*rows_per_shard. Chunk c of source p (rows [chunk_ends[c-1],
// chunk_ends[c]) of each shard, chunk_ends[-1] = 0) has landed once *flags[p] >= flag_base + c + 1;
// chunks land in order.
struct TileWait {
  const uint64_t* flags[kTileWaitMaxRanks];  // this device's flag for each source rank
  uint64_t flag_base;      // epoch * kMaxChunks
  int rows_per_shard;      // rows of one batch entry of one source's shard
  // The end row of each chunk within a shard, ascending, the last = rows_per_shard (later
  // entries unused); SetChunkEnds (ffi/tile_wait_setup.h) fills them.
  int chunk_ends[kTileWaitMaxChunks] = {0, 0, 0, 0};
  int tp;                  // sources
  int rank;                // this device: its shard's tiles are computed first
  uint64_t timeout_ns;     // per wait; a timed-out wait records the error and stops waiting
  uint64_t epoch;
  int32_t device;
  const int32_t* rank_info;  // [axis_index, group] operand, checked against rank/group
  int32_t group;
  DeviceErrorRecord* error;
  // What a timed-out wait reports: the op (OpCode) and, per source, the rank it waited for.
  int32_t op = static_cast<int32_t>(OpCode::kAllGatherMatmul);
  int32_t source_ranks[kTileWaitMaxRanks] = {0, 1, 2, 3, 4, 5, 6, 7};
};

}  // namespace jaxflux
