// The device-side error record and op codes every jaxflux kernel reports through, and the
// receiving kernel of the copy-engine all-gather. Host-callable from plain C++; the device code
// is in signal_kernels.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace jaxflux {

enum class OpCode : int32_t {
  kAllGather = 1,
  kAllGatherMatmul = 2,
  kMatmulReduceScatter = 3,
  kMatmulAllReduce = 4,
  kMoeAllGatherGroupedMatmul = 5,
  kMoeGroupedMatmulReduceScatter = 6,
};
enum class ErrorKind : int32_t { kNone = 0, kTimeout = 1, kRankMismatch = 2 };

// Written by device code into host-mapped pinned memory; the first error wins (claim), and
// `ready` is set last so the host never reads a half-written record.
struct DeviceErrorRecord {
  int32_t claim;     // 0 free, 1 taken by a writer
  int32_t ready;     // 1 once the fields below are valid
  int32_t kind;      // ErrorKind
  int32_t op;        // OpCode
  int32_t device;    // CUDA ordinal that recorded it
  int32_t rank;      // rank of that device in its group
  int32_t peer;      // rank waited for (timeout) or rank read from the operand (mismatch)
  int32_t group;     // group of that device (mismatch: group read from the operand)
  uint64_t target;   // flag value waited for
  uint64_t seen;     // flag value seen last
  uint64_t epoch;
  uint64_t timeout_ns;
};

// The receiving half of the push all-gather, as one kernel per call: the local shard into `out`
// first, then each peer's chunks in the order they arrive, each after a bounded wait on the
// local flag its pusher writes once the chunk has landed in this device's receive slot. Every
// block waits for the flag of each segment it copies (thread 0 polls, the block syncs), so the
// grid spins while chunks are on the link; that is safe because nothing a device must run for
// its peers needs an SM: pushes are copy-engine copies and releases stream memory writes
// (stream_ops.h). Once any wait has failed, the others stop waiting (the results are void),
// so a dead peer costs one timeout per call.
inline constexpr int kGatherMaxSegments = 64;

struct GatherSegment {
  const char* src;
  char* dst;
  size_t rows, cols;       // rows of `cols` bytes (pitches in GatherParams)
  const uint64_t* flag;    // nullptr: copy at once (the local shard)
  uint64_t target;         // wait until *flag >= target
  int32_t peer;            // the rank that pushes this segment (named in a timeout)
};

struct GatherParams {
  GatherSegment segments[kGatherMaxSegments];
  int32_t num_segments;
  size_t dst_pitch, src_pitch;
  // Who waits, for error records, and the rank check: the rank cached at discovery must match
  // this program's [axis_index, group] operand, or data would land in the wrong rows.
  const int32_t* rank_info;
  int32_t rank, group, device, op;
  uint64_t epoch, timeout_ns;
  DeviceErrorRecord* error;
};

// `max_blocks` caps the grid (two 512-thread blocks per SM fit).
cudaError_t LaunchGather(const GatherParams& params, int max_blocks, cudaStream_t stream);

}  // namespace jaxflux
