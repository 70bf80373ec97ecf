// jaxflux_grouped_gemm: the grouped GEMM of jaxflux.grouped_matmul (grouped_gemm_sm90.h), one
// 16-bit dtype throughout, group sizes read on the device.
//   kind 0 (forward):     d [m, n], d[rows of g] = a[rows of g] · b[g], b [G, k, n] ([G, n, k]
//                         with transpose_w); rows past sum(group_sizes) are zeros.
//   kind 1 (weight grad): d [G, k, n], d[g] = a[rows of g]ᵀ · b[rows of g], b [m, n]; an empty
//                         group's d[g] is zeros.
//   FP8 (kind 0, a and b e4m3, b [G, n, k] with transpose_w): two more operands, row_scale [m]
//                         and col_scale [G, n] (float32); d bf16, d[i] = (a[i] · b[g]ᵀ) ·
//                         row_scale[i] · col_scale[g] in fp32, rounded once.
// `tile` is a GroupedGemmTiles, chosen by jaxflux/tuning. The workspace (per-group arguments
// and tensor maps, written on the device) is the call's second result, sized at trace time by
// GroupedGemmWorkspaceBytes: execute allocates nothing and never reads the sizes back.
#include "xla_ffi/ffi/grouped_gemm.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi/attribute_names.h"
#include "xla_ffi/ffi/errors.h"
#include "xla_ffi/ffi/host_executions.h"
#include "xla_ffi/ffi/scratch.h"
#include "xla_ffi/kernels/grouped_gemm_sm90.h"

namespace ffi = xla::ffi;

namespace jaxflux {

static_assert(kGroupedGemmTilesNames.size() == kGroupedGemmNumTiles,
              "attribute_names.h names every GroupedGemmTiles");

namespace {

constexpr char kOp[] = "grouped_gemm";

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("jaxflux ") + kOp + ": " + what);
}

std::string Dims(ffi::AnyBuffer::Dimensions dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

// Shapes and dtypes of the operands of `kind`; fills the problem's m, n, k and groups.
ffi::Error CheckOperands(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::S32> group_sizes,
                         ffi::Result<ffi::AnyBuffer>& d, GroupedGemmKind kind,
                         bool b_kmajor, GemmDtype* dtype, GroupedGemmProblem* p) {
  const auto dt = a.element_type();
  if (dt == ffi::DataType::F8E4M3FN) {
    if (b.element_type() != dt || d->element_type() != ffi::DataType::BF16) {
      return Invalid("FP8: a and b must be float8_e4m3fn and the output bfloat16");
    }
    if (kind != GroupedGemmKind::kForward || !b_kmajor) {
      return Invalid("FP8 runs the forward (kind 0) with b given [G, n, k] (transpose_w=1)");
    }
    *dtype = GemmDtype::kE4M3;
  } else if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16) {
    return Invalid("a must be bfloat16, float16 or float8_e4m3fn");
  } else if (b.element_type() != dt || d->element_type() != dt) {
    return Invalid("a, b and the output need one dtype");
  } else {
    *dtype = dt == ffi::DataType::BF16 ? GemmDtype::kBF16 : GemmDtype::kF16;
  }
  const auto a_dims = a.dimensions(), b_dims = b.dimensions(), d_dims = d->dimensions();
  const auto g_dims = group_sizes.dimensions();
  if (g_dims.size() != 1) return Invalid("group_sizes must be [G]");
  const int64_t groups = g_dims[0];
  if (a_dims.size() != 2) return Invalid("a must be [m, k]; got " + Dims(a_dims));
  const int64_t m = a_dims[0], k = a_dims[1];
  int64_t n = 0;
  if (kind == GroupedGemmKind::kForward) {
    if (b_dims.size() != 3 || b_dims[0] != groups || b_dims[b_kmajor ? 2 : 1] != k) {
      return Invalid(std::string("b must be ") + (b_kmajor ? "[G, n, k]" : "[G, k, n]") +
                     " with G=" + std::to_string(groups) + ", k=" + std::to_string(k) +
                     "; got " + Dims(b_dims));
    }
    n = b_dims[b_kmajor ? 1 : 2];
    if (d_dims.size() != 2 || d_dims[0] != m || d_dims[1] != n) {
      return Invalid("the output must be [m, n]; got " + Dims(d_dims));
    }
  } else {
    if (b_kmajor) return Invalid("transpose_w applies to the forward (kind 0) only");
    if (b_dims.size() != 2 || b_dims[0] != m) {
      return Invalid("b must be [m, n] with m=" + std::to_string(m) + "; got " + Dims(b_dims));
    }
    n = b_dims[1];
    if (d_dims.size() != 3 || d_dims[0] != groups || d_dims[1] != k || d_dims[2] != n) {
      return Invalid("the output must be [G, k, n]; got " + Dims(d_dims));
    }
  }
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  if (m > kIntMax || n > kIntMax || k > kIntMax || groups > kIntMax) {
    return Invalid("a dimension exceeds 2^31-1");
  }
  if (k % 8 || n % 8) {  // 16-byte rows for TMA
    return Invalid("k and n must be multiples of 8 (16-byte rows for TMA); got k=" +
                   std::to_string(k) + ", n=" + std::to_string(n));
  }
  if (*dtype == GemmDtype::kE4M3 && k % 16) {  // one-byte elements
    return Invalid("FP8: k must be a multiple of 16 (16-byte rows for TMA); got k=" +
                   std::to_string(k));
  }
  p->m = static_cast<int>(m);
  p->n = static_cast<int>(n);
  p->k = static_cast<int>(k);
  p->groups = static_cast<int>(groups);
  return ffi::Error::Success();
}

// True when the kernels have nothing to compute: an empty output, or one that is all zeros (no
// groups, no rows, or an empty contraction), which is then cleared on `stream`.
ffi::Error ZeroOnly(cudaStream_t stream, const GroupedGemmProblem& p,
                    ffi::Result<ffi::AnyBuffer>& d, bool* done) {
  const bool forward = p.kind == GroupedGemmKind::kForward;
  const int64_t contraction = forward ? p.k : p.m;
  *done = d->element_count() == 0 || p.groups == 0 || contraction == 0 || p.m == 0;
  if (*done && d->size_bytes() > 0) {
    if (cudaError_t err = cudaMemsetAsync(d->untyped_data(), 0, d->size_bytes(), stream);
        err != cudaSuccess) {
      return CudaOpError(kOp, "cudaMemsetAsync", err);
    }
  }
  return ffi::Error::Success();
}

// FP8's scales: row_scale [m] and col_scale [groups, n], float32; none for 16-bit types.
ffi::Error ReadScales(ffi::RemainingArgs scales, GemmDtype dtype, GroupedGemmProblem* p) {
  const bool fp8 = dtype == GemmDtype::kE4M3;
  if (scales.size() != (fp8 ? 2u : 0u)) {
    return Invalid(fp8 ? "FP8 takes two scale operands, row_scale [m] and col_scale [G, n]"
                       : "scale operands apply to FP8 operands only");
  }
  if (!fp8) return ffi::Error::Success();
  auto row = scales.get<ffi::AnyBuffer>(0);
  auto col = scales.get<ffi::AnyBuffer>(1);
  if (row.has_error() || col.has_error()) return Invalid("could not read the scale operands");
  if (row->element_type() != ffi::DataType::F32 || col->element_type() != ffi::DataType::F32 ||
      row->element_count() != static_cast<size_t>(p->m) ||
      col->element_count() != static_cast<size_t>(p->groups) * p->n) {
    return Invalid("FP8 scales must be float32 row_scale [m] = [" + std::to_string(p->m) +
                   "] and col_scale [G, n] = [" + std::to_string(p->groups) + ", " +
                   std::to_string(p->n) + "]");
  }
  p->row_scale = static_cast<const float*>(row->untyped_data());
  p->col_scale = static_cast<const float*>(col->untyped_data());
  return ffi::Error::Success();
}

ffi::Error Describe(int64_t kind, int64_t transpose_w, int64_t tile, int32_t device,
                    GroupedGemmProblem* problem) {
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "kind", kind, {0, 1}));
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "transpose_w", transpose_w, {0, 1}));
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "tile", tile, {0, 1}));
  problem->kind = static_cast<GroupedGemmKind>(kind);
  problem->b_kmajor = transpose_w == 1;
  problem->tiles = static_cast<GroupedGemmTiles>(tile);
  problem->device = device;
  return ffi::Error::Success();
}

ffi::Error GroupedGemmExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer a,
                              ffi::AnyBuffer b, ffi::Buffer<ffi::S32> group_sizes,
                              ffi::RemainingArgs scales, ffi::Result<ffi::AnyBuffer> d,
                              ffi::Result<ffi::AnyBuffer> workspace, int64_t kind,
                              int64_t transpose_w, int64_t tile) {
  CountHostExecution(CountedTarget::kGroupedGemm);
  GroupedGemmProblem problem{};
  JAXFLUX_RETURN_IF_ERROR(Describe(kind, transpose_w, tile, device, &problem));
  GemmDtype dtype = GemmDtype::kBF16;
  JAXFLUX_RETURN_IF_ERROR(CheckOperands(a, b, group_sizes, d, problem.kind, problem.b_kmajor,
                                        &dtype, &problem));
  JAXFLUX_RETURN_IF_ERROR(ReadScales(scales, dtype, &problem));
  bool done = false;
  JAXFLUX_RETURN_IF_ERROR(ZeroOnly(stream, problem, d, &done));
  if (done) return ffi::Error::Success();
  problem.a = a.untyped_data();
  problem.b = b.untyped_data();
  problem.group_sizes = group_sizes.typed_data();
  problem.d = d->untyped_data();
  void* space = nullptr;
  JAXFLUX_RETURN_IF_ERROR(WorkspaceFromResult(
      kOp, *workspace, GroupedGemmSm90WorkspaceBytes(dtype, problem), &space));
  if (const char* failure = GroupedGemmSm90(dtype, problem, space, stream)) {
    return OpError(kOp, failure);
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return CudaOpError(kOp, "kernel launch", err);
  }
  return ffi::Error::Success();
}

}  // namespace

std::optional<size_t> GroupedGemmWorkspaceBytes(GemmDtype dtype, int64_t m, int64_t n, int64_t k,
                                                int64_t groups, int64_t kind,
                                                int64_t transpose_w, int64_t tile,
                                                int32_t device, std::string* error) {
  GroupedGemmProblem problem{};
  if (ffi::Error e = Describe(kind, transpose_w, tile, device, &problem); e.failure()) {
    *error = e.message();
    return std::nullopt;
  }
  const int64_t contraction = kind == 0 ? k : m;
  if (m <= 0 || n <= 0 || k <= 0 || groups <= 0 || contraction <= 0) return 0;  // zeros only
  problem.m = static_cast<int>(m);
  problem.n = static_cast<int>(n);
  problem.k = static_cast<int>(k);
  problem.groups = static_cast<int>(groups);
  return GroupedGemmSm90WorkspaceBytes(dtype, problem);
}

}  // namespace jaxflux

// Not declared kCmdBufferCompatible, as JaxfluxGemm (gemm.cc says why).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfluxGroupedGemm, jaxflux::GroupedGemmExecute,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this device
        .Ctx<xla::ffi::DeviceOrdinal>()                 // CUDA ordinal (SM count for the grid)
        .Arg<xla::ffi::AnyBuffer>()                     // a: [m, k], rows sorted by group
        .Arg<xla::ffi::AnyBuffer>()                     // b: [G, k, n] / [G, n, k]; kind 1 [m, n]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // group_sizes: [G]
        .RemainingArgs()                                // FP8: row_scale [m], col_scale [G, n]
        .Ret<xla::ffi::AnyBuffer>()                     // d: [m, n]; kind 1 [G, k, n]
        .Ret<xla::ffi::AnyBuffer>()                     // workspace: u8, its WorkspaceBytes
        .Attr<int64_t>("kind")                          // 0 forward, 1 weight gradient
        .Attr<int64_t>("transpose_w")                   // kind 0: 1 b is [G, n, k]
        .Attr<int64_t>("tile"));                        // GroupedGemmTiles
