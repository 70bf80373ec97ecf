// The FP8 pieces of the sm90 GEMM (gemm_sm90.h's FP8 kinds), shared by the fused kernels:
// D (bf16) = (A·B) * row_scale[m] * col_scale[n] (+ C), A e4m3 or e5m2 row-major, B e4m3 given
// transposed ([N, K] row-major: wgmma reads 8-bit operands K-major only), fp32 accumulation.
//
// The scales are an epilogue visitor tree: the accumulator times a per-row vector (x's scales,
// a per-tensor scale broadcast by the caller) times a per-column vector (w's), in fp32, rounded
// once to bf16; with a source C (GEMM+ReduceScatter's own rows) the product is added to C before
// that rounding. Fp8Config mirrors gemm_sm90::Config, so gemm_sm90::MakeArguments, Launch and
// the fused kernels' schedulers, mainloop and epilogue wrappers take it unchanged.
#pragma once

#include <type_traits>

#include "cutlass/epilogue/fusion/callbacks.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "xla_ffi/kernels/gemm_sm90.cuh"

namespace jaxflux::gemm_sm90 {

// The FP8 tile configs: K steps of 128 one-byte elements (128-byte rows, as the 16-bit tiles).
using Fp8DefaultTiles = TileConfig<128, 256, 2, 1, false, 128>;

// The mainloop schedule: fast accumulation (wgmma's accumulator throughout) or promotion of the
// partial sums to fp32 registers every mma_promotion_interval k-blocks (CUTLASS's FP8 mainloop).
template <class Tiles, bool kFastAccum>
using Fp8MainloopSchedule = std::conditional_t<
    Tiles::kIsPingpong,
    std::conditional_t<kFastAccum, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
                       cutlass::gemm::KernelTmaWarpSpecializedPingpong>,
    std::conditional_t<kFastAccum, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                       cutlass::gemm::KernelTmaWarpSpecializedCooperative>>;

namespace fusion = cutlass::epilogue::fusion;

// acc * row_scale[m] * col_scale[n] (+ C), fp32 math, one rounding to ElementD.
template <class Tile, class ElementD, class ElementC>
struct ScaleTree {
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  // One scale per row of A: a column vector, any M (alignment 1), batch entries apart.
  using RowScale = fusion::Sm90ColBroadcast<0, Tile, float, float,
                                            cute::Stride<cute::_1, cute::_0, int64_t>, 1>;
  // One scale per column of B: a row vector, N a multiple of 16.
  using ColScale = fusion::Sm90RowBroadcast<0, Tile, float, float,
                                            cute::Stride<cute::_0, cute::_1, int64_t>, 4>;
  using AccTimesRow = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                                      fusion::Sm90AccFetch, RowScale>;
  using Callbacks = std::conditional_t<
      std::is_void_v<ElementC>,
      fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, ElementD, float, kRound>,
                      AccTimesRow, ColScale>,
      fusion::Sm90EVT<fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementD, float, kRound>,
                      AccTimesRow, ColScale, fusion::Sm90SrcFetch<ElementC>>>;
};

// The FP8 counterpart of gemm_sm90::Config: ElementA (e4m3/e5m2) row-major, ElementB (e4m3)
// K-major, D bf16; ElementC void (no source) or bf16 (D = scaled A·B + C).
template <class ElementA_, class ElementB_, class SchedulerTag = void,
          class Tiles = Fp8DefaultTiles, class ElementC = void,
          template <class, int> class EpilogueWrap = PlainEpilogue, bool kFastAccum = true>
struct Fp8Config {
  static constexpr bool kFp8 = true;
  using ElementA = ElementA_;
  using ElementB = ElementB_;
  using ElementD = cutlass::bfloat16_t;
  using Layout = cutlass::layout::RowMajor;  // A [M,K], C and D [M,N]
  static constexpr int kAlignAB = 16;        // 16-byte accesses of one-byte elements
  static constexpr int kAlignD = 8;
  using Tile = typename Tiles::Tile;
  using Cluster = typename Tiles::Cluster;
  using Tree = ScaleTree<Tile, ElementD, ElementC>;

  using Epilogue = EpilogueWrap<
      typename cutlass::epilogue::collective::CollectiveBuilder<
          cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
          cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, Layout, kAlignD,
          ElementD, Layout, kAlignD, typename Tiles::EpilogueSchedule,
          typename Tree::Callbacks>::CollectiveOp,
      cute::get<0>(Tile{})>;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, Layout, kAlignAB, ElementB,
      KMajorB, kAlignAB, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Fp8MainloopSchedule<Tiles, kFastAccum>>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, SchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // The epilogue tree's arguments (gemm_sm90::MakeArguments sets them for FP8 configs).
  static typename Tree::Callbacks::Arguments ScaleArguments(const GemmProblem& p) {
    typename Tree::RowScale::Arguments row{
        p.row_scale, 0.0f, {cute::_1{}, cute::_0{}, p.batch_stride_row_scale}};
    typename Tree::ColScale::Arguments col{p.col_scale, 0.0f, {cute::_0{}, cute::_1{}, 0}};
    if constexpr (std::is_void_v<ElementC>) {
      return {{{}, row, {}}, col, {}};
    } else {
      return {{{}, row, {}}, col, {}, {}};
    }
  }
};

template <class C>
size_t Fp8WorkspaceBytes(const GemmProblem& p) {
  return C::Gemm::get_workspace_size(MakeArguments<C>(p));
}

template <class C>
const char* Fp8Run(const GemmProblem& p, void* workspace, cudaStream_t stream) {
  if (p.row_scale == nullptr || p.col_scale == nullptr) {
    return "FP8 GEMM without its row and column scales";
  }
  if (!p.b_kmajor) return "FP8 GEMM needs B given transposed, [N, K] (K-major)";
  return Launch<C>(MakeArguments<C>(p), workspace, stream);
}

}  // namespace jaxflux::gemm_sm90

// The entry points of CUTLASS's persistent FP8 GEMM for one A type (B e4m3), both
// accumulations (GemmProblem::fast_accum); NAME = the A type's name.
#define JAXFLUX_GEMM_FP8_INSTANCE(NAME, ELEMENT_A)                                            \
  namespace jaxflux {                                                                         \
  using GemmFp8Fast_##NAME = gemm_sm90::Fp8Config<ELEMENT_A, cutlass::float_e4m3_t, void,     \
                                                  gemm_sm90::Fp8DefaultTiles, void,           \
                                                  gemm_sm90::PlainEpilogue, true>;            \
  using GemmFp8Promoted_##NAME = gemm_sm90::Fp8Config<ELEMENT_A, cutlass::float_e4m3_t, void, \
                                                      gemm_sm90::Fp8DefaultTiles, void,       \
                                                      gemm_sm90::PlainEpilogue, false>;       \
  size_t GemmWorkspaceBytes_##NAME(const GemmProblem& problem) {                              \
    return problem.fast_accum ? gemm_sm90::Fp8WorkspaceBytes<GemmFp8Fast_##NAME>(problem)     \
                              : gemm_sm90::Fp8WorkspaceBytes<GemmFp8Promoted_##NAME>(problem); \
  }                                                                                           \
  const char* GemmRun_##NAME(const GemmProblem& problem, void* workspace,                     \
                             cudaStream_t stream) {                                           \
    return problem.fast_accum                                                                 \
               ? gemm_sm90::Fp8Run<GemmFp8Fast_##NAME>(problem, workspace, stream)            \
               : gemm_sm90::Fp8Run<GemmFp8Promoted_##NAME>(problem, workspace, stream);       \
  }                                                                                           \
  }  // namespace jaxflux
