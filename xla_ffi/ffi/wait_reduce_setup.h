// The host side of the wait+reduce pass (WaitReduce, kernels/reduce_kernels.h) that GEMM+AllReduce
// and GEMM+ReduceScatter's pass mode end with: this device sums every rank's partial in its own
// arena, in rank order, once each peer's flag has reached `target`.
#pragma once

#include <cstddef>
#include <cstdint>

#include "xla_ffi/ffi/group_call.h"
#include "xla_ffi/kernels/gemm_sm90.h"
#include "xla_ffi/kernels/reduce_kernels.h"
#include "xla_ffi/runtime/runtime.h"
#include "xla_ffi/runtime/signals.h"

namespace jaxflux {

// The reduce kernels hold one pointer per rank of a group the runtime can form.
static_assert(kReduceMaxRanks >= kMaxRanks, "the reduce kernels must take every rank of a group");

// partial_of(r): where source rank r's partial lies in this device's arena. `dtype` is the
// GEMMs' kind; the partials and `out` hold its output dtype (FP8 kinds: bfloat16).
template <class PartialOf>
WaitReduceParams WaitReduceOfThisCall(const GroupCall& call, PartialOf partial_of,
                                      uint64_t target, void* out, size_t count, GemmDtype dtype,
                                      OpCode op) {
  WaitReduceParams params{};
  params.tp = static_cast<int32_t>(call.tp());
  for (int r = 0; r < call.tp(); ++r) {
    params.partials[r] = partial_of(r);
    params.flags[r] = r == call.rank() ? nullptr : call.FlagFrom(r);
  }
  params.target = target;
  params.out = out;
  params.count = count;
  params.dtype = dtype == GemmDtype::kF16 ? ReduceDtype::kF16 : ReduceDtype::kBF16;
  params.timeout_ns = TimeoutNs();
  params.epoch = call.epoch();
  params.device = call.ordinal();
  params.rank = call.rank();
  params.op = static_cast<int32_t>(op);
  params.error = DeviceErrorRecordPtr();
  return params;
}

}  // namespace jaxflux
