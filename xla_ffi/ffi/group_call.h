// The frame every communicating handler (all_gather, all_gather_matmul, matmul_reduce_scatter)
// runs its protocol in: Begin() is the preamble, Finish() the tail, written once here.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi/group.h"
#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"

namespace jaxflux {

// The attributes every group target takes.
struct GroupAttrs {
  int64_t tp = 0;
  int64_t num_groups = 0;
  int64_t site = 0;             // the call's signature key (discovery's rendezvous key)
  int64_t workspace_class = 0;  // the workspace arena to use (runtime.h)
  int64_t debug_skip_rank = -1;  // test hook: this rank never signals its peers
  int64_t run_id = 0;            // XLA's logical execution (discovery's rendezvous key)
};

// printf into a std::string (the handlers' debug traces).
std::string StrFormat(const char* format, ...) __attribute__((format(printf, 1, 2)));

class GroupCall {
 public:
  GroupCall(const char* op, cudaStream_t stream, int32_t ordinal)
      : op_(op), stream_(stream), ordinal_(ordinal) {}
  GroupCall(const GroupCall&) = delete;
  GroupCall& operator=(const GroupCall&) = delete;

  // The preamble, in protocol order: the group (discovery on the first call of this executable
  // instance), any device error recorded since the last call (Finish returns it, only after this
  // call has taken part in the protocol, so that epochs stay aligned across the group), the
  // workspace check (`half_bytes` of each parity half this call uses; 0: none), the device made
  // current, every rank's resources, this device's lock (one handler at a time), and the epoch.
  xla::ffi::Error Begin(RankState* state, xla::ffi::Buffer<xla::ffi::S32> rank_info,
                        const GroupAttrs& attrs, size_t half_bytes);

  // The tail: the debug trace (describe() returns what follows "<op> epoch <e>, "), the
  // synchronous error check when configured, and the pending device error if any.
  template <class Describe>
  xla::ffi::Error Finish(Describe&& describe) {
    if (DebugEnabled()) Trace(describe());
    return FinishErrors();
  }

  const GroupInfo& group() const { return g_; }
  int rank() const { return g_.rank; }
  int tp() const { return g_.tp; }
  int32_t ordinal() const { return ordinal_; }
  uint64_t epoch() const { return epoch_; }
  DeviceResources* self() const { return resources_.self; }
  // Bytes of each parity half of the workspace; the half this epoch uses starts at
  // parity_offset() in every rank's arena.
  size_t half() const { return half_; }
  size_t parity_offset() const { return (epoch_ & 1) * half_; }
  // Rank `rank`'s arena (this device's at rank()), at this epoch's parity half.
  char* ArenaOf(int rank) const { return resources_.arenas[rank] + parity_offset(); }
  // This device's flag that rank `source` writes (source == rank(): the own flag).
  uint64_t* FlagFrom(int source) const {
    return resources_.self->ready_flags + FlagIndex() + g_.peers[source];
  }
  // This device's flag in rank `peer`'s flag array.
  uint64_t* FlagOn(int peer) const {
    return resources_.ranks[peer]->ready_flags + FlagIndex() + g_.slot;
  }
  // Test hook (debug_skip_rank): this rank writes no flag on its peers.
  bool skip_signals() const { return skip_signals_; }

  // The side stream starts after everything queued on XLA's stream so far / XLA's stream
  // continues only after everything queued on the side stream.
  xla::ffi::Error ForkSide();
  xla::ffi::Error JoinSide();

 private:
  size_t FlagIndex() const { return static_cast<size_t>(g_.channel) * kMaxDevices; }
  void Trace(const std::string& detail) const;
  xla::ffi::Error FinishErrors();

  const char* op_;
  cudaStream_t stream_;
  int32_t ordinal_;
  GroupInfo g_;
  GroupResources resources_;
  std::optional<std::string> pending_;
  size_t half_ = 0;
  uint64_t epoch_ = 0;
  bool skip_signals_ = false;
  std::optional<DeviceGuard> guard_;          // restored last
  std::unique_lock<std::mutex> device_lock_;  // released first
};

}  // namespace jaxflux
