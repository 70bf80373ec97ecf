#include "xla_ffi/ffi/group_call.h"

#include <cstdarg>
#include <cstdio>
#include <string>

#include "xla_ffi/ffi/errors.h"

namespace ffi = xla::ffi;

namespace jaxflux {

ffi::Error GroupCall::Begin(RankState* state, ffi::Buffer<ffi::S32> rank_info,
                            const GroupAttrs& attrs, size_t half_bytes) {
  if (attrs.tp < 2 || attrs.tp > kMaxRanks) {
    return InvalidAttr(op_, "tp", attrs.tp, "must be in 2.." + std::to_string(kMaxRanks));
  }
  if (const auto n = static_cast<int64_t>(rank_info.element_count());
      n != 2 && n != 2 + attrs.tp) {
    return ffi::Error::InvalidArgument(std::string("jaxflux ") + op_ +
                                       ": rank_info must hold 2 (or 2 + tp) int32s");
  }
  JAXFLUX_RETURN_IF_ERROR(ResolveGroup(op_, stream_, ordinal_, state, rank_info,
                                       {attrs.run_id, attrs.site}, attrs.tp, attrs.num_groups,
                                       &g_));
  pending_ = TakeDeviceErrorMessage();

  half_ = WorkspaceBytes(attrs.workspace_class) / 2;
  if (half_bytes > 0 && (WorkspaceArena(attrs.workspace_class, g_.slot) == nullptr ||
                         half_bytes > half_ || half_ % 256 != 0)) {
    return OpError(op_, "workspace class " + std::to_string(attrs.workspace_class) +
                            " has no room for " + std::to_string(half_bytes) +
                            " bytes per parity half on GPU " + std::to_string(ordinal_) +
                            " (jaxflux sets a class up when it traces a call that needs it: "
                            "trace the program in this process)");
  }
  guard_.emplace(ordinal_);
  JAXFLUX_RETURN_IF_CUDA_ERROR(op_, guard_->status());
  JAXFLUX_RETURN_IF_ERROR(
      GetGroupResources(op_, attrs.workspace_class, g_, half_bytes > 0, &resources_));
  device_lock_ = std::unique_lock<std::mutex>(resources_.self->mu);
  skip_signals_ = attrs.debug_skip_rank == g_.rank;
  epoch_ = NextEpoch(g_.channel, g_.slot);
  return ffi::Error::Success();
}

ffi::Error GroupCall::ForkSide() {
  JAXFLUX_RETURN_IF_CUDA_ERROR(op_, cudaEventRecord(self()->fork, stream_));
  JAXFLUX_RETURN_IF_CUDA_ERROR(op_, cudaStreamWaitEvent(self()->side, self()->fork, 0));
  return ffi::Error::Success();
}

ffi::Error GroupCall::JoinSide() {
  JAXFLUX_RETURN_IF_CUDA_ERROR(op_, cudaEventRecord(self()->join, self()->side));
  JAXFLUX_RETURN_IF_CUDA_ERROR(op_, cudaStreamWaitEvent(stream_, self()->join, 0));
  return ffi::Error::Success();
}

void GroupCall::Trace(const std::string& detail) const {
  std::fprintf(stderr, "[jaxflux] GPU %d rank %d channel %d: %s epoch %llu, %s\n", ordinal_,
               g_.rank, g_.channel, op_, static_cast<unsigned long long>(epoch_),
               detail.c_str());
}

ffi::Error GroupCall::FinishErrors() {
  if (SyncErrors()) {
    JAXFLUX_RETURN_IF_CUDA_ERROR(op_, cudaStreamSynchronize(stream_));
    if (!pending_) pending_ = TakeDeviceErrorMessage();
  }
  if (pending_) return ffi::Error::Internal(*pending_);
  return ffi::Error::Success();
}

std::string StrFormat(const char* format, ...) {
  char text[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof(text), format, args);
  va_end(args);
  return text;
}

}  // namespace jaxflux
