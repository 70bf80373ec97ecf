// Launchers of the tiny signalling kernels (release, bounded wait, landed marks). Host-callable
// from plain C++; the device code is in signal_kernels.cu.
#ifndef JAXFLUX_XLA_FFI_KERNELS_SIGNAL_KERNELS_H_
#define JAXFLUX_XLA_FFI_KERNELS_SIGNAL_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jaxflux {

inline constexpr int kSignalMaxTargets = 8;

enum class OpCode : int32_t { kAllGather = 1, kAllGatherMatmul = 2, kMatmulReduceScatter = 3 };
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

struct ReleaseParams {
  uint64_t* flags[kSignalMaxTargets];  // flag of this rank in each peer's ready array
  int32_t num_flags;
  uint64_t value;                      // epoch * chunks + chunk + 1
  const int32_t* rank_info;            // [axis_index, group_index] operand of this call
  int32_t expected_rank;               // rank cached at discovery; mismatch => error record
  int32_t expected_group;
  int32_t device;
  int32_t op;
  uint64_t epoch;
  DeviceErrorRecord* error;
};

struct WaitParams {
  const uint64_t* flag;   // local flag a peer releases
  uint64_t target;        // wait until *flag >= target
  uint64_t timeout_ns;
  uint64_t epoch;
  int32_t device, rank, peer, op;
  DeviceErrorRecord* error;
};

struct MarkParams {
  uint64_t* flag;
  uint64_t value;
};

// Bounded wait on a local flag (one-thread kernel, skipped when `flag` is null), then an SM
// copy of a 2D piece: `rows` rows of `cols` bytes from src (pitch src_pitch) to dst (pitch
// dst_pitch). Used by the receiver of the push all-gather to move a landed chunk from its
// receive slot into `out`. On timeout the error is recorded (the copy still runs; the call's
// results are invalid anyway).
struct WaitCopyParams {
  WaitParams wait;        // wait.flag == nullptr: copy at once
  char* dst;
  const char* src;
  size_t dst_pitch, src_pitch, rows, cols;
};

// `max_blocks` caps the copy grid.
cudaError_t LaunchWaitCopy(const WaitCopyParams& params, int max_blocks, cudaStream_t stream);

cudaError_t LaunchRelease(const ReleaseParams& params, cudaStream_t stream);
cudaError_t LaunchWait(const WaitParams& params, cudaStream_t stream);
cudaError_t LaunchMark(const MarkParams& params, cudaStream_t stream);

}  // namespace jaxflux

#endif  // JAXFLUX_XLA_FFI_KERNELS_SIGNAL_KERNELS_H_
