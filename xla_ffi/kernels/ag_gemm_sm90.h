// AllGather+GEMM on Hopper: the GEMM half. D[M,N] = A[M,K] · B[K,N] where A is the gathered input
// that copy engines are still filling while the kernel runs. Before a CTA loads A for an output
// tile it waits (bounded) on the "landed" flags of the shard chunks the tile's rows come from.
// Plain C++ interface: the FFI handler never sees CUTLASS.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "xla_ffi/kernels/gemm_sm90.h"
#include "xla_ffi/kernels/signal_kernels.h"

namespace jaxflux {

inline constexpr int kAgGemmMaxRanks = 8;
inline constexpr int kAgGemmMaxChunks = 4;  // = runtime kMaxChunks (checked where both are seen)

// Where A's rows come from and how the kernel learns that they have landed.
// A = [batch][tp][rows_per_shard][K]: rank p's shard of batch entry b starts at row
// (b*tp + p)*rows_per_shard. Chunk c of rank p (rows [chunk_ends[c-1], chunk_ends[c]) of each
// shard, chunk_ends[-1] = 0) has landed once *flags[p] >= flag_base + c + 1; chunks land in
// order.
struct AgGemmWait {
  const uint64_t* flags[kAgGemmMaxRanks];  // this device's flag for each source rank
  uint64_t flag_base;      // epoch * kMaxChunks
  int rows_per_shard;      // m (rows of one batch entry of one rank's shard)
  // The end row of each chunk within a shard, ascending, the last = rows_per_shard (later
  // entries unused); SetChunkEnds (gemm_wait.h) fills them.
  int chunk_ends[kAgGemmMaxChunks] = {0, 0, 0, 0};
  int tp;
  int rank;                // this device: its shard's tiles are computed first
  uint64_t timeout_ns;     // per wait; a timed-out wait records the error and stops waiting
  uint64_t epoch;
  int32_t device;
  const int32_t* rank_info;  // [axis_index, group] operand, checked against rank/group
  int32_t group;
  DeviceErrorRecord* error;
  // What a timed-out wait reports: the op (OpCode) and, per source, the rank it waited for.
  int32_t op = static_cast<int32_t>(OpCode::kAllGatherMatmul);
  int32_t source_ranks[kAgGemmMaxRanks] = {0, 1, 2, 3, 4, 5, 6, 7};
};

// The CUTLASS kernel shapes compiled for the fused kernel (tile MxN, K step 64; cluster MxN;
// cooperative or ping-pong warp specialization).
enum class AgGemmConfig : int {
  kCoop128x256Cluster2x1 = 0,  // the default, measured in benchmarks/README.md
  kCoop128x256Cluster1x2 = 1,
  kCoop256x128Cluster1x2 = 2,
  kPingpong128x128Cluster1x2 = 3,
};
inline constexpr int kAgGemmNumConfigs = 4;

// The config for a problem: JAXFLUX_AG_GEMM_CONFIG=0..3 when set (measurement knob), else the
// default (per-shape choice: to be measured, issue 4).
AgGemmConfig ChooseAgGemmConfig(const GemmProblem& problem);

struct AgGemmProblem {
  GemmProblem gemm;        // a = the gathered buffer (workspace), m = batch*tp*rows_per_shard
  AgGemmWait wait;
  int wait_for_flags;      // 0: GEMM-only mode (no waits; what fusion costs the GEMM itself)
  AgGemmConfig config = AgGemmConfig::kCoop128x256Cluster2x1;
  // This rank's own shard, [batch * rows_per_shard, K] row-major (x): when set, the tiles of
  // rank wait.rank's rows are read from it instead of from gemm.a, whose own rows then need not
  // hold the shard. Needs rows_per_shard % AgGemmTileRows(config) == 0; nullptr: all from a.
  const void* a_local = nullptr;
};

// Rows of one output tile of a config (a shard read through a_local must be a whole number).
int AgGemmTileRows(AgGemmConfig config);

size_t AgGemmSm90WorkspaceBytes(GemmDtype dtype, const AgGemmProblem& problem);

// Launches on `stream`. Returns a static string describing the failure, or nullptr.
const char* AgGemmSm90(GemmDtype dtype, const AgGemmProblem& problem, void* workspace,
                       cudaStream_t stream);

}  // namespace jaxflux
