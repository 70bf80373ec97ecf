// Dispatch of the grouped GEMM (grouped_gemm_sm90.h) over (dtype, operand layouts, tile config)
// to the instantiations in instantiations/grouped_gemm_sm90_*.cu. No CUTLASS here (compiles
// fast).
#include "xla_ffi/kernels/grouped_gemm_sm90.h"

namespace jaxflux {

#define JAXFLUX_DECLARE_GROUPED_GEMM(NAME)                                                  \
  size_t GroupedGemmWorkspaceBytes_##NAME(const GroupedGemmProblem& problem);               \
  const char* GroupedGemmRun_##NAME(const GroupedGemmProblem& problem, void* workspace,     \
                                    cudaStream_t stream);
JAXFLUX_DECLARE_GROUPED_GEMM(bf16_nmajor_cooperative_128x256)
JAXFLUX_DECLARE_GROUPED_GEMM(bf16_nmajor_pingpong_128x128)
JAXFLUX_DECLARE_GROUPED_GEMM(bf16_kmajor_cooperative_128x256)
JAXFLUX_DECLARE_GROUPED_GEMM(bf16_kmajor_pingpong_128x128)
JAXFLUX_DECLARE_GROUPED_GEMM(bf16_wgrad_cooperative_128x256)
JAXFLUX_DECLARE_GROUPED_GEMM(bf16_wgrad_pingpong_128x128)
JAXFLUX_DECLARE_GROUPED_GEMM(f16_nmajor_cooperative_128x256)
JAXFLUX_DECLARE_GROUPED_GEMM(f16_nmajor_pingpong_128x128)
JAXFLUX_DECLARE_GROUPED_GEMM(f16_kmajor_cooperative_128x256)
JAXFLUX_DECLARE_GROUPED_GEMM(f16_kmajor_pingpong_128x128)
JAXFLUX_DECLARE_GROUPED_GEMM(f16_wgrad_cooperative_128x256)
JAXFLUX_DECLARE_GROUPED_GEMM(f16_wgrad_pingpong_128x128)
#undef JAXFLUX_DECLARE_GROUPED_GEMM

namespace {

struct Entry {
  size_t (*workspace_bytes)(const GroupedGemmProblem&);
  const char* (*run)(const GroupedGemmProblem&, void*, cudaStream_t);
};

#define JAXFLUX_GROUPED_GEMM_ENTRY(NAME) \
  {GroupedGemmWorkspaceBytes_##NAME, GroupedGemmRun_##NAME}

// [dtype][operands: forward N-major, forward K-major, weight grad][GroupedGemmTiles], 16-bit
// dtypes in GemmDtype order.
constexpr Entry kTable[2][3][kGroupedGemmNumTiles] = {
    {{JAXFLUX_GROUPED_GEMM_ENTRY(bf16_nmajor_cooperative_128x256),
      JAXFLUX_GROUPED_GEMM_ENTRY(bf16_nmajor_pingpong_128x128)},
     {JAXFLUX_GROUPED_GEMM_ENTRY(bf16_kmajor_cooperative_128x256),
      JAXFLUX_GROUPED_GEMM_ENTRY(bf16_kmajor_pingpong_128x128)},
     {JAXFLUX_GROUPED_GEMM_ENTRY(bf16_wgrad_cooperative_128x256),
      JAXFLUX_GROUPED_GEMM_ENTRY(bf16_wgrad_pingpong_128x128)}},
    {{JAXFLUX_GROUPED_GEMM_ENTRY(f16_nmajor_cooperative_128x256),
      JAXFLUX_GROUPED_GEMM_ENTRY(f16_nmajor_pingpong_128x128)},
     {JAXFLUX_GROUPED_GEMM_ENTRY(f16_kmajor_cooperative_128x256),
      JAXFLUX_GROUPED_GEMM_ENTRY(f16_kmajor_pingpong_128x128)},
     {JAXFLUX_GROUPED_GEMM_ENTRY(f16_wgrad_cooperative_128x256),
      JAXFLUX_GROUPED_GEMM_ENTRY(f16_wgrad_pingpong_128x128)}}};

#undef JAXFLUX_GROUPED_GEMM_ENTRY

// nullptr for a dtype or tile config with no kernel (FP8 is not built).
const Entry* Lookup(GemmDtype dtype, const GroupedGemmProblem& problem) {
  const int d = static_cast<int>(dtype);
  const int tiles = static_cast<int>(problem.tiles);
  if (d < 0 || d >= 2 || tiles < 0 || tiles >= kGroupedGemmNumTiles) return nullptr;
  const int operands = problem.kind == GroupedGemmKind::kWeightGrad ? 2
                       : problem.b_kmajor                          ? 1
                                                                   : 0;
  return &kTable[d][operands][tiles];
}

}  // namespace

size_t GroupedGemmSm90WorkspaceBytes(GemmDtype dtype, const GroupedGemmProblem& problem) {
  const Entry* entry = Lookup(dtype, problem);
  return entry != nullptr ? entry->workspace_bytes(problem) : 0;
}

const char* GroupedGemmSm90(GemmDtype dtype, const GroupedGemmProblem& problem, void* workspace,
                            cudaStream_t stream) {
  const Entry* entry = Lookup(dtype, problem);
  if (entry == nullptr) return "no grouped GEMM for this dtype or tile config (bf16, fp16 only)";
  return entry->run(problem, workspace, stream);
}

}  // namespace jaxflux
