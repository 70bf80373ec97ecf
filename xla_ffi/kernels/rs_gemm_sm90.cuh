// The own-rows GEMM of the fused GEMM+ReduceScatter (rs_gemm_sm90.h): the sm90 GEMM of
// gemm_sm90.cuh with a source operand C, the fused ops' tile scheduler (for its tile order) and
// an epilogue that waits for C's rows before loading them (rs_epilogue_sm90.cuh). One .cu per
// element type instantiates it.
#pragma once

#include "xla_ffi/kernels/ag_gemm_scheduler_sm90.cuh"
#include "xla_ffi/kernels/gemm_sm90.cuh"
#include "xla_ffi/kernels/rs_epilogue_sm90.cuh"
#include "xla_ffi/kernels/rs_gemm_sm90.h"

namespace jaxflux::rs_gemm_sm90 {

// The two tile configs (RsGemmProblem::pingpong picks): cooperative 128x256 with 2x1 clusters
// (the plain GEMM's), and ping-pong 128x128 2x1, whose two consumer warp groups alternate tiles
// so that one's epilogue (the C read) overlaps the other's mainloop.
using PingpongTiles = gemm_sm90::TileConfig<128, 128, 2, 1, true>;

template <class Element, class LayoutB, class Tiles = gemm_sm90::DefaultTiles>
using Config = gemm_sm90::Config<Element, AgGemmSchedulerTag, Tiles, Element, LayoutB,
                                 WaitingEpilogue>;

// Swizzle of the own-rows tile order (CUTLASS max_swizzle_size, see ag_gemm_sm90.cuh). Along N
// with no swizzle, each wave of tiles spans all of B and re-reads it from HBM; with 4, bands of
// 4 cluster rows of tiles share B's columns in L2. Measured (benchmarks/README.md, session 9):
// the fused op 1.4-3.7% faster at M = 8192 on 3 of 4 shapes with 4, but 0.1-0.9% slower at
// M = 2048, where this rank's rows are a single band and the swizzle turns the sweep in landing
// order into column order over all of them; so 4 from two bands of rows up, else 1.
// JAXFLUX_GEMM_RS_SWIZZLE (1, 2, 4, 8) overrides it for measurements.
inline int Swizzle(int rows, int cluster_rows) {
  static const int forced = gemm_sm90::SwizzleFromEnv("JAXFLUX_GEMM_RS_SWIZZLE", 0);
  if (forced != 0) return forced;
  return rows >= 2 * 4 * cluster_rows ? 4 : 1;  // two bands of 4 cluster rows of tiles
}

template <class Element, class LayoutB, class Tiles>
typename Config<Element, LayoutB, Tiles>::Gemm::Arguments MakeArguments(const RsGemmProblem& p) {
  using C = Config<Element, LayoutB, Tiles>;
  constexpr int kTileM = cute::get<0>(typename C::Tile{});
  constexpr int kTileN = cute::get<1>(typename C::Tile{});
  constexpr int kClusterM = cute::get<0>(typename C::Cluster{});
  constexpr int kClusterN = cute::get<1>(typename C::Cluster{});
  auto args = gemm_sm90::MakeArguments<C>(p.gemm);
  // D = A·B + C; without a source, beta 0 makes CUTLASS skip C's loads (its TMA descriptor
  // still needs a valid tensor: D's).
  args.epilogue.ptr_C = static_cast<const Element*>(p.c != nullptr ? p.c : p.gemm.d);
  args.epilogue.thread.beta = p.c != nullptr ? 1.0f : 0.0f;
  auto& s = args.scheduler;  // CUTLASS's raster heuristic when the partial lands whole
  if (p.wait.chunk_ends[0] < p.wait.rows_per_shard) {
    // The peer's partial lands in row chunks, in order: sweep the rows in that order too.
    using Options = typename C::Kernel::TileScheduler::RasterOrderOptions;
    s.raster_order = Options::AlongN;
  }
  s.max_swizzle_size = Swizzle(p.gemm.m, kClusterM * kTileM);
  s.wait_for_flags = 0;  // the scheduler only orders the tiles; the epilogue waits for C
  s.tiles_m = C::Kernel::TileScheduler::template LinearTilesM<kTileN, kClusterM, kClusterN>(
      p.gemm.m, p.gemm.n, s.max_swizzle_size);
  s.tile_shift = 0;
  s.total_rows = p.gemm.m;
  args.epilogue.wait = p.wait;
  args.epilogue.wait_for_flags = p.c != nullptr ? p.wait_for_flags : 0;
  args.epilogue.total_rows = p.gemm.m;
  return args;
}

// The probe's kernel (RsGemmProblem::cutlass_scheduler): the same tiles, swizzle and source-C
// epilogue under CUTLASS's own persistent scheduler (raster along N when chunked, as above).
template <class Element>
using PlainSchedulerConfig =
    gemm_sm90::Config<Element, void, gemm_sm90::DefaultTiles, Element, gemm_sm90::NMajorB>;

template <class Element>
typename PlainSchedulerConfig<Element>::Gemm::Arguments MakePlainSchedulerArguments(
    const RsGemmProblem& p) {
  using C = PlainSchedulerConfig<Element>;
  auto args = gemm_sm90::MakeArguments<C>(p.gemm);
  args.epilogue.ptr_C = static_cast<const Element*>(p.c != nullptr ? p.c : p.gemm.d);
  args.epilogue.thread.beta = p.c != nullptr ? 1.0f : 0.0f;
  if (p.wait.chunk_ends[0] < p.wait.rows_per_shard) {
    args.scheduler.raster_order = C::Kernel::TileScheduler::RasterOrderOptions::AlongN;
  }
  constexpr int kTileM = cute::get<0>(typename C::Tile{});
  constexpr int kClusterM = cute::get<0>(typename C::Cluster{});
  args.scheduler.max_swizzle_size = Swizzle(p.gemm.m, kClusterM * kTileM);  // as the fused one
  return args;
}

template <class Element, class LayoutB, class Tiles>
size_t WorkspaceBytesOf(const RsGemmProblem& p) {
  return Config<Element, LayoutB, Tiles>::Gemm::get_workspace_size(
      MakeArguments<Element, LayoutB, Tiles>(p));
}

template <class Element, class LayoutB, class Tiles>
const char* RunOf(const RsGemmProblem& p, void* workspace, cudaStream_t stream) {
  return gemm_sm90::Launch<Config<Element, LayoutB, Tiles>>(
      MakeArguments<Element, LayoutB, Tiles>(p), workspace, stream);
}

// The schedule's tiles (RsGemmProblem::pingpong), then B's layout.
template <class Element, class LayoutB>
size_t WorkspaceBytesOfLayout(const RsGemmProblem& p) {
  return p.pingpong ? WorkspaceBytesOf<Element, LayoutB, PingpongTiles>(p)
                    : WorkspaceBytesOf<Element, LayoutB, gemm_sm90::DefaultTiles>(p);
}

template <class Element, class LayoutB>
const char* RunOfLayout(const RsGemmProblem& p, void* workspace, cudaStream_t stream) {
  return p.pingpong ? RunOf<Element, LayoutB, PingpongTiles>(p, workspace, stream)
                    : RunOf<Element, LayoutB, gemm_sm90::DefaultTiles>(p, workspace, stream);
}

// B's layout from the problem (GemmProblem::b_kmajor); the probe's scheduler if asked for.
template <class Element>
size_t WorkspaceBytes(const RsGemmProblem& p) {
  if (p.cutlass_scheduler != 0) {
    if (p.gemm.b_kmajor || p.pingpong) return 0;  // Run reports it
    return PlainSchedulerConfig<Element>::Gemm::get_workspace_size(
        MakePlainSchedulerArguments<Element>(p));
  }
  return p.gemm.b_kmajor ? WorkspaceBytesOfLayout<Element, gemm_sm90::KMajorB>(p)
                         : WorkspaceBytesOfLayout<Element, gemm_sm90::NMajorB>(p);
}

template <class Element>
const char* Run(const RsGemmProblem& p, void* workspace, cudaStream_t stream) {
  if (p.cutlass_scheduler != 0) {
    if (p.gemm.b_kmajor || p.pingpong) {
      return "the CUTLASS-scheduler probe takes an N-major weight and the cooperative schedule";
    }
    return gemm_sm90::Launch<PlainSchedulerConfig<Element>>(
        MakePlainSchedulerArguments<Element>(p), workspace, stream);
  }
  return p.gemm.b_kmajor ? RunOfLayout<Element, gemm_sm90::KMajorB>(p, workspace, stream)
                         : RunOfLayout<Element, gemm_sm90::NMajorB>(p, workspace, stream);
}

}  // namespace jaxflux::rs_gemm_sm90

// Defines the entry points of one element type (listed in rs_gemm_sm90_dispatch.cu).
#define JAXFLUX_RS_GEMM_INSTANCE(NAME, ELEMENT)                                              \
  namespace jaxflux {                                                                        \
  size_t RsGemmWorkspaceBytes_##NAME(const RsGemmProblem& problem) {                         \
    return rs_gemm_sm90::WorkspaceBytes<ELEMENT>(problem);                                   \
  }                                                                                          \
  const char* RsGemmRun_##NAME(const RsGemmProblem& problem, void* workspace,                \
                               cudaStream_t stream) {                                        \
    return rs_gemm_sm90::Run<ELEMENT>(problem, workspace, stream);                           \
  }                                                                                          \
  }  // namespace jaxflux
