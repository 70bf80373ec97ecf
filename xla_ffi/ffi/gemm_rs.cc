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
//   At tp=2 the own-rows GEMM can do the reduction instead (rs_gemm_sm90.h): z = x_r · w +
//     recv[p] in its epilogue, whose C loads wait (bounded) for the peer's flag while the
//     mainloop runs; no reduction pass, and the own partial is never rounded to 16 bits on its
//     own. EpilogueReduce (below) chooses it where measured faster; the `reduce` attribute and
//     JAXFLUX_GEMM_RS_REDUCE=pass|epilogue force a mode.
// Slot reuse: a peer writes recv[.][e%2] again at e+2 only after its own reduction of e+1, which
// waited for our flag of e+1, released after our reduction of e had run on our stream (with the
// epilogue reduction: after our own-rows GEMM of e, which precedes our push of e+1 in stream
// order).
#include "xla_ffi/ffi/gemm_rs.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi/errors.h"
#include "xla_ffi/ffi/gemm_wait.h"
#include "xla_ffi/ffi/group.h"
#include "xla_ffi/ffi/push_plan.h"
#include "xla_ffi/kernels/gemm_sm90.h"
#include "xla_ffi/kernels/reduce_kernels.h"
#include "xla_ffi/kernels/rs_gemm_sm90.h"
#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"
#include "xla_ffi/runtime/stream_ops.h"

namespace ffi = xla::ffi;

namespace jaxflux {
namespace {

constexpr char kOp[] = "matmul_reduce_scatter";

ffi::Error Fail(const std::string& what) { return OpError(kOp, what); }

#define JAXFLUX_CUDA(call) JAXFLUX_RETURN_IF_CUDA_ERROR(kOp, call)

struct Shapes {
  size_t batch = 0, rows = 0, m = 0, k = 0, n = 0, elem = 0;  // rows = M, m = M / tp
  GemmDtype dtype = GemmDtype::kBF16;
  bool w_kmajor = false;  // w holds the weight transposed, [N, K] (transpose_w)
};

ffi::Error CheckInputs(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> rank_info,
                       ffi::AnyBuffer z, int64_t tp, int64_t transpose_w, Shapes* s) {
  auto invalid = [](const std::string& what) {
    return ffi::Error::InvalidArgument("jaxflux matmul_reduce_scatter: " + what);
  };
  const auto dt = x.element_type();
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16) {
    return invalid("x must be bfloat16 or float16");
  }
  if (w.element_type() != dt || z.element_type() != dt) {
    return invalid("x, w and z need one dtype");
  }
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  s->w_kmajor = transpose_w != 0;
  const int k_dim = s->w_kmajor ? 1 : 0;
  if (xd.size() < 2 || wd.size() != 2 || xd.back() != wd[k_dim]) {
    return invalid("expected x [..., M, K] and w [K, N] (or [N, K] with transpose_w)");
  }
  if (tp < 2 || tp > kReduceMaxRanks) {
    return invalid("tp must be in 2.." + std::to_string(kReduceMaxRanks));
  }
  s->rows = static_cast<size_t>(xd[xd.size() - 2]);
  s->k = static_cast<size_t>(wd[k_dim]);
  s->n = static_cast<size_t>(wd[1 - k_dim]);
  s->elem = ffi::ByteWidth(dt);
  s->dtype = dt == ffi::DataType::BF16 ? GemmDtype::kBF16 : GemmDtype::kF16;
  if (s->rows == 0 || s->k == 0 || s->n == 0) return invalid("empty operands are not supported");
  if (s->rows % static_cast<size_t>(tp)) return invalid("M must divide by tp");
  if (s->k % 8 || s->n % 8) return invalid("K and N must be multiples of 8 (16-byte rows)");
  s->m = s->rows / static_cast<size_t>(tp);
  s->batch = x.element_count() / (s->rows * s->k);
  if (s->batch * s->rows > static_cast<size_t>(std::numeric_limits<int>::max()) ||
      s->n > static_cast<size_t>(std::numeric_limits<int>::max()) ||
      s->k > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return invalid("a dimension exceeds 2^31-1");
  }
  if (z.element_count() != s->batch * s->m * s->n) return invalid("z must be [..., M/tp, N]");
  if (const auto n = static_cast<int64_t>(rank_info.element_count()); n != 2 && n != 2 + tp) {
    return invalid("rank_info must hold 2 (or 2 + tp) int32s");
  }
  return ffi::Error::Success();
}

// The end of a call: debug line, optional sync, and any device error recorded before it.
ffi::Error Finish(cudaStream_t stream, int32_t ordinal, int rank, const GroupInfo& g,
                  uint64_t epoch, const Shapes& s, std::optional<std::string> pending) {
  if (DebugEnabled()) {
    std::fprintf(stderr, "[jaxflux] GPU %d rank %d channel %d: matmul_reduce_scatter epoch %llu, "
                 "batch %zu, M=%zu N=%zu K=%zu\n", ordinal, rank, g.channel,
                 static_cast<unsigned long long>(epoch), s.batch, s.rows, s.n, s.k);
  }
  if (SyncErrors()) {
    JAXFLUX_CUDA(cudaStreamSynchronize(stream));
    if (!pending) pending = TakeDeviceErrorMessage();
  }
  if (pending) return ffi::Error::Internal(*pending);
  return ffi::Error::Success();
}

// The `reduce` attribute (matmul_reduce_scatter.REDUCE_MODES).
enum class ReduceMode : int64_t { kChoose = 0, kPass = 1, kEpilogue = 2 };

// How a peer's partial reaches its owner (JAXFLUX_GEMM_RS_PUSH; benchmarks/README.md has the
// measurements, including those of two removed experiments: `store`, the GEMM storing straight
// into the owner's slot over NVLink, correct but 0.99-1.27x copy's time; `chunks`, the peer-rows
// GEMM in row chunks each pushed as it finished, -3%..+7% against copy):
// - split (default): the peer-rows GEMM is one launch writing a local staging slot; a copy
//   engine pushes its partial in kMaxChunks row chunks, each flagged as it lands, so with the
//   epilogue reduction the owner's first tiles wait for a quarter of the push, not all of it
//   (session 7, 2xH200: 5-7% faster than copy on llama70b-out M >= 4096, 2.5% on gpt3-out,
//   the same elsewhere).
// - copy (JAXFLUX_GEMM_RS_PUSH=copy, for measurement): the whole partial in one push, one flag;
//   the epilogue reduction only where the partial is within its no-stall size.
enum class PushMode { kCopy, kSplit };

PushMode Push() {
  static const PushMode mode = [] {
    const char* env = std::getenv("JAXFLUX_GEMM_RS_PUSH");
    return env != nullptr && std::string(env) == "copy" ? PushMode::kCopy : PushMode::kSplit;
  }();
  return mode;
}

// Whether the peer's partial can go in row chunks: the split push, and unbatched x (a batched
// partial is one [b, m, N] slot whose row chunks are not contiguous; it goes whole).
bool PushInChunks(size_t batch) { return Push() == PushMode::kSplit && batch == 1; }

// Whether the own-rows GEMM reduces in its epilogue (tp = 2) rather than in a separate pass.
// The epilogue saves the pass (it reads both partials and writes the output: ~partial/0.8 TB/s),
// but its first wave of tiles waits for the whole peer partial, pushed over NVLink (~0.38 TB/s)
// after the peer-rows GEMM; the push beyond one wave of 128x256 tiles (~47 us per 4096 of K on
// an H200) stalls the GEMM. The epilogue wins when that stall is shorter than the pass, with a
// margin: partial bytes <= kEpilogueBytesPerK * K. Measured crossover (2xH200, the four
// benchmark shapes at M = 1024..8192, benchmarks/README.md): it picks the faster mode in all
// 16 cases but one within 0.5%. JAXFLUX_GEMM_RS_REDUCE=pass|epilogue overrides (measurement).
constexpr size_t kEpilogueBytesPerK = 6144;

bool EpilogueReduce(int64_t tp, int64_t mode, size_t partial_bytes, size_t k, size_t batch) {
  static const int forced = [] {  // 0: choose, 1: pass, 2: epilogue
    const char* env = std::getenv("JAXFLUX_GEMM_RS_REDUCE");
    if (env == nullptr) return 0;
    const std::string v(env);
    return v == "pass" ? 1 : v == "epilogue" ? 2 : 0;
  }();
  const auto chosen = static_cast<ReduceMode>(mode != 0 ? mode : forced);
  switch (chosen) {
    case ReduceMode::kPass:
      return false;
    case ReduceMode::kEpilogue:
      return tp == 2;
    default:
      // Pushed in chunks, the partial's first chunk is there soon after the owner's GEMM
      // starts; pushed whole, it must be within the size the epilogue waits for without
      // stalling.
      return tp == 2 && (PushInChunks(batch) || partial_bytes <= kEpilogueBytesPerK * k);
  }
}

// The own-rows GEMM's schedule (RsGemmProblem::pingpong). Ping-pong 128x128 tiles overlap one
// consumer warp group's epilogue (the C read: the peer's partial) with the other's mainloop,
// where cooperative 128x256 tiles stall both groups on it. Measured on the own-rows kernel alone
// with C (1xH200, session 13, two runs, every gemm_rs shape at 2048..16384 tokens, tp=2;
// benchmarks/results/gemm_table_gemm_rs_own_rows_s13_run{1,2}_*.json, benchmarks/README.md
// "Session 13"). On the rows whose partial the fused op pushes in chunks (tiles swept along
// N), ping-pong takes 0.90-0.98x cooperative's time at K_local 4096 and 6144 (the
// out-projections from 4096 tokens) and 0.97-0.99x at 14336 (llama70b-fc2, 16384 tokens) in
// both runs, and 1.01x at 24576 (gpt3-fc2). On the rows pushed whole (CUTLASS's raster order)
// it is 0.97-1.04x at K_local <= 14336 and 0.98-1.21x at 24576. Hence ping-pong when the
// partial goes in chunks and K_local <= kPingpongMaxK. With the weight read K-major (the
// backward of a column-parallel layer; session 14, two runs,
// benchmarks/results/gemm_table_gemm_rs_own_rows_kmajor_s14_run{1,2}_*.json) the same rule
// picks the faster schedule on every chunked row: 0.93-0.99x at K_local 4096 and 6144, 0.98x at
// 14336, 1.04x at 24576.
// JAXFLUX_GEMM_RS_SCHEDULE=cooperative|pingpong forces one (tests, measurement).
constexpr size_t kPingpongMaxK = 16384;

enum class Schedule { kChoose, kCooperative, kPingpong };

// Any other value is refused earlier, at trace time (jaxflux/_knobs.py), as for every knob.
Schedule ForcedSchedule() {
  static const Schedule forced = [] {
    const char* env = std::getenv("JAXFLUX_GEMM_RS_SCHEDULE");
    const std::string v = env != nullptr ? env : "";
    return v == "cooperative" ? Schedule::kCooperative
           : v == "pingpong"  ? Schedule::kPingpong
                              : Schedule::kChoose;
  }();
  return forced;
}

bool OwnRowsPingpong(int chunk_count, size_t k) {
  switch (ForcedSchedule()) {
    case Schedule::kCooperative:
      return false;
    case Schedule::kPingpong:
      return true;
    default:
      return chunk_count > 1 && k <= kPingpongMaxK;
  }
}

static_assert(kAgGemmMaxChunks == kMaxChunks, "the kernel's chunk_ends hold one push's chunks");
static_assert(kPushMaxChunks == kMaxChunks, "a push plan's chunks are flagged e*kMaxChunks + c + 1");

// The chunks of the split push (with the epilogue reduction, unbatched x): kMaxChunks chunks of
// equal rows, or one chunk (s.m rows) when the partial is within the epilogue's measured
// no-stall size (kEpilogueBytesPerK bytes per K), where waiting for all of it costs nothing.
// (Cutting where a model of the owner's GEMM waves said each chunk lands on time measured the
// same as even chunks, session 8: docs/design.md.)
PushChunks PlanPush(const Shapes& s, bool epilogue_reduce) {
  PushChunks plan;
  plan.ends[0] = s.m;
  if (!PushInChunks(s.batch) || !epilogue_reduce) return plan;
  if (s.m * s.n * s.elem <= kEpilogueBytesPerK * s.k) return plan;
  return PlanEvenChunks(s.m);
}

ffi::Error GemmRs(cudaStream_t stream, int32_t ordinal, ffi::ScratchAllocator scratch,
                  RankState* state, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Buffer<ffi::S32> rank_info, ffi::Result<ffi::AnyBuffer> z, int64_t tp,
                  int64_t num_groups, int64_t site, int64_t generation, int64_t debug_skip_rank,
                  int64_t reduce_mode, int64_t transpose_w) {
  Shapes s;
  if (ffi::Error e = CheckInputs(x, w, rank_info, *z, tp, transpose_w, &s); e.failure()) {
    return e;
  }
  if (reduce_mode < 0 || reduce_mode > 2 ||
      (static_cast<ReduceMode>(reduce_mode) == ReduceMode::kEpilogue && tp != 2)) {
    return ffi::Error::InvalidArgument("jaxflux matmul_reduce_scatter: reduce must be 0 "
                                       "(choose), 1 (pass) or 2 (epilogue, tp = 2 only)");
  }
  GroupInfo g;
  if (ffi::Error e = ResolveGroup("matmul_reduce_scatter", stream, ordinal, state,
                                  rank_info, site, tp, num_groups, &g);
      e.failure()) {
    return e;
  }
  // A device error recorded since the last call fails this call, after it has taken part.
  std::optional<std::string> pending = TakeDeviceErrorMessage();

  const int rank = g.rank;
  const size_t partial_bytes = s.batch * s.m * s.n * s.elem;  // one owner's rows of x · w
  const size_t slot_bytes = (partial_bytes + 255) / 256 * 256;
  const size_t half = WorkspaceBytes(generation) / 2;
  char* my_arena = WorkspaceArena(generation, g.slot);
  if (my_arena == nullptr || 2 * slot_bytes * static_cast<size_t>(tp) > half) {
    return Fail("workspace generation " + std::to_string(generation) + " has no room for " +
                std::to_string(2 * tp) + " slots of " + std::to_string(partial_bytes) +
                " bytes on GPU " + std::to_string(ordinal) +
                " (the op must be traced through jaxflux, which sizes it)");
  }
  DeviceGuard guard(ordinal);
  JAXFLUX_CUDA(guard.status());
  GroupResources group;
  if (ffi::Error e = GetGroupResources("matmul_reduce_scatter", generation, g, true,
                                       &group);
      e.failure()) {
    return e;
  }
  DeviceResources* res = group.self;
  std::lock_guard<std::mutex> device_lock(res->mu);
  std::string failed;

  const uint64_t epoch = NextEpoch(g.channel, g.slot);
  const size_t parity_offset = (epoch & 1) * half;
  const uint64_t flag_value = epoch * kMaxChunks + 1;  // one chunk: the whole partial
  const size_t flag_index = static_cast<size_t>(g.channel) * kMaxDevices;
  auto recv = [&](int device_rank, int source) {  // recv[source] in the arena of device_rank
    return group.arenas[device_rank] + parity_offset + static_cast<size_t>(source) * slot_bytes;
  };
  char* stage_base = my_arena + parity_offset + static_cast<size_t>(tp) * slot_bytes;
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
  const bool epilogue_reduce = EpilogueReduce(tp, reduce_mode, partial_bytes, s.k, s.batch);
  const PushChunks chunks = PlanPush(s, epilogue_reduce);  // 1: the whole partial
  const int peer = (rank + 1) % static_cast<int>(tp);  // the only peer when epilogue_reduce
  RsGemmProblem own{};  // the own rows with the reduction in the epilogue (tp = 2)
  if (epilogue_reduce) {
    own.gemm = problem;
    own.gemm.a = x_base_of(rank);
    own.gemm.d = z->untyped_data();
    own.c = recv(rank, peer);
    AgGemmWait& wait = own.wait;
    wait = WaitOfThisRank(g, ordinal, epoch, rank_info.typed_data());
    wait.flags[0] = res->ready_flags + flag_index + g.peers[peer];
    wait.flag_base = flag_value - 1;  // chunk c landed once the flag reaches flag_base + c + 1
    wait.rows_per_shard = static_cast<int>(s.m);
    SetChunkEnds(&wait, chunks.ends, chunks.count);
    wait.tp = 1;
    wait.op = static_cast<int32_t>(OpCode::kMatmulReduceScatter);
    wait.source_ranks[0] = peer;
    own.pingpong = OwnRowsPingpong(chunks.count, s.k) ? 1 : 0;
  }
  void* gemm_workspace = nullptr;
  if (const size_t bytes = std::max(GemmSm90WorkspaceBytes(s.dtype, problem),
                                     epilogue_reduce ? RsGemmSm90WorkspaceBytes(s.dtype, own)
                                                     : size_t{0});
      bytes > 0) {
    auto allocation = scratch.Allocate(bytes, 256);
    if (!allocation.has_value()) {
      return Fail("could not allocate " + std::to_string(bytes) + " bytes of GEMM scratch");
    }
    gemm_workspace = *allocation;
  }
  const bool skip = debug_skip_rank == rank;  // test hook: this rank never signals its peers
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
    problem.d = p == rank ? recv(rank, rank) : stage_base + static_cast<size_t>(p) * slot_bytes;
    if (const char* failure = GemmSm90(s.dtype, problem, gemm_workspace, stream)) {
      return Fail(failure);
    }
    JAXFLUX_CUDA(cudaGetLastError());
    if (p == rank) break;
    // The peer's partial, pushed from the side stream chunk by chunk (one chunk: all of it,
    // every batch entry), each chunk flagged on the peer as it lands.
    JAXFLUX_CUDA(cudaEventRecord(res->fork, stream));
    JAXFLUX_CUDA(cudaStreamWaitEvent(res->side, res->fork, 0));
    const size_t out_row = s.n * s.elem;
    const char* stage = static_cast<const char*>(problem.d);
    for (int c = 0; c < chunks.count; ++c) {
      const size_t row0 = c == 0 ? 0 : chunks.ends[c - 1];
      const size_t bytes = chunks.count == 1 ? partial_bytes : (chunks.ends[c] - row0) * out_row;
      JAXFLUX_CUDA(cudaMemcpyAsync(recv(p, rank) + row0 * out_row, stage + row0 * out_row, bytes,
                                   cudaMemcpyDefault, res->side));
      if (!skip && !WriteFlag(res->side, group.ranks[p]->ready_flags + flag_index + g.slot,
                              flag_value + c, &failed)) {
        return Fail(failed);
      }
    }
  }

  if (!epilogue_reduce) {
    WaitReduceParams reduce{};
    reduce.tp = static_cast<int32_t>(tp);
    for (int r = 0; r < tp; ++r) {
      reduce.partials[r] = recv(rank, r);
      reduce.flags[r] = r == rank ? nullptr : res->ready_flags + flag_index + g.peers[r];
    }
    reduce.target = flag_value;
    reduce.out = z->untyped_data();
    reduce.count = s.batch * s.m * s.n;
    reduce.dtype = s.dtype == GemmDtype::kF16 ? ReduceDtype::kF16 : ReduceDtype::kBF16;
    reduce.timeout_ns = TimeoutNs();
    reduce.epoch = epoch;
    reduce.device = ordinal;
    reduce.rank = rank;
    reduce.op = static_cast<int32_t>(OpCode::kMatmulReduceScatter);
    reduce.error = DeviceErrorRecordPtr();
    JAXFLUX_CUDA(LaunchWaitReduce(reduce, 2 * std::max(res->sm_count, 1), stream));
  }
  JAXFLUX_CUDA(cudaEventRecord(res->join, res->side));
  JAXFLUX_CUDA(cudaStreamWaitEvent(stream, res->join, 0));
  return Finish(stream, ordinal, rank, g, epoch, s, std::move(pending));
}

ffi::Error GemmRsSiteCached(cudaStream_t stream, int32_t ordinal, ffi::ScratchAllocator scratch,
                            ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> rank_info,
                            ffi::Result<ffi::AnyBuffer> z, int64_t tp, int64_t num_groups,
                            int64_t site, int64_t generation, int64_t debug_skip_rank,
                            int64_t reduce_mode, int64_t transpose_w) {
  return GemmRs(stream, ordinal, std::move(scratch), nullptr, x, w, rank_info, z, tp, num_groups,
                site, generation, debug_skip_rank, reduce_mode, transpose_w);
}

}  // namespace
}  // namespace jaxflux

#define JAXFLUX_GEMM_RS_BINDING(...)                                                   \
  xla::ffi::Ffi::Bind()                                                                \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>() /* XLA's stream */                \
      .Ctx<xla::ffi::DeviceOrdinal>()                /* CUDA ordinal */                \
      .Ctx<xla::ffi::ScratchAllocator>()             /* CUTLASS scratch, if any */     \
      __VA_ARGS__                                                                      \
      .Arg<xla::ffi::AnyBuffer>()                    /* x: [..., M, K] */              \
      .Arg<xla::ffi::AnyBuffer>()                    /* w: [K, N] or [N, K] */         \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()        /* rank_info */                   \
      .Ret<xla::ffi::AnyBuffer>()                    /* z: [..., M/tp, N] */           \
      .Attr<int64_t>("tp")                                                             \
      .Attr<int64_t>("num_groups")                                                     \
      .Attr<int64_t>("site")                                                           \
      .Attr<int64_t>("generation")                                                     \
      .Attr<int64_t>("debug_skip_rank")                                                \
      .Attr<int64_t>("reduce")                                                         \
      .Attr<int64_t>("transpose_w") /* 1: w is [N, K], the weight transposed */

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfluxGemmRsExecute, jaxflux::GemmRs,
                              JAXFLUX_GEMM_RS_BINDING(
                                  .Ctx<xla::ffi::State<jaxflux::RankState>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfluxGemmRsSiteCached, jaxflux::GemmRsSiteCached,
                              JAXFLUX_GEMM_RS_BINDING());
