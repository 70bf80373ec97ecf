// Dispatch of the decode GEMM (gemm_swap_ab_sm90.h) over (dtype, weight layout, token width)
// to the instantiations in instantiations/gemm_swap_ab_sm90_*.cu. No CUTLASS here (compiles
// fast).
#include "xla_ffi/kernels/gemm_swap_ab_sm90.h"

namespace jaxflux {

#define JAXFLUX_DECLARE_SWAP_AB(NAME)                                                       \
  size_t GemmSwapAbWorkspaceBytes_##NAME(const GemmProblem& problem);                       \
  const char* GemmSwapAbRun_##NAME(const GemmProblem& problem, void* workspace,             \
                                   cudaStream_t stream);
JAXFLUX_DECLARE_SWAP_AB(bf16_nmajor_t16)
JAXFLUX_DECLARE_SWAP_AB(bf16_nmajor_t32)
JAXFLUX_DECLARE_SWAP_AB(bf16_nmajor_t64)
JAXFLUX_DECLARE_SWAP_AB(bf16_kmajor_t16)
JAXFLUX_DECLARE_SWAP_AB(bf16_kmajor_t32)
JAXFLUX_DECLARE_SWAP_AB(bf16_kmajor_t64)
JAXFLUX_DECLARE_SWAP_AB(f16_nmajor_t16)
JAXFLUX_DECLARE_SWAP_AB(f16_nmajor_t32)
JAXFLUX_DECLARE_SWAP_AB(f16_nmajor_t64)
JAXFLUX_DECLARE_SWAP_AB(f16_kmajor_t16)
JAXFLUX_DECLARE_SWAP_AB(f16_kmajor_t32)
JAXFLUX_DECLARE_SWAP_AB(f16_kmajor_t64)
JAXFLUX_DECLARE_SWAP_AB(e4m3_kmajor_t16)
JAXFLUX_DECLARE_SWAP_AB(e4m3_kmajor_t32)
JAXFLUX_DECLARE_SWAP_AB(e4m3_kmajor_t64)
JAXFLUX_DECLARE_SWAP_AB(e5m2_kmajor_t16)
JAXFLUX_DECLARE_SWAP_AB(e5m2_kmajor_t32)
JAXFLUX_DECLARE_SWAP_AB(e5m2_kmajor_t64)
#undef JAXFLUX_DECLARE_SWAP_AB

namespace {

struct Entry {
  size_t (*workspace_bytes)(const GemmProblem&);
  const char* (*run)(const GemmProblem&, void*, cudaStream_t);
};

#define JAXFLUX_SWAP_AB_ENTRY(NAME) {GemmSwapAbWorkspaceBytes_##NAME, GemmSwapAbRun_##NAME}

// [dtype][B K-major][token width], in GemmDtype and kSwapAbTokenWidths order. FP8 reads B
// K-major only (wgmma's 8-bit operands): no N-major entries.
constexpr Entry kNone{nullptr, nullptr};
constexpr Entry kTable[4][2][kSwapAbNumWidths] = {
    {{JAXFLUX_SWAP_AB_ENTRY(bf16_nmajor_t16), JAXFLUX_SWAP_AB_ENTRY(bf16_nmajor_t32),
      JAXFLUX_SWAP_AB_ENTRY(bf16_nmajor_t64)},
     {JAXFLUX_SWAP_AB_ENTRY(bf16_kmajor_t16), JAXFLUX_SWAP_AB_ENTRY(bf16_kmajor_t32),
      JAXFLUX_SWAP_AB_ENTRY(bf16_kmajor_t64)}},
    {{JAXFLUX_SWAP_AB_ENTRY(f16_nmajor_t16), JAXFLUX_SWAP_AB_ENTRY(f16_nmajor_t32),
      JAXFLUX_SWAP_AB_ENTRY(f16_nmajor_t64)},
     {JAXFLUX_SWAP_AB_ENTRY(f16_kmajor_t16), JAXFLUX_SWAP_AB_ENTRY(f16_kmajor_t32),
      JAXFLUX_SWAP_AB_ENTRY(f16_kmajor_t64)}},
    {{kNone, kNone, kNone},
     {JAXFLUX_SWAP_AB_ENTRY(e4m3_kmajor_t16), JAXFLUX_SWAP_AB_ENTRY(e4m3_kmajor_t32),
      JAXFLUX_SWAP_AB_ENTRY(e4m3_kmajor_t64)}},
    {{kNone, kNone, kNone},
     {JAXFLUX_SWAP_AB_ENTRY(e5m2_kmajor_t16), JAXFLUX_SWAP_AB_ENTRY(e5m2_kmajor_t32),
      JAXFLUX_SWAP_AB_ENTRY(e5m2_kmajor_t64)}}};

#undef JAXFLUX_SWAP_AB_ENTRY

// nullptr for a layout the dtype has no kernel for.
const Entry* Lookup(GemmDtype dtype, const GemmProblem& problem) {
  const int d = static_cast<int>(dtype);
  if (d < 0 || d >= 4) return nullptr;
  const long long rows = static_cast<long long>(problem.m) * problem.batch;
  const Entry* entry = &kTable[d][problem.b_kmajor ? 1 : 0][SwapAbWidthIndex(rows)];
  return entry->run != nullptr ? entry : nullptr;
}

}  // namespace

size_t GemmSwapAbSm90WorkspaceBytes(GemmDtype dtype, const GemmProblem& problem) {
  const Entry* entry = Lookup(dtype, problem);
  return entry != nullptr ? entry->workspace_bytes(problem) : 0;
}

const char* GemmSwapAbSm90(GemmDtype dtype, const GemmProblem& problem, void* workspace,
                           cudaStream_t stream) {
  const Entry* entry = Lookup(dtype, problem);
  if (entry == nullptr) return "no decode GEMM for this dtype and weight layout (FP8: K-major)";
  return entry->run(problem, workspace, stream);
}

}  // namespace jaxflux
