// The own-rows GEMM of the fused GEMM+ReduceScatter (rs_gemm_sm90.h): the sm90 GEMM of
// gemm_sm90.cuh (16-bit) or gemm_fp8_sm90.cuh (FP8) with a source operand C, the fused ops' tile scheduler (for its tile order) and
// an epilogue that waits for C's rows before loading them (rs_epilogue_sm90.cuh). Instantiated
// per element type in instantiations/rs_gemm_sm90_*.cu (generate_instantiations.py).
#pragma once

#include "xla_ffi/kernels/fused_tile_scheduler_sm90.cuh"
#include "xla_ffi/kernels/gemm_fp8_sm90.cuh"
#include "xla_ffi/kernels/gemm_sm90.cuh"
#include "xla_ffi/kernels/rs_epilogue_sm90.cuh"
#include "xla_ffi/kernels/rs_gemm_sm90.h"

namespace jaxflux::rs_gemm_sm90 {

// The two tile configs (RsGemmProblem::pingpong picks): cooperative 128x256 with 2x1 clusters
// (the plain GEMM's), and ping-pong 128x128 2x1, whose two consumer warp groups alternate tiles
// so that one's epilogue (the C read) overlaps the other's mainloop. FP8 steps K by 128.
using PingpongTiles = gemm_sm90::TileConfig<128, 128, 2, 1, true>;
using Fp8PingpongTiles = gemm_sm90::TileConfig<128, 128, 2, 1, true, 128>;

template <class Element, class LayoutB, class Tiles = gemm_sm90::DefaultTiles>
using Config = gemm_sm90::Config<Element, FusedSchedulerTag, Tiles, Element, LayoutB,
                                 WaitingEpilogue>;

// FP8: A e4m3 or e5m2, B e4m3 K-major, C and D bf16; D = (A·B) * scales + C.
template <class ElementA, class Tiles>
using Fp8Config = gemm_sm90::Fp8Config<
    ElementA, cutlass::float_e4m3_t, FusedSchedulerTag, Tiles, cutlass::bfloat16_t,
    WaitingEpilogue, kFp8FastAccum>;

template <class C>
typename C::Gemm::Arguments MakeArguments(const RsGemmProblem& p) {
  constexpr int kTileN = cute::get<1>(typename C::Tile{});
  constexpr int kClusterM = cute::get<0>(typename C::Cluster{});
  constexpr int kClusterN = cute::get<1>(typename C::Cluster{});
  auto args = gemm_sm90::MakeArguments<C>(p.gemm);
  // D = A·B + C; without a source, beta 0 makes CUTLASS skip C's loads (its TMA descriptor
  // still needs a valid tensor: D's). The FP8 tree always reads C (Run requires one).
  args.epilogue.ptr_C = static_cast<const typename C::ElementD*>(p.c != nullptr ? p.c : p.gemm.d);
  if constexpr (!C::kFp8) args.epilogue.thread.beta = p.c != nullptr ? 1.0f : 0.0f;
  auto& s = args.scheduler;  // CUTLASS's raster heuristic when the partial lands whole
  if (p.wait.chunk_ends[0] < p.wait.rows_per_shard) {
    // The peer's partial lands in row chunks, in order: sweep the rows in that order too.
    using Options = typename C::Kernel::TileScheduler::RasterOrderOptions;
    s.raster_order = Options::AlongN;
  }
  s.max_swizzle_size = p.gemm.swizzle;
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

template <class C>
size_t WorkspaceBytesOf(const RsGemmProblem& p) {
  return C::Gemm::get_workspace_size(MakeArguments<C>(p));
}

template <class C>
const char* RunOf(const RsGemmProblem& p, void* workspace, cudaStream_t stream) {
  if constexpr (C::kFp8) {
    if (p.c == nullptr || p.gemm.row_scale == nullptr || p.gemm.col_scale == nullptr ||
        !p.gemm.b_kmajor) {
      return "matmul_reduce_scatter: the FP8 own-rows GEMM needs c, row and column scales and "
             "the weight K-major";
    }
  }
  return gemm_sm90::Launch<C>(MakeArguments<C>(p), workspace, stream);
}

// 16-bit: the schedule's tiles (RsGemmProblem::pingpong), then B's layout.
template <class Element, class LayoutB>
size_t WorkspaceBytesOfLayout(const RsGemmProblem& p) {
  return p.pingpong ? WorkspaceBytesOf<Config<Element, LayoutB, PingpongTiles>>(p)
                    : WorkspaceBytesOf<Config<Element, LayoutB>>(p);
}

template <class Element, class LayoutB>
const char* RunOfLayout(const RsGemmProblem& p, void* workspace, cudaStream_t stream) {
  return p.pingpong ? RunOf<Config<Element, LayoutB, PingpongTiles>>(p, workspace, stream)
                    : RunOf<Config<Element, LayoutB>>(p, workspace, stream);
}

template <class Element>
size_t WorkspaceBytes(const RsGemmProblem& p) {
  return p.gemm.b_kmajor ? WorkspaceBytesOfLayout<Element, gemm_sm90::KMajorB>(p)
                         : WorkspaceBytesOfLayout<Element, gemm_sm90::NMajorB>(p);
}

template <class Element>
const char* Run(const RsGemmProblem& p, void* workspace, cudaStream_t stream) {
  return p.gemm.b_kmajor ? RunOfLayout<Element, gemm_sm90::KMajorB>(p, workspace, stream)
                         : RunOfLayout<Element, gemm_sm90::NMajorB>(p, workspace, stream);
}

// FP8 (B K-major only): the schedule's tiles.
template <class ElementA>
size_t Fp8WorkspaceBytes(const RsGemmProblem& p) {
  return p.pingpong ? WorkspaceBytesOf<Fp8Config<ElementA, Fp8PingpongTiles>>(p)
                    : WorkspaceBytesOf<Fp8Config<ElementA, gemm_sm90::Fp8DefaultTiles>>(p);
}

template <class ElementA>
const char* Fp8Run(const RsGemmProblem& p, void* workspace, cudaStream_t stream) {
  return p.pingpong
             ? RunOf<Fp8Config<ElementA, Fp8PingpongTiles>>(p, workspace, stream)
             : RunOf<Fp8Config<ElementA, gemm_sm90::Fp8DefaultTiles>>(p, workspace, stream);
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

// The FP8 entry points of one A type (B e4m3), both schedules.
#define JAXFLUX_RS_GEMM_FP8_INSTANCE(NAME, ELEMENT_A)                                        \
  namespace jaxflux {                                                                        \
  size_t RsGemmWorkspaceBytes_##NAME(const RsGemmProblem& problem) {                         \
    return rs_gemm_sm90::Fp8WorkspaceBytes<ELEMENT_A>(problem);                              \
  }                                                                                          \
  const char* RsGemmRun_##NAME(const RsGemmProblem& problem, void* workspace,                \
                               cudaStream_t stream) {                                        \
    return rs_gemm_sm90::Fp8Run<ELEMENT_A>(problem, workspace, stream);                      \
  }                                                                                          \
  }  // namespace jaxflux
