// The fused AllGather+GEMM kernel: the sm90 GEMM of gemm_sm90.cuh (16-bit) or gemm_fp8_sm90.cuh
// (FP8) with the fused tile scheduler (fused_tile_scheduler_sm90.cuh) and the local-shard mainloop
// (ag_gemm_mainloop_sm90.cuh). Instantiated per (element type, tile config, B layout) in
// instantiations/ag_gemm_sm90_*.cu (generate_instantiations.py).
#pragma once

#include "xla_ffi/kernels/ag_gemm_mainloop_sm90.cuh"
#include "xla_ffi/kernels/ag_gemm_sm90.h"
#include "xla_ffi/kernels/fused_tile_scheduler_sm90.cuh"
#include "xla_ffi/kernels/gemm_fp8_sm90.cuh"
#include "xla_ffi/kernels/gemm_sm90.cuh"

namespace jaxflux::ag_gemm_sm90 {

// The tile configs of AgGemmConfig, 16-bit and FP8 (K steps of 128 one-byte elements).
using Cooperative128x256Cluster2x1 = gemm_sm90::TileConfig<128, 256, 2, 1, false>;
using Pingpong128x128Cluster1x2 = gemm_sm90::TileConfig<128, 128, 1, 2, true>;
using Fp8Cooperative128x256Cluster2x1 = gemm_sm90::TileConfig<128, 256, 2, 1, false, 128>;
using Fp8Pingpong128x128Cluster1x2 = gemm_sm90::TileConfig<128, 128, 1, 2, true, 128>;

// A stock GEMM config (16-bit or FP8) with the fused tile scheduler and a mainloop that reads
// this rank's own rows from its shard rather than from the gathered buffer (LocalShardMainloop).
template <class Stock>
struct FusedConfig : Stock {
  using Mainloop = LocalShardMainloop<typename Stock::Mainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      typename Stock::Epilogue,
                                                      FusedSchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Element, class Tiles, class LayoutB>
using Config =
    FusedConfig<gemm_sm90::Config<Element, FusedSchedulerTag, Tiles, void, LayoutB>>;

// FP8: A e4m3 or e5m2, B e4m3 K-major, D bf16 with the scales in the epilogue.
template <class ElementA, class Tiles>
using Fp8Config = FusedConfig<gemm_sm90::Fp8Config<
    ElementA, cutlass::float_e4m3_t, FusedSchedulerTag, Tiles, void, gemm_sm90::PlainEpilogue,
    kFp8FastAccum>>;

template <class C>
typename C::Gemm::Arguments MakeArguments(const AgGemmProblem& p) {
  constexpr int kTileM = cute::get<0>(typename C::Tile{});
  constexpr int kTileN = cute::get<1>(typename C::Tile{});
  constexpr int kClusterM = cute::get<0>(typename C::Cluster{});
  constexpr int kClusterN = cute::get<1>(typename C::Cluster{});
  auto args = gemm_sm90::MakeArguments<C>(p.gemm);
  if (p.a_local != nullptr) {  // Run checks rows_per_shard % kTileM
    args.mainloop.ptr_a_local = static_cast<const typename C::ElementA*>(p.a_local);
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

template <class C>
size_t WorkspaceBytes(const AgGemmProblem& p) {
  return C::Gemm::get_workspace_size(MakeArguments<C>(p));
}

template <class C>
const char* Run(const AgGemmProblem& p, void* workspace, cudaStream_t stream) {
  constexpr int kTileM = C::Mainloop::kTileM;
  if (p.a_local != nullptr && p.wait.rows_per_shard % kTileM != 0) {
    return "all_gather_matmul: a_local needs rows per shard to be a multiple of the tile rows";
  }
  if constexpr (C::kFp8) {
    if (p.gemm.row_scale == nullptr || p.gemm.col_scale == nullptr || !p.gemm.b_kmajor) {
      return "all_gather_matmul: FP8 needs row and column scales and the weight K-major";
    }
  }
  return gemm_sm90::Launch<C>(MakeArguments<C>(p), workspace, stream);
}

}  // namespace jaxflux::ag_gemm_sm90

// One instantiation per (element type, tile config, B layout) and .cu file, so they compile in
// parallel: defines the two entry points that ag_gemm_sm90_dispatch.cu's table lists, for the
// config given after NAME.
#define JAXFLUX_AG_GEMM_DEFINE(NAME, ...)                                                    \
  namespace jaxflux {                                                                     \
  using AgGemmConfig_##NAME = __VA_ARGS__;                                                \
  size_t AgGemmWorkspaceBytes_##NAME(const AgGemmProblem& problem) {                      \
    return ag_gemm_sm90::WorkspaceBytes<AgGemmConfig_##NAME>(problem);                    \
  }                                                                                       \
  const char* AgGemmRun_##NAME(const AgGemmProblem& problem, void* workspace,             \
                               cudaStream_t stream) {                                     \
    return ag_gemm_sm90::Run<AgGemmConfig_##NAME>(problem, workspace, stream);            \
  }                                                                                       \
  }  // namespace jaxflux

#define JAXFLUX_AG_GEMM_INSTANCE(NAME, ELEMENT, TILES, LAYOUT_B)                          \
  JAXFLUX_AG_GEMM_DEFINE(NAME, ag_gemm_sm90::Config<ELEMENT, ag_gemm_sm90::TILES,         \
                                                    gemm_sm90::LAYOUT_B>)

// FP8: A of ELEMENT_A, B e4m3 given K-major.
#define JAXFLUX_AG_GEMM_FP8_INSTANCE(NAME, ELEMENT_A, TILES)                                 \
  JAXFLUX_AG_GEMM_DEFINE(NAME, ag_gemm_sm90::Fp8Config<ELEMENT_A, ag_gemm_sm90::TILES>)
