// CUTLASS workspace from XLA's scratch allocator, the same way in every handler.
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

}  // namespace jaxflux
