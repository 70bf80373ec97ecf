// The tensor-parallel MoE ops: AllGather + gather + grouped GEMM, and grouped GEMM + combine +
// ReduceScatter. Tokens are sharded over the tp ranks (m each) and every token has its (token,
// expert) rows in the segment of the rank that holds it: segment p, rows [p*s, (p+1)*s), is rank
// p's pairs sorted by expert, group_sizes[p] their counts. A segment's rows come from one rank's
// tokens and go back to that rank, so each segment is a grouped GEMM of its own, and the
// communication of one segment hides behind the grouped GEMM of another.
//
// jaxflux_all_gather_grouped_matmul, per call (epoch e, parity e%2) on rank r:
//   side stream: copy-engine push of x [m, K] into every peer's receive slot [e%2][r], then the
//                flag write e*4 + 1 on that peer (stream memory op, no SM);
//   main stream: own segment: gather rows from x, grouped GEMM; then for each peer p in the
//                order they push to us (r-1, r-2, ...): gather rows from slot [p] (the kernel
//                first waits, bounded, for p's flag), grouped GEMM. The peers' pushes land while
//                the earlier segments' GEMMs run.
//   join with the side stream (the push reads x).
// jaxflux_grouped_matmul_reduce_scatter, per call on rank r, workspace half [e%2] holding
// recv[tp] (partials of this rank's segment, by source) and stage[tp]:
//   main stream: for p = r+1, ..., r-1: grouped GEMM of segment p -> stage[p], then a fork:
//     side stream: copy-engine copy stage[p] -> recv[r] on p, flag write e*4 + 1 on p;
//   main stream: grouped GEMM of the own segment -> recv[r] (overlaps the last pushes), then one
//     pass that waits (bounded) for every peer's flag, sums the partials in rank order into the
//     segment's rows and combines each token's top-k rows, weighted, into z (fp32, one rounding);
//     join with the side stream.
// Slot reuse follows the two-parity argument of the dense ops (docs/runtime.md): a receive slot
// of parity e%2 is written again at e+2 only after its reader at e has run on its stream, which
// every peer's epoch e+1 waited for.
#include "xla_ffi/ffi/moe_gemm.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi/errors.h"
#include "xla_ffi/ffi/group.h"
#include "xla_ffi/ffi/group_call.h"
#include "xla_ffi/ffi/scratch.h"
#include "xla_ffi/ffi/workspace_layout.h"
#include "xla_ffi/kernels/grouped_gemm_sm90.h"
#include "xla_ffi/kernels/moe_kernels.h"
#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"
#include "xla_ffi/runtime/stream_ops.h"

namespace ffi = xla::ffi;

namespace jaxflux {
namespace {

constexpr char kAgOp[] = "all_gather_grouped_matmul";
// Its workspace layout (workspace_layout.h); a compile error if kAgOp has none.
constexpr SlotLayout kAgLayout = *SlotLayoutOf(kAgOp);
constexpr char kRsOp[] = "grouped_matmul_reduce_scatter";
// Its workspace layout (workspace_layout.h); a compile error if kRsOp has none.
constexpr SlotLayout kRsLayout = *SlotLayoutOf(kRsOp);

std::string Dims(ffi::AnyBuffer::Dimensions dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

bool SameDims(ffi::AnyBuffer::Dimensions a, ffi::AnyBuffer::Dimensions b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

ffi::Error Invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("jaxflux ") + op + ": " + what);
}

// One segment's grouped GEMM: a [s, k] rows, b the weights, d [s, n], the segment's group sizes.
struct SegmentGemm {
  GroupedGemmProblem problem;
  GemmDtype dtype;
  void* workspace;
};

// The weights [G, k, n] ([G, n, k] with transpose_w) against the rows' k: fills the problem's
// n, k, groups and layout; dtype one 16-bit type with `a`.
ffi::Error ReadWeights(const char* op, ffi::AnyBuffer a, ffi::AnyBuffer w, int64_t transpose_w,
                       int64_t tp, ffi::Buffer<ffi::S32> group_sizes, SegmentGemm* gemm) {
  const auto dt = a.element_type();
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16) {
    return Invalid(op, "the tokens must be bfloat16 or float16");
  }
  if (w.element_type() != dt) return Invalid(op, "the tokens and w need one dtype");
  gemm->dtype = dt == ffi::DataType::BF16 ? GemmDtype::kBF16 : GemmDtype::kF16;
  const auto a_dims = a.dimensions(), w_dims = w.dimensions(), g_dims = group_sizes.dimensions();
  const bool kmajor = transpose_w == 1;
  if (a_dims.size() != 2) return Invalid(op, "the tokens must be 2-D; got " + Dims(a_dims));
  const int64_t k = a_dims[1];
  if (w_dims.size() != 3 || w_dims[kmajor ? 2 : 1] != k) {
    return Invalid(op, std::string("w must be ") + (kmajor ? "[G, n, k]" : "[G, k, n]") +
                           " with k=" + std::to_string(k) + "; got " + Dims(w_dims));
  }
  const int64_t groups = w_dims[0], n = w_dims[kmajor ? 1 : 2];
  if (g_dims.size() != 2 || g_dims[0] != tp || g_dims[1] != groups) {
    return Invalid(op, "group_sizes must be [tp, G] = [" + std::to_string(tp) + ", " +
                           std::to_string(groups) + "]; got " + Dims(g_dims));
  }
  if (k % 8 || n % 8) {
    return Invalid(op, "k and n must be multiples of 8 (16-byte rows); got k=" +
                           std::to_string(k) + ", n=" + std::to_string(n));
  }
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  if (n > kIntMax || k > kIntMax || groups > kIntMax) {
    return Invalid(op, "a dimension exceeds 2^31-1");
  }
  GroupedGemmProblem& p = gemm->problem;
  p.b = w.untyped_data();
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.groups = static_cast<int>(groups);
  p.b_kmajor = kmajor;
  p.kind = GroupedGemmKind::kForward;
  return ffi::Error::Success();
}

// d [s, n] = a [s, k] · w per group of `sizes` (the segment's [G] group sizes); zeros where the
// kernel has nothing to compute.
ffi::Error RunSegment(const char* op, SegmentGemm& gemm, const void* a, const int32_t* sizes,
                      void* d, int64_t s, size_t elem, cudaStream_t stream) {
  GroupedGemmProblem& p = gemm.problem;
  if (s == 0) return ffi::Error::Success();
  if (p.groups == 0 || p.k == 0) {
    JAXFLUX_RETURN_IF_CUDA_ERROR(
        op, cudaMemsetAsync(d, 0, static_cast<size_t>(s) * p.n * elem, stream));
    return ffi::Error::Success();
  }
  p.a = a;
  p.group_sizes = sizes;
  p.d = d;
  p.m = static_cast<int>(s);
  if (const char* failure = GroupedGemmSm90(gemm.dtype, p, gemm.workspace, stream)) {
    return OpError(op, failure);
  }
  JAXFLUX_RETURN_IF_CUDA_ERROR(op, cudaGetLastError());
  return ffi::Error::Success();
}

MoeWaitInfo WhoWaits(const GroupCall& call, const int32_t* rank_info, OpCode op) {
  MoeWaitInfo who{};
  who.rank_info = rank_info;
  who.rank = call.rank();
  who.group = call.group().group;
  who.device = call.ordinal();
  who.op = static_cast<int32_t>(op);
  who.epoch = call.epoch();
  who.timeout_ns = TimeoutNs();
  who.error = DeviceErrorRecordPtr();
  return who;
}

ReduceDtype RowDtype(GemmDtype dtype) {
  return dtype == GemmDtype::kF16 ? ReduceDtype::kF16 : ReduceDtype::kBF16;
}

ffi::Error AllocateGemmScratch(const char* op, ffi::ScratchAllocator& scratch, SegmentGemm* gemm,
                               int64_t s) {
  gemm->workspace = nullptr;
  if (s == 0 || gemm->problem.groups == 0 || gemm->problem.k == 0) return ffi::Error::Success();
  gemm->problem.m = static_cast<int>(s);
  return AllocateScratch(op, scratch, GroupedGemmSm90WorkspaceBytes(gemm->dtype, gemm->problem),
                         &gemm->workspace);
}

ffi::Error MoeAgGroupedGemm(cudaStream_t stream, int32_t ordinal, ffi::ScratchAllocator scratch,
                            RankState* state, ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::S32> token_index,
                            ffi::Buffer<ffi::F32> row_scale, ffi::Buffer<ffi::S32> rank_info,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> rows,
                            int64_t tp, int64_t num_groups, int64_t site, int64_t workspace_class,
                            int64_t debug_skip_rank, int64_t transpose_w, int64_t tile) {
  const char* op = kAgOp;
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(op, "transpose_w", transpose_w, {0, 1}));
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(op, "tile", tile, {0, 1}));
  if (tp < 2 || tp > kMaxRanks) {
    return InvalidAttr(op, "tp", tp, "must be in 2.." + std::to_string(kMaxRanks));
  }
  SegmentGemm gemm{};
  gemm.problem.tiles = static_cast<GroupedGemmTiles>(tile);
  gemm.problem.device = ordinal;
  JAXFLUX_RETURN_IF_ERROR(ReadWeights(op, x, w, transpose_w, tp, group_sizes, &gemm));
  const int64_t m = x.dimensions()[0], k = gemm.problem.k, n = gemm.problem.n;
  const auto t_dims = token_index.dimensions();
  if (t_dims.size() != 2 || t_dims[0] != tp || !SameDims(row_scale.dimensions(), t_dims)) {
    return Invalid(op, "token_index and row_scale must be [tp, s]; got " + Dims(t_dims) +
                           " and " + Dims(row_scale.dimensions()));
  }
  const int64_t s = t_dims[1];
  if (s > std::numeric_limits<int>::max()) return Invalid(op, "a segment exceeds 2^31-1 rows");
  if (y->element_type() != x.element_type() || rows->element_type() != x.element_type() ||
      y->element_count() != static_cast<size_t>(tp * s * n) ||
      rows->element_count() != static_cast<size_t>(tp * s * k)) {
    return Invalid(op, "the outputs must be y [tp*s, n] and rows [tp*s, k] in x's dtype");
  }
  const size_t elem = ffi::ByteWidth(x.element_type());
  const size_t shard_bytes = x.size_bytes();
  const size_t slot_bytes = SlotBytes(shard_bytes);
  JAXFLUX_RETURN_IF_ERROR(AllocateGemmScratch(op, scratch, &gemm, s));

  GroupCall call(op, stream, ordinal);
  JAXFLUX_RETURN_IF_ERROR(call.Begin(state, rank_info,
                                     {tp, num_groups, site, workspace_class, debug_skip_rank,
                                      run.run_id},
                                     HalfBytes(kAgLayout, tp, shard_bytes)));
  const int rank = call.rank();
  DeviceResources* res = call.self();
  const uint64_t flag_value = call.epoch() * kMaxChunks + 1;
  std::string failed;

  // Side stream: x into every peer's receive slot [rank], each announced by its flag.
  JAXFLUX_RETURN_IF_ERROR(call.ForkSide());
  for (int i = 1; i < tp; ++i) {
    const int p = (rank + i) % tp;  // rotated so ranks start on different peers
    if (shard_bytes > 0) {
      JAXFLUX_RETURN_IF_CUDA_ERROR(
          op, cudaMemcpyAsync(call.ArenaOf(p) + rank * slot_bytes, x.untyped_data(), shard_bytes,
                              cudaMemcpyDefault, res->side));
    }
    if (!call.skip_signals() && !WriteFlag(res->side, call.FlagOn(p), flag_value, &failed)) {
      return OpError(op, failed);
    }
  }

  // Main stream: each segment's rows, then its grouped GEMM; the own segment first.
  MoeGatherParams gather{};
  gather.m = m;
  gather.k = k;
  gather.num_rows = s;
  gather.dtype = RowDtype(gemm.dtype);
  gather.who = WhoWaits(call, rank_info.typed_data(),
                        OpCode::kMoeAllGatherGroupedMatmul);
  // A gather that waits takes at most half the SMs, as the all-gather's receiver does.
  const int sms = std::max(res->sm_count, 1);
  char* rows_base = static_cast<char*>(rows->untyped_data());
  char* y_base = static_cast<char*>(y->untyped_data());
  for (int i = 0; i < tp; ++i) {
    const int p = (rank + tp - i) % tp;  // the peer that pushes to us first, after our own
    gather.src = p == rank ? x.untyped_data() : call.ArenaOf(rank) + p * slot_bytes;
    gather.flag = p == rank ? nullptr : call.FlagFrom(p);
    gather.target = flag_value;
    gather.peer = p;
    gather.token_index = token_index.typed_data() + p * s;
    gather.row_scale = row_scale.typed_data() + p * s;
    gather.rows = rows_base + static_cast<size_t>(p) * s * k * elem;
    if (s > 0 || gather.flag != nullptr) {  // an empty segment still waits: epochs stay aligned
      const int max_blocks = gather.flag == nullptr ? 4 * sms : std::max(sms / 2, 1);
      JAXFLUX_RETURN_IF_CUDA_ERROR(op, LaunchMoeGather(gather, max_blocks, stream));
    }
    JAXFLUX_RETURN_IF_ERROR(RunSegment(op, gemm, gather.rows,
                                       group_sizes.typed_data() + p * gemm.problem.groups,
                                       y_base + static_cast<size_t>(p) * s * n * elem, s, elem,
                                       stream));
  }
  JAXFLUX_RETURN_IF_ERROR(call.JoinSide());
  return call.Finish([&] {
    return StrFormat("m=%lld K=%lld n=%lld, %d experts, %lld rows per segment",
                     static_cast<long long>(m), static_cast<long long>(k),
                     static_cast<long long>(n), gemm.problem.groups, static_cast<long long>(s));
  });
}

ffi::Error MoeGroupedGemmRs(cudaStream_t stream, int32_t ordinal, ffi::ScratchAllocator scratch,
                            RankState* state, ffi::RunId run, ffi::AnyBuffer h, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::S32> row_index,
                            ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> rank_info,
                            ffi::Result<ffi::AnyBuffer> z, ffi::Result<ffi::AnyBuffer> y_rows,
                            int64_t tp, int64_t num_groups, int64_t site, int64_t workspace_class,
                            int64_t debug_skip_rank, int64_t transpose_w, int64_t tile) {
  const char* op = kRsOp;
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(op, "transpose_w", transpose_w, {0, 1}));
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(op, "tile", tile, {0, 1}));
  if (tp < 2 || tp > kReduceMaxRanks) {
    return InvalidAttr(op, "tp", tp, "must be in 2.." + std::to_string(kReduceMaxRanks));
  }
  SegmentGemm gemm{};
  gemm.problem.tiles = static_cast<GroupedGemmTiles>(tile);
  gemm.problem.device = ordinal;
  JAXFLUX_RETURN_IF_ERROR(ReadWeights(op, h, w, transpose_w, tp, group_sizes, &gemm));
  const int64_t rows = h.dimensions()[0], k = gemm.problem.k, n = gemm.problem.n;
  if (rows % tp) {
    return Invalid(op, "h's rows (" + std::to_string(rows) + ") must be tp=" +
                           std::to_string(tp) + " segments of equal size");
  }
  const int64_t s = rows / tp;
  if (s > std::numeric_limits<int>::max()) return Invalid(op, "a segment exceeds 2^31-1 rows");
  const auto r_dims = row_index.dimensions();
  if (r_dims.size() != 2 || !SameDims(weights.dimensions(), r_dims)) {
    return Invalid(op, "row_index and weights must be [m, topk]; got " + Dims(r_dims) + " and " +
                           Dims(weights.dimensions()));
  }
  const int64_t m = r_dims[0], topk = r_dims[1];
  if (z->element_type() != h.element_type() || y_rows->element_type() != h.element_type() ||
      z->element_count() != static_cast<size_t>(m * n) ||
      y_rows->element_count() != static_cast<size_t>(s * n)) {
    return Invalid(op, "the outputs must be z [m, n] and y_rows [s, n] in h's dtype");
  }
  const size_t elem = ffi::ByteWidth(h.element_type());
  const size_t partial_bytes = static_cast<size_t>(s) * n * elem;
  const size_t slot_bytes = SlotBytes(partial_bytes);
  JAXFLUX_RETURN_IF_ERROR(AllocateGemmScratch(op, scratch, &gemm, s));

  GroupCall call(op, stream, ordinal);
  JAXFLUX_RETURN_IF_ERROR(call.Begin(state, rank_info,
                                     {tp, num_groups, site, workspace_class, debug_skip_rank,
                                      run.run_id},
                                     HalfBytes(kRsLayout, tp, partial_bytes)));
  const int rank = call.rank();
  DeviceResources* res = call.self();
  const uint64_t flag_value = call.epoch() * kMaxChunks + 1;
  std::string failed;
  auto recv = [&](int device_rank, int source) {  // recv[source] in the arena of device_rank
    return call.ArenaOf(device_rank) + static_cast<size_t>(source) * slot_bytes;
  };
  char* stage_base = call.ArenaOf(rank) + static_cast<size_t>(tp) * slot_bytes;
  const char* h_base = static_cast<const char*>(h.untyped_data());

  for (int i = 1; i <= tp; ++i) {
    const int p = (rank + i) % tp;  // peers first (they wait for us), own segment last
    char* d = p == rank ? recv(rank, rank) : stage_base + static_cast<size_t>(p) * slot_bytes;
    JAXFLUX_RETURN_IF_ERROR(RunSegment(op, gemm, h_base + static_cast<size_t>(p) * s * k * elem,
                                       group_sizes.typed_data() + p * gemm.problem.groups, d, s,
                                       elem, stream));
    if (p == rank) break;
    // Segment p's partial goes to p from the side stream while the next segment's GEMM runs.
    JAXFLUX_RETURN_IF_ERROR(call.ForkSide());
    if (partial_bytes > 0) {
      JAXFLUX_RETURN_IF_CUDA_ERROR(op, cudaMemcpyAsync(recv(p, rank), d, partial_bytes,
                                                       cudaMemcpyDefault, res->side));
    }
    if (!call.skip_signals() && !WriteFlag(res->side, call.FlagOn(p), flag_value, &failed)) {
      return OpError(op, failed);
    }
  }

  MoeCombineParams combine{};
  combine.tp = static_cast<int32_t>(tp);
  for (int r = 0; r < tp; ++r) {
    combine.partials[r] = recv(rank, r);
    combine.flags[r] = r == rank ? nullptr : call.FlagFrom(r);
  }
  combine.target = flag_value;
  combine.row_index = row_index.typed_data();
  combine.weights = weights.typed_data();
  combine.z = z->untyped_data();
  combine.y_rows = y_rows->untyped_data();
  combine.m = m;
  combine.topk = topk;
  combine.s = s;
  combine.n = n;
  combine.dtype = RowDtype(gemm.dtype);
  combine.who = WhoWaits(call, rank_info.typed_data(),
                         OpCode::kMoeGroupedMatmulReduceScatter);
  JAXFLUX_RETURN_IF_CUDA_ERROR(
      op, LaunchMoeCombine(combine, std::max(res->sm_count / 2, 1), stream));
  JAXFLUX_RETURN_IF_ERROR(call.JoinSide());
  return call.Finish([&] {
    return StrFormat("m=%lld top-%lld, k=%lld N=%lld, %d experts, %lld rows per segment",
                     static_cast<long long>(m), static_cast<long long>(topk),
                     static_cast<long long>(k), static_cast<long long>(n), gemm.problem.groups,
                     static_cast<long long>(s));
  });
}

}  // namespace
}  // namespace jaxflux

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfluxMoeAgGroupedGemmExecute, jaxflux::MoeAgGroupedGemm,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
        .Ctx<xla::ffi::DeviceOrdinal>()                 // CUDA ordinal
        .Ctx<xla::ffi::ScratchAllocator>()              // the grouped GEMM's arguments
        .Ctx<xla::ffi::State<jaxflux::RankState>>()     // ranks found by this instance
        .Ctx<xla::ffi::RunId>()                         // this logical execution
        .Arg<xla::ffi::AnyBuffer>()                     // x: [m, K] this rank's tokens
        .Arg<xla::ffi::AnyBuffer>()                     // w: [G, K, n] or [G, n, K]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // group_sizes: [tp, G]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // token_index: [tp, s]
        .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // row_scale: [tp, s]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank_info
        .Ret<xla::ffi::AnyBuffer>()                     // y: [tp*s, n]
        .Ret<xla::ffi::AnyBuffer>()                     // rows: [tp*s, K]
        .Attr<int64_t>("tp")
        .Attr<int64_t>("num_groups")
        .Attr<int64_t>("site")
        .Attr<int64_t>("workspace_class")
        .Attr<int64_t>("debug_skip_rank")
        .Attr<int64_t>("transpose_w")  // 1: w is [G, n, K]
        .Attr<int64_t>("tile"));       // GroupedGemmTiles

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfluxMoeGroupedGemmRsExecute, jaxflux::MoeGroupedGemmRs,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
        .Ctx<xla::ffi::DeviceOrdinal>()                 // CUDA ordinal
        .Ctx<xla::ffi::ScratchAllocator>()              // the grouped GEMM's arguments
        .Ctx<xla::ffi::State<jaxflux::RankState>>()     // ranks found by this instance
        .Ctx<xla::ffi::RunId>()                         // this logical execution
        .Arg<xla::ffi::AnyBuffer>()                     // h: [tp*s, k] every segment's rows
        .Arg<xla::ffi::AnyBuffer>()                     // w: [G, k, N] or [G, N, k]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // group_sizes: [tp, G]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // row_index: [m, topk]
        .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // weights: [m, topk]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank_info
        .Ret<xla::ffi::AnyBuffer>()                     // z: [m, N]
        .Ret<xla::ffi::AnyBuffer>()                     // y_rows: [s, N]
        .Attr<int64_t>("tp")
        .Attr<int64_t>("num_groups")
        .Attr<int64_t>("site")
        .Attr<int64_t>("workspace_class")
        .Attr<int64_t>("debug_skip_rank")
        .Attr<int64_t>("transpose_w")  // 1: w is [G, N, k]
        .Attr<int64_t>("tile"));       // GroupedGemmTiles
