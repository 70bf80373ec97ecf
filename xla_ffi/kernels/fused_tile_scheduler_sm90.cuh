// The tile scheduler of the fused GEMMs: CUTLASS's static persistent scheduler with two changes,
// both applied where a warp fetches its next output tile.
//   1. Order: M tiles are rotated so that this rank's own shard (already local, no wait) comes
//      first; later tiles follow the order in which peers' shards arrive (rank+1, rank+2, ...).
//   2. Readiness: before returning a tile, wait (bounded) until every chunk of A that the tile's
//      rows touch has landed, then a proxy fence so the TMA loads (async proxy) that follow are
//      ordered after the flag acquire (generic proxy).
// Only the producer warp group waits (one lane per warp polls, the warp then syncs): the
// consumer warp groups ask for the same tiles but block on the shared-memory pipeline that the
// producer fills after its wait, so they need no flag of their own. (GEMM+ReduceScatter's
// own-rows kernel uses this scheduler for its tile order only: its wait, on C, is its
// epilogue's, rs_epilogue_sm90.cuh.)
#pragma once

#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "xla_ffi/kernels/tile_wait.h"
#include "xla_ffi/kernels/tile_wait_sm90.cuh"

namespace jaxflux {

// Tag type that selects FusedTileScheduler in CUTLASS's GemmUniversal.
struct FusedSchedulerTag {};

template <int kTileM>
class FusedTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  using BaseParams = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;

  struct Arguments : Base::Arguments {
    TileWait wait{};
    int wait_for_flags = 1;
    int tiles_m = 0;        // M tiles of the linear tile index (LinearTilesM)
    int tile_shift = 0;     // rotation of M tiles (a multiple of the cluster's M extent)
    int total_rows = 0;     // M
  };

  struct Params : BaseParams {
    TileWait wait{};
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
  // kernel parameter), so the scheduler keeps its address, not a copy: a copy of the wait state
  // (runtime-indexed arrays) would live in local memory and spill.
  CUTLASS_DEVICE explicit FusedTileScheduler(Params const& params)
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
      tile_wait::CheckRank(params_->wait);
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

 private:
  CUTLASS_DEVICE WorkTileInfo Prepare(WorkTileInfo work) const {
    if (!work.is_valid()) return work;
    const Params& p = *params_;
    work.M_idx = (work.M_idx + p.tile_shift) % p.tiles_m;
    // The producer warp group waits before it loads the tile's A (AllGather+GEMM).
    if (p.wait_for_flags && threadIdx.x < kProducerThreads) {
      tile_wait::WaitForRows(p.wait, p.total_rows, work.M_idx * kTileM, kTileM);
    }
    return work;
  }

  // Threads [0, 128) are the producer warp group of CUTLASS's sm90 warp-specialized kernels.
  static constexpr int kProducerThreads = 128;

  Params const* params_;
};

}  // namespace jaxflux

namespace cutlass::gemm::kernel::detail {

template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<jaxflux::FusedSchedulerTag, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler =
      jaxflux::FusedTileScheduler<std::decay_t<decltype(cute::get<0>(TileShape{}))>::value>;
};

}  // namespace cutlass::gemm::kernel::detail
