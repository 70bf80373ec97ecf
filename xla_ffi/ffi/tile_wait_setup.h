// The host side of a fused GEMM's tile wait (TileWait, kernels/tile_wait.h): who is waiting and
// for how long, shared by the AllGather+GEMM and GEMM+ReduceScatter handlers; each fills in what
// it waits for.
#pragma once

#include <cstdint>

#include "xla_ffi/kernels/tile_wait.h"
#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"

namespace jaxflux {

inline TileWait TileWaitOfThisRank(const GroupInfo& g, int32_t ordinal, uint64_t epoch,
                                   const int32_t* rank_info) {
  TileWait wait{};
  wait.rank = g.rank;
  wait.group = g.group;
  wait.device = ordinal;
  wait.epoch = epoch;
  wait.timeout_ns = TimeoutNs();
  wait.rank_info = rank_info;  // checked against rank and group by the kernel
  wait.error = DeviceErrorRecordPtr();
  return wait;
}

// The wait's chunks within a shard: `count` chunks ending at ends[0..count) (ascending, the
// last = the shard's rows).
template <class Ends>
void SetChunkEnds(TileWait* wait, const Ends& ends, int count) {
  for (int c = 0; c < kTileWaitMaxChunks; ++c) {
    wait->chunk_ends[c] = static_cast<int>(ends[c < count ? c : count - 1]);
  }
}

}  // namespace jaxflux
