// Fused GEMM+ReduceScatter: z = reduce_scatter(x · w, axis=-2), the communication of each
// owner's rows hidden behind the GEMM of the next owner's rows.
//
// Per call (epoch e, parity e%2) on this device (rank r of tp). x [b, M, K] holds every token;
// owner p of the output gets rows [p*m, (p+1)*m) of each batch entry (m = M/tp). This device's
// workspace half [e%2] holds `recv[tp]` (partials landed here, by source rank) and
// `stage[tp]` (partials this device computed for peers):
//   main stream: for p = r+1, r+2, ..., r-1: GEMM of owner p's rows -> stage[p]; then a fork:
//     side stream: copy-engine copy stage[p] -> recv[r] on p, then a flag write
//                  ready[this device] = e*4 + 1 on p (cuStreamWriteValue64: no SM needed);
//   main stream: GEMM of this device's own rows -> recv[r] (overlaps the last pushes), then one
//     kernel that waits (bounded) for every peer's flag and sums recv[0..tp) in rank order with
//     fp32 accumulation into z; then a join with the side stream (stage[] must not be rewritten
//     before its copy is done).
//   FP8 (x e4m3/e5m2, w e4m3 given [N, K], z bf16): the GEMMs apply x's row scales and w's
//     column scales in their epilogues, and the partials pushed and reduced are bf16.
//   At tp=2 the own-rows GEMM can do the reduction instead (reduce=1, rs_gemm_sm90.h): z = x_r · w
//     + recv[p] in its epilogue, whose C loads wait (bounded) for the peer's flag while the
//     mainloop runs; no reduction pass, and the own partial is never rounded to 16 bits on its
//     own. The peer's partial then goes in one push (push_chunks=0) or in row chunks, each
//     flagged, so that the owner's first tiles wait for a part of it only (push_chunks=1).
// Which mode, push, schedule and swizzles: chosen by jaxflux/tuning, passed as attributes.
// Slot reuse: a peer writes recv[.][e%2] again at e+2 only after its own reduction of e+1, which
// waited for our flag of e+1, released after our reduction of e had run on our stream (with the
// epilogue reduction: after our own-rows GEMM of e, which precedes our push of e+1 in stream
// order).
#include "xla_ffi/ffi/gemm_rs.h"

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
#include "xla_ffi/ffi/tile_wait_setup.h"
#include "xla_ffi/ffi/wait_reduce_setup.h"
#include "xla_ffi/ffi/workspace_layout.h"
#include "xla_ffi/kernels/gemm_sm90.h"
#include "xla_ffi/kernels/reduce_kernels.h"
#include "xla_ffi/kernels/rs_gemm_sm90.h"
#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"
#include "xla_ffi/runtime/stream_ops.h"

namespace ffi = xla::ffi;

namespace jaxflux {

// own_rows_schedule: 0 cooperative, 1 ping-pong (the CheckAttrIn below).
static_assert(kOwnRowsScheduleNames.size() == 2, "attribute_names.h names both schedules");

namespace {

constexpr char kOp[] = "matmul_reduce_scatter";
// Its workspace layout (workspace_layout.h); a compile error if kOp has none.
constexpr SlotLayout kLayout = *SlotLayoutOf(kOp);

static_assert(kTileWaitMaxChunks == kMaxChunks, "the kernel's chunk_ends hold one push's chunks");
static_assert(kPushMaxChunks == kMaxChunks, "a push plan's chunks are flagged e*kMaxChunks + c + 1");

ffi::Error Fail(const std::string& what) { return OpError(kOp, what); }

#define JAXFLUX_CUDA(call) JAXFLUX_RETURN_IF_CUDA_ERROR(kOp, call)

struct Shapes : MatmulOperands {
  size_t m = 0;  // M / tp, the rows each owner gets
};

// The kernel choices, as the attributes give them (chosen by jaxflux/tuning).
struct Choices {
  bool epilogue_reduce = false;  // reduce: 1 the own-rows GEMM sums the peer's partial
  bool push_chunks = false;      // push_chunks: 1 the peer's partial goes in row chunks
  bool pingpong = false;         // own_rows_schedule (the epilogue-reduce kernel's)
  int own_rows_swizzle = 1;      // of the epilogue-reduce kernel
  int peer_rows_swizzle = 1;     // of CUTLASS's GEMM (peer rows; all rows with reduce=0)
  int grid_sms = 0;
};

// The operands, with the group's checks: tp in range, M dividing by it, z [..., M/tp, N].
ffi::Error CheckInputs(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer z, int64_t tp,
                       int64_t transpose_w, Shapes* s) {
  JAXFLUX_RETURN_IF_ERROR(ReadMatmulOperands(kOp, x, w, z, transpose_w, s));
  if (tp < 2 || tp > kReduceMaxRanks) {
    return InvalidAttr(kOp, "tp", tp, "must be in 2.." + std::to_string(kReduceMaxRanks));
  }
  auto invalid = [](const std::string& what) {
    return ffi::Error::InvalidArgument("jaxflux matmul_reduce_scatter: " + what);
  };
  if (s->rows % static_cast<size_t>(tp)) return invalid("M must divide by tp");
  s->m = s->rows / static_cast<size_t>(tp);
  if (z.element_count() != s->batch * s->m * s->n) return invalid("z must be [..., M/tp, N]");
  return ffi::Error::Success();
}

ffi::Error CheckChoices(const Shapes& s, int64_t tp, int64_t reduce,
                        int64_t push_chunks, int64_t own_rows_schedule, int64_t own_rows_swizzle,
                        int64_t peer_rows_swizzle, int64_t grid_sms, Choices* c) {
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "reduce", reduce, {0, 1}));
  if (reduce == 1 && tp != 2) {
    return InvalidAttr(kOp, "reduce", reduce,
                       "(the epilogue reduction) needs tp=2, here tp=" + std::to_string(tp) +
                           "; pass reduce=0");
  }
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "push_chunks", push_chunks, {0, 1}));
  if (push_chunks == 1 && (reduce != 1 || s.batch != 1)) {
    return InvalidAttr(kOp, "push_chunks", push_chunks,
                       "needs reduce=1 and an unbatched x (here reduce=" + std::to_string(reduce) +
                           ", batch " + std::to_string(s.batch) + "); pass push_chunks=0");
  }
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "own_rows_schedule", own_rows_schedule, {0, 1}));
  JAXFLUX_RETURN_IF_ERROR(CheckSwizzle(kOp, "own_rows_swizzle", own_rows_swizzle));
  JAXFLUX_RETURN_IF_ERROR(CheckSwizzle(kOp, "peer_rows_swizzle", peer_rows_swizzle));
  JAXFLUX_RETURN_IF_ERROR(CheckGridSms(kOp, grid_sms));
  c->epilogue_reduce = reduce == 1;
  c->push_chunks = push_chunks == 1;
  c->pingpong = own_rows_schedule == 1;
  c->own_rows_swizzle = static_cast<int>(own_rows_swizzle);
  c->peer_rows_swizzle = static_cast<int>(peer_rows_swizzle);
  c->grid_sms = static_cast<int>(grid_sms);
  return ffi::Error::Success();
}

ffi::Error GemmRs(cudaStream_t stream, int32_t ordinal, ffi::ScratchAllocator scratch,
                  RankState* state, ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Buffer<ffi::S32> rank_info, ffi::RemainingArgs scales,
                  ffi::Result<ffi::AnyBuffer> z, int64_t tp,
                  int64_t num_groups, int64_t site, int64_t workspace_class,
                  int64_t debug_skip_rank,
                  int64_t transpose_w, int64_t reduce, int64_t push_chunks,
                  int64_t own_rows_schedule, int64_t own_rows_swizzle, int64_t peer_rows_swizzle,
                  int64_t grid_sms) {
  Shapes s;
  JAXFLUX_RETURN_IF_ERROR(CheckInputs(x, w, *z, tp, transpose_w, &s));
  Choices choice;
  JAXFLUX_RETURN_IF_ERROR(CheckChoices(s, tp, reduce, push_chunks,
                                       own_rows_schedule, own_rows_swizzle, peer_rows_swizzle,
                                       grid_sms, &choice));
  const float* row_scale = nullptr;  // FP8: x's, one per row; w's, one per column
  const float* col_scale = nullptr;
  JAXFLUX_RETURN_IF_ERROR(
      Fp8Scales(kOp, s.dtype, scales, s.batch * s.rows, s.n, &row_scale, &col_scale));
  // One owner's rows of x · w, in the output's dtype.
  const size_t partial_bytes = s.batch * s.m * s.n * s.out_elem;
  const size_t slot_bytes = SlotBytes(partial_bytes);
  GroupCall call(kOp, stream, ordinal);
  JAXFLUX_RETURN_IF_ERROR(call.Begin(state, rank_info,
                                     {tp, num_groups, site, workspace_class, debug_skip_rank,
                                      run.run_id},
                                     HalfBytes(kLayout, tp, partial_bytes)));
  const GroupInfo& g = call.group();
  const int rank = g.rank;
  DeviceResources* res = call.self();
  std::string failed;

  const uint64_t epoch = call.epoch();
  const uint64_t flag_value = epoch * kMaxChunks + 1;  // chunk c: flag_value + c
  auto recv = [&](int device_rank, int source) {  // recv[source] in the arena of device_rank
    return call.ArenaOf(device_rank) + static_cast<size_t>(source) * slot_bytes;
  };
  char* stage_base = call.ArenaOf(rank) + static_cast<size_t>(tp) * slot_bytes;
  const char* x_base = static_cast<const char*>(x.untyped_data());
  auto x_base_of = [&](int owner) {  // owner's rows of the first batch entry of x
    return x_base + static_cast<size_t>(owner) * s.m * s.k * s.elem;
  };

  // Owner p's rows of every batch entry, as one batched GEMM into a contiguous [b, m, N] slot.
  GemmProblem problem{};
  problem.b = w.untyped_data();
  problem.m = static_cast<int>(s.m);
  problem.n = static_cast<int>(s.n);
  problem.k = static_cast<int>(s.k);
  problem.device = ordinal;
  problem.b_kmajor = s.w_kmajor;
  problem.batch = static_cast<int>(s.batch);
  problem.batch_stride_a = static_cast<int64_t>(s.rows * s.k);
  problem.batch_stride_d = static_cast<int64_t>(s.m * s.n);
  problem.swizzle = choice.peer_rows_swizzle;
  problem.grid_sms = choice.grid_sms;
  problem.batch_stride_row_scale = static_cast<int64_t>(s.rows);
  problem.col_scale = col_scale;
  problem.fast_accum = kFp8FastAccum;  // as the own-rows kernel accumulates
  auto row_scale_of = [&](int owner) {  // owner's rows of the first batch entry
    return row_scale == nullptr ? nullptr : row_scale + static_cast<size_t>(owner) * s.m;
  };
  const bool epilogue_reduce = choice.epilogue_reduce;
  PushChunks chunks;  // one chunk: the whole partial
  chunks.ends[0] = s.m;
  if (choice.push_chunks) chunks = PlanEvenChunks(s.m);
  const int peer = (rank + 1) % static_cast<int>(tp);  // the only peer when epilogue_reduce
  RsGemmProblem own{};  // the own rows with the reduction in the epilogue (tp = 2)
  if (epilogue_reduce) {
    own.gemm = problem;
    own.gemm.a = x_base_of(rank);
    own.gemm.row_scale = row_scale_of(rank);
    own.gemm.d = z->untyped_data();
    own.gemm.swizzle = choice.own_rows_swizzle;
    own.c = recv(rank, peer);
    TileWait& wait = own.wait;
    wait = TileWaitOfThisRank(g, ordinal, epoch, rank_info.typed_data());
    wait.flags[0] = call.FlagFrom(peer);
    wait.flag_base = flag_value - 1;  // chunk c landed once the flag reaches flag_base + c + 1
    wait.rows_per_shard = static_cast<int>(s.m);
    SetChunkEnds(&wait, chunks.ends, chunks.count);
    wait.tp = 1;
    wait.op = static_cast<int32_t>(OpCode::kMatmulReduceScatter);
    wait.source_ranks[0] = peer;
    own.pingpong = choice.pingpong ? 1 : 0;
  }
  void* gemm_workspace = nullptr;
  JAXFLUX_RETURN_IF_ERROR(AllocateScratch(
      kOp, scratch,
      std::max(GemmSm90WorkspaceBytes(s.dtype, problem),
               epilogue_reduce ? RsGemmSm90WorkspaceBytes(s.dtype, own) : size_t{0}),
      &gemm_workspace));
  for (int i = 1; i <= tp; ++i) {
    const int p = (rank + i) % tp;  // peers first (they wait for us), own rows last
    if (p == rank && epilogue_reduce) {
      if (const char* failure = RsGemmSm90(s.dtype, own, gemm_workspace, stream)) {
        return Fail(failure);
      }
      JAXFLUX_CUDA(cudaGetLastError());
      break;
    }
    problem.a = x_base_of(p);
    problem.row_scale = row_scale_of(p);
    problem.d = p == rank ? recv(rank, rank) : stage_base + static_cast<size_t>(p) * slot_bytes;
    if (const char* failure = GemmSm90(s.dtype, problem, gemm_workspace, stream)) {
      return Fail(failure);
    }
    JAXFLUX_CUDA(cudaGetLastError());
    if (p == rank) break;
    // The peer's partial, pushed from the side stream chunk by chunk (one chunk: all of it,
    // every batch entry), each chunk flagged on the peer as it lands.
    JAXFLUX_RETURN_IF_ERROR(call.ForkSide());
    const size_t out_row = s.n * s.out_elem;
    const char* stage = static_cast<const char*>(problem.d);
    for (int c = 0; c < chunks.count; ++c) {
      const size_t row0 = c == 0 ? 0 : chunks.ends[c - 1];
      const size_t bytes = chunks.count == 1 ? partial_bytes : (chunks.ends[c] - row0) * out_row;
      JAXFLUX_CUDA(cudaMemcpyAsync(recv(p, rank) + row0 * out_row, stage + row0 * out_row, bytes,
                                   cudaMemcpyDefault, res->side));
      if (!call.skip_signals() &&
          !WriteFlag(res->side, call.FlagOn(p), flag_value + c, &failed)) {
        return Fail(failed);
      }
    }
  }

  if (!epilogue_reduce) {
    const WaitReduceParams params = WaitReduceOfThisCall(
        call, [&](int r) { return recv(rank, r); }, flag_value, z->untyped_data(),
        s.batch * s.m * s.n, s.dtype, OpCode::kMatmulReduceScatter);
    JAXFLUX_CUDA(LaunchWaitReduce(params, 2 * std::max(res->sm_count, 1), stream));
  }
  JAXFLUX_RETURN_IF_ERROR(call.JoinSide());
  return call.Finish([&] {
    return StrFormat("batch %zu, M=%zu N=%zu K=%zu, reduce %d, %d push chunks, own rows %s",
                     s.batch, s.rows, s.n, s.k, epilogue_reduce ? 1 : 0, chunks.count,
                     choice.pingpong ? "pingpong" : "cooperative");
  });
}

}  // namespace
}  // namespace jaxflux

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfluxGemmRsExecute, jaxflux::GemmRs,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
        .Ctx<xla::ffi::DeviceOrdinal>()                 // CUDA ordinal
        .Ctx<xla::ffi::ScratchAllocator>()              // CUTLASS scratch, if any
        .Ctx<xla::ffi::State<jaxflux::RankState>>()     // ranks found by this instance
        .Ctx<xla::ffi::RunId>()                         // this logical execution
        .Arg<xla::ffi::AnyBuffer>()                     // x: [..., M, K]
        .Arg<xla::ffi::AnyBuffer>()                     // w: [K, N] or [N, K]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank_info
        .RemainingArgs()                                // FP8: x's row and w's column scales
        .Ret<xla::ffi::AnyBuffer>()                     // z: [..., M/tp, N]
        .Attr<int64_t>("tp")
        .Attr<int64_t>("num_groups")
        .Attr<int64_t>("site")
        .Attr<int64_t>("workspace_class")
        .Attr<int64_t>("debug_skip_rank")
        .Attr<int64_t>("transpose_w")        // 1: w is [N, K], the weight transposed
        .Attr<int64_t>("reduce")             // 0 pass, 1 epilogue (tp = 2)
        .Attr<int64_t>("push_chunks")        // 1: the partial in even row chunks
        .Attr<int64_t>("own_rows_schedule")  // 0 cooperative, 1 ping-pong
        .Attr<int64_t>("own_rows_swizzle")   // 1, 2, 4 or 8
        .Attr<int64_t>("peer_rows_swizzle")  // 1, 2, 4 or 8
        .Attr<int64_t>("grid_sms"));         // 0: all SMs
