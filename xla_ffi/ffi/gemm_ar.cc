// Fused GEMM+AllReduce: out = all_reduce(x · w) over the group, every rank holding all M rows,
// the push of each row chunk's partial hidden behind the GEMM of the next chunk.
//
// Per call (epoch e, parity e%2) on this device (rank r of tp). x [b, M, k] holds this rank's
// slice of the contraction. This device's workspace half [e%2] holds `recv[tp]`, one partial of
// all rows per source rank; recv[r] is this rank's own partial, computed in place:
//   main stream: per row chunk c (one chunk when the partial goes whole): the GEMM of the chunk's
//     rows -> recv[r]; then a fork:
//     side stream: for every peer p, copy-engine copy of the chunk -> recv[r] on p, then a flag
//                  write ready[this device] = e*4 + c + 1 on p (cuStreamWriteValue64: no SM);
//   main stream: one kernel that waits (bounded) for every peer's last chunk flag and sums
//     recv[0..tp) in rank order with fp32 accumulation into out; then a join with the side
//     stream (recv[r] must not be rewritten before its copies are done).
// Every rank sums the same 16-bit partials in the same order with one rounding, so the replicas
// are bitwise identical across the group. The GEMM is CUTLASS's stock persistent GEMM, its
// stream-K GEMM, or the swap-AB decode GEMM for few rows (GemmTiles); which one, the push and the
// swizzle are chosen by jaxflux/tuning and passed as attributes.
// FP8 (x e4m3/e5m2, w e4m3 given [N, k], out bf16): the GEMM applies x's row scales and w's
// column scales in its epilogue, and the partials pushed and summed are bf16.
// Slot reuse: a peer writes recv[.][e%2] here again at e+2 only after its reduction of e+1,
// which waited for our last flag of e+1, written after our GEMMs of e+1, which follow our
// reduction of e on our stream; our own recv[r] is rewritten at e+2 after the join of e.
#include "xla_ffi/ffi/gemm_ar.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi/attribute_names.h"
#include "xla_ffi/ffi/errors.h"
#include "xla_ffi/ffi/group.h"
#include "xla_ffi/ffi/group_call.h"
#include "xla_ffi/ffi/matmul_operands.h"
#include "xla_ffi/ffi/push_plan.h"
#include "xla_ffi/ffi/scratch.h"
#include "xla_ffi/ffi/wait_reduce_setup.h"
#include "xla_ffi/ffi/workspace_layout.h"
#include "xla_ffi/kernels/gemm_sm90.h"
#include "xla_ffi/kernels/reduce_kernels.h"
#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"
#include "xla_ffi/runtime/stream_ops.h"

namespace ffi = xla::ffi;

namespace jaxflux {

static_assert(kGemmTilesNames.size() == kGemmNumTiles,
              "attribute_names.h names every GemmTiles");

namespace {

constexpr char kOp[] = "matmul_all_reduce";
// Its workspace layout (workspace_layout.h); a compile error if kOp has none.
constexpr SlotLayout kLayout = *SlotLayoutOf(kOp);

static_assert(kPushMaxChunks == kMaxChunks, "a push's chunks are flagged e*kMaxChunks + c + 1");

ffi::Error Fail(const std::string& what) { return OpError(kOp, what); }

#define JAXFLUX_CUDA(call) JAXFLUX_RETURN_IF_CUDA_ERROR(kOp, call)

// The operands, with the group's checks: tp in range, the output [..., M, N].
ffi::Error CheckInputs(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer out, int64_t tp,
                       int64_t transpose_w, MatmulOperands* s) {
  JAXFLUX_RETURN_IF_ERROR(ReadMatmulOperands(kOp, x, w, out, transpose_w, s));
  if (tp < 2 || tp > kReduceMaxRanks) {
    return InvalidAttr(kOp, "tp", tp, "must be in 2.." + std::to_string(kReduceMaxRanks));
  }
  if (out.element_count() != s->batch * s->rows * s->n) {
    return ffi::Error::InvalidArgument("jaxflux matmul_all_reduce: the output must be [..., M, N]");
  }
  return ffi::Error::Success();
}

ffi::Error GemmAr(cudaStream_t stream, int32_t ordinal, ffi::ScratchAllocator scratch,
                  RankState* state, ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Buffer<ffi::S32> rank_info, ffi::RemainingArgs scales,
                  ffi::Result<ffi::AnyBuffer> out, int64_t tp,
                  int64_t num_groups, int64_t site, int64_t workspace_class,
                  int64_t debug_skip_rank,
                  int64_t transpose_w, int64_t tile, int64_t push_chunks, int64_t swizzle,
                  int64_t grid_sms) {
  MatmulOperands s;
  JAXFLUX_RETURN_IF_ERROR(CheckInputs(x, w, *out, tp, transpose_w, &s));
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "tile", tile, {0, 1, 2}));
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "push_chunks", push_chunks, {0, 1}));
  if (push_chunks == 1 && s.batch != 1) {
    return InvalidAttr(kOp, "push_chunks", push_chunks,
                       "needs an unbatched x (here batch " + std::to_string(s.batch) +
                           "); pass push_chunks=0");
  }
  JAXFLUX_RETURN_IF_ERROR(CheckSwizzle(kOp, "swizzle", swizzle));
  JAXFLUX_RETURN_IF_ERROR(CheckGridSms(kOp, grid_sms));
  const float* row_scale = nullptr;  // FP8: x's, one per row; w's, one per column
  const float* col_scale = nullptr;
  JAXFLUX_RETURN_IF_ERROR(
      Fp8Scales(kOp, s.dtype, scales, s.batch * s.rows, s.n, &row_scale, &col_scale));

  const size_t partial_bytes = s.batch * s.rows * s.n * s.out_elem;  // x · w, every row
  const size_t slot_bytes = SlotBytes(partial_bytes);
  GroupCall call(kOp, stream, ordinal);
  JAXFLUX_RETURN_IF_ERROR(call.Begin(state, rank_info,
                                     {tp, num_groups, site, workspace_class, debug_skip_rank,
                                      run.run_id},
                                     HalfBytes(kLayout, tp, partial_bytes)));
  const int rank = call.rank();
  DeviceResources* res = call.self();
  std::string failed;

  const uint64_t epoch = call.epoch();
  const uint64_t flag_value = epoch * kMaxChunks + 1;  // chunk c: flag_value + c
  auto recv = [&](int device_rank, int source) {  // recv[source] in the arena of device_rank
    return call.ArenaOf(device_rank) + static_cast<size_t>(source) * slot_bytes;
  };
  PushChunks chunks;  // one chunk: the whole partial, every batch entry
  chunks.ends[0] = s.rows;
  if (push_chunks == 1) chunks = PlanEvenChunks(s.rows);

  GemmProblem problem{};
  problem.b = w.untyped_data();
  problem.n = static_cast<int>(s.n);
  problem.k = static_cast<int>(s.k);
  problem.device = ordinal;
  problem.b_kmajor = s.w_kmajor;
  problem.batch = static_cast<int>(s.batch);
  problem.batch_stride_a = static_cast<int64_t>(s.rows * s.k);
  problem.batch_stride_d = static_cast<int64_t>(s.rows * s.n);
  problem.swizzle = static_cast<int>(swizzle);
  problem.grid_sms = static_cast<int>(grid_sms);
  problem.tiles = static_cast<GemmTiles>(tile);
  problem.col_scale = col_scale;
  problem.batch_stride_row_scale = static_cast<int64_t>(s.rows);
  problem.fast_accum = kFp8FastAccum;
  // The largest chunk sizes the CUTLASS scratch (stream-K's partial tiles scale with it).
  problem.row_scale = row_scale;
  size_t largest = 0;
  for (int c = 0; c < chunks.count; ++c) {
    largest = std::max(largest, chunks.ends[c] - (c == 0 ? 0 : chunks.ends[c - 1]));
  }
  problem.m = static_cast<int>(largest);
  void* gemm_workspace = nullptr;
  JAXFLUX_RETURN_IF_ERROR(
      AllocateScratch(kOp, scratch, GemmSm90WorkspaceBytes(s.dtype, problem), &gemm_workspace));

  const size_t out_row = s.n * s.out_elem;
  const char* x_base = static_cast<const char*>(x.untyped_data());
  char* own = recv(rank, rank);
  for (int c = 0; c < chunks.count; ++c) {
    const size_t row0 = c == 0 ? 0 : chunks.ends[c - 1];
    problem.m = static_cast<int>(chunks.ends[c] - row0);
    problem.a = x_base + row0 * s.k * s.elem;
    problem.d = own + row0 * out_row;
    if (row_scale != nullptr) problem.row_scale = row_scale + row0;
    if (const char* failure = GemmSm90(s.dtype, problem, gemm_workspace, stream)) {
      return Fail(failure);
    }
    JAXFLUX_CUDA(cudaGetLastError());
    // This chunk of the own partial to every peer, flagged on each as it lands.
    JAXFLUX_RETURN_IF_ERROR(call.ForkSide());
    const size_t bytes = chunks.count == 1 ? partial_bytes : problem.m * out_row;
    for (int i = 1; i < tp; ++i) {
      const int p = (rank + i) % static_cast<int>(tp);
      JAXFLUX_CUDA(cudaMemcpyAsync(recv(p, rank) + row0 * out_row, own + row0 * out_row, bytes,
                                   cudaMemcpyDefault, res->side));
      if (!call.skip_signals() &&
          !WriteFlag(res->side, call.FlagOn(p), flag_value + c, &failed)) {
        return Fail(failed);
      }
    }
  }

  // The last chunk's flag says the whole partial has landed.
  const WaitReduceParams params = WaitReduceOfThisCall(
      call, [&](int r) { return recv(rank, r); },
      flag_value + static_cast<uint64_t>(chunks.count - 1), out->untyped_data(),
      s.batch * s.rows * s.n, s.dtype, OpCode::kMatmulAllReduce);
  JAXFLUX_CUDA(LaunchWaitReduce(params, 2 * std::max(res->sm_count, 1), stream));
  JAXFLUX_RETURN_IF_ERROR(call.JoinSide());
  return call.Finish([&] {
    return StrFormat("batch %zu, M=%zu N=%zu k=%zu, GEMM tiles %d, %d push chunks", s.batch,
                     s.rows, s.n, s.k, static_cast<int>(tile), chunks.count);
  });
}

}  // namespace
}  // namespace jaxflux

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfluxGemmArExecute, jaxflux::GemmAr,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
        .Ctx<xla::ffi::DeviceOrdinal>()                 // CUDA ordinal
        .Ctx<xla::ffi::ScratchAllocator>()              // CUTLASS scratch, if any
        .Ctx<xla::ffi::State<jaxflux::RankState>>()     // ranks found by this instance
        .Ctx<xla::ffi::RunId>()                         // this logical execution
        .Arg<xla::ffi::AnyBuffer>()                     // x: [..., M, k]
        .Arg<xla::ffi::AnyBuffer>()                     // w: [k, N] or [N, k]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank_info
        .RemainingArgs()                                // FP8: x's row and w's column scales
        .Ret<xla::ffi::AnyBuffer>()                     // out: [..., M, N]
        .Attr<int64_t>("tp")
        .Attr<int64_t>("num_groups")
        .Attr<int64_t>("site")
        .Attr<int64_t>("workspace_class")
        .Attr<int64_t>("debug_skip_rank")
        .Attr<int64_t>("transpose_w")   // 1: w is [N, k], the weight transposed
        .Attr<int64_t>("tile")          // GemmTiles: 0 persistent, 1 stream-K, 2 swap-AB decode
        .Attr<int64_t>("push_chunks")   // 1: the partial in even row chunks
        .Attr<int64_t>("swizzle")       // 1, 2, 4 or 8
        .Attr<int64_t>("grid_sms"));    // 0: all SMs
