// Fused AllGather+GEMM: y = all_gather(x, axis=-2) · w, with the gather hidden inside the GEMM.
//
// Per call (epoch e, parity e%2) on this device (rank r of tp), with A = the receive half
// [e%2] of the symmetric workspace laid out as the gathered x, [batch][tp][m][K]:
//   main stream : fork the side stream; x -> A[.., r, ..] (local copy; skipped with local_read,
//                 where the GEMM reads its own rows straight from x) and its flag;
//   side stream : per chunk c of x: copy-engine copy into the same rows of
//                 every peer's A, each followed by a flag write (cuStreamWriteValue64, no SM
//                 needed) ready[this device] = e*kMaxChunks + c + 1 on that peer;
//   main stream : one persistent GEMM over A that starts on rank r's rows and waits, per output
//                 tile, for the flags of the chunks its rows come from
//                 (fused_tile_scheduler_sm90.cuh).
//                 Then, when x_full is requested, A (and x, for the own rows) -> x_full, and
//                 a join with the side stream (the pushes read x, which XLA may reuse once
//                 the call is over).
// FP8 (x e4m3/e5m2, w e4m3 given [N, K], y bf16): x's row scales travel with x. Each parity
// half holds, after A, the gathered scales S [batch][tp][m] (float32), filled like A: the own
// rows' on the main stream before the GEMM, the peers' pushed from the side stream ahead of
// the first chunk, so a chunk's flag also says its scales have landed. The GEMM's epilogue reads
// a tile's row scales from S (a 128-row tile spans whole 128-byte lines of S: it never reads a
// line holding rows it has not waited for).
// Why two parities suffice without a "consumed" handshake: docs/runtime.md (the same argument
// as the push all-gather; the GEMM of call e-1 waits for every chunk of e-1, and the side stream
// of call e forks after it).
#include "xla_ffi/ffi/ag_gemm.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi/attribute_names.h"
#include "xla_ffi/ffi/errors.h"
#include "xla_ffi/ffi/group.h"
#include "xla_ffi/ffi/group_call.h"
#include "xla_ffi/ffi/matmul_operands.h"
#include "xla_ffi/ffi/scratch.h"
#include "xla_ffi/ffi/tile_wait_setup.h"
#include "xla_ffi/ffi/workspace_layout.h"
#include "xla_ffi/kernels/ag_gemm_sm90.h"
#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"
#include "xla_ffi/runtime/stream_ops.h"

namespace ffi = xla::ffi;

namespace jaxflux {

static_assert(kAgGemmConfigNames.size() == kAgGemmNumConfigs,
              "attribute_names.h names every AgGemmConfig");

namespace {

constexpr char kOp[] = "all_gather_matmul";
// Its workspace layout (workspace_layout.h); a compile error if kOp has none.
constexpr SlotLayout kLayout = *SlotLayoutOf(kOp);

static_assert(kTileWaitMaxChunks == kMaxChunks, "the kernel's chunk_ends hold one shard's chunks");

ffi::Error Fail(const std::string& what) { return OpError(kOp, what); }

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("jaxflux all_gather_matmul: ") + what);
}

#define JAXFLUX_CUDA(call) JAXFLUX_RETURN_IF_CUDA_ERROR(kOp, call)

struct Shapes {
  size_t batch = 0, m = 0, k = 0, n = 0, elem = 0, out_elem = 0;
  GemmDtype dtype = GemmDtype::kBF16;
  bool w_kmajor = false;  // w holds the weight transposed, [N, K] (transpose_w)
};

ffi::Error CheckInputs(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer y, int64_t tp,
                       int64_t transpose_w, Shapes* s) {
  s->w_kmajor = transpose_w != 0;
  const std::string types = OperandTypes(x, w, y, s->w_kmajor, &s->dtype, &s->elem, &s->out_elem);
  if (!types.empty()) return Invalid(types);
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const int k_dim = s->w_kmajor ? 1 : 0;
  if (xd.size() < 2 || wd.size() != 2 || xd.back() != wd[k_dim]) {
    return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: expected x [..., m, K] and "
                                       "w [K, N] (or [N, K] with transpose_w)");
  }
  s->m = static_cast<size_t>(xd[xd.size() - 2]);
  s->k = static_cast<size_t>(wd[k_dim]);
  s->n = static_cast<size_t>(wd[1 - k_dim]);
  if (s->m == 0 || s->k == 0 || s->n == 0) {
    return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: empty operands are not "
                                       "supported by the fused kernel");
  }
  s->batch = x.element_count() / (s->m * s->k);
  const size_t align = 16 / s->elem;  // 16-byte rows for TMA
  if (s->k % align || s->n % align) {
    return Invalid("K and N must be multiples of " + std::to_string(align) +
                   " (16-byte rows for TMA)");
  }
  if (tp < 2 || tp > kAgGemmMaxRanks) {
    return InvalidAttr(kOp, "tp", tp, "must be in 2.." + std::to_string(kAgGemmMaxRanks));
  }
  const size_t rows = s->batch * s->m * static_cast<size_t>(tp);
  if (rows > static_cast<size_t>(std::numeric_limits<int>::max()) ||
      s->n > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: a dimension exceeds 2^31-1");
  }
  if (y.element_count() != rows * s->n) {
    return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: y must be [..., tp*m, N]");
  }
  return ffi::Error::Success();
}

// The kernel choices, as the attributes give them (chosen by jaxflux/tuning).
ffi::Error CheckChoices(const Shapes& s, int64_t transpose_w, int64_t tile, int64_t swizzle,
                        int64_t local_read, int64_t grid_sms) {
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "transpose_w", transpose_w, {0, 1}));
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "tile", tile, {0, 1}));
  JAXFLUX_RETURN_IF_ERROR(CheckSwizzle(kOp, "swizzle", swizzle));
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(kOp, "local_read", local_read, {0, 1}));
  if (local_read == 1 && s.m % kAgGemmTileRows != 0) {
    return InvalidAttr(kOp, "local_read", local_read,
                       "needs the shard's rows m to be a multiple of " +
                           std::to_string(kAgGemmTileRows) + " (m=" + std::to_string(s.m) +
                           "); pass local_read=0");
  }
  return CheckGridSms(kOp, grid_sms);
}

// Rows per chunk of a shard: one chunk per shard for batched x (a batch entry's rows are not
// contiguous in A), else up to kMaxChunks pieces of about kChunkTargetBytes, cut at tile rows.
size_t ChunkRows(const Shapes& s) {
  if (s.batch != 1) return s.m;
  const size_t bytes = s.m * s.k * s.elem;
  const size_t pieces = std::clamp<size_t>(bytes / kChunkTargetBytes, 1, kMaxChunks);
  size_t rows = (s.m + pieces - 1) / pieces;
  rows = (rows + kAgGemmTileRows - 1) / kAgGemmTileRows * kAgGemmTileRows;
  return std::min(rows, s.m);
}

ffi::Error AgGemm(cudaStream_t stream, int32_t ordinal, ffi::ScratchAllocator scratch,
                  RankState* state, ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Buffer<ffi::S32> rank_info, ffi::RemainingArgs scales,
                  ffi::Result<ffi::AnyBuffer> y,
                  ffi::RemainingRets extra, int64_t tp, int64_t num_groups, int64_t site,
                  int64_t workspace_class, int64_t debug_skip_rank, int64_t transpose_w,
                  int64_t tile, int64_t swizzle, int64_t local_read, int64_t grid_sms) {
  Shapes s;
  JAXFLUX_RETURN_IF_ERROR(CheckInputs(x, w, *y, tp, transpose_w, &s));
  JAXFLUX_RETURN_IF_ERROR(CheckChoices(s, transpose_w, tile, swizzle, local_read, grid_sms));
  void* x_full = nullptr;
  if (extra.size() > 0) {
    auto ret = extra.get<ffi::AnyBuffer>(0);
    if (ret.has_error()) return ret.error();
    if ((*ret)->size_bytes() != x.size_bytes() * static_cast<size_t>(tp)) {
      return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: x_full must be tp times x");
    }
    x_full = (*ret)->untyped_data();
  }
  const float* x_scale = nullptr;  // FP8: x's, one per row of the shard; w's, one per column
  const float* w_scale = nullptr;
  JAXFLUX_RETURN_IF_ERROR(
      Fp8Scales(kOp, s.dtype, scales, s.batch * s.m, s.n, &x_scale, &w_scale));
  const size_t shard_bytes = x.size_bytes();
  // A, then (FP8) the gathered row scales S, in each parity half.
  const size_t a_bytes = SlotBytes(shard_bytes * static_cast<size_t>(tp));
  const size_t scale_row_bytes = x_scale != nullptr ? s.m * sizeof(float) : 0;  // one entry's
  GroupCall call(kOp, stream, ordinal);
  JAXFLUX_RETURN_IF_ERROR(call.Begin(
      state, rank_info, {tp, num_groups, site, workspace_class, debug_skip_rank, run.run_id},
      HalfBytes(kLayout, tp, shard_bytes, s.batch * scale_row_bytes)));
  const GroupInfo& g = call.group();
  const int rank = g.rank;
  DeviceResources* res = call.self();
  std::string failed;

  const uint64_t epoch = call.epoch();
  const uint64_t base = epoch * kMaxChunks;
  const size_t chunk_rows = ChunkRows(s);
  const size_t num_chunks = (s.m + chunk_rows - 1) / chunk_rows;
  const size_t row_bytes = s.k * s.elem;
  const size_t entry_bytes = s.m * row_bytes;              // one batch entry of one shard
  const size_t a_pitch = entry_bytes * static_cast<size_t>(tp);  // one batch entry of A
  const char* x_base = static_cast<const char*>(x.untyped_data());
  char* a = call.ArenaOf(rank);  // A: this device's receive half

  AgGemmProblem problem{};
  problem.gemm = GemmProblem{a, w.untyped_data(), y->untyped_data(),
                             static_cast<int>(s.batch * s.m * tp), static_cast<int>(s.n),
                             static_cast<int>(s.k), ordinal};
  problem.gemm.b_kmajor = s.w_kmajor;
  problem.gemm.col_scale = w_scale;
  // S [batch][tp][m]: row i of A's batch entry b has its scale at b*tp*m + i.
  char* scales_of_rank = a + a_bytes;  // this device's S
  if (x_scale != nullptr) {
    problem.gemm.row_scale = reinterpret_cast<const float*>(scales_of_rank);
    problem.gemm.batch_stride_row_scale = static_cast<int64_t>(tp) * static_cast<int64_t>(s.m);
  }
  const size_t scale_pitch = scale_row_bytes * static_cast<size_t>(tp);  // one entry of S
  problem.gemm.swizzle = static_cast<int>(swizzle);
  problem.gemm.grid_sms = static_cast<int>(grid_sms);
  problem.wait_for_flags = 1;
  problem.config = static_cast<AgGemmConfig>(tile);
  // local_read: the GEMM reads its own rows straight from x (a shard is a whole number of tile
  // rows, so no tile mixes x's rows with a peer's); else x is copied into its rows of A first.
  const bool local_direct = local_read == 1;
  if (local_direct) problem.a_local = x_base;

  JAXFLUX_RETURN_IF_ERROR(call.ForkSide());
  // Without local_read the local shard goes into A on the main stream, before the GEMM. Not on
  // the side stream: a copy within one device runs as a kernel, which needs an SM, and the GEMM
  // holds every SM while it waits for that copy.
  if (!local_direct) {
    for (size_t b = 0; b < s.batch; ++b) {
      JAXFLUX_CUDA(cudaMemcpyAsync(a + b * a_pitch + rank * entry_bytes, x_base + b * entry_bytes,
                                   entry_bytes, cudaMemcpyDeviceToDevice, stream));
    }
  }
  if (x_scale != nullptr) {  // the own rows' scales into S, on the main stream like the rows
    JAXFLUX_CUDA(cudaMemcpy2DAsync(scales_of_rank + rank * scale_row_bytes, scale_pitch, x_scale,
                                   scale_row_bytes, scale_row_bytes, s.batch,
                                   cudaMemcpyDeviceToDevice, stream));
  }
  // Own rows ready (either way): the GEMM's waits treat every source alike.
  if (!WriteFlag(stream, call.FlagFrom(rank), base + num_chunks, &failed)) return Fail(failed);

  // Side stream: (FP8) the row scales into this rank's rows of S on every peer, then every chunk
  // of x into this rank's rows of A on every peer (P2P copies run on the copy engines), each
  // followed by its flag on that peer. Forked before the local copy, which it does not need.
  for (int i = 1; i < tp && x_scale != nullptr; ++i) {
    const int p = (rank + i) % tp;
    JAXFLUX_CUDA(cudaMemcpy2DAsync(call.ArenaOf(p) + a_bytes + rank * scale_row_bytes, scale_pitch,
                                   x_scale, scale_row_bytes, scale_row_bytes, s.batch,
                                   cudaMemcpyDefault, res->side));
  }
  for (size_t c = 0; c < num_chunks; ++c) {
    const size_t row0 = c * chunk_rows;
    const size_t rows = std::min(chunk_rows, s.m - row0);
    for (int i = 1; i < tp; ++i) {
      const int p = (rank + i) % tp;  // rotated so ranks start on different peers
      char* dst = call.ArenaOf(p) + static_cast<size_t>(rank) * entry_bytes + row0 * row_bytes;
      for (size_t b = 0; b < s.batch; ++b) {
        JAXFLUX_CUDA(cudaMemcpyAsync(dst + b * a_pitch,
                                     x_base + b * entry_bytes + row0 * row_bytes,
                                     rows * row_bytes, cudaMemcpyDefault, res->side));
      }
      if (call.skip_signals()) continue;
      if (!WriteFlag(res->side, call.FlagOn(p), base + c + 1, &failed)) return Fail(failed);
    }
  }

  // Main stream: the GEMM, waiting on the flags per tile.
  TileWait& wait = problem.wait;
  wait = TileWaitOfThisRank(g, ordinal, epoch, rank_info.typed_data());
  for (int p = 0; p < tp; ++p) wait.flags[p] = call.FlagFrom(p);
  wait.flag_base = base;
  wait.rows_per_shard = static_cast<int>(s.m);
  std::array<size_t, kMaxChunks> chunk_ends{};
  for (size_t c = 0; c < num_chunks; ++c) chunk_ends[c] = std::min((c + 1) * chunk_rows, s.m);
  SetChunkEnds(&wait, chunk_ends, static_cast<int>(num_chunks));
  wait.tp = static_cast<int>(tp);
  void* gemm_workspace = nullptr;
  JAXFLUX_RETURN_IF_ERROR(AllocateScratch(kOp, scratch, AgGemmSm90WorkspaceBytes(s.dtype, problem),
                                          &gemm_workspace));
  if (const char* failure = AgGemmSm90(s.dtype, problem, gemm_workspace, stream)) {
    return Fail(failure);
  }
  JAXFLUX_CUDA(cudaGetLastError());
  if (x_full != nullptr && !local_direct) {
    // Every chunk has landed once the GEMM is done: A is x_full, in x_full's layout.
    JAXFLUX_CUDA(cudaMemcpyAsync(x_full, a, shard_bytes * static_cast<size_t>(tp),
                                 cudaMemcpyDeviceToDevice, stream));
  } else if (x_full != nullptr) {
    // A holds the peers' rows only: per batch entry, the ranks before this one and after it
    // from A, this rank's own from x (the same bytes as one copy of A).
    char* dst = static_cast<char*>(x_full);
    const size_t before = static_cast<size_t>(rank) * entry_bytes;
    const size_t after = static_cast<size_t>(tp - 1 - rank) * entry_bytes;
    for (size_t b = 0; b < s.batch; ++b) {
      const size_t at = b * a_pitch;
      if (before > 0) {
        JAXFLUX_CUDA(cudaMemcpyAsync(dst + at, a + at, before, cudaMemcpyDeviceToDevice, stream));
      }
      JAXFLUX_CUDA(cudaMemcpyAsync(dst + at + before, x_base + b * entry_bytes, entry_bytes,
                                   cudaMemcpyDeviceToDevice, stream));
      if (after > 0) {
        JAXFLUX_CUDA(cudaMemcpyAsync(dst + at + before + entry_bytes, a + at + before + entry_bytes,
                                     after, cudaMemcpyDeviceToDevice, stream));
      }
    }
  }
  JAXFLUX_RETURN_IF_ERROR(call.JoinSide());
  return call.Finish([&] {
    return StrFormat("M=%d N=%zu K=%zu, %zu chunks of %zu rows, tile %lld, swizzle %lld, "
                     "local_read %lld", problem.gemm.m, s.n, s.k, num_chunks, chunk_rows,
                     static_cast<long long>(tile), static_cast<long long>(swizzle),
                     static_cast<long long>(local_read));
  });
}

}  // namespace
}  // namespace jaxflux

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfluxAgGemmExecute, jaxflux::AgGemm,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
        .Ctx<xla::ffi::DeviceOrdinal>()                 // CUDA ordinal
        .Ctx<xla::ffi::ScratchAllocator>()              // CUTLASS scratch, if any
        .Ctx<xla::ffi::State<jaxflux::RankState>>()     // ranks found by this instance
        .Ctx<xla::ffi::RunId>()                         // this logical execution
        .Arg<xla::ffi::AnyBuffer>()                     // x: local shard [..., m, K]
        .Arg<xla::ffi::AnyBuffer>()                     // w: [K, N] or [N, K]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank_info
        .RemainingArgs()                                // FP8: x's row and w's column scales
        .Ret<xla::ffi::AnyBuffer>()                     // y: [..., tp*m, N]
        .RemainingRets()                                // optional x_full
        .Attr<int64_t>("tp")
        .Attr<int64_t>("num_groups")
        .Attr<int64_t>("site")
        .Attr<int64_t>("workspace_class")
        .Attr<int64_t>("debug_skip_rank")
        .Attr<int64_t>("transpose_w")  // 1: w is [N, K], the weight transposed
        .Attr<int64_t>("tile")         // AgGemmConfig
        .Attr<int64_t>("swizzle")      // 1, 2, 4 or 8
        .Attr<int64_t>("local_read")   // 1: own rows straight from x (m % 128 == 0)
        .Attr<int64_t>("grid_sms"));   // 0: all SMs
