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
// Per call and device that is 2 events, one kernel, and chunks x (tp-1) copies and flag writes.
// Why two parities suffice without a "consumed" flag is argued in docs/runtime.md.
#include "xla_ffi/ffi/all_gather.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <memory>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi/errors.h"
#include "xla_ffi/ffi/group.h"
#include "xla_ffi/ffi/group_call.h"
#include "xla_ffi/ffi/workspace_layout.h"
#include "xla_ffi/kernels/signal_kernels.h"
#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"
#include "xla_ffi/runtime/stream_ops.h"

namespace ffi = xla::ffi;

namespace jaxflux {

namespace {

constexpr char kOp[] = "all_gather";
// Its workspace layout (workspace_layout.h); a compile error if kOp has none.
constexpr SlotLayout kLayout = *SlotLayoutOf(kOp);

// The own shard plus every chunk of every peer fits one gather kernel.
static_assert(1 + kMaxChunks * (kMaxRanks - 1) <= kGatherMaxSegments);

#define JAXFLUX_CUDA(call) JAXFLUX_RETURN_IF_CUDA_ERROR(kOp, call)

// A piece of the shard: rows [row0, row0+rows) of `row_bytes` each, bytes [col0, col0+cols).
struct Chunk {
  size_t row0, rows, col0, cols;
};

// Splits [rows x row_bytes] into at most kMaxChunks 2D pieces of about kChunkTargetBytes.
int MakeChunks(size_t rows, size_t row_bytes, std::array<Chunk, kMaxChunks>* chunks) {
  const size_t total = rows * row_bytes;
  size_t k = std::clamp<size_t>(total / kChunkTargetBytes, 1, kMaxChunks);
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
  for (size_t r = 0; r < rows; r += per) {
    (*chunks)[n++] = Chunk{r, std::min(per, rows - r), 0, row_bytes};
  }
  return n;
}

cudaError_t Copy2D(char* dst, size_t dst_pitch, const char* src, size_t src_pitch,
                   const Chunk& c, cudaStream_t stream) {
  return cudaMemcpy2DAsync(dst + c.row0 * dst_pitch + c.col0, dst_pitch,
                           src + c.row0 * src_pitch + c.col0, src_pitch, c.cols, c.rows,
                           cudaMemcpyDefault, stream);
}

ffi::Error CheckInputs(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, int64_t tp) {
  const auto dims = x.dimensions();
  if (dims.size() < 2) {
    return ffi::Error::InvalidArgument("jaxflux all_gather: x must have rank >= 2, got rank " +
                                       std::to_string(dims.size()));
  }
  if (ffi::ByteWidth(x.element_type()) == 0 || x.element_type() == ffi::DataType::PRED) {
    return ffi::Error::InvalidArgument("jaxflux all_gather: unsupported element type");
  }
  if (tp < 2 || tp > kMaxRanks) {
    return InvalidAttr(kOp, "tp", tp, "must be in 2.." + std::to_string(kMaxRanks));
  }
  if (out->element_type() != x.element_type() ||
      out->size_bytes() != x.size_bytes() * static_cast<size_t>(tp)) {
    return ffi::Error::InvalidArgument("jaxflux all_gather: out must be x's dtype and tp times "
                                       "its size");
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<std::unique_ptr<RankState>> RankStateInstantiate() {
  return std::make_unique<RankState>();
}

ffi::Error AllGather(cudaStream_t stream, int32_t ordinal, RankState* state, ffi::RunId run,
                     ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_info,
                     ffi::Result<ffi::AnyBuffer> out,
                     int64_t tp, int64_t num_groups, int64_t site, int64_t workspace_class,
                     int64_t debug_skip_rank) {
  JAXFLUX_RETURN_IF_ERROR(CheckInputs(x, out, tp));
  const auto dims = x.dimensions();
  const size_t elem = ffi::ByteWidth(x.element_type());
  const size_t m = static_cast<size_t>(dims[dims.size() - 2]);
  const size_t k = static_cast<size_t>(dims[dims.size() - 1]);
  const size_t row_bytes = m * k * elem;  // one batch entry of the shard
  const size_t rows = row_bytes == 0 ? 0 : x.size_bytes() / row_bytes;
  const size_t shard_bytes = x.size_bytes();
  // Receive slots: arena half = [source rank][slot_bytes].
  const size_t slot_bytes = SlotBytes(shard_bytes);

  GroupCall call(kOp, stream, ordinal);
  JAXFLUX_RETURN_IF_ERROR(call.Begin(state, rank_info,
                                     {tp, num_groups, site, workspace_class, debug_skip_rank,
                                      run.run_id},
                                     HalfBytes(kLayout, tp, shard_bytes)));
  const GroupInfo& g = call.group();
  const int rank = g.rank;
  DeviceResources* res = call.self();

  std::array<Chunk, kMaxChunks> chunks;
  const int num_chunks = rows == 0 ? 0 : MakeChunks(rows, row_bytes, &chunks);
  const uint64_t epoch = call.epoch();
  const uint64_t base = epoch * kMaxChunks;  // flag value of chunk c at this epoch: base + c + 1
  const size_t out_pitch = row_bytes * tp;
  char* out_base = static_cast<char*>(out->untyped_data());
  const char* x_base = static_cast<const char*>(x.untyped_data());
  // The gather grid spins while chunks are on the link: it takes at most half the SMs, one
  // block each, so that whatever else this device must run meanwhile finds whole SMs free.
  const int max_blocks = std::max(res->sm_count / 2, 1);

  JAXFLUX_RETURN_IF_ERROR(call.ForkSide());

  // Side stream: push x chunk by chunk into every peer's receive slot [parity][rank] (P2P
  // copy-engine writes straight from XLA's input buffer), then write the chunk's flag in every
  // peer's ready array.
  std::string failed;
  auto release = [&](uint64_t value) {
    for (int i = 1; i < tp && !call.skip_signals(); ++i) {
      const int p = (rank + i) % tp;
      if (!WriteFlag(res->side, call.FlagOn(p), value, &failed)) return false;
    }
    return true;
  };
  for (int c = 0; c < num_chunks; ++c) {
    for (int i = 1; i < tp; ++i) {
      const int p = (rank + i) % tp;  // rotated so ranks start on different peers
      JAXFLUX_CUDA(Copy2D(call.ArenaOf(p) + rank * slot_bytes, row_bytes, x_base, row_bytes,
                          chunks[c], res->side));
    }
    if (!release(base + c + 1)) return OpError(kOp, failed);
  }
  if (num_chunks == 0 && !release(base + kMaxChunks)) {  // empty shard: keep the flags moving
    return OpError(kOp, failed);
  }

  // Main stream: one kernel copies the own shard x -> out[rank], then every peer's chunks from
  // the receive slots as they land (bounded waits on the local ready flags).
  GatherParams gather{};
  gather.dst_pitch = out_pitch;
  gather.src_pitch = row_bytes;
  gather.rank_info = rank_info.typed_data();
  gather.rank = rank;
  gather.group = g.group;
  gather.device = ordinal;
  gather.op = static_cast<int32_t>(OpCode::kAllGather);
  gather.epoch = epoch;
  gather.timeout_ns = TimeoutNs();
  gather.error = DeviceErrorRecordPtr();
  int n = 0;
  if (shard_bytes > 0) {
    gather.segments[n++] = GatherSegment{x_base, out_base + rank * row_bytes, rows, row_bytes,
                                         nullptr, 0, rank};
  }
  for (int c = 0; c < std::max(num_chunks, 1); ++c) {
    for (int i = 1; i < tp; ++i) {
      const int p = (rank + tp - i) % tp;  // the peer that pushes to us first
      GatherSegment& seg = gather.segments[n++];
      seg = GatherSegment{nullptr, nullptr, 0, 0, call.FlagFrom(p),
                          num_chunks == 0 ? base + kMaxChunks : base + c + 1, p};
      if (num_chunks == 0) continue;  // wait only
      const Chunk& ch = chunks[c];
      seg.dst = out_base + p * row_bytes + ch.row0 * out_pitch + ch.col0;
      seg.src = call.ArenaOf(rank) + p * slot_bytes + ch.row0 * row_bytes + ch.col0;
      seg.rows = ch.rows;
      seg.cols = ch.cols;
    }
  }
  gather.num_segments = n;
  JAXFLUX_CUDA(LaunchGather(gather, max_blocks, stream));
  // The push reads x: XLA's stream must not move on (and free or reuse x) before it is done.
  JAXFLUX_RETURN_IF_ERROR(call.JoinSide());
  return call.Finish([&] {
    return StrFormat("%zu bytes, %d chunks launched", shard_bytes, num_chunks);
  });
}

}  // namespace
}  // namespace jaxflux

// The instantiate stage of every group target: the per-executable rank state.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfluxRankStateInstantiate, jaxflux::RankStateInstantiate,
                              xla::ffi::Ffi::BindInstantiate());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfluxAllGatherExecute, jaxflux::AllGather,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this device
        .Ctx<xla::ffi::DeviceOrdinal>()                 // CUDA ordinal of this device
        .Ctx<xla::ffi::State<jaxflux::RankState>>()     // ranks found by this instance
        .Ctx<xla::ffi::RunId>()                         // this logical execution
        .Arg<xla::ffi::AnyBuffer>()                     // x: local shard [..., m, k]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank_info: [axis_index, group]
        .Ret<xla::ffi::AnyBuffer>()                     // out: [..., tp*m, k]
        .Attr<int64_t>("tp")                            // group size
        .Attr<int64_t>("num_groups")                    // groups over the other mesh axes
        .Attr<int64_t>("site")                          // unique id of the traced call
        .Attr<int64_t>("workspace_class")               // the workspace arena to use
        .Attr<int64_t>("debug_skip_rank"));             // test hook: rank that never signals
