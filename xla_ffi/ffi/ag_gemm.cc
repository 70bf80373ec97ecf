// Fused AllGather+GEMM: y = all_gather(x, axis=-2) · w, with the gather hidden inside the GEMM.
//
// Per call (epoch e, parity e%2) on this device (rank r of tp), with A = the receive half
// [e%2] of the symmetric workspace laid out as the gathered x, [batch][tp][m][K]:
//   main stream : fork the side stream; x -> A[.., r, ..] (local copy; skipped when the GEMM
//                 reads its own rows straight from x, the default where a shard is a whole
//                 number of tiles) and its flag;
//   side stream : per chunk c of x: copy-engine copy into the same rows of
//                 every peer's A, each followed by a flag write (cuStreamWriteValue64, no SM
//                 needed) ready[this device] = e*kMaxChunks + c + 1 on that peer;
//   main stream : one persistent GEMM over A that starts on rank r's rows and waits, per output
//                 tile, for the flags of the chunks its rows come from (ag_gemm_scheduler_sm90).
//                 Then, when x_full is requested, A (and x, for the own rows) -> x_full, and
//                 a join with the side stream (the pushes read x, which XLA may reuse once
//                 the call is over).
// Why two parities suffice without a "consumed" handshake: docs/runtime.md (the same argument
// as the push all-gather; the GEMM of call e-1 waits for every chunk of e-1, and the side stream
// of call e forks after it).
#include "xla_ffi/ffi/ag_gemm.h"

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
#include "xla_ffi/kernels/ag_gemm_sm90.h"
#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"
#include "xla_ffi/runtime/stream_ops.h"

namespace ffi = xla::ffi;

namespace jaxflux {
namespace {

constexpr int kChunkRowAlign = 128;                    // the GEMM's tile height

constexpr char kOp[] = "all_gather_matmul";

ffi::Error Fail(const std::string& what) { return OpError(kOp, what); }

// Where the GEMM reads this rank's own rows (JAXFLUX_AG_GEMM_LOCAL, a measurement knob):
// "direct" (default) straight from x wherever a shard is a whole number of tile rows
// (AgGemmProblem::a_local), so nothing is copied before the GEMM; "copy" always copies x into
// the gathered buffer first (the earlier design, and the fallback for other shard sizes).
bool LocalDirectAllowed() {
  static const bool allowed = [] {
    const char* env = std::getenv("JAXFLUX_AG_GEMM_LOCAL");
    return env == nullptr || std::string(env) != "copy";
  }();
  return allowed;
}

#define JAXFLUX_CUDA(call) JAXFLUX_RETURN_IF_CUDA_ERROR(kOp, call)

struct Shapes {
  size_t batch = 0, m = 0, k = 0, n = 0, elem = 0;
  GemmDtype dtype = GemmDtype::kBF16;
  bool w_kmajor = false;  // w holds the weight transposed, [N, K] (transpose_w)
};

ffi::Error CheckInputs(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> rank_info,
                       ffi::AnyBuffer y, int64_t tp, int64_t transpose_w, Shapes* s) {
  const auto dt = x.element_type();
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: x must be bfloat16 or float16");
  }
  if (w.element_type() != dt || y.element_type() != dt) {
    return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: x, w and y need one dtype");
  }
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  s->w_kmajor = transpose_w != 0;
  const int k_dim = s->w_kmajor ? 1 : 0;
  if (xd.size() < 2 || wd.size() != 2 || xd.back() != wd[k_dim]) {
    return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: expected x [..., m, K] and "
                                       "w [K, N] (or [N, K] with transpose_w)");
  }
  s->m = static_cast<size_t>(xd[xd.size() - 2]);
  s->k = static_cast<size_t>(wd[k_dim]);
  s->n = static_cast<size_t>(wd[1 - k_dim]);
  s->elem = ffi::ByteWidth(dt);
  s->dtype = dt == ffi::DataType::BF16 ? GemmDtype::kBF16 : GemmDtype::kF16;
  if (s->m == 0 || s->k == 0 || s->n == 0) {
    return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: empty operands are not "
                                       "supported by the fused kernel");
  }
  s->batch = x.element_count() / (s->m * s->k);
  if (s->k % 8 || s->n % 8) {
    return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: K and N must be multiples of "
                                       "8 (16-byte rows for TMA)");
  }
  if (tp < 2 || tp > kAgGemmMaxRanks) {
    return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: tp must be in 2.." +
                                       std::to_string(kAgGemmMaxRanks));
  }
  const size_t rows = s->batch * s->m * static_cast<size_t>(tp);
  if (rows > static_cast<size_t>(std::numeric_limits<int>::max()) ||
      s->n > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: a dimension exceeds 2^31-1");
  }
  if (y.element_count() != rows * s->n) {
    return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: y must be [..., tp*m, N]");
  }
  if (const auto n = static_cast<int64_t>(rank_info.element_count()); n != 2 && n != 2 + tp) {
    return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: rank_info must hold 2 (or "
                                       "2 + tp) int32s");
  }
  return ffi::Error::Success();
}

// Rows per chunk of a shard: one chunk per shard for batched x (a batch entry's rows are not
// contiguous in A), else up to kMaxChunks pieces of about kChunkTargetBytes, cut at tile rows.
size_t ChunkRows(const Shapes& s) {
  if (s.batch != 1) return s.m;
  const size_t bytes = s.m * s.k * s.elem;
  const size_t pieces = std::clamp<size_t>(bytes / kChunkTargetBytes, 1, kMaxChunks);
  size_t rows = (s.m + pieces - 1) / pieces;
  rows = (rows + kChunkRowAlign - 1) / kChunkRowAlign * kChunkRowAlign;
  return std::min(rows, s.m);
}

ffi::Error AgGemm(cudaStream_t stream, int32_t ordinal, ffi::ScratchAllocator scratch,
                  RankState* state, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Buffer<ffi::S32> rank_info, ffi::Result<ffi::AnyBuffer> y,
                  ffi::RemainingRets extra, int64_t tp, int64_t num_groups, int64_t site,
                  int64_t generation, int64_t debug_skip_rank, int64_t config,
                  int64_t transpose_w) {
  Shapes s;
  if (ffi::Error e = CheckInputs(x, w, rank_info, *y, tp, transpose_w, &s); e.failure()) {
    return e;
  }
  if (config >= kAgGemmNumConfigs) {
    return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: config must be -1 (choose) or "
                                       "0.." + std::to_string(kAgGemmNumConfigs - 1));
  }
  void* x_full = nullptr;
  if (extra.size() > 0) {
    auto ret = extra.get<ffi::AnyBuffer>(0);
    if (ret.has_error()) return ret.error();
    if ((*ret)->size_bytes() != x.size_bytes() * static_cast<size_t>(tp)) {
      return ffi::Error::InvalidArgument("jaxflux all_gather_matmul: x_full must be tp times x");
    }
    x_full = (*ret)->untyped_data();
  }
  GroupInfo g;
  if (ffi::Error e = ResolveGroup("all_gather_matmul", stream, ordinal, state,
                                  rank_info, site, tp, num_groups, &g);
      e.failure()) {
    return e;
  }
  // A device error recorded since the last call fails this call, but only after it has taken
  // part in the protocol, so that epochs stay aligned across the group.
  std::optional<std::string> pending = TakeDeviceErrorMessage();

  const int rank = g.rank;
  const size_t shard_bytes = x.size_bytes();
  const size_t half = WorkspaceBytes(generation) / 2;
  char* my_arena = WorkspaceArena(generation, g.slot);
  if (my_arena == nullptr || shard_bytes * static_cast<size_t>(tp) > half || half % 256 != 0) {
    return Fail("workspace generation " + std::to_string(generation) + " has no room for " +
                std::to_string(tp) + " shards of " + std::to_string(shard_bytes) +
                " bytes on GPU " + std::to_string(ordinal) +
                " (the op must be traced through jaxflux, which sizes it)");
  }
  DeviceGuard guard(ordinal);
  JAXFLUX_CUDA(guard.status());
  GroupResources group;
  if (ffi::Error e = GetGroupResources("all_gather_matmul", generation, g, true, &group);
      e.failure()) {
    return e;
  }
  DeviceResources* res = group.self;
  std::lock_guard<std::mutex> device_lock(res->mu);
  const auto& peer_arena = group.arenas;
  const auto& peer_res = group.ranks;
  std::string failed;

  const uint64_t epoch = NextEpoch(g.channel, g.slot);
  const size_t parity_offset = (epoch & 1) * half;
  const uint64_t base = epoch * kMaxChunks;
  const size_t chunk_rows = ChunkRows(s);
  const size_t num_chunks = (s.m + chunk_rows - 1) / chunk_rows;
  const size_t row_bytes = s.k * s.elem;
  const size_t entry_bytes = s.m * row_bytes;              // one batch entry of one shard
  const size_t a_pitch = entry_bytes * static_cast<size_t>(tp);  // one batch entry of A
  const char* x_base = static_cast<const char*>(x.untyped_data());
  const size_t flag_index = static_cast<size_t>(g.channel) * kMaxDevices;

  AgGemmProblem problem{};
  problem.gemm = GemmProblem{my_arena + parity_offset, w.untyped_data(), y->untyped_data(),
                             static_cast<int>(s.batch * s.m * tp), static_cast<int>(s.n),
                             static_cast<int>(s.k), ordinal};
  problem.gemm.b_kmajor = s.w_kmajor;
  problem.wait_for_flags = 1;
  problem.config = config >= 0 ? static_cast<AgGemmConfig>(config)
                               : ChooseAgGemmConfig(problem.gemm);
  // The GEMM reads its own rows straight from x when a shard is a whole number of tiles (no tile
  // then mixes x's rows with a peer's); else x is copied into its rows of A first.
  const bool local_direct =
      LocalDirectAllowed() && s.m % static_cast<size_t>(AgGemmTileRows(problem.config)) == 0;
  if (local_direct) problem.a_local = x_base;

  JAXFLUX_CUDA(cudaEventRecord(res->fork, stream));
  JAXFLUX_CUDA(cudaStreamWaitEvent(res->side, res->fork, 0));
  // Without local_direct the local shard goes into A on the main stream, before the GEMM. Not on
  // the side stream: a copy within one device runs as a kernel, which needs an SM, and the GEMM
  // holds every SM while it waits for that copy (measured on 2xH200: the wait timed out, even
  // with the driver asked to prefer a copy engine). It costs one serial read and write of the
  // shard, which local_direct saves.
  if (!local_direct) {
    for (size_t b = 0; b < s.batch; ++b) {
      JAXFLUX_CUDA(cudaMemcpyAsync(my_arena + parity_offset + b * a_pitch + rank * entry_bytes,
                                   x_base + b * entry_bytes, entry_bytes,
                                   cudaMemcpyDeviceToDevice, stream));
    }
  }
  // Own rows ready (either way): the GEMM's waits treat every source alike.
  if (!WriteFlag(stream, res->ready_flags + flag_index + g.slot, base + num_chunks, &failed)) {
    return Fail(failed);
  }

  // Side stream: every chunk of x into this rank's rows of A on every peer (P2P copies run on
  // the copy engines), each followed by its flag on that peer. Forked before the local copy,
  // which it does not need.
  const bool skip = debug_skip_rank == rank;  // test hook: this rank never signals its peers
  for (size_t c = 0; c < num_chunks; ++c) {
    const size_t row0 = c * chunk_rows;
    const size_t rows = std::min(chunk_rows, s.m - row0);
    for (int i = 1; i < tp; ++i) {
      const int p = (rank + i) % tp;  // rotated so ranks start on different peers
      char* dst = peer_arena[p] + parity_offset + static_cast<size_t>(rank) * entry_bytes +
                  row0 * row_bytes;
      for (size_t b = 0; b < s.batch; ++b) {
        JAXFLUX_CUDA(cudaMemcpyAsync(dst + b * a_pitch,
                                     x_base + b * entry_bytes + row0 * row_bytes,
                                     rows * row_bytes, cudaMemcpyDefault, res->side));
      }
      if (skip) continue;
      uint64_t* flag = peer_res[p]->ready_flags + flag_index + g.slot;
      if (!WriteFlag(res->side, flag, base + c + 1, &failed)) return Fail(failed);
    }
  }

  // Main stream: the GEMM, waiting on the flags per tile.
  AgGemmWait& wait = problem.wait;
  wait = WaitOfThisRank(g, ordinal, epoch, rank_info.typed_data());
  for (int p = 0; p < tp; ++p) wait.flags[p] = res->ready_flags + flag_index + g.peers[p];
  wait.flag_base = base;
  wait.rows_per_shard = static_cast<int>(s.m);
  std::array<size_t, kMaxChunks> chunk_ends{};
  for (size_t c = 0; c < num_chunks; ++c) chunk_ends[c] = std::min((c + 1) * chunk_rows, s.m);
  SetChunkEnds(&wait, chunk_ends, static_cast<int>(num_chunks));
  wait.tp = static_cast<int>(tp);
  void* gemm_workspace = nullptr;
  if (const size_t bytes = AgGemmSm90WorkspaceBytes(s.dtype, problem); bytes > 0) {
    auto allocation = scratch.Allocate(bytes, 256);
    if (!allocation.has_value()) {
      return Fail("could not allocate " + std::to_string(bytes) + " bytes of GEMM scratch");
    }
    gemm_workspace = *allocation;
  }
  if (const char* failure = AgGemmSm90(s.dtype, problem, gemm_workspace, stream)) {
    return Fail(failure);
  }
  JAXFLUX_CUDA(cudaGetLastError());
  if (x_full != nullptr && !local_direct) {
    // Every chunk has landed once the GEMM is done: A is x_full, in x_full's layout.
    JAXFLUX_CUDA(cudaMemcpyAsync(x_full, my_arena + parity_offset,
                                 shard_bytes * static_cast<size_t>(tp), cudaMemcpyDeviceToDevice,
                                 stream));
  } else if (x_full != nullptr) {
    // A holds the peers' rows only: per batch entry, the ranks before this one and after it
    // from A, this rank's own from x (the same bytes as one copy of A).
    char* dst = static_cast<char*>(x_full);
    const char* a = my_arena + parity_offset;
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
  JAXFLUX_CUDA(cudaEventRecord(res->join, res->side));
  JAXFLUX_CUDA(cudaStreamWaitEvent(stream, res->join, 0));

  if (DebugEnabled()) {
    std::fprintf(stderr, "[jaxflux] GPU %d rank %d channel %d: all_gather_matmul epoch %llu, "
                 "M=%d N=%zu K=%zu, %zu chunks of %zu rows\n", ordinal, rank, g.channel,
                 static_cast<unsigned long long>(epoch), problem.gemm.m, s.n, s.k, num_chunks,
                 chunk_rows);
  }
  if (SyncErrors()) {
    JAXFLUX_CUDA(cudaStreamSynchronize(stream));
    if (!pending) pending = TakeDeviceErrorMessage();
  }
  if (pending) return ffi::Error::Internal(*pending);
  return ffi::Error::Success();
}

ffi::Error AgGemmSiteCached(cudaStream_t stream, int32_t ordinal, ffi::ScratchAllocator scratch,
                            ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> rank_info,
                            ffi::Result<ffi::AnyBuffer> y, ffi::RemainingRets extra, int64_t tp,
                            int64_t num_groups, int64_t site, int64_t generation,
                            int64_t debug_skip_rank, int64_t config, int64_t transpose_w) {
  return AgGemm(stream, ordinal, std::move(scratch), nullptr, x, w, rank_info, y, extra, tp,
                num_groups, site, generation, debug_skip_rank, config, transpose_w);
}

}  // namespace
}  // namespace jaxflux

#define JAXFLUX_AG_GEMM_BINDING(...)                                                   \
  xla::ffi::Ffi::Bind()                                                                \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>() /* XLA's stream */                \
      .Ctx<xla::ffi::DeviceOrdinal>()                /* CUDA ordinal */                \
      .Ctx<xla::ffi::ScratchAllocator>()             /* CUTLASS scratch, if any */     \
      __VA_ARGS__                                                                      \
      .Arg<xla::ffi::AnyBuffer>()                    /* x: local shard [..., m, K] */  \
      .Arg<xla::ffi::AnyBuffer>()                    /* w: [K, N] or [N, K] */         \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()        /* rank_info */                   \
      .Ret<xla::ffi::AnyBuffer>()                    /* y: [..., tp*m, N] */           \
      .RemainingRets()                               /* optional x_full */             \
      .Attr<int64_t>("tp")                                                             \
      .Attr<int64_t>("num_groups")                                                     \
      .Attr<int64_t>("site")                                                           \
      .Attr<int64_t>("generation")                                                     \
      .Attr<int64_t>("debug_skip_rank")                                                \
      .Attr<int64_t>("config")      /* AgGemmConfig, -1: ChooseAgGemmConfig */         \
      .Attr<int64_t>("transpose_w") /* 1: w is [N, K], the weight transposed */

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfluxAgGemmExecute, jaxflux::AgGemm,
                              JAXFLUX_AG_GEMM_BINDING(
                                  .Ctx<xla::ffi::State<jaxflux::RankState>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfluxAgGemmSiteCached, jaxflux::AgGemmSiteCached,
                              JAXFLUX_AG_GEMM_BINDING());
