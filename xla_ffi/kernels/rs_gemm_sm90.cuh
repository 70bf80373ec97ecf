// The own-rows GEMM of the fused GEMM+ReduceScatter (rs_gemm_sm90.h): the sm90 GEMM of
// gemm_sm90.cuh with a source operand C and the fused ops' tile scheduler, whose waits are
// limited to the warp that loads C. One .cu per element type instantiates it.
#pragma once

#include "xla_ffi/kernels/ag_gemm_scheduler_sm90.cuh"
#include "xla_ffi/kernels/gemm_sm90.cuh"
#include "xla_ffi/kernels/rs_gemm_sm90.h"

namespace jaxflux::rs_gemm_sm90 {

// The default tile config (cooperative 128x256, 2x1 clusters): its producer warp 2 loads C,
// which is what the scheduler's epilogue_load_only wait assumes.
template <class Element, class LayoutB>
using Config =
    gemm_sm90::Config<Element, AgGemmSchedulerTag, gemm_sm90::DefaultTiles, Element, LayoutB>;

template <class Element, class LayoutB>
typename Config<Element, LayoutB>::Gemm::Arguments MakeArguments(const RsGemmProblem& p) {
  using C = Config<Element, LayoutB>;
  constexpr int kTileM = cute::get<0>(typename C::Tile{});
  constexpr int kClusterM = cute::get<0>(typename C::Cluster{});
  auto args = gemm_sm90::MakeArguments<C>(p.gemm);
  // D = A·B + C; without a source, beta 0 makes CUTLASS skip C's loads (its TMA descriptor
  // still needs a valid tensor: D's).
  args.epilogue.ptr_C = static_cast<const Element*>(p.c != nullptr ? p.c : p.gemm.d);
  args.epilogue.thread.beta = p.c != nullptr ? 1.0f : 0.0f;
  auto& s = args.scheduler;  // CUTLASS's tile order; every tile waits on the same flag
  if (p.wait.chunk_ends[0] < p.wait.rows_per_shard) {
    // The peer's partial lands in row chunks, in order: sweep the rows in that order too.
    using Options = typename C::Kernel::TileScheduler::RasterOrderOptions;
    s.raster_order = Options::AlongN;
  }
  s.wait = p.wait;
  s.wait_for_flags = p.wait_for_flags;
  const int tiles = (p.gemm.m + kTileM - 1) / kTileM;
  s.tiles_m = (tiles + kClusterM - 1) / kClusterM * kClusterM;
  s.tile_shift = 0;
  s.total_rows = p.gemm.m;
  return args;
}

template <class Element, class LayoutB>
size_t WorkspaceBytesOf(const RsGemmProblem& p) {
  return Config<Element, LayoutB>::Gemm::get_workspace_size(MakeArguments<Element, LayoutB>(p));
}

template <class Element, class LayoutB>
const char* RunOf(const RsGemmProblem& p, void* workspace, cudaStream_t stream) {
  return gemm_sm90::Launch<Config<Element, LayoutB>>(MakeArguments<Element, LayoutB>(p),
                                                     workspace, stream);
}

// B's layout from the problem (GemmProblem::b_kmajor).
template <class Element>
size_t WorkspaceBytes(const RsGemmProblem& p) {
  return p.gemm.b_kmajor ? WorkspaceBytesOf<Element, gemm_sm90::KMajorB>(p)
                         : WorkspaceBytesOf<Element, gemm_sm90::NMajorB>(p);
}

template <class Element>
const char* Run(const RsGemmProblem& p, void* workspace, cudaStream_t stream) {
  return p.gemm.b_kmajor ? RunOf<Element, gemm_sm90::KMajorB>(p, workspace, stream)
                         : RunOf<Element, gemm_sm90::NMajorB>(p, workspace, stream);
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
