// jaxflux_gemm: the GEMMs of the fused ops with communication off, D[..., M, N] = A[..., M, K] ·
// B[K, N] (B [N, K] with transpose_w; leading axes of A fold into M). The dense ops run it at
// tp=1, and the benchmark times it against XLA's dot (cuBLAS) to see what fusion costs a GEMM.
//   kernel 0: CUTLASS's GEMM (GEMM+ReduceScatter's peer rows, GEMM+AllReduce): `tile` a
//             GemmTiles (0 persistent 128x256, 1 stream-K 128x128, 2 the swap-AB decode GEMM);
//   kernel 1: the AllGather+GEMM kernel with its waits off (one shard, no rotation);
//   kernel 2: GEMM+ReduceScatter's own-rows kernel with its waits off, D = A·B + C.
// The kernel's choices (tile, schedule, swizzle, grid) come as attributes, chosen by
// jaxflux/tuning as for the fused ops. FP8 (a e4m3/e5m2, b e4m3 given [N, K], d bf16) takes two
// more operands, a's row scales and b's column scales, applied in the epilogue; kernel 0 then
// accumulates as `fast_accum` says, the fused kernels as they are built (kFp8FastAccum).
//
// The CUTLASS workspace is the call's second result, sized at trace time by
// GemmWorkspaceBytes (the module's gemm_workspace_bytes), so execute allocates nothing, reads
// nothing back and launches the same work for the same buffers (capturable; not declared so,
// see the handler's definition).
#include "xla_ffi/ffi/gemm.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi/errors.h"
#include "xla_ffi/ffi/host_executions.h"
#include "xla_ffi/ffi/matmul_operands.h"
#include "xla_ffi/ffi/push_plan.h"
#include "xla_ffi/ffi/scratch.h"
#include "xla_ffi/ffi/tile_wait_setup.h"
#include "xla_ffi/kernels/ag_gemm_sm90.h"
#include "xla_ffi/kernels/gemm_sm90.h"
#include "xla_ffi/kernels/rs_gemm_sm90.h"

namespace ffi = xla::ffi;

namespace jaxflux {
namespace {

constexpr char kOp[] = "gemm";

enum Kernel : int64_t { kCutlass = 0, kAllGatherMatmul = 1, kOwnRows = 2 };

// The GEMM's operands: a [..., M, K] and b [K, N] (or [N, K] with b_kmajor; leading axes of a
// fold into M), d [..., M, N], one 16-bit dtype, or FP8 (OperandTypes). Sets the kind, m, n, k;
// *done when there is nothing to compute (an empty output, or K = 0, where d is zeroed on
// `stream`).
ffi::Error CheckOperands(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                         ffi::Result<ffi::AnyBuffer>& d, bool b_kmajor, GemmDtype* dtype,
                         int64_t* m, int64_t* n, int64_t* k, bool* done) {
  *done = false;
  size_t elem = 0, out_elem = 0;
  const std::string types = OperandTypes(a, b, *d, b_kmajor, dtype, &elem, &out_elem);
  if (!types.empty()) return ffi::Error::InvalidArgument("jaxflux gemm: " + types);
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
  const int64_t align = 16 / static_cast<int64_t>(elem);  // 16-byte rows for TMA
  if (*k % align || *n % align) {
    return ffi::Error::InvalidArgument("jaxflux gemm: K and N must be multiples of " +
                                       std::to_string(align) + " (16-byte rows for TMA); got K=" +
                                       std::to_string(*k) + ", N=" + std::to_string(*n));
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

ffi::Error CheckChoices(const GemmChoice& c) {
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "fast_accum", c.fast_accum, {0, 1}));
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "kernel", c.kernel, {kCutlass, kAllGatherMatmul,
                                                                kOwnRows}));
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "transpose_w", c.transpose_w, {0, 1}));
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "tile", c.tile, {0, 1, 2}));
  if (c.kernel != kCutlass && c.tile >= kAgGemmNumConfigs) {
    return InvalidAttr(kOp, "tile", c.tile, "kernels 1 and 2 take 0 or 1");
  }
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "own_rows_schedule", c.own_rows_schedule, {0, 1}));
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "push_chunks", c.push_chunks, {0, 1}));
  JAXFLUX_RETURN_IF_ERROR(CheckSwizzle(kOp, "swizzle", c.swizzle));
  return CheckGridSms(kOp, c.grid_sms);
}

// The kernel launch of one call, its pointers null until the handler fills them: what the
// workspace size and the launch are both computed from.
struct GemmLaunch {
  int64_t kernel = kCutlass;
  GemmDtype dtype = GemmDtype::kBF16;
  GemmProblem problem{};  // kernel 0
  AgGemmProblem fused{};  // kernel 1
  RsGemmProblem own{};    // kernel 2
};

ffi::Error Describe(GemmDtype dtype, int64_t m, int64_t n, int64_t k, const GemmChoice& choice,
                    int32_t device, GemmLaunch* launch) {
  JAXFLUX_RETURN_IF_ERROR(CheckChoices(choice));
  launch->kernel = choice.kernel;
  launch->dtype = dtype;
  GemmProblem problem{nullptr, nullptr, nullptr, static_cast<int>(m), static_cast<int>(n),
                      static_cast<int>(k), device};
  problem.b_kmajor = choice.transpose_w == 1;
  problem.swizzle = static_cast<int>(choice.swizzle);
  problem.grid_sms = static_cast<int>(choice.grid_sms);
  problem.batch_stride_row_scale = m;
  problem.fast_accum = choice.fast_accum == 1;
  problem.tiles = static_cast<GemmTiles>(choice.kernel == kCutlass ? choice.tile : 0);
  launch->problem = problem;
  if (choice.kernel == kAllGatherMatmul) {  // one shard (no rotation), waits off
    AgGemmProblem& fused = launch->fused;
    fused.gemm = problem;
    fused.wait_for_flags = 0;
    fused.config = static_cast<AgGemmConfig>(choice.tile);
    fused.wait.tp = 1;
    fused.wait.rows_per_shard = static_cast<int>(m);
    fused.wait.chunk_ends[0] = static_cast<int>(m);  // one chunk (no waits anyway)
  } else if (choice.kernel == kOwnRows) {  // D = A·B + C, no peer and no waits
    RsGemmProblem& own = launch->own;
    own.gemm = problem;
    own.wait_for_flags = 0;
    own.pingpong = choice.own_rows_schedule == 1 ? 1 : 0;
    own.wait.tp = 1;
    own.wait.rows_per_shard = static_cast<int>(m);
    own.wait.chunk_ends[0] = static_cast<int>(m);  // one chunk: CUTLASS's tile order
    if (choice.push_chunks == 1) {  // the tiles swept along N, as when the partial lands in chunks
      const PushChunks chunks = PlanEvenChunks(static_cast<size_t>(m));
      SetChunkEnds(&own.wait, chunks.ends, chunks.count);
    }
  }
  return ffi::Error::Success();
}

size_t LaunchWorkspaceBytes(const GemmLaunch& launch) {
  switch (launch.kernel) {
    case kAllGatherMatmul: return AgGemmSm90WorkspaceBytes(launch.dtype, launch.fused);
    case kOwnRows: return RsGemmSm90WorkspaceBytes(launch.dtype, launch.own);
    default: return GemmSm90WorkspaceBytes(launch.dtype, launch.problem);
  }
}

ffi::Error GemmExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                       ffi::AnyBuffer c, ffi::RemainingArgs scales, ffi::Result<ffi::AnyBuffer> d,
                       ffi::Result<ffi::AnyBuffer> workspace, int64_t kernel,
                       int64_t transpose_w, int64_t tile, int64_t own_rows_schedule,
                       int64_t push_chunks, int64_t swizzle, int64_t grid_sms,
                       int64_t fast_accum) {
  CountHostExecution(CountedTarget::kGemm);
  const GemmChoice choice{kernel, transpose_w, tile, own_rows_schedule,
                          push_chunks, swizzle, grid_sms, fast_accum};
  int64_t m = 0, n = 0, k = 0;
  GemmDtype dtype = GemmDtype::kBF16;
  bool done = false;
  if (ffi::Error e = CheckOperands(stream, a, b, d, transpose_w == 1, &dtype, &m, &n, &k, &done);
      e.failure() || done) {
    return e;
  }
  const float* row_scale = nullptr;
  const float* col_scale = nullptr;
  JAXFLUX_RETURN_IF_ERROR(Fp8Scales(kOp, dtype, scales, static_cast<size_t>(m),
                                    static_cast<size_t>(n), &row_scale, &col_scale));
  if (kernel == kOwnRows &&
      (c.element_type() != d->element_type() || c.element_count() != d->element_count())) {
    return ffi::Error::InvalidArgument("jaxflux gemm: kernel 2 needs c laid out like the output "
                                       "[..., M, N], in its dtype");
  }
  GemmLaunch launch;
  JAXFLUX_RETURN_IF_ERROR(Describe(dtype, m, n, k, choice, device, &launch));
  void* space = nullptr;
  JAXFLUX_RETURN_IF_ERROR(
      WorkspaceFromResult(kOp, *workspace, LaunchWorkspaceBytes(launch), &space));
  for (GemmProblem* p : {&launch.problem, &launch.fused.gemm, &launch.own.gemm}) {
    p->a = a.untyped_data();
    p->b = b.untyped_data();
    p->d = d->untyped_data();
    p->row_scale = row_scale;
    p->col_scale = col_scale;
  }
  launch.own.c = c.untyped_data();
  const char* failure = nullptr;
  switch (kernel) {
    case kAllGatherMatmul: failure = AgGemmSm90(dtype, launch.fused, space, stream); break;
    case kOwnRows: failure = RsGemmSm90(dtype, launch.own, space, stream); break;
    default: failure = GemmSm90(dtype, launch.problem, space, stream);
  }
  return CheckLaunch(failure);
}

}  // namespace

std::optional<size_t> GemmWorkspaceBytes(GemmDtype dtype, int64_t m, int64_t n, int64_t k,
                                         const GemmChoice& choice, int32_t device,
                                         std::string* error) {
  if (m <= 0 || n <= 0 || k <= 0) return 0;  // nothing launched
  GemmLaunch launch;
  if (ffi::Error e = Describe(dtype, m, n, k, choice, device, &launch); e.failure()) {
    *error = e.message();
    return std::nullopt;
  }
  return LaunchWorkspaceBytes(launch);
}

}  // namespace jaxflux

// Not declared kCmdBufferCompatible, though execute could be captured: in a decode loop the
// buffers move every step, XLA records the graph again each time, and batch-1 generation on one
// H100 decoded 1.15x slower with the declaration (docs/design.md, "Command buffers").
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfluxGemm, jaxflux::GemmExecute,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this device
        .Ctx<xla::ffi::DeviceOrdinal>()                 // CUDA ordinal (SM count for the grid)
        .Arg<xla::ffi::AnyBuffer>()                     // a: [..., M, K]
        .Arg<xla::ffi::AnyBuffer>()                     // b: [K, N] ([N, K]: transpose_w)
        .Arg<xla::ffi::AnyBuffer>()                     // c: [..., M, N] (kernel 2), else unused
        .RemainingArgs()                                // FP8: a's row and b's column scales
        .Ret<xla::ffi::AnyBuffer>()                     // d: [..., M, N]
        .Ret<xla::ffi::AnyBuffer>()                     // workspace: u8, GemmWorkspaceBytes
        .Attr<int64_t>("kernel")                        // 0 CUTLASS, 1 AG+GEMM, 2 own rows
        .Attr<int64_t>("transpose_w")                   // 1: b is [N, K], read K-major
        .Attr<int64_t>("tile")                          // 0: GemmTiles; 1: AgGemmConfig
        .Attr<int64_t>("own_rows_schedule")             // kernel 2: 0 cooperative, 1 ping-pong
        .Attr<int64_t>("push_chunks")                   // kernel 2: 1 tiles along N, as chunked
        .Attr<int64_t>("swizzle")                       // 1, 2, 4 or 8
        .Attr<int64_t>("grid_sms")                      // 0: all SMs
        .Attr<int64_t>("fast_accum"));                  // FP8, kernel 0: 1 fast accumulation
