// The CUTLASS pieces of the decode GEMM (gemm_swap_ab_sm90.h). Instantiated per (dtype, weight
// layout, token width) in instantiations/gemm_swap_ab_sm90_*.cu (generate_instantiations.py).
//
// CUTLASS's problem is the swapped one: its A is the weight viewed as [N, K], its B is x [M, K]
// (K-major), its D is y viewed as [N, M] column-major. Tiles 128 (weight rows) x width (tokens)
// x 128 bytes of K, the cooperative schedule (the only sm90 one CUTLASS's stream-K scheduler
// runs), no cluster: one token tile shares each weight tile with no other CTA.
#pragma once

#include <type_traits>

#include "xla_ffi/kernels/gemm_fp8_sm90.cuh"
#include "xla_ffi/kernels/gemm_swap_ab_sm90.h"

namespace jaxflux::gemm_swap_ab_sm90 {

namespace fusion = cutlass::epilogue::fusion;

// The weight as CUTLASS's A [N, K]: given [N, K] it is K-major; given [K, N], N-major (A's
// M-major, which wgmma reads from shared memory for 16-bit types).
using KMajorW = cutlass::layout::RowMajor;
using NMajorW = cutlass::layout::ColumnMajor;
using XLayout = cutlass::layout::ColumnMajor;  // x [M, K] as CUTLASS's B: K-major
using DLayout = cutlass::layout::ColumnMajor;  // y [M, N] row-major is yᵀ [N, M] column-major

// FP8: yᵀ = (acc * x_scale[token]) * w_scale[feature] in fp32, one rounding to bf16: the
// non-swapped kernel's acc * row_scale[m] * col_scale[n] (gemm_fp8_sm90.cuh) in the same order.
template <class Tile, class ElementD>
struct SwappedScaleTree {
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  // x's scales, one per token: a row vector of yᵀ (any number of tokens: alignment 1).
  using TokenScale = fusion::Sm90RowBroadcast<0, Tile, float, float,
                                              cute::Stride<cute::_0, cute::_1, int64_t>, 1>;
  // w's scales, one per output feature: a column vector of yᵀ.
  using FeatureScale = fusion::Sm90ColBroadcast<0, Tile, float, float,
                                                cute::Stride<cute::_1, cute::_0, int64_t>, 1>;
  using AccTimesToken =
      fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                      fusion::Sm90AccFetch, TokenScale>;
  using Callbacks =
      fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, ElementD, float, kRound>,
                      AccTimesToken, FeatureScale>;
};

// ElementW: the weight's type (FP8: e4m3); ElementX: x's. 16-bit: both the same, D too. FP8:
// D bf16, fast accumulation (as the fused FP8 kernels, gemm_sm90.h's kFp8FastAccum).
template <class ElementW, class ElementX, class LayoutW, int kTokens>
struct Config {
  static constexpr bool kFp8 = cutlass::sizeof_bits<ElementX>::value == 8;
  using ElementD = std::conditional_t<kFp8, cutlass::bfloat16_t, ElementX>;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<ElementX>::value;
  static constexpr int kAlignD = 8;
  using Tiles = gemm_sm90::TileConfig<128, kTokens, 1, 1, false, kAlignAB * 8>;
  using Tile = typename Tiles::Tile;
  using Cluster = typename Tiles::Cluster;
  using Fusion = std::conditional_t<kFp8, typename SwappedScaleTree<Tile, ElementD>::Callbacks,
                                    fusion::LinearCombination<ElementD, float, void, float>>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, DLayout, kAlignD,
      ElementD, DLayout, kAlignD, cutlass::epilogue::TmaWarpSpecializedCooperative,
      Fusion>::CollectiveOp;

  using Schedule =
      std::conditional_t<kFp8, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementW, LayoutW, kAlignAB, ElementX,
      XLayout, kAlignAB, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, cutlass::gemm::StreamKScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The rows of a problem whose batch entries fold into one matrix of rows (x, d and the row
// scales contiguous across entries), or -1.
inline long long FoldedRows(const GemmProblem& p) {
  const long long rows = static_cast<long long>(p.m) * p.batch;
  if (p.batch == 1) return rows;
  const bool contiguous = p.batch_stride_a == static_cast<int64_t>(p.m) * p.k &&
                          p.batch_stride_d == static_cast<int64_t>(p.m) * p.n &&
                          (p.row_scale == nullptr || p.batch_stride_row_scale == p.m);
  return contiguous ? rows : -1;
}

template <class C>
typename C::Gemm::Arguments MakeArguments(const GemmProblem& p, int rows) {
  using Kernel = typename C::Gemm::GemmKernel;
  auto stride_w = cutlass::make_cute_packed_stride(typename Kernel::StrideA{},
                                                   cute::make_shape(p.n, p.k, 1));
  auto stride_x = cutlass::make_cute_packed_stride(typename Kernel::StrideB{},
                                                   cute::make_shape(rows, p.k, 1));
  auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{},
                                                   cute::make_shape(p.n, rows, 1));
  cutlass::KernelHardwareInfo hw;
  hw.device_id = p.device;
  hw.sm_count = GridSms(p.device, p.grid_sms);
  typename C::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {p.n, rows, p.k, 1},
      {static_cast<const typename C::Mainloop::ElementA*>(p.b), stride_w,
       static_cast<const typename C::Mainloop::ElementB*>(p.a), stride_x},
      {},
      hw};
  if constexpr (C::kFp8) {
    using Tree = SwappedScaleTree<typename C::Tile, typename C::ElementD>;
    typename Tree::TokenScale::Arguments token{p.row_scale, 0.0f, {cute::_0{}, cute::_1{}, 0}};
    typename Tree::FeatureScale::Arguments feature{p.col_scale, 0.0f,
                                                   {cute::_1{}, cute::_0{}, 0}};
    args.epilogue.thread = {{{}, token, {}}, feature, {}};
  } else {
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
  }
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = stride_d;
  args.epilogue.ptr_D = static_cast<typename C::ElementD*>(p.d);
  args.epilogue.dD = stride_d;
  // Every tile split along K over the SMs (the heuristic would keep tiles whole from half the
  // SMs up); the fixup of the splits is CUTLASS's deterministic one, its default.
  using Mode = std::remove_reference_t<decltype(args.scheduler.decomposition_mode)>;
  args.scheduler.decomposition_mode = Mode::StreamK;
  args.scheduler.max_swizzle_size = 1;
  return args;
}

template <class C>
size_t WorkspaceBytes(const GemmProblem& p) {
  const long long rows = FoldedRows(p);
  if (rows <= 0) return 0;
  return C::Gemm::get_workspace_size(MakeArguments<C>(p, static_cast<int>(rows)));
}

template <class C>
const char* Run(const GemmProblem& p, void* workspace, cudaStream_t stream) {
  const long long rows = FoldedRows(p);
  if (rows < 0) return "the decode GEMM needs contiguous batch entries";
  if constexpr (C::kFp8) {
    if (p.row_scale == nullptr || p.col_scale == nullptr) {
      return "FP8 GEMM without its row and column scales";
    }
  }
  return gemm_sm90::Launch<C>(MakeArguments<C>(p, static_cast<int>(rows)), workspace, stream);
}

}  // namespace jaxflux::gemm_swap_ab_sm90

// The entry points of one (weight type, x type, weight layout, token width); NAME names them in
// gemm_swap_ab_sm90_dispatch.cu's table.
#define JAXFLUX_GEMM_SWAP_AB_INSTANCE(NAME, ELEMENT_W, ELEMENT_X, LAYOUT_W, TOKENS)           \
  namespace jaxflux {                                                                        \
  using GemmSwapAb_##NAME =                                                                  \
      gemm_swap_ab_sm90::Config<ELEMENT_W, ELEMENT_X, gemm_swap_ab_sm90::LAYOUT_W, TOKENS>;  \
  size_t GemmSwapAbWorkspaceBytes_##NAME(const GemmProblem& problem) {                      \
    return gemm_swap_ab_sm90::WorkspaceBytes<GemmSwapAb_##NAME>(problem);                    \
  }                                                                                          \
  const char* GemmSwapAbRun_##NAME(const GemmProblem& problem, void* workspace,              \
                                   cudaStream_t stream) {                                    \
    return gemm_swap_ab_sm90::Run<GemmSwapAb_##NAME>(problem, workspace, stream);            \
  }                                                                                          \
  }  // namespace jaxflux
