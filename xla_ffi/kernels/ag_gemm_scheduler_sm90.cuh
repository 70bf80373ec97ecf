// The tile scheduler of the fused AllGather+GEMM: CUTLASS's static persistent scheduler with two
// changes, both applied where a warp fetches its next output tile.
//   1. Order: M tiles are rotated so that this rank's own shard (already local, no wait) comes
//      first; later tiles follow the order in which peers' shards arrive (rank+1, rank+2, ...).
//   2. Readiness: before returning a tile, wait (bounded) until every chunk of A that the tile's
//      rows touch has landed, then a proxy fence so the TMA loads (async proxy) that follow are
//      ordered after the flag acquire (generic proxy).
// Only the producer warp group waits (one lane per warp polls, the warp then syncs): the
// consumer warp groups ask for the same tiles but block on the shared-memory pipeline that the
// producer fills after its wait, so they need no flag of their own.
#pragma once

#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "xla_ffi/kernels/ag_gemm_sm90.h"
#include "xla_ffi/runtime/wait.cuh"

namespace jaxflux {

// Tag type that selects AgGemmScheduler in CUTLASS's GemmUniversal.
struct AgGemmSchedulerTag {};

template <int kTileM>
class AgGemmScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  using BaseParams = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;

  struct Arguments : Base::Arguments {
    AgGemmWait wait{};
    int wait_for_flags = 1;
    int tiles_m = 0;        // M tiles of the linear tile index (LinearTilesM)
    int tile_shift = 0;     // rotation of M tiles (a multiple of the cluster's M extent)
    int total_rows = 0;     // M
  };

  struct Params : BaseParams {
    AgGemmWait wait{};
    int wait_for_flags = 1;
    int tiles_m = 0;
    int tile_shift = 0;
    int total_rows = 0;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem, TileShape tile,
                                        ClusterShape cluster,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params params;
    static_cast<BaseParams&>(params) = Base::to_underlying_arguments(
        problem, tile, cluster, hw_info, args, workspace, epilogue_subtile,
        ktile_start_alignment_count);
    params.wait = args.wait;
    params.wait_for_flags = args.wait_for_flags;
    params.tiles_m = args.tiles_m;
    params.tile_shift = args.tile_shift;
    params.total_rows = args.total_rows;
    return params;
  }

  // The M tiles the scheduler's linear tile index spans. CUTLASS rounds the grid's tile counts
  // up to the cluster and, with a swizzle, to swizzle x cluster; the extra tiles lie past M
  // (TMA clips them). The rotation (tile_shift) must run over all of them: modulo fewer, a tile
  // past M would wrap onto a real tile and compute it twice.
  template <int kTileN, int kClusterM, int kClusterN>
  static int LinearTilesM(int m, int n, int max_swizzle) {
    const int tiles_m = ((m + kTileM - 1) / kTileM + kClusterM - 1) / kClusterM * kClusterM;
    const int tiles_n = ((n + kTileN - 1) / kTileN + kClusterN - 1) / kClusterN * kClusterN;
    const int log_swizzle = BaseParams::get_log_swizzle_size(tiles_m, tiles_n, max_swizzle);
    const int step = (1 << log_swizzle) * kClusterM;
    return (tiles_m + step - 1) / step * step;
  }

  // `params` is the kernel's own (CUTLASS's kernels build the scheduler from the __grid_constant__
  // kernel parameter), so the scheduler keeps its address, not a copy. A copy of the wait state
  // (AgGemmWait, 192 bytes, arrays indexed at run time) lived in local memory: 392 bytes of stack
  // and 120-198 bytes of spill stores per kernel by ptxas -v; the own-rows kernel wrote 21-28 MB
  // more to HBM than under CUTLASS's scheduler and took 0.4-3.0% more cycles (benchmarks/README.md,
  // session 10).
  CUTLASS_DEVICE explicit AgGemmScheduler(Params const& params)
      : Base(static_cast<BaseParams const&>(params)), params_(&params) {}

  // Every way a CUTLASS sm90 kernel asks for its tile goes through get_current_work() below:
  // the cooperative kernel calls initial_work_tile_info / fetch_next_work, the ping-pong kernel
  // also advance_to_next_work + get_current_work (its consumers start one tile apart). The base
  // class's own versions would skip the rotation, so all three are replaced.
  CUTLASS_DEVICE WorkTileInfo get_current_work() const {
    return Prepare(Base::get_current_work());
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    if (params_->wait_for_flags && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
      CheckRank(params_->wait);
    }
    return get_current_work();
  }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    Base::advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }

  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo info, Pipeline&, PipelineState) {
    return fetch_next_work(info);
  }

  // CUTLASS's epilogue hook, asked with each tile right before its C is loaded (by the producer
  // warp that loads C) and before its D is stored (by the consumers). With epilogue_load_only,
  // the C-load warp waits here rather than when it fetches the tile: the first fetch happens
  // before the kernel's register reallocation (setmaxnreg), which the consumers' own must wait
  // for, so a wait there would hold back the mainloop's math as well.
  CUTLASS_HOST_DEVICE static bool compute_epilogue(WorkTileInfo const& work, Params const& params) {
#if defined(__CUDA_ARCH__)
    if (params.wait_for_flags && params.wait.epilogue_load_only &&
        threadIdx.x / 32 == kEpilogueLoadWarp) {
      WaitForRows(params.wait, params.total_rows, work.M_idx * kTileM);
    }
#endif
    return true;
  }

 private:
  CUTLASS_DEVICE WorkTileInfo Prepare(WorkTileInfo work) const {
    if (!work.is_valid()) return work;
    const Params& p = *params_;
    work.M_idx = (work.M_idx + p.tile_shift) % p.tiles_m;
    // The producer warp group waits before it loads the tile's A (AllGather+GEMM); with
    // epilogue_load_only the wait is compute_epilogue's.
    if (p.wait_for_flags && !p.wait.epilogue_load_only && threadIdx.x < kProducerThreads) {
      WaitForRows(p.wait, p.total_rows, work.M_idx * kTileM);
    }
    return work;
  }

  // Threads [0, 128) are the producer warp group of CUTLASS's sm90 warp-specialized kernels;
  // its warp 2 loads the epilogue's source C (ProducerWarpRole::Epilogue of the cooperative
  // kernel, the only one the fused GEMM+ReduceScatter instantiates with a C).
  static constexpr int kProducerThreads = 128;
  static constexpr int kEpilogueLoadWarp = 2;

  // Waits (the calling warp) for the chunks behind rows [row0, row0 + kTileM) of A, or of C.
  CUTLASS_DEVICE static void WaitForRows(AgGemmWait const& w, int total_rows, int row0) {
    const int end = min(row0 + kTileM, total_rows);
    const int m = w.rows_per_shard;
    for (int row = row0; row < end;) {
      const int in_batch = row % (w.tp * m);
      const int source = in_batch / m;
      const int local = in_batch % m;
      int chunk = 0;
      while (chunk < kAgGemmMaxChunks - 1 && local >= w.chunk_ends[chunk]) ++chunk;
      Wait(w, source, chunk);
      row += min(m, w.chunk_ends[chunk]) - local;  // next chunk or shard boundary
    }
    if (row0 < end) asm volatile("fence.proxy.async.global;" ::: "memory");
  }

  CUTLASS_DEVICE static void Wait(AgGemmWait const& w, int source, int chunk) {
    const unsigned lanes = __activemask();
    if ((threadIdx.x & 31) == __ffs(lanes) - 1) Poll(w, source, chunk);
    __syncwarp(lanes);  // orders the other lanes after the leader's acquire
  }

  CUTLASS_DEVICE static void Poll(AgGemmWait const& w, int source, int chunk) {
    const uint64_t* flag = w.flags[source];
    const uint64_t target = w.flag_base + static_cast<uint64_t>(chunk) + 1;
    uint64_t seen = device::LoadAcquireSys(flag);
    if (seen >= target) return;
    const uint64_t start = device::GlobalTimerNs();
    for (uint32_t spins = 1; seen < target; ++spins) {
      if ((spins & 63u) == 0) {
        // Stop soon after any wait has failed (the results are void anyway), so a dead peer
        // costs one timeout, not one per tile. The record is host memory: read over PCIe by
        // every spinning CTA, often, it slowed the peer's copy-engine push into this GPU 19-24x
        // (a 64 MiB push took 3.2-4.2 ms, not 0.17: benchmarks/README.md), so only every 4096th.
        if ((spins & 4095u) == 0 && w.error != nullptr &&
            *reinterpret_cast<volatile int32_t*>(&w.error->ready)) {
          return;
        }
        if (device::GlobalTimerNs() - start > w.timeout_ns) {
          device::RecordError(w.error, ErrorKind::kTimeout, w.op, w.device, w.rank,
                              w.source_ranks[source], w.group, target, seen, w.epoch,
                              w.timeout_ns);
          return;
        }
      }
      __nanosleep(128);
      seen = device::LoadAcquireSys(flag);
    }
  }

  // The rank cached at discovery must match this program's operand, or data lands in the wrong
  // rows (see docs/runtime.md, "site" rank cache).
  CUTLASS_DEVICE static void CheckRank(AgGemmWait const& w) {
    if (w.rank_info == nullptr) return;
    const int32_t rank = w.rank_info[0];
    const int32_t group = w.rank_info[1];
    if (rank != w.rank || group != w.group) {
      device::RecordError(w.error, ErrorKind::kRankMismatch, w.op, w.device, w.rank, rank, group,
                          0, 0, w.epoch, 0);
    }
  }

  Params const* params_;
};

}  // namespace jaxflux

namespace cutlass::gemm::kernel::detail {

template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<jaxflux::AgGemmSchedulerTag, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler =
      jaxflux::AgGemmScheduler<std::decay_t<decltype(cute::get<0>(TileShape{}))>::value>;
};

}  // namespace cutlass::gemm::kernel::detail
