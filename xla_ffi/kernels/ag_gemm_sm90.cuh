// The fused AllGather+GEMM kernel: the sm90 GEMM of gemm_sm90.cuh with the fused tile scheduler
// (fused_tile_scheduler_sm90.cuh) and the local-shard mainloop (ag_gemm_mainloop_sm90.cuh).
// Instantiated per (element type, tile config, B layout) in instantiations/ag_gemm_sm90_*.cu
// (generate_instantiations.py).
#pragma once

#include "xla_ffi/kernels/ag_gemm_mainloop_sm90.cuh"
#include "xla_ffi/kernels/ag_gemm_sm90.h"
#include "xla_ffi/kernels/fused_tile_scheduler_sm90.cuh"
#include "xla_ffi/kernels/gemm_sm90.cuh"

namespace jaxflux::ag_gemm_sm90 {

// The tile configs of AgGemmConfig.
using Cooperative128x256Cluster2x1 = gemm_sm90::TileConfig<128, 256, 2, 1, false>;
using Pingpong128x128Cluster1x2 = gemm_sm90::TileConfig<128, 128, 1, 2, true>;

// The GEMM of gemm_sm90.cuh with the fused tile scheduler and a mainloop that reads this
// rank's own rows from its shard rather than from the gathered buffer (LocalShardMainloop).
template <class Element, class Tiles, class LayoutB>
struct Config : gemm_sm90::Config<Element, FusedSchedulerTag, Tiles, void, LayoutB> {
  using Stock = gemm_sm90::Config<Element, FusedSchedulerTag, Tiles, void, LayoutB>;
  using Mainloop = LocalShardMainloop<typename Stock::Mainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      typename Stock::Epilogue,
                                                      FusedSchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Element, class Tiles, class LayoutB>
typename Config<Element, Tiles, LayoutB>::Gemm::Arguments MakeArguments(const AgGemmProblem& p) {
  using C = Config<Element, Tiles, LayoutB>;
  constexpr int kTileM = cute::get<0>(typename C::Tile{});
  constexpr int kTileN = cute::get<1>(typename C::Tile{});
  constexpr int kClusterM = cute::get<0>(typename C::Cluster{});
  constexpr int kClusterN = cute::get<1>(typename C::Cluster{});
  auto args = gemm_sm90::MakeArguments<C>(p.gemm);
  if (p.a_local != nullptr) {  // Run checks rows_per_shard % kTileM
    args.mainloop.ptr_a_local = static_cast<const typename C::Element*>(p.a_local);
    args.mainloop.shard_rows = p.wait.rows_per_shard;
    args.mainloop.tp = p.wait.tp;
    args.mainloop.rank = p.wait.rank;
  }
  auto& s = args.scheduler;
  using Options = typename C::Kernel::TileScheduler::RasterOrderOptions;
  // Along N: consecutive tiles share their A rows, so the kernel sweeps the gathered rows in
  // order (own shard first, then as peers' shards arrive).
  s.raster_order = Options::AlongN;
  s.max_swizzle_size = p.gemm.swizzle;
  s.wait = p.wait;
  s.wait_for_flags = p.wait_for_flags;
  s.tiles_m = C::Kernel::TileScheduler::template LinearTilesM<kTileN, kClusterM, kClusterN>(
      p.gemm.m, p.gemm.n, s.max_swizzle_size);
  const long long first_row = static_cast<long long>(p.wait.rank) * p.wait.rows_per_shard;
  s.tile_shift = static_cast<int>(first_row / kTileM) / kClusterM * kClusterM % s.tiles_m;
  s.total_rows = p.gemm.m;
  return args;
}

template <class Element, class Tiles, class LayoutB>
size_t WorkspaceBytes(const AgGemmProblem& p) {
  return Config<Element, Tiles, LayoutB>::Gemm::get_workspace_size(
      MakeArguments<Element, Tiles, LayoutB>(p));
}

template <class Element, class Tiles, class LayoutB>
const char* Run(const AgGemmProblem& p, void* workspace, cudaStream_t stream) {
  constexpr int kTileM = Config<Element, Tiles, LayoutB>::Mainloop::kTileM;
  if (p.a_local != nullptr && p.wait.rows_per_shard % kTileM != 0) {
    return "all_gather_matmul: a_local needs rows per shard to be a multiple of the tile rows";
  }
  return gemm_sm90::Launch<Config<Element, Tiles, LayoutB>>(
      MakeArguments<Element, Tiles, LayoutB>(p), workspace, stream);
}

}  // namespace jaxflux::ag_gemm_sm90

// One instantiation per (element type, tile config, B layout) and .cu file, so they compile in
// parallel: defines the two entry points that ag_gemm_sm90_dispatch.cu's table lists.
#define JAXFLUX_AG_GEMM_INSTANCE(NAME, ELEMENT, TILES, LAYOUT_B)                          \
  namespace jaxflux {                                                                     \
  size_t AgGemmWorkspaceBytes_##NAME(const AgGemmProblem& problem) {                      \
    return ag_gemm_sm90::WorkspaceBytes<ELEMENT, ag_gemm_sm90::TILES,                     \
                                        gemm_sm90::LAYOUT_B>(problem);                    \
  }                                                                                       \
  const char* AgGemmRun_##NAME(const AgGemmProblem& problem, void* workspace,             \
                               cudaStream_t stream) {                                     \
    return ag_gemm_sm90::Run<ELEMENT, ag_gemm_sm90::TILES, gemm_sm90::LAYOUT_B>(          \
        problem, workspace, stream);                                                      \
  }                                                                                       \
  }  // namespace jaxflux
