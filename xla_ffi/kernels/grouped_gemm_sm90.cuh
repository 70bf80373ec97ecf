// The CUTLASS 3 pieces of the grouped GEMM (grouped_gemm_sm90.h): CUTLASS's ptr-array grouped
// GEMM (TMA, warp-specialized, persistent over every group's tiles), fed by a setup kernel that
// turns the device-side group sizes into its per-group problem shapes, pointers and strides.
// Instantiated per element type, layout and tile config in
// instantiations/grouped_gemm_sm90_*.cu (generate_instantiations.py).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "xla_ffi/kernels/device_info.h"
#include "xla_ffi/kernels/grouped_gemm_sm90.h"

namespace jaxflux::grouped_gemm_sm90 {

namespace fusion_ns = cutlass::epilogue::fusion;

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // M, N, K
using GroupShape = ProblemShape::UnderlyingProblemShape;

// A tile config of the ptr-array kernels: CTA tile (K step of 128 bytes: 64 16-bit elements,
// Fp8Tile 128 one-byte ones), cluster, and the warp-specialized schedule (FP8: fast
// accumulation, as the dense FP8 kernels).
template <int kTileM, int kTileN, int kClusterM, int kClusterN, bool kPingpong>
struct Tiles {
  using Tile = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::_64>;
  using Fp8Tile = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::_128>;
  using Cluster = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  using MainloopSchedule =
      std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using Fp8MainloopSchedule = std::conditional_t<
      kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum>;
  using EpilogueSchedule =
      std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

// In GroupedGemmTiles order.
using Cooperative128x256 = Tiles<128, 256, 1, 2, false>;
using Pingpong128x128 = Tiles<128, 128, 1, 2, true>;

using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

// The operand layouts of each kind: A row-major (forward) or read transposed, M-major (weight
// gradient: Aᵀ of x's rows); B [k, n] N-major, [n, k] K-major, or dy's rows N-major.
struct ForwardNMajor {
  static constexpr GroupedGemmKind kKind = GroupedGemmKind::kForward;
  using LayoutA = RowMajor;
  using LayoutB = RowMajor;
};
struct ForwardKMajor {
  static constexpr GroupedGemmKind kKind = GroupedGemmKind::kForward;
  using LayoutA = RowMajor;
  using LayoutB = ColumnMajor;
};
struct WeightGrad {
  static constexpr GroupedGemmKind kKind = GroupedGemmKind::kWeightGrad;
  using LayoutA = ColumnMajor;
  using LayoutB = RowMajor;
};

template <class Element_, class Operands, class T>
struct Config {
  static constexpr bool kFp8 = false;
  using Element = Element_;
  using ElementA = Element;
  using ElementB = Element;
  using ElementD = Element;
  static constexpr GroupedGemmKind kKind = Operands::kKind;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte accesses

  // D = A·B, fp32 math; no source operand.
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename T::Tile,
      typename T::Cluster, cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      RowMajor*, kAlign, Element, RowMajor*, kAlign,
      typename T::EpilogueSchedule>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, typename Operands::LayoutA*,
      kAlign, Element, typename Operands::LayoutB*, kAlign, float, typename T::Tile,
      typename T::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename T::MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// The FP8 forward: A e4m3 row-major, B e4m3 K-major, D bf16 = (A·B) · row scale · column
// scale in the epilogue, each group's scale vectors reached through pointer arrays (the setup
// kernel points them at the group's rows and its expert's columns).
template <class T>
struct Fp8Config {
  static constexpr bool kFp8 = true;
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  static constexpr GroupedGemmKind kKind = GroupedGemmKind::kForward;
  static constexpr int kAlignAB = 16;  // 16-byte accesses of one-byte elements
  static constexpr int kAlignD = 8;
  using Tile = typename T::Fp8Tile;

  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  // One scale per row of A (any row count: alignment 1), one per column of B[g].
  using RowScale = fusion_ns::Sm90ColBroadcast<0, Tile, float*, float,
                                               cute::Stride<cute::_1, cute::_0, int64_t>, 1>;
  using ColScale = fusion_ns::Sm90RowBroadcast<0, Tile, float*, float,
                                               cute::Stride<cute::_0, cute::_1, int64_t>, 4>;
  using AccTimesRow =
      fusion_ns::Sm90EVT<fusion_ns::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                         fusion_ns::Sm90AccFetch, RowScale>;
  using Callbacks =
      fusion_ns::Sm90EVT<fusion_ns::Sm90Compute<cutlass::multiplies, ElementD, float, kRound>,
                         AccTimesRow, ColScale>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, typename T::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajor*, kAlignD,
      ElementD, RowMajor*, kAlignD, typename T::EpilogueSchedule, Callbacks>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, RowMajor*, kAlignAB,
      ElementB, ColumnMajor*, kAlignAB, float, Tile, typename T::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename T::Fp8MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// The per-group arguments CUTLASS reads on the device, carved from the call's scratch, each
// array 128-byte aligned; CUTLASS's own workspace (its tensor maps) follows. FP8 configs also
// carry each group's scale vectors.
template <class C>
struct GroupArrays {
  GroupShape* shapes;
  const typename C::ElementA** a;
  const typename C::ElementB** b;
  typename C::ElementD** d;
  typename C::StrideA* stride_a;
  typename C::StrideB* stride_b;
  typename C::StrideD* stride_d;
  const float** row_scale;  // FP8 only (else nullptr)
  const float** col_scale;
  void* cutlass_workspace;

  static size_t Aligned(size_t bytes) { return (bytes + 127) / 128 * 128; }

  // What Carve lays out, up to CUTLASS's workspace.
  static size_t Bytes(int groups) {
    return reinterpret_cast<uintptr_t>(Carve(nullptr, groups).cutlass_workspace);
  }

  static GroupArrays Carve(void* workspace, int groups) {
    const size_t g = static_cast<size_t>(groups);
    uintptr_t p = reinterpret_cast<uintptr_t>(workspace);  // integers: Bytes carves from 0
    auto take = [&](size_t bytes) {
      char* here = reinterpret_cast<char*>(p);
      p += Aligned(bytes);
      return here;
    };
    GroupArrays out;
    out.shapes = reinterpret_cast<GroupShape*>(take(g * sizeof(GroupShape)));
    out.a = reinterpret_cast<const typename C::ElementA**>(take(g * sizeof(void*)));
    out.b = reinterpret_cast<const typename C::ElementB**>(take(g * sizeof(void*)));
    out.d = reinterpret_cast<typename C::ElementD**>(take(g * sizeof(void*)));
    out.stride_a = reinterpret_cast<typename C::StrideA*>(take(g * sizeof(typename C::StrideA)));
    out.stride_b = reinterpret_cast<typename C::StrideB*>(take(g * sizeof(typename C::StrideB)));
    out.stride_d = reinterpret_cast<typename C::StrideD*>(take(g * sizeof(typename C::StrideD)));
    out.row_scale = nullptr;
    out.col_scale = nullptr;
    if constexpr (C::kFp8) {
      out.row_scale = reinterpret_cast<const float**>(take(g * sizeof(void*)));
      out.col_scale = reinterpret_cast<const float**>(take(g * sizeof(void*)));
    }
    out.cutlass_workspace = reinterpret_cast<void*>(p);
    return out;
  }
};

// The strides are the same for every group (only the row counts differ), so the host computes
// them once and the setup kernel copies them into each group's slot.
template <class C>
struct GroupStrides {
  typename C::StrideA a;
  typename C::StrideB b;
  typename C::StrideD d;

  static GroupStrides For(const GroupedGemmProblem& p) {
    GroupStrides s;
    if constexpr (C::kKind == GroupedGemmKind::kForward) {
      s.a = cutlass::make_cute_packed_stride(typename C::StrideA{}, cute::make_shape(1, p.k, 1));
      s.b = cutlass::make_cute_packed_stride(typename C::StrideB{}, cute::make_shape(p.n, p.k, 1));
      s.d = cutlass::make_cute_packed_stride(typename C::StrideD{}, cute::make_shape(1, p.n, 1));
    } else {  // Aᵀ [k, rows] M-major over x [m, k]; B dy [rows, n]; D [k, n]
      s.a = cutlass::make_cute_packed_stride(typename C::StrideA{}, cute::make_shape(p.k, 1, 1));
      s.b = cutlass::make_cute_packed_stride(typename C::StrideB{}, cute::make_shape(p.n, 1, 1));
      s.d = cutlass::make_cute_packed_stride(typename C::StrideD{}, cute::make_shape(p.k, p.n, 1));
    }
    return s;
  }
};

// One thread per group: its first row (the clamped sizes of the groups before it) and its
// CUTLASS arguments. An empty group gets a problem with no tiles. O(groups²) reads of a few
// hundred sizes at most, in one block: cheaper than a second launch for a scan.
template <class C>
__global__ void SetUpGroups(GroupedGemmProblem p, GroupArrays<C> arrays, GroupStrides<C> strides,
                            int* total_rows) {
  const auto* a = static_cast<const typename C::ElementA*>(p.a);
  const auto* b = static_cast<const typename C::ElementB*>(p.b);
  auto* d = static_cast<typename C::ElementD*>(p.d);
  for (int g = threadIdx.x; g < p.groups; g += blockDim.x) {
    int64_t start = 0;
    for (int j = 0; j < g; ++j) start += max(p.group_sizes[j], 0);
    start = min(start, static_cast<int64_t>(p.m));
    const int rows = static_cast<int>(
        min(static_cast<int64_t>(max(p.group_sizes[g], 0)), static_cast<int64_t>(p.m) - start));
    const int64_t group = g;
    if constexpr (C::kKind == GroupedGemmKind::kForward) {
      arrays.shapes[g] = GroupShape{rows, p.n, p.k};
      arrays.a[g] = a + start * p.k;
      arrays.b[g] = b + group * p.k * p.n;
      arrays.d[g] = d + start * p.n;
      if constexpr (C::kFp8) {
        arrays.row_scale[g] = p.row_scale + start;
        arrays.col_scale[g] = p.col_scale + group * p.n;
      }
    } else {
      arrays.shapes[g] = GroupShape{rows > 0 ? p.k : 0, p.n, rows};
      arrays.a[g] = a + start * p.k;
      arrays.b[g] = b + start * p.n;
      arrays.d[g] = d + group * p.k * p.n;
    }
    arrays.stride_a[g] = strides.a;
    arrays.stride_b[g] = strides.b;
    arrays.stride_d[g] = strides.d;
    if (g == p.groups - 1) *total_rows = static_cast<int>(start + rows);
  }
}

// kForward: zeroes D's rows from *total_rows on (ragged_dot's rows past the groups). Nearly
// every call has none, and then each block returns at once. (static: every instantiation's
// translation unit has its own copy of these two non-template kernels.)
static __global__ void ZeroRowsPast(uint4* d, const int* total_rows, int64_t m,
                                    int64_t row_words) {
  const int64_t end = m * row_words;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = *total_rows * row_words + blockIdx.x * blockDim.x + threadIdx.x; i < end;
       i += stride) {
    d[i] = uint4{0, 0, 0, 0};
  }
}

// kWeightGrad: zeroes D[g] of every group with no rows (its GEMM has no tiles). Block row g of
// the grid sweeps group g.
static __global__ void ZeroEmptyGroups(uint4* d, const GroupShape* shapes,
                                       int64_t group_words) {
  if (cute::get<0>(shapes[blockIdx.y]) != 0) return;
  uint4* group = d + blockIdx.y * group_words;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < group_words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    group[i] = uint4{0, 0, 0, 0};
  }
}

template <class C>
typename C::Gemm::Arguments MakeArguments(const GroupedGemmProblem& p,
                                          const GroupArrays<C>& arrays) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = p.device;
  hw.sm_count = SmCount(p.device);
  typename C::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {p.groups, arrays.shapes, nullptr},  // shapes on the device only: no host sync
      {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b},
      {{}, nullptr, arrays.stride_d, arrays.d, arrays.stride_d},
      hw};
  if constexpr (C::kFp8) {
    // Batch stride 0: each group's vector is its own pointer.
    typename C::RowScale::Arguments row{arrays.row_scale, 0.0f, {cute::_1{}, cute::_0{}, 0}};
    typename C::ColScale::Arguments col{arrays.col_scale, 0.0f, {cute::_0{}, cute::_1{}, 0}};
    args.epilogue.thread = {{{}, row, {}}, col, {}};
  } else {
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
  }
  return args;
}

constexpr int kSetupThreads = 256;
// The total row count's slot between the arrays and CUTLASS's workspace, whose tensor maps need
// 64-byte alignment.
constexpr size_t kTotalRowsBytes = 128;
constexpr int kZeroThreads = 256;

template <class C>
size_t WorkspaceBytes(const GroupedGemmProblem& p) {
  // CUTLASS's workspace depends on the SM count and the group count, not on the pointers.
  GroupArrays<C> placeholder = GroupArrays<C>::Carve(nullptr, p.groups);
  const size_t cutlass_bytes = C::Gemm::get_workspace_size(MakeArguments<C>(p, placeholder));
  return GroupArrays<C>::Bytes(p.groups) + kTotalRowsBytes + cutlass_bytes;
}

template <class C>
const char* Run(const GroupedGemmProblem& p, void* workspace, cudaStream_t stream) {
  if constexpr (C::kFp8) {
    if (p.row_scale == nullptr || p.col_scale == nullptr) {
      return "FP8 grouped GEMM without its row and column scales";
    }
    if (!p.b_kmajor) return "FP8 grouped GEMM needs B given [groups, n, k] (K-major)";
  }
  GroupArrays<C> arrays = GroupArrays<C>::Carve(workspace, p.groups);
  int* total_rows = reinterpret_cast<int*>(arrays.cutlass_workspace);
  arrays.cutlass_workspace = static_cast<char*>(arrays.cutlass_workspace) + kTotalRowsBytes;

  SetUpGroups<C><<<1, kSetupThreads, 0, stream>>>(p, arrays, GroupStrides<C>::For(p),
                                                  total_rows);
  const int sms = std::max(SmCount(p.device), 1);
  constexpr int64_t kElementsPerWord = 16 / sizeof(typename C::ElementD);
  if constexpr (C::kKind == GroupedGemmKind::kForward) {
    ZeroRowsPast<<<sms, kZeroThreads, 0, stream>>>(static_cast<uint4*>(p.d), total_rows, p.m,
                                                   p.n / kElementsPerWord);
  } else {
    const int64_t group_words = static_cast<int64_t>(p.k) * p.n / kElementsPerWord;
    const int64_t blocks = std::min<int64_t>((group_words + kZeroThreads - 1) / kZeroThreads, 64);
    ZeroEmptyGroups<<<dim3(static_cast<unsigned>(std::max<int64_t>(blocks, 1)), p.groups),
                      kZeroThreads, 0, stream>>>(static_cast<uint4*>(p.d), arrays.shapes,
                                                 group_words);
  }
  if (cudaGetLastError() != cudaSuccess) return "grouped GEMM setup kernel launch failed";

  typename C::Gemm gemm;
  const auto args = MakeArguments<C>(p, arrays);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    return "CUTLASS cannot implement this grouped problem (K and N must be multiples of 8)";
  }
  if (gemm.initialize(args, arrays.cutlass_workspace, stream) != cutlass::Status::kSuccess) {
    return "CUTLASS grouped GEMM initialize failed";
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) return "CUTLASS grouped GEMM launch failed";
  return nullptr;
}

}  // namespace jaxflux::grouped_gemm_sm90

// Defines the entry points of the FP8 forward (e4m3, B K-major) with one tile config; NAME is
// e4m3_kmajor_<tiles>.
#define JAXFLUX_GROUPED_GEMM_FP8_INSTANCE(NAME, TILES)                                      \
  namespace jaxflux {                                                                       \
  size_t GroupedGemmWorkspaceBytes_##NAME(const GroupedGemmProblem& problem) {              \
    using C = grouped_gemm_sm90::Fp8Config<grouped_gemm_sm90::TILES>;                       \
    return grouped_gemm_sm90::WorkspaceBytes<C>(problem);                                   \
  }                                                                                         \
  const char* GroupedGemmRun_##NAME(const GroupedGemmProblem& problem, void* workspace,     \
                                    cudaStream_t stream) {                                  \
    using C = grouped_gemm_sm90::Fp8Config<grouped_gemm_sm90::TILES>;                       \
    return grouped_gemm_sm90::Run<C>(problem, workspace, stream);                           \
  }                                                                                         \
  }  // namespace jaxflux

// Defines the entry points of one (element type, operand layouts, tile config); NAME is
// <dtype>_<layouts>_<tiles>, listed in grouped_gemm_sm90_dispatch.cu.
#define JAXFLUX_GROUPED_GEMM_INSTANCE(NAME, ELEMENT, OPERANDS, TILES)                       \
  namespace jaxflux {                                                                       \
  size_t GroupedGemmWorkspaceBytes_##NAME(const GroupedGemmProblem& problem) {              \
    using C = grouped_gemm_sm90::Config<ELEMENT, grouped_gemm_sm90::OPERANDS,               \
                                        grouped_gemm_sm90::TILES>;                          \
    return grouped_gemm_sm90::WorkspaceBytes<C>(problem);                                   \
  }                                                                                         \
  const char* GroupedGemmRun_##NAME(const GroupedGemmProblem& problem, void* workspace,     \
                                    cudaStream_t stream) {                                  \
    using C = grouped_gemm_sm90::Config<ELEMENT, grouped_gemm_sm90::OPERANDS,               \
                                        grouped_gemm_sm90::TILES>;                          \
    return grouped_gemm_sm90::Run<C>(problem, workspace, stream);                           \
  }                                                                                         \
  }  // namespace jaxflux
