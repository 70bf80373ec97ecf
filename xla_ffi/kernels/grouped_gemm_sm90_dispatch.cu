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
JAXFLUX_DECLARE_GROUPED_GEMM(e4m3_kmajor_cooperative_128x256)
JAXFLUX_DECLARE_GROUPED_GEMM(e4m3_kmajor_pingpong_128x128)
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

// FP8 (e4m3): the forward with the weight K-major only, [GroupedGemmTiles].
constexpr Entry kFp8Table[kGroupedGemmNumTiles] = {
    JAXFLUX_GROUPED_GEMM_ENTRY(e4m3_kmajor_cooperative_128x256),
    JAXFLUX_GROUPED_GEMM_ENTRY(e4m3_kmajor_pingpong_128x128)};

#undef JAXFLUX_GROUPED_GEMM_ENTRY

// nullptr for a dtype, layout or tile config with no kernel.
const Entry* Lookup(GemmDtype dtype, const GroupedGemmProblem& problem) {
  const int d = static_cast<int>(dtype);
  const int tiles = static_cast<int>(problem.tiles);
  if (tiles < 0 || tiles >= kGroupedGemmNumTiles) return nullptr;
  if (dtype == GemmDtype::kE4M3) {
    const bool built = problem.kind == GroupedGemmKind::kForward && problem.b_kmajor;
    return built ? &kFp8Table[tiles] : nullptr;
  }
  if (d < 0 || d >= 2) return nullptr;
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
  if (entry == nullptr) {
    return "no grouped GEMM for this dtype, layout or tile config (bf16, fp16; e4m3 forward "
           "with the weight K-major)";
  }
  return entry->run(problem, workspace, stream);
}

}  // namespace jaxflux
