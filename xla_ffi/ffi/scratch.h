// CUTLASS workspace, the same way in every handler: from XLA's scratch allocator (the fused
// cross-process ops), or from a result the call declares (the tp=1 handlers, which allocate
// nothing while executing).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi/errors.h"

namespace jaxflux {

// `bytes` of device scratch into *workspace (nullptr for 0 bytes). XLA's allocator refuses an
// alignment above 16 bytes; its blocks are 256-byte aligned, which CUTLASS's workspaces (and the
// 16-byte TMA accesses) need no more than, so the pointer is only checked.
inline xla::ffi::Error AllocateScratch(const char* op, xla::ffi::ScratchAllocator& scratch,
                                       size_t bytes, void** workspace) {
  *workspace = nullptr;
  if (bytes == 0) return xla::ffi::Error::Success();
  auto allocation = scratch.Allocate(bytes, 16);
  if (!allocation.has_value()) {
    return OpError(op, "XLA's scratch allocator could not give " + std::to_string(bytes) +
                           " bytes of GEMM workspace");
  }
  if (reinterpret_cast<uintptr_t>(*allocation) % 16 != 0) {
    return OpError(op, "XLA's scratch allocator returned a block not 16-byte aligned");
  }
  *workspace = *allocation;
  return xla::ffi::Error::Success();
}

// `bytes` of `buffer` (a u8 result sized at trace time) into *workspace (nullptr for 0 bytes).
// XLA's buffers are at least 64-byte aligned, more than CUTLASS's workspaces and the 16-byte
// TMA accesses need, so the pointer is only checked.
inline xla::ffi::Error WorkspaceFromResult(const char* op, xla::ffi::AnyBuffer buffer,
                                           size_t bytes, void** workspace) {
  *workspace = nullptr;
  if (bytes == 0) return xla::ffi::Error::Success();
  if (buffer.size_bytes() < bytes) {
    return OpError(op, "the workspace result holds " + std::to_string(buffer.size_bytes()) +
                           " bytes; this call needs " + std::to_string(bytes) +
                           " (jaxflux sizes it at trace time: was the program traced for "
                           "another GPU?)");
  }
  if (reinterpret_cast<uintptr_t>(buffer.untyped_data()) % 16 != 0) {
    return OpError(op, "the workspace result is not 16-byte aligned");
  }
  *workspace = buffer.untyped_data();
  return xla::ffi::Error::Success();
}

}  // namespace jaxflux
