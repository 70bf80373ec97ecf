// D[..., M, N] = A[..., M, K] · B[K, N] with the sm90 CUTLASS GEMM (xla_ffi/kernels/gemm_sm90.h),
// and the fused kernels' GEMMs with communication off (GEMM-only modes, measurement).
// Leading axes of A fold into M (row-major, so they are contiguous).
#include "xla_ffi/ffi/gemm.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi/gemm_wait.h"
#include "xla_ffi/ffi/push_plan.h"
#include "xla_ffi/kernels/ag_gemm_sm90.h"
#include "xla_ffi/kernels/gemm_sm90.h"
#include "xla_ffi/kernels/rs_gemm_sm90.h"

namespace ffi = xla::ffi;

namespace jaxflux {
namespace {

// tile_order 0: CUTLASS's persistent scheduler; 1: the fused AllGather+GEMM kernel itself with
// its flag waits off (same tile order and rasterization); 2: the fused GEMM+ReduceScatter's GEMMs
// with no pushes or reduction: `owners` launches, one per owner's block of M / owners rows of
// every batch entry, the launches gemm_rs.cc makes (order aside). Modes 1 and 2 measure what
// fusion costs the GEMM.
constexpr int64_t kTileOrderCutlass = 0, kTileOrderAllGather = 1, kTileOrderPerOwner = 2;

// The GEMM's operands: a [..., M, K] and b [K, N] (or [N, K] with b_kmajor; leading axes of a
// fold into M), d [..., M, N], one dtype, bf16 or fp16. Sets m, n, k; *done when there is
// nothing to compute (an empty output, or K = 0, where d is zeroed on `stream`).
ffi::Error CheckOperands(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                         ffi::Result<ffi::AnyBuffer>& d, bool b_kmajor, int64_t* m, int64_t* n,
                         int64_t* k, bool* done) {
  *done = false;
  const auto dtype = a.element_type();
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument("jaxflux gemm: inputs must be bfloat16 or float16");
  }
  if (b.element_type() != dtype || d->element_type() != dtype) {
    return ffi::Error::InvalidArgument("jaxflux gemm: a, b and the output need one dtype");
  }
  const auto a_dims = a.dimensions();
  const auto b_dims = b.dimensions();
  const int k_axis = b_kmajor ? 1 : 0;
  if (a_dims.size() < 2 || b_dims.size() != 2 || a_dims.back() != b_dims[k_axis]) {
    return ffi::Error::InvalidArgument(b_kmajor
                                           ? "jaxflux gemm: expected a [..., M, K] and b [N, K]"
                                           : "jaxflux gemm: expected a [..., M, K] and b [K, N]");
  }
  *k = b_dims[k_axis];
  *n = b_dims[1 - k_axis];
  *m = *k == 0 ? 0 : static_cast<int64_t>(a.element_count()) / *k;
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  if (*m > kIntMax || *n > kIntMax || *k > kIntMax) {
    return ffi::Error::InvalidArgument("jaxflux gemm: a dimension exceeds 2^31-1");
  }
  if (*k % 8 || *n % 8) {
    return ffi::Error::InvalidArgument("jaxflux gemm: K and N must be multiples of 8 (16-byte "
                                       "rows for TMA); got K=" + std::to_string(*k) +
                                       ", N=" + std::to_string(*n));
  }
  if (*m == 0 || *n == 0) {
    *done = true;
  } else if (*k == 0) {  // empty contraction: D = 0
    *done = true;
    if (cudaError_t err = cudaMemsetAsync(d->untyped_data(), 0, d->size_bytes(), stream);
        err != cudaSuccess) {
      return ffi::Error::Internal(std::string("jaxflux gemm: cudaMemsetAsync failed: ") +
                                  cudaGetErrorString(err));
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckLaunch(const char* failure) {
  if (failure != nullptr) {
    return ffi::Error::Internal(std::string("jaxflux gemm: ") + failure);
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jaxflux gemm: kernel launch failed: ") +
                                cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// `bytes` of CUTLASS workspace from XLA's scratch allocator (none for 0) into *workspace.
ffi::Error AllocateWorkspace(ffi::ScratchAllocator& scratch, size_t bytes, void** workspace) {
  *workspace = nullptr;
  if (bytes == 0) return ffi::Error::Success();
  auto allocation = scratch.Allocate(bytes, 256);
  if (!allocation.has_value()) {
    return ffi::Error::Internal("jaxflux gemm: could not allocate " + std::to_string(bytes) +
                               " bytes of scratch");
  }
  *workspace = *allocation;
  return ffi::Error::Success();
}

ffi::Error GemmExecute(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                       ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> d,
                       int64_t tile_order, int64_t config, int64_t owners) {
  int64_t m = 0, n = 0, k = 0;
  bool done = false;
  if (ffi::Error e = CheckOperands(stream, a, b, d, false, &m, &n, &k, &done);
      e.failure() || done) {
    return e;
  }
  const auto dtype = a.element_type();
  const auto a_dims = a.dimensions();
  if (tile_order < kTileOrderCutlass || tile_order > kTileOrderPerOwner) {
    return ffi::Error::InvalidArgument("jaxflux gemm: unknown tile_order " +
                                       std::to_string(tile_order));
  }
  const int64_t rows = a_dims[a_dims.size() - 2];  // M of one batch entry
  if (tile_order == kTileOrderPerOwner && (owners < 1 || rows % owners)) {
    return ffi::Error::InvalidArgument("jaxflux gemm: owners=" + std::to_string(owners) +
                                       " must be >= 1 and divide M=" + std::to_string(rows));
  }
  const GemmDtype which = dtype == ffi::DataType::BF16 ? GemmDtype::kBF16 : GemmDtype::kF16;
  GemmProblem problem{a.untyped_data(), b.untyped_data(), d->untyped_data(),
                      static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), device};
  AgGemmProblem fused{};  // tile_order 1: one shard (no rotation), waits off
  fused.gemm = problem;
  fused.wait_for_flags = 0;
  if (config >= kAgGemmNumConfigs) {
    return ffi::Error::InvalidArgument("jaxflux gemm: config must be -1 (choose) or 0.." +
                                       std::to_string(kAgGemmNumConfigs - 1));
  }
  fused.config = config >= 0 ? static_cast<AgGemmConfig>(config) : ChooseAgGemmConfig(problem);
  fused.wait.tp = 1;
  fused.wait.rows_per_shard = static_cast<int>(m);
  fused.wait.chunk_ends[0] = static_cast<int>(m);  // one chunk (no waits anyway)
  if (tile_order == kTileOrderPerOwner) {  // one owner's rows of every batch entry
    problem.m = static_cast<int>(rows / owners);
    problem.batch = static_cast<int>(m / rows);
    problem.batch_stride_a = rows * k;
    problem.batch_stride_d = rows * n;
  }
  const size_t bytes = tile_order == kTileOrderAllGather
                           ? AgGemmSm90WorkspaceBytes(which, fused)
                           : GemmSm90WorkspaceBytes(which, problem);
  void* workspace = nullptr;
  if (ffi::Error e = AllocateWorkspace(scratch, bytes, &workspace); e.failure()) return e;
  const char* failure = nullptr;
  if (tile_order == kTileOrderAllGather) {
    failure = AgGemmSm90(which, fused, workspace, stream);
  } else if (tile_order == kTileOrderCutlass) {
    failure = GemmSm90(which, problem, workspace, stream);
  } else {
    const size_t elem = ffi::ByteWidth(dtype);
    const char* a_base = static_cast<const char*>(a.untyped_data());
    char* d_base = static_cast<char*>(d->untyped_data());
    for (int64_t o = 0; o < owners && failure == nullptr; ++o) {
      problem.a = a_base + static_cast<size_t>(o * problem.m * k) * elem;
      problem.d = d_base + static_cast<size_t>(o * problem.m * n) * elem;
      failure = GemmSm90(which, problem, workspace, stream);
    }
  }
  return CheckLaunch(failure);
}

// The fused GEMM+ReduceScatter's own-rows kernel (rs_gemm_sm90.h) alone, communication off:
// D = A·B + C with no peer and no waits, or D = A·B with with_c = 0 (beta 0: c is not read and
// may be any array). with_c = 1 against 0 is what reading the peer's partial as C costs that
// GEMM, apart from the pushes that run beside it in the fused op; chunked = 1 sweeps the tiles
// along N as the fused op does when the partial lands in row chunks (PlanEvenChunks);
// cutlass_scheduler = 1 runs the same GEMM and epilogue under CUTLASS's own scheduler instead;
// pingpong = 1 the ping-pong 128x128 tiles instead of cooperative 128x256 (RsGemmProblem);
// transpose_w = 1 takes b as [N, K] and reads it K-major, as the fused op does for the backward
// of a column-parallel layer (fused scheduler only: RsGemmSm90 reports the other).
ffi::Error GemmOwnRowsExecute(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                              ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer c,
                              ffi::Result<ffi::AnyBuffer> d, int64_t with_c, int64_t chunked,
                              int64_t cutlass_scheduler, int64_t pingpong, int64_t transpose_w) {
  int64_t m = 0, n = 0, k = 0;
  bool done = false;
  if (ffi::Error e = CheckOperands(stream, a, b, d, transpose_w != 0, &m, &n, &k, &done);
      e.failure() || done) {
    return e;
  }
  if (with_c != 0 &&
      (c.element_type() != d->element_type() || c.element_count() != d->element_count())) {
    return ffi::Error::InvalidArgument("jaxflux gemm own rows: c must be laid out like the "
                                       "output [..., M, N], in its dtype");
  }
  const GemmDtype which =
      a.element_type() == ffi::DataType::BF16 ? GemmDtype::kBF16 : GemmDtype::kF16;
  RsGemmProblem own{};
  own.gemm = GemmProblem{a.untyped_data(), b.untyped_data(), d->untyped_data(),
                         static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), device};
  own.gemm.b_kmajor = transpose_w != 0;
  own.c = with_c != 0 ? c.untyped_data() : nullptr;
  own.wait_for_flags = 0;
  own.cutlass_scheduler = cutlass_scheduler != 0 ? 1 : 0;
  own.pingpong = pingpong != 0 ? 1 : 0;
  own.wait.tp = 1;
  own.wait.rows_per_shard = static_cast<int>(m);
  own.wait.chunk_ends[0] = static_cast<int>(m);  // one chunk: CUTLASS's tile order
  if (chunked != 0) {
    const PushChunks chunks = PlanEvenChunks(static_cast<size_t>(m));
    SetChunkEnds(&own.wait, chunks.ends, chunks.count);
  }
  void* workspace = nullptr;
  if (ffi::Error e = AllocateWorkspace(scratch, RsGemmSm90WorkspaceBytes(which, own), &workspace);
      e.failure()) {
    return e;
  }
  return CheckLaunch(RsGemmSm90(which, own, workspace, stream));
}

}  // namespace
}  // namespace jaxflux

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfluxGemm, jaxflux::GemmExecute,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this device
        .Ctx<xla::ffi::DeviceOrdinal>()                 // CUDA ordinal (SM count for the grid)
        .Ctx<xla::ffi::ScratchAllocator>()              // CUTLASS workspace, if any
        .Arg<xla::ffi::AnyBuffer>()                     // a: [..., M, K]
        .Arg<xla::ffi::AnyBuffer>()                     // b: [K, N]
        .Ret<xla::ffi::AnyBuffer>()                     // d: [..., M, N]
        .Attr<int64_t>("tile_order")                    // 0 CUTLASS's, 1 AG+GEMM's, 2 owners
        .Attr<int64_t>("config")                        // tile_order 1: AgGemmConfig or -1
        .Attr<int64_t>("owners"));                      // tile_order 2: row blocks (tp)

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfluxGemmOwnRows, jaxflux::GemmOwnRowsExecute,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this device
        .Ctx<xla::ffi::DeviceOrdinal>()                 // CUDA ordinal
        .Ctx<xla::ffi::ScratchAllocator>()              // CUTLASS workspace, if any
        .Arg<xla::ffi::AnyBuffer>()                     // a: [..., M, K]
        .Arg<xla::ffi::AnyBuffer>()                     // b: [K, N] ([N, K]: transpose_w)
        .Arg<xla::ffi::AnyBuffer>()                     // c: [..., M, N] (with_c = 1)
        .Ret<xla::ffi::AnyBuffer>()                     // d: [..., M, N]
        .Attr<int64_t>("with_c")                        // 1: D = A·B + C; 0: D = A·B
        .Attr<int64_t>("chunked")                       // 1: tiles along N, as for chunks
        .Attr<int64_t>("cutlass_scheduler")             // 1: CUTLASS's scheduler (probe)
        .Attr<int64_t>("pingpong")                      // 1: ping-pong 128x128 tiles
        .Attr<int64_t>("transpose_w"));                 // 1: b is [N, K], read K-major
