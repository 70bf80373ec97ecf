// Copy-engine all-gather along axis -2, the communication half of AllGather+GEMM.
//
// Push protocol. Per call (epoch e, parity e%2), on this device (rank r) of a group of tp:
//   side stream : (forked from main) for each chunk c: copy x[c] straight into every peer's
//                 receive slot [e%2][r] (P2P copy-engine write), then release
//                 ready[this device] = e*K+c+1 into every peer's flag array (a stream memory
//                 write after a system-scope barrier: no kernel, no SM)
//   main stream : one kernel (LaunchGather): x -> out[r], then for each chunk c, each peer p:
//                 bounded wait on the local ready[p] >= e*K+c+1, SM copy slot [e%2][p] -> out[p]
//   main waits for side (join) before the handler returns.
// Per call and device that is 2 events, one kernel, and chunks x (tp-1) copies and flag writes:
// the earlier version's one release kernel per chunk and wait + copy kernels per chunk and peer
// cost ~0.12 ms a call with no data moved (docs/runtime.md).
// Why two parities suffice without a "consumed" flag is argued in docs/runtime.md.
#include "xla_ffi/ffi/all_gather.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <array>
#include <memory>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi/errors.h"
#include "xla_ffi/ffi/group.h"
#include "xla_ffi/kernels/signal_kernels.h"
#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"
#include "xla_ffi/runtime/stream_ops.h"

namespace ffi = xla::ffi;

namespace jaxflux {

namespace {

constexpr char kOp[] = "all_gather";

// The own shard plus every chunk of every peer fits one gather kernel.
static_assert(1 + kMaxChunks * (kMaxRanks - 1) <= kGatherMaxSegments);

#define JAXFLUX_CUDA(call) JAXFLUX_RETURN_IF_CUDA_ERROR(kOp, call)

// A piece of the shard: rows [row0, row0+rows) of `row_bytes` each, bytes [col0, col0+cols).
struct Chunk {
  size_t row0, rows, col0, cols;
};

// Upper bound on chunks per shard: kMaxChunks, or fewer via JAXFLUX_AG_MAX_CHUNKS (an experiment
// knob: pipelining pays off for the fused GEMM, while a bare all-gather may prefer fewer launches).
size_t MaxChunks() {
  static const size_t value = [] {
    const char* env = std::getenv("JAXFLUX_AG_MAX_CHUNKS");
    const long n = env ? std::strtol(env, nullptr, 10) : kMaxChunks;
    return static_cast<size_t>(std::clamp<long>(n, 1, kMaxChunks));
  }();
  return value;
}

// Measurement knob, JAXFLUX_AG_ABLATE=push,local,recv: skip those stages (the flags still move,
// so nothing hangs, but the output is WRONG). Timing a run with a stage left out and taking the
// difference places the time without a profiler (the GPU machine has no nsys).
struct Ablation {
  bool push = false, local = false, recv = false;
};
const Ablation& Ablate() {
  static const Ablation value = [] {
    Ablation a;
    const char* env = std::getenv("JAXFLUX_AG_ABLATE");
    const std::string s = env ? env : "";
    a.push = s.find("push") != std::string::npos;
    a.local = s.find("local") != std::string::npos;
    a.recv = s.find("recv") != std::string::npos;
    return a;
  }();
  return value;
}

// Splits [rows x row_bytes] into at most MaxChunks() 2D pieces of about kChunkTargetBytes.
int MakeChunks(size_t rows, size_t row_bytes, std::array<Chunk, kMaxChunks>* chunks) {
  const size_t total = rows * row_bytes;
  size_t k = std::clamp<size_t>(total / kChunkTargetBytes, 1, MaxChunks());
  if (rows == 1) {
    // Split the single row in 256-byte aligned column pieces.
    size_t piece = (row_bytes / k + 255) / 256 * 256;
    if (piece == 0) piece = row_bytes;
    int n = 0;
    for (size_t c = 0; c < row_bytes && n < static_cast<int>(k); c += piece) {
      (*chunks)[n++] = Chunk{0, 1, c, std::min(piece, row_bytes - c)};
    }
    return n;
  }
  k = std::min(k, rows);
  const size_t per = (rows + k - 1) / k;
  int n = 0;
  for (size_t r = 0; r < rows; r += per) (*chunks)[n++] = Chunk{r, std::min(per, rows - r), 0, row_bytes};
  return n;
}

cudaError_t Copy2D(char* dst, size_t dst_pitch, const char* src, size_t src_pitch,
                   const Chunk& c, cudaStream_t stream) {
  return cudaMemcpy2DAsync(dst + c.row0 * dst_pitch + c.col0, dst_pitch,
                           src + c.row0 * src_pitch + c.col0, src_pitch, c.cols, c.rows,
                           cudaMemcpyDefault, stream);
}

ffi::Error AllGatherImpl(cudaStream_t stream, int ordinal, const GroupInfo& g,
                         ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_info,
                         ffi::Result<ffi::AnyBuffer> out, int64_t generation,
                         int64_t debug_skip_rank) {
  // A device error recorded since the last call (e.g. a timeout) fails this call, but only after
  // it has taken part in the protocol, so that epochs stay aligned across the group.
  std::optional<std::string> pending = TakeDeviceErrorMessage();

  const auto dims = x.dimensions();
  const size_t elem = ffi::ByteWidth(x.element_type());
  const size_t m = static_cast<size_t>(dims[dims.size() - 2]);
  const size_t k = static_cast<size_t>(dims[dims.size() - 1]);
  const size_t row_bytes = m * k * elem;  // one batch entry of the shard
  const size_t rows = row_bytes == 0 ? 0 : x.size_bytes() / row_bytes;
  const size_t shard_bytes = x.size_bytes();
  const int tp = g.tp;
  const int rank = g.rank;

  // Receive slots: arena = [parity][source rank][slot_bytes]; parity halves start at `half`.
  const size_t slot_bytes = (shard_bytes + 255) / 256 * 256;
  const size_t half = WorkspaceBytes(generation) / 2;
  if (shard_bytes > 0 && (WorkspaceArena(generation, g.slot) == nullptr ||
                          slot_bytes * static_cast<size_t>(tp) > half)) {
    return ffi::Error::Internal(
        "jaxflux all_gather: workspace generation " + std::to_string(generation) +
        " has no room for " + std::to_string(tp) + " receive slots of a " +
        std::to_string(shard_bytes) + "-byte shard on GPU " + std::to_string(ordinal) +
        " (the op must be traced through jaxflux, which sizes it)");
  }
  DeviceGuard guard(ordinal);
  JAXFLUX_CUDA(guard.status());
  GroupResources group;
  if (ffi::Error e = GetGroupResources("all_gather", generation, g, shard_bytes > 0, &group);
      e.failure()) {
    return e;
  }
  DeviceResources* res = group.self;
  std::lock_guard<std::mutex> device_lock(res->mu);
  const auto& peer_arena = group.arenas;
  const auto& peer_res = group.ranks;

  std::array<Chunk, kMaxChunks> chunks;
  const int num_chunks = rows == 0 ? 0 : MakeChunks(rows, row_bytes, &chunks);
  const uint64_t epoch = NextEpoch(g.channel, g.slot);
  const size_t slot_base = (epoch & 1) * half;
  const uint64_t base = epoch * kMaxChunks;  // flag value of chunk c at this epoch: base + c + 1
  const uint64_t timeout_ns = TimeoutNs();
  DeviceErrorRecord* err_rec = DeviceErrorRecordPtr();
  const size_t out_pitch = row_bytes * tp;
  char* out_base = static_cast<char*>(out->untyped_data());
  const char* x_base = static_cast<const char*>(x.untyped_data());
  char* my_arena = WorkspaceArena(generation, g.slot);
  // The gather grid spins while chunks are on the link: it takes at most half the SMs, one
  // block each, so that whatever else this device must run meanwhile finds whole SMs free (a
  // spinning grid with a block on every SM hung once, docs/runtime.md).
  const int max_blocks = std::max(res->sm_count / 2, 1);

  JAXFLUX_CUDA(cudaEventRecord(res->fork, stream));
  JAXFLUX_CUDA(cudaStreamWaitEvent(res->side, res->fork, 0));

  // Side stream: push x chunk by chunk into every peer's receive slot [parity][rank] (P2P
  // copy-engine writes straight from XLA's input buffer), then write the chunk's flag in every
  // peer's ready array.
  const bool skip = debug_skip_rank == rank;  // test hook: this rank never signals
  const Ablation& ablate = Ablate();
  std::string failed;
  auto release = [&](uint64_t value) {
    for (int i = 1; i < tp && !skip; ++i) {
      const int p = (rank + i) % tp;
      uint64_t* flag =
          peer_res[p]->ready_flags + static_cast<size_t>(g.channel) * kMaxDevices + g.slot;
      if (!WriteFlag(res->side, flag, value, &failed)) return false;
    }
    return true;
  };
  for (int c = 0; c < num_chunks; ++c) {
    for (int i = 1; i < tp && !ablate.push; ++i) {
      const int p = (rank + i) % tp;  // rotated so ranks start on different peers
      JAXFLUX_CUDA(Copy2D(peer_arena[p] + slot_base + rank * slot_bytes, row_bytes, x_base,
                          row_bytes, chunks[c], res->side));
    }
    if (!release(base + c + 1)) return ffi::Error::Internal("jaxflux all_gather: " + failed);
  }
  if (num_chunks == 0 && !release(base + kMaxChunks)) {  // empty shard: keep the flags moving
    return ffi::Error::Internal("jaxflux all_gather: " + failed);
  }

  // Main stream: one kernel copies the own shard x -> out[rank], then every peer's chunks from
  // the receive slots as they land (bounded waits on the local ready flags).
  uint64_t* my_ready = res->ready_flags + static_cast<size_t>(g.channel) * kMaxDevices;
  GatherParams gather{};
  gather.dst_pitch = out_pitch;
  gather.src_pitch = row_bytes;
  gather.rank_info = rank_info.typed_data();
  gather.rank = rank;
  gather.group = g.group;
  gather.device = ordinal;
  gather.op = static_cast<int32_t>(OpCode::kAllGather);
  gather.epoch = epoch;
  gather.timeout_ns = timeout_ns;
  gather.error = err_rec;
  int n = 0;
  if (shard_bytes > 0 && !ablate.local) {
    gather.segments[n++] = GatherSegment{x_base, out_base + rank * row_bytes, rows, row_bytes,
                                         nullptr, 0, rank};
  }
  for (int c = 0; c < std::max(num_chunks, 1); ++c) {
    for (int i = 1; i < tp; ++i) {
      const int p = (rank + tp - i) % tp;  // the peer that pushes to us first
      GatherSegment& seg = gather.segments[n++];
      seg = GatherSegment{nullptr, nullptr, 0, 0, my_ready + g.peers[p],
                          num_chunks == 0 ? base + kMaxChunks : base + c + 1, p};
      if (num_chunks == 0 || ablate.recv) continue;  // wait only
      const Chunk& ch = chunks[c];
      seg.dst = out_base + p * row_bytes + ch.row0 * out_pitch + ch.col0;
      seg.src = my_arena + slot_base + p * slot_bytes + ch.row0 * row_bytes + ch.col0;
      seg.rows = ch.rows;
      seg.cols = ch.cols;
    }
  }
  gather.num_segments = n;
  JAXFLUX_CUDA(LaunchGather(gather, max_blocks, stream));
  // The push reads x: XLA's stream must not move on (and free or reuse x) before it is done.
  JAXFLUX_CUDA(cudaEventRecord(res->join, res->side));
  JAXFLUX_CUDA(cudaStreamWaitEvent(stream, res->join, 0));

  if (DebugEnabled()) {
    std::fprintf(stderr, "[jaxflux] GPU %d rank %d channel %d: all_gather epoch %llu, %zu bytes, "
                 "%d chunks launched\n", ordinal, rank, g.channel,
                 static_cast<unsigned long long>(epoch), shard_bytes, num_chunks);
  }
  if (SyncErrors()) {
    JAXFLUX_CUDA(cudaStreamSynchronize(stream));
    if (!pending) pending = TakeDeviceErrorMessage();
  }
  if (pending) return ffi::Error::Internal(*pending);
  return ffi::Error::Success();
}

ffi::Error CheckInputs(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_info,
                       ffi::Result<ffi::AnyBuffer> out, int64_t tp) {
  const auto dims = x.dimensions();
  if (dims.size() < 2) {
    return ffi::Error::InvalidArgument("jaxflux all_gather: x must have rank >= 2, got rank " +
                                       std::to_string(dims.size()));
  }
  if (ffi::ByteWidth(x.element_type()) == 0 || x.element_type() == ffi::DataType::PRED) {
    return ffi::Error::InvalidArgument("jaxflux all_gather: unsupported element type");
  }
  if (out->element_type() != x.element_type() ||
      out->size_bytes() != x.size_bytes() * static_cast<size_t>(tp)) {
    return ffi::Error::InvalidArgument("jaxflux all_gather: out must be x's dtype and tp times "
                                       "its size");
  }
  if (const auto n = static_cast<int64_t>(rank_info.element_count()); n != 2 && n != 2 + tp) {
    return ffi::Error::InvalidArgument("jaxflux all_gather: rank_info must hold 2 (or 2 + tp) "
                                       "int32s");
  }
  if (tp < 2 || tp > kMaxRanks) {
    return ffi::Error::InvalidArgument("jaxflux all_gather: tp must be in 2.." +
                                       std::to_string(kMaxRanks) + ", got " + std::to_string(tp));
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<std::unique_ptr<RankState>> AllGatherInstantiate() {
  return std::make_unique<RankState>();
}

ffi::Error AllGatherExecute(cudaStream_t stream, int32_t ordinal, RankState* state,
                            ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_info,
                            ffi::Result<ffi::AnyBuffer> out, int64_t tp, int64_t num_groups,
                            int64_t site, int64_t generation, int64_t debug_skip_rank) {
  if (ffi::Error e = CheckInputs(x, rank_info, out, tp); e.failure()) return e;
  GroupInfo g;
  if (ffi::Error e =
          ResolveGroup("all_gather", stream, ordinal, state, rank_info, site, tp, num_groups, &g);
      e.failure()) {
    return e;
  }
  return AllGatherImpl(stream, ordinal, g, x, rank_info, out, generation, debug_skip_rank);
}

ffi::Error AllGatherSiteCached(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                               ffi::Buffer<ffi::S32> rank_info,
                               ffi::Result<ffi::AnyBuffer> out, int64_t tp, int64_t num_groups,
                               int64_t site, int64_t generation, int64_t debug_skip_rank) {
  return AllGatherExecute(stream, ordinal, nullptr, x, rank_info, out, tp, num_groups, site,
                          generation, debug_skip_rank);
}

}  // namespace
}  // namespace jaxflux

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfluxAllGatherInstantiate, jaxflux::AllGatherInstantiate,
                              xla::ffi::Ffi::BindInstantiate());

// The stateful and the site-cached target differ only in the State context.
#define JAXFLUX_ALL_GATHER_BINDING(...)                                                  \
  xla::ffi::Ffi::Bind()                                                                  \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>() /* XLA's stream for this device */  \
      .Ctx<xla::ffi::DeviceOrdinal>()                /* CUDA ordinal of this device */   \
      __VA_ARGS__                                                                        \
      .Arg<xla::ffi::AnyBuffer>()             /* x: local shard [..., m, k] */           \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>() /* rank_info: [axis_index, group] */       \
      .Ret<xla::ffi::AnyBuffer>()             /* out: [..., tp*m, k] */                  \
      .Attr<int64_t>("tp")                    /* group size */                           \
      .Attr<int64_t>("num_groups")            /* groups over the other mesh axes */      \
      .Attr<int64_t>("site")                  /* unique id of the traced call */         \
      .Attr<int64_t>("generation")            /* workspace generation to use */          \
      .Attr<int64_t>("debug_skip_rank")       /* test hook: rank that never signals */

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfluxAllGatherExecute, jaxflux::AllGatherExecute,
                              JAXFLUX_ALL_GATHER_BINDING(
                                  .Ctx<xla::ffi::State<jaxflux::RankState>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfluxAllGatherSiteCached, jaxflux::AllGatherSiteCached,
                              JAXFLUX_ALL_GATHER_BINDING());
