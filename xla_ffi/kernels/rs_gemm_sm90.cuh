// The own-rows GEMM of the fused GEMM+ReduceScatter (rs_gemm_sm90.h): the sm90 GEMM of
// gemm_sm90.cuh with a source operand C and the fused ops' tile scheduler, whose waits are
// limited to the warp that loads C. One .cu per element type instantiates it.
#pragma once

#include "xla_ffi/kernels/ag_gemm_scheduler_sm90.cuh"
#include "xla_ffi/kernels/gemm_sm90.cuh"
#include "xla_ffi/kernels/rs_gemm_sm90.h"

namespace jaxflux::rs_gemm_sm90 {

// The default tile config (cooperative 128x256, 2x1 clusters): its producer warp 2 loads C,
// which is what the scheduler's epilogue_load_only wait assumes. EpiTile: the epilogue's
// sub-tile (gemm_sm90::Config), CUTLASS's automatic 128x32 by default.
template <class Element, class LayoutB,
          class EpiTile = cutlass::epilogue::collective::EpilogueTileAuto>
using Config = gemm_sm90::Config<Element, AgGemmSchedulerTag, gemm_sm90::DefaultTiles, Element,
                                 LayoutB, EpiTile>;

template <class Element, class LayoutB, class EpiTile>
typename Config<Element, LayoutB, EpiTile>::Gemm::Arguments MakeArguments(
    const RsGemmProblem& p) {
  using C = Config<Element, LayoutB, EpiTile>;
  constexpr int kTileM = cute::get<0>(typename C::Tile{});
  constexpr int kClusterM = cute::get<0>(typename C::Cluster{});
  auto args = gemm_sm90::MakeArguments<C>(p.gemm);
  args.epilogue.ptr_C = static_cast<const Element*>(p.c);
  args.epilogue.thread.beta = 1.0f;  // D = A·B + C
  auto& s = args.scheduler;  // CUTLASS's tile order; every tile waits on the same flag
  if (p.wait.chunk_ends[0] < p.wait.rows_per_shard) {
    // The peer's partial lands in row chunks, in order: sweep the rows in that order too.
    using Options = typename C::Kernel::TileScheduler::RasterOrderOptions;
    s.raster_order = Options::AlongN;
  }
  s.wait = p.wait;
  s.wait_for_flags = 1;
  const int tiles = (p.gemm.m + kTileM - 1) / kTileM;
  s.tiles_m = (tiles + kClusterM - 1) / kClusterM * kClusterM;
  s.tile_shift = 0;
  s.total_rows = p.gemm.m;
  return args;
}

template <class Element, class LayoutB, class EpiTile>
size_t WorkspaceBytesOf(const RsGemmProblem& p) {
  return Config<Element, LayoutB, EpiTile>::Gemm::get_workspace_size(
      MakeArguments<Element, LayoutB, EpiTile>(p));
}

template <class Element, class LayoutB, class EpiTile>
const char* RunOf(const RsGemmProblem& p, void* workspace, cudaStream_t stream) {
  return gemm_sm90::Launch<Config<Element, LayoutB, EpiTile>>(
      MakeArguments<Element, LayoutB, EpiTile>(p), workspace, stream);
}

// B's layout from the problem (GemmProblem::b_kmajor).
template <class Element, class EpiTile>
size_t WorkspaceBytes(const RsGemmProblem& p) {
  return p.gemm.b_kmajor ? WorkspaceBytesOf<Element, gemm_sm90::KMajorB, EpiTile>(p)
                         : WorkspaceBytesOf<Element, gemm_sm90::NMajorB, EpiTile>(p);
}

template <class Element, class EpiTile>
const char* Run(const RsGemmProblem& p, void* workspace, cudaStream_t stream) {
  return p.gemm.b_kmajor ? RunOf<Element, gemm_sm90::KMajorB, EpiTile>(p, workspace, stream)
                         : RunOf<Element, gemm_sm90::NMajorB, EpiTile>(p, workspace, stream);
}

}  // namespace jaxflux::rs_gemm_sm90

// Defines the entry points of one element type and epilogue sub-tile (listed in
// rs_gemm_sm90_dispatch.cu).
#define JAXFLUX_RS_GEMM_INSTANCE(NAME, ELEMENT, EPI_TILE)                                    \
  namespace jaxflux {                                                                        \
  size_t RsGemmWorkspaceBytes_##NAME(const RsGemmProblem& problem) {                         \
    return rs_gemm_sm90::WorkspaceBytes<ELEMENT, EPI_TILE>(problem);                         \
  }                                                                                          \
  const char* RsGemmRun_##NAME(const RsGemmProblem& problem, void* workspace,                \
                               cudaStream_t stream) {                                        \
    return rs_gemm_sm90::Run<ELEMENT, EPI_TILE>(problem, workspace, stream);                 \
  }                                                                                          \
  }  // namespace jaxflux
