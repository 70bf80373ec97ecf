// The CUTLASS 3 pieces of the sm90 GEMM (gemm_sm90.h), shared by the fused kernels.
//
// Stock config: warp-specialized cooperative mainloop with TMA, 128x256x64 tiles, 2x1 clusters,
// persistent tile scheduler (the stock config measured closest to cuBLAS on the benchmark
// shapes). The fused kernels plug in their own scheduler, mainloop or epilogue
// (ag_gemm_sm90.cuh, rs_gemm_sm90.cuh). Instantiated per element type in
// instantiations/gemm_sm90_*.cu (generate_instantiations.py).
#pragma once

#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "xla_ffi/kernels/device_info.h"
#include "xla_ffi/kernels/gemm_sm90.h"

namespace jaxflux::gemm_sm90 {

// One CUTLASS kernel shape: CTA tile (K step 64: 128-byte rows of 16-bit elements), cluster,
// and the warp-specialized schedule (cooperative: two consumer warp groups share a tile;
// ping-pong: they alternate tiles). The FP8 kernels step K by 128, the same 128-byte rows.
template <int kTileM, int kTileN, int kClusterM, int kClusterN, bool kPingpong, int kTileK = 64>
struct TileConfig {
  static constexpr bool kIsPingpong = kPingpong;
  using Tile = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>;
  using Cluster = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  using MainloopSchedule =
      std::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                                              cutlass::epilogue::TmaWarpSpecializedCooperative>;
};

using DefaultTiles = TileConfig<128, 256, 2, 1, false>;
// GemmTiles::kStreamK128x128: narrower tiles, no cluster, CUTLASS's stream-K scheduler.
using StreamKTiles = TileConfig<128, 128, 1, 1, false>;

// B's layouts: [K,N] row-major (N-major), or given as Bᵀ [N,K] row-major (K-major).
using NMajorB = cutlass::layout::RowMajor;
using KMajorB = cutlass::layout::ColumnMajor;

// CUTLASS's epilogue as built (the default EpilogueWrap of Config).
template <class Epilogue, int kTileM>
using PlainEpilogue = Epilogue;

// SchedulerTag: void = CUTLASS's static persistent scheduler; the fused ops plug
// in their own (fused_tile_scheduler_sm90.cuh). ElementC: void = no source operand (D = A·B);
// Element = D = A·B + C (the fused GEMM+ReduceScatter's own rows, rs_gemm_sm90.cuh).
// LayoutB: NMajorB or KMajorB (GemmProblem::b_kmajor). EpilogueWrap<CUTLASS's epilogue, tile
// rows>: the epilogue the kernel runs (GEMM+ReduceScatter's waits for C: rs_epilogue_sm90.cuh).
template <class Element_, class SchedulerTag = void, class Tiles = DefaultTiles,
          class ElementC = void, class LayoutB = NMajorB,
          template <class, int> class EpilogueWrap = PlainEpilogue>
struct Config {
  static constexpr bool kFp8 = false;
  using Element = Element_;
  using ElementA = Element;
  using ElementB = Element;
  using ElementD = Element;
  using Layout = cutlass::layout::RowMajor;  // A [M,K], C and D [M,N]
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte accesses
  using Tile = typename Tiles::Tile;
  using Cluster = typename Tiles::Cluster;

  // D = alpha·A·B + beta·C, fp32 math; with ElementC = void no C is read.
  using Epilogue = EpilogueWrap<
      typename cutlass::epilogue::collective::CollectiveBuilder<
          cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
          cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, Layout, kAlign,
          Element, Layout, kAlign, typename Tiles::EpilogueSchedule>::CollectiveOp,
      cute::get<0>(Tile{})>;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, Layout, kAlign, Element,
      LayoutB, kAlign, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Tiles::MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, SchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class C>
typename C::Gemm::Arguments MakeArguments(const GemmProblem& p) {
  using Gemm = typename C::Gemm;
  auto stride_a = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideA{},
                                                   cute::make_shape(p.m, p.k, p.batch));
  auto stride_b = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideB{},
                                                   cute::make_shape(p.n, p.k, p.batch));
  auto stride_d = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideD{},
                                                   cute::make_shape(p.m, p.n, p.batch));
  if (p.batch > 1) {  // explicit batch strides: a and d may be views into larger buffers
    cute::get<2>(stride_a) = p.batch_stride_a;
    cute::get<2>(stride_b) = 0;
    cute::get<2>(stride_d) = p.batch_stride_d;
  }
  cutlass::KernelHardwareInfo hw;
  hw.device_id = p.device;
  hw.sm_count = GridSms(p.device, p.grid_sms);
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {p.m, p.n, p.k, p.batch},
      {static_cast<const typename C::ElementA*>(p.a), stride_a,
       static_cast<const typename C::ElementB*>(p.b), stride_b},
      {},  // the epilogue's, set below by name (Config's EpilogueWrap may extend them)
      hw};
  if constexpr (C::kFp8) {
    args.epilogue.thread = C::ScaleArguments(p);
  } else {
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
  }
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = stride_d;
  args.epilogue.ptr_D = static_cast<typename C::ElementD*>(p.d);
  args.epilogue.dD = stride_d;
  args.scheduler.max_swizzle_size = p.swizzle;
  return args;
}

template <class C>
const char* Launch(const typename C::Gemm::Arguments& args, void* workspace,
                   cudaStream_t stream) {
  typename C::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    return "CUTLASS cannot implement this problem (K and N must be multiples of 8)";
  }
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) {
    return "CUTLASS GEMM initialize failed";
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) return "CUTLASS GEMM launch failed";
  return nullptr;
}

// MakeArguments plus the scheduler's own: the stream-K scheduler splits every output tile along K
// across the SMs. (Its heuristic keeps tiles whole once they fill half the SMs, which leaves the
// other half idle while a decode-sized GEMM reads the weight.)
template <class C, class Scheduler>
typename C::Gemm::Arguments ArgumentsFor(const GemmProblem& p) {
  auto args = MakeArguments<C>(p);
  if constexpr (std::is_same_v<Scheduler, cutlass::gemm::StreamKScheduler>) {
    using Mode = std::remove_reference_t<decltype(args.scheduler.decomposition_mode)>;
    args.scheduler.decomposition_mode = Mode::StreamK;
  }
  return args;
}

template <class Element, class Tiles = DefaultTiles, class Scheduler = void>
size_t WorkspaceBytes(const GemmProblem& p) {
  if (p.b_kmajor) {
    using C = Config<Element, Scheduler, Tiles, void, KMajorB>;
    return C::Gemm::get_workspace_size(ArgumentsFor<C, Scheduler>(p));
  }
  using C = Config<Element, Scheduler, Tiles>;
  return C::Gemm::get_workspace_size(ArgumentsFor<C, Scheduler>(p));
}

template <class Element, class Tiles = DefaultTiles, class Scheduler = void>
const char* Run(const GemmProblem& p, void* workspace, cudaStream_t stream) {
  if (p.b_kmajor) {
    using C = Config<Element, Scheduler, Tiles, void, KMajorB>;
    return Launch<C>(ArgumentsFor<C, Scheduler>(p), workspace, stream);
  }
  using C = Config<Element, Scheduler, Tiles>;
  return Launch<C>(ArgumentsFor<C, Scheduler>(p), workspace, stream);
}

}  // namespace jaxflux::gemm_sm90

// Defines the entry points of one element type (listed in gemm_sm90_dispatch.cu).
#define JAXFLUX_GEMM_INSTANCE(NAME, ELEMENT)                                                 \
  namespace jaxflux {                                                                        \
  size_t GemmWorkspaceBytes_##NAME(const GemmProblem& problem) {                             \
    return gemm_sm90::WorkspaceBytes<ELEMENT>(problem);                                      \
  }                                                                                          \
  const char* GemmRun_##NAME(const GemmProblem& problem, void* workspace,                    \
                             cudaStream_t stream) {                                          \
    return gemm_sm90::Run<ELEMENT>(problem, workspace, stream);                              \
  }                                                                                          \
  }  // namespace jaxflux

// The stream-K entry points of one element type (GemmTiles::kStreamK128x128);
// NAME = streamk_<dtype>.
#define JAXFLUX_GEMM_STREAMK_INSTANCE(NAME, ELEMENT)                                         \
  namespace jaxflux {                                                                        \
  size_t GemmWorkspaceBytes_##NAME(const GemmProblem& problem) {                      \
    return gemm_sm90::WorkspaceBytes<ELEMENT, gemm_sm90::StreamKTiles,                       \
                                     cutlass::gemm::StreamKScheduler>(problem);              \
  }                                                                                          \
  const char* GemmRun_##NAME(const GemmProblem& problem, void* workspace,                    \
                             cudaStream_t stream) {                                          \
    return gemm_sm90::Run<ELEMENT, gemm_sm90::StreamKTiles, cutlass::gemm::StreamKScheduler>( \
        problem, workspace, stream);                                                         \
  }                                                                                          \
  }  // namespace jaxflux
